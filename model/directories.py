"""Output directories that a command replaces whole: the export's model repository, the training
checkpoint. Each command owns the directories that hold its marker file, and refuses any other."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The training checkpoint's marker (model/checkpoints.py writes it): here, torch-free, so that the
# training CLI checks --out against it before torch is loaded.
STATE_FILE = "training_state.pt"


class OutputError(Exception):
    """An --out that is not the command's own directory to replace; the message says why."""


def check_out(out: Path, marker: str, kind: str) -> None:
    """`out` must be absent, empty, or hold `marker` (it is `kind`, which the command wrote): a typo
    such as `--out build` must not delete what is there."""
    if not out.resolve().name or out.resolve() == Path.cwd().resolve():
        raise OutputError(f"--out {out}: name a directory of its own (it is replaced whole)")
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise OutputError(
            f"--out {out} holds files but no {marker}: not {kind}, so it is not "
            "replaced; name a new directory, or remove it first"
        )


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside takes effect when the block is done: a directory swapped in by renames is never
    left half swapped. (Only the main thread can set signal handlers; elsewhere nothing is deferred.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
