"""The name a server process shows in `ps`, `top` and /proc/PID/comm: embed-engine, embed-front-N.

Spawned children otherwise all read `python3`, and an operator (or a test sampling memory per
process) cannot tell the engine from a front.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15
COMM_LEN = 15  # the kernel keeps 15 bytes of a process's name


def name_process(name: str) -> None:
    """Name the calling process (Linux; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:COMM_LEN], 0, 0, 0)
