"""`python -m minilm_embed.client ARGS` as a process of its own, forked from a process that has
already imported the client (multiprocessing's forkserver, one per test process), not started afresh.

Each run is still a process of its own: its pid, fds 0-2 (stdin a pipe, as subprocess.run(input=...)
gives, so embed-file reads it as it reads a pipe; stdout and stderr read at the fd level), its
environment, working directory and exit status (a signal's as -N). What it saves is the interpreter's
start and the client's imports, about 0.5 CPU-s a run on a Zen 3: the 145 runs of the client in
test_bulk.py and test_client.py cost ~80 CPU-s of a CPU-bound `make test` that way. The forkserver
imports the client and nothing else, and makes no channel before forking (gRPC's core starts at the
first one).

What differs from a fresh interpreter: the child ends with os._exit once main() has returned and
stdout and stderr are flushed (multiprocessing's way), so what a real process does at interpreter
shutdown (atexit, finalizers) is not run here; the tests that start the client with Popen
(test_client.py, test_bulk.py) cover its exit. Settings read at import (the locale, PYTHON*, GRPC_*)
are the forkserver's; the client reads its EMBED_* variables at run time. An uncaught exception's
traceback is headed "Process ForkServerProcess-N:".
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["minilm_embed.client.__main__"])


def _client(argv: list[str], env: dict[str, str], cwd: str, stdin: str, stdout: str, stderr: str) -> None:
    """The forked child: fds 0-2 and sys.std* as a fresh interpreter has them, then the CLI."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    # multiprocessing gives its children /dev/null for stdin; the interpreter's own read fd 0 with
    # the encoding and error handler it chose at start (sys.__stdin__'s, closed since).
    original = sys.__stdin__
    encoding, errors = (original.encoding, original.errors) if original is not None else ("utf-8", "strict")
    sys.stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding, errors=errors
    )
    sys.argv = ["-m", *argv]
    from minilm_embed.client.__main__ import main

    sys.exit(main(argv))


def _feed(fifo: str, data: bytes) -> None:
    """Write `data` into the child's stdin and close it, as subprocess.run(input=...) does; a child that
    exits without reading it all ends the write (EPIPE), as there."""
    with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as pipe:  # opens once the child does
        pipe.write(data)


def run_client(
    args: Sequence[str], env: Mapping[str, str], cwd: Path, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """What subprocess.run(capture_output=True, text=True) returns for the client with `args`."""
    with tempfile.TemporaryDirectory(prefix="cli-") as scratch:
        paths = {name: os.path.join(scratch, name) for name in ("stdin", "stdout", "stderr")}
        os.mkfifo(paths["stdin"])
        for name in ("stdout", "stderr"):
            open(paths[name], "w").close()
        feeder = threading.Thread(target=_feed, args=(paths["stdin"], (stdin or "").encode()), daemon=True)
        feeder.start()
        process = _CONTEXT.Process(
            target=_client,
            args=(list(args), dict(env), str(cwd), paths["stdin"], paths["stdout"], paths["stderr"]),
        )
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            process.kill()
            process.join()
        # A child that died before it opened its stdin leaves the feeder waiting for a reader: one is
        # opened for it until it has given up (a write to a reader that then goes is EPIPE).
        if feeder.is_alive():
            reader = os.open(paths["stdin"], os.O_RDONLY | os.O_NONBLOCK)
            feeder.join(1)
            os.close(reader)
        feeder.join(10)
        out = Path(paths["stdout"]).read_text(encoding="utf-8")
        err = Path(paths["stderr"]).read_text(encoding="utf-8")
    if timed_out:
        raise subprocess.TimeoutExpired(["minilm-embed", *args], timeout, out, err)
    return subprocess.CompletedProcess(["minilm-embed", *args], process.exitcode, out, err)
