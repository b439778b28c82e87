"""How a server child shows in `ps`, `top` and /proc: embed-engine, embed-front-N.

A spawned child's command line otherwise reads `python -B -c from multiprocessing.spawn import
spawn_main; ...` and its process name `python3`, and an operator (or a test sampling memory per
process) cannot tell the engine from a front. Each child sets both:

- its process name (/proc/PID/comm: `ps -e`, `top`, `pgrep`): `embed-engine`, `embed-front-N`;
- its command line (/proc/PID/cmdline: `ps aux`, `ps -ef`, `pgrep -f`), as gunicorn and postgres
  do: `minilm-embed-serve: embed-engine`, `minilm-embed-serve: embed-front-N`. The same name in
  both, so `pgrep embed-front` and `pgrep -f embed-front` find the same processes, and
  `pgrep -f minilm-embed-serve` finds the supervisor (whose command line stays the operator's) and
  every child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

PROGRAM = "minilm-embed-serve"
PR_SET_NAME = 15
COMM_LEN = 15  # the kernel keeps 15 bytes of a process's name


def command_line(name: str) -> str:
    """What a child named `name` shows as its command line."""
    return f"{PROGRAM}: {name}"


def name_process(name: str) -> None:
    """Name the calling process: its command line (any platform setproctitle supports) and its
    process name (Linux)."""
    # setproctitle writes over the process's argv and, unless SPT_NOENV is set when it starts, its
    # environment block too: /proc/PID/environ (`ps e`, `cat /proc/PID/environ`) would read blank.
    # The spawn command line (over 100 bytes) holds the title without it.
    ours = "SPT_NOENV" not in os.environ
    if ours:
        os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle

        setproctitle.setproctitle(command_line(name))
    finally:
        if ours:
            del os.environ["SPT_NOENV"]
    if not sys.platform.startswith("linux"):
        return
    # After setproctitle, which on Linux also sets the process name, to the title's first 15 bytes
    # (`minilm-embed-se`): the name must be the process's own.
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:COMM_LEN], 0, 0, 0)
