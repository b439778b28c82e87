"""The server's stop signals, caught from its first moment.

Importing the server takes about a second (grpc, numpy, ONNX Runtime's bindings; 0.9 s on an idle
2-vCPU AMD EPYC Zen 3). A rollout that stops a pod it has just started must get the same clean stop,
exit 0, as one that stops it later, not a death by the signal's default action. `main` catches the
signals before it imports the rest; the supervisor reads what was caught and goes on catching into
the same list: its first signal starts the drain, a second one ends it at once (app.Supervisor.force).
SIGHUP (a terminal or ssh session closed, `kill -HUP`) is a stop signal too: it killed the supervisor
at once, exit 129, its calls cut, and there is nothing to reload (settings are read once, at start).
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
received: list[int] = []


def catch() -> list[int]:
    """From now on SIGTERM, SIGINT and SIGHUP are recorded in the list returned (and nothing else)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _record)
    return received


def _record(signum: int, frame: FrameType | None) -> None:
    received.append(signum)
