"""Output directories that a command replaces whole: the export's model repository, the training
checkpoint. Each command owns the directories that hold its marker file, and refuses any other."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The training checkpoint's marker (model/checkpoints.py writes it): here, torch-free, so that the
# training CLI checks --out against it before torch is loaded.
STATE_FILE = "training_state.pt"
# In `<out>.partial` while model/checkpoints.py writes a checkpoint there, removed before it is swapped
# in: a `.partial` holding it is an unfinished save of model.train, which the next run may remove.
SAVING_MARKER = ".model-train-saving"


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
    check_writable(out)


def check_writable(out: Path) -> None:
    """A directory can be made beside `out` (the command writes there, then renames): found now, not at
    the first save after hours of work. Missing parents are made later; the nearest existing one is
    tried, by making a directory in it and removing it."""
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"--out {out}: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.check.", dir=parent))
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create a directory in {parent} ({e.strerror})") from e


def beside(out: Path, what: str) -> Path:
    """`<out>.<what>`: where a save writes (`partial`) and keeps the checkpoint it replaces (`previous`)."""
    return out.with_name(f"{out.name}.{what}")


def check_leftovers(out: Path, resuming: Path | None) -> None:
    """Refuse a run whose save would remove a `<out>.partial` or `<out>.previous` not its own."""
    for what in ("partial", "previous"):
        problem = leftover_problem(out, what, resuming)
        if problem:
            raise OutputError(problem)


def leftover_problem(out: Path, what: str, resuming: Path | None) -> str | None:
    """Why `<out>.<what>` (`partial` or `previous`: a save removes both) may not be removed, if it may
    not. Only an empty directory, an unfinished save (SAVING_MARKER inside) and the checkpoint being
    resumed are the run's to remove; a checkpoint that a killed run left is the user's to resume."""
    path = beside(out, what)
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_dir():
        return f"{path} is not a directory that model.train wrote: move or remove it"
    if not any(path.iterdir()) or (path / SAVING_MARKER).is_file():
        return None
    if not (path / STATE_FILE).is_file():
        return f"{path} holds files but is not a checkpoint of model.train: move or remove it"
    if what == "partial":  # whole, not yet swapped in; a save to this --out would remove it first
        return (
            f"{path} holds a checkpoint that a killed run left: resume it with --resume {path} "
            "--out DIR (another directory), or remove it"
        )
    if resuming is not None and path.resolve() == resuming.resolve():
        return None  # the checkpoint this run continues: its first save replaces it
    if (out / STATE_FILE).is_file():  # killed after the second rename: `out` holds the newer one
        return f"{path} holds a checkpoint that a killed run left, older than {out}'s: move or remove it"
    return f"{path} holds a checkpoint that a killed run left: resume it with --resume {path}, or remove it"


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
