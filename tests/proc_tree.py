"""A live process's children from /proc (Linux), tolerant of the tree changing while it is read."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The children of `pid` now, from every thread's /proc/PID/task/TID/children; [] when `pid` has
    ended. A thread or process that ends while this reads is passed over, not an error: a server's
    threads come and go (a CI run once failed on a thread that ended between the listing and the read)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found  # the process has ended
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile; its children went to another thread of the process
    return found


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it, now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children(p)
    return found


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every descendant, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick
    return total
