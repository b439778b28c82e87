"""`python -m minilm_embed.client ARGS` as a process of its own, forked from a process that has
already imported the client (multiprocessing's forkserver, one per test process), not started afresh.

Each run is still a real process: its own pid, fds 0-2, environment, working directory and exit
status (a signal's as -N), its output read at the fd level. What it saves is the interpreter's start
and the client's imports, about 0.5 CPU-s a run on a Zen 3: 145 runs of the client in test_bulk.py
and test_client.py took ~80 CPU-s of a CPU-bound `make test` that way. The forkserver imports the
client and nothing else, and makes no channel before forking (gRPC's core starts at the first one).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["minilm_embed.client.__main__"])


def _client(argv: list[str], env: dict[str, str], cwd: str, stdin: str, stdout: str, stderr: str) -> None:
    """The forked child: fds 0-2 and sys.std* as a fresh interpreter would have them, then the CLI."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    # multiprocessing gives its children /dev/null for stdin; a fresh interpreter reads fd 0.
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.argv = ["-m", *argv]
    from minilm_embed.client.__main__ import main

    sys.exit(main(argv))


def run_client(
    args: Sequence[str], env: Mapping[str, str], cwd: Path, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """What subprocess.run(capture_output=True, text=True) returns for the client with `args`."""
    with tempfile.TemporaryDirectory(prefix="cli-") as scratch:
        paths = {name: os.path.join(scratch, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin or "")
        for name in ("stdout", "stderr"):
            open(paths[name], "w").close()
        process = _CONTEXT.Process(
            target=_client,
            args=(list(args), dict(env), str(cwd), paths["stdin"], paths["stdout"], paths["stderr"]),
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["minilm-embed", *args], timeout)
        out = Path(paths["stdout"]).read_text(encoding="utf-8")
        err = Path(paths["stderr"]).read_text(encoding="utf-8")
    return subprocess.CompletedProcess(["minilm-embed", *args], process.exitcode, out, err)
