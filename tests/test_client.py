"""The command line `minilm-embed` against a real server: what a user types and what comes out."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from minilm_embed.client.client import EmbeddingClient
from tests import cli_process
from tests.server_process import ServerProcess, serving
from tests.test_server import SHORT, TINY, assert_close, free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving() as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[EmbeddingClient]:
    with EmbeddingClient(server.address, timeout=60) as c:
        yield c


def run_client(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The client as `python -m minilm_embed.client ARGS` runs it, as a process forked from one that has
    imported it (tests/cli_process.py)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("EMBED_")}  # no stray settings
    return cli_process.run_client(args, {**environment, **(env or {})}, ROOT, stdin=stdin)


def test_embed_prints_json_with_one_vector_per_text(server, client):
    texts = ["A man is playing a guitar.", "東京は日本の首都です。"]
    done = run_client("--address", server.address, "embed", *texts)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["dimensions"] == 384
    vectors = np.asarray(out["embeddings"], dtype=np.float32)
    assert vectors.shape == (2, 384)
    assert np.allclose(vectors, client.embed(texts), atol=1e-6)
    assert [u["tokens"] for u in out["usage"]] == [len(t.ids) for t in client.tokenize(texts).tokens]
    timing = out["timing"]  # uint64s, numbers as every other field (protobuf's JSON writes strings)
    assert {name: type(value) for name, value in timing.items()} == dict.fromkeys(timing, int)
    assert timing["totalUs"] > 0


def test_an_argument_that_is_not_utf8_is_named_not_a_traceback(server):
    # The shell hands the bytes over as they are; Python gives them as lone surrogates (PEP 383).
    done = run_client("--address", server.address, "embed", "fine", os.fsdecode(b"lone \xed\xb2\x80 byte"))
    assert done.returncode == 2, done.stderr
    assert "input 1 is not UTF-8" in done.stderr and "byte 0xed at offset 5" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    # Named as the server names the same argument when it refuses it: it said "text 2" to "input 1".
    done = run_client("--address", server.address, "embed", "fine", "")
    assert done.returncode == 1 and "input 1 is an empty string" in done.stderr, done.stderr


def test_embed_file_writes_rows_in_the_file_order(server, client, tmp_path):
    lines = [(SHORT + TINY)[i] for i in np.random.default_rng(1).permutation(len(SHORT + TINY))]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "vectors.npy"
    done = run_client(
        "--address", server.address, "embed-file", str(corpus), "--out", str(out), "--batch-size", "8"
    )
    assert done.returncode == 0, done.stderr
    vectors = np.load(out)
    assert vectors.shape == (len(lines), 384)
    alone = np.concatenate([client.embed([line]) for line in lines])
    assert_close(vectors, alone)


def test_embed_file_help_is_written_for_the_command_line_with_its_defaults():
    """It printed bulk.py's docstring: jsonl=True, resume=True, PARTIAL_MAGIC and the like, names a
    user of the command line never meets, and no option said its default."""
    done = run_client("embed-file", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines at the terminal's width
    for name in ("jsonl=True", "resume=True", "PARTIAL_MAGIC", "PARTIAL_SUFFIX", "SAME_ROW_COSINE"):
        assert name not in text
    assert "row i is input line i" in text and "An empty line is refused" in text
    assert "OUT.partial" in text and "--resume to go on" in text and "--retry-for seconds" in text
    for default in ("texts per request", "bytes of text per request", "requests in flight", "retried for"):
        assert re.search(re.escape(default) + r"[^[]*\[default \S+\]", text), default
    assert "[default 32]" in text and "[default 16]" in text and "[default 600]" in text
    assert "[default bulk]" in text and "[default 1048576]" in text


def test_a_lone_string_is_one_text_and_any_iterable_of_strings_is_accepted(client):
    texts = ["A man is playing a guitar.", "Someone plays an instrument."]
    want = client.embed(texts)
    assert client.embed(texts[0]).shape == (1, 384)  # not one vector per character
    assert_close(client.embed(texts[0]), want[:1])
    assert_close(client.embed(np.array(texts)), want)  # `texts or []` raised on an array
    assert_close(client.embed(t for t in texts), want)
    assert len(client.tokenize(texts[0]).tokens) == 1
    with pytest.raises(TypeError, match=r"texts\[1\] is NoneType, not str"):
        client.embed([texts[0], None])


def test_info_prints_the_model_and_limits(server):
    done = run_client("--address", server.address, "info")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["modelId"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["dimensions"] == 384
    assert info["executionProvider"] == "CPUExecutionProvider"
    assert info["limits"]["maxInputsPerRequest"] == 256
    # A uint64 in the proto: a number, as the other limits, not protobuf's JSON string "2097152".
    assert info["limits"]["maxMessageBytes"] == 2 * 1024 * 1024


def test_every_64_bit_integer_is_a_json_number_nested_and_repeated_ones_too():
    from minilm_embed.client.__main__ import as_json
    from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb

    tokens = pb.TokenizeResponse(tokens=[pb.Tokens(ids=[101, 7592, 102], usage=pb.InputUsage(tokens=3))])
    assert as_json(tokens)["tokens"][0]["ids"] == [101, 7592, 102]
    info = as_json(pb.InfoResponse(limits=pb.Limits(max_message_bytes=1 << 40), versions={"server": "1"}))
    assert (info["limits"]["maxMessageBytes"], info["versions"]) == (1 << 40, {"server": "1"})


def test_address_comes_from_embed_address(server):
    done = run_client("info", env={"EMBED_ADDRESS": server.address})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dimensions"] == 384


def test_address_flag_overrides_embed_address(server):
    closed = f"127.0.0.1:{free_port()}"
    done = run_client("--address", server.address, "info", env={"EMBED_ADDRESS": closed})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dimensions"] == 384


@pytest.mark.parametrize("command", [["info"], ["embed", "hello"]])
def test_unreachable_server_gives_one_clear_error_line_and_exit_1(command):
    closed = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = run_client("--address", closed, "--timeout", "2", *command)
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("client: error: UNAVAILABLE"), done.stderr


def test_version_is_the_installed_packages_and_exits_0():
    done = run_client("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"minilm-embed {importlib.metadata.version('minilm-embed')}"


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("client: error: "), done.stderr
    return lines[0].removeprefix("client: error: ")


@pytest.mark.parametrize("value", ["0", "nan", "inf", "1e10"])
@pytest.mark.parametrize(
    "command", [["info"], ["embed", "hello"], ["embed-file", "in.txt", "--out", "v.npy"]]
)
def test_a_timeout_no_call_can_have_is_a_usage_error_not_a_traceback(server, tmp_path, command, value):
    """The client's ValueError for --timeout 0 was a traceback and exit 1; gRPC takes inf as already
    past (info failed DEADLINE_EXCEEDED at once, embed-file retried that for --retry-for), and so one
    past about 7.4e9 s, whose deadline overflows gRPC's int64 nanoseconds."""
    (tmp_path / "in.txt").write_text("one\n", encoding="utf-8")
    command = [str(tmp_path / part) if part in ("in.txt", "v.npy") else part for part in command]
    done = run_client("--address", server.address, "--timeout", value, *command)
    assert done.returncode == 2
    assert one_error_line(done) == (
        f"--timeout must be a number of seconds above 0 and at most 1e+09, not {float(value)}"
    )
    assert not (tmp_path / "v.npy.partial").exists()


@pytest.mark.parametrize(
    ("token", "env", "message"),
    [
        ("tökén".encode(), {}, "--token-file {}: the token holds characters a header cannot carry"),
        (b"\xff\xfetoken", {}, "--token-file {}: not UTF-8 (invalid start byte at byte 0)"),
        (None, {"EMBED_TOKEN": "to\x01ken"}, "EMBED_TOKEN: the token holds characters a header cannot carry"),
    ],
)
def test_a_token_no_header_can_carry_is_a_usage_error_naming_where_it_came_from(
    server, tmp_path, token, env, message
):
    path = tmp_path / "token"
    flags = []
    if token is not None:
        path.write_bytes(token)
        flags = ["--token-file", str(path)]
    done = run_client("--address", server.address, *flags, "info", env=env)
    assert done.returncode == 2
    assert one_error_line(done).startswith(message.format(path)), done.stderr


def test_a_text_over_the_token_limit_without_truncation_names_the_flag_to_drop(server):
    done = run_client("--address", server.address, "embed", "--no-truncate", "word " * 300)
    assert done.returncode == 1
    line = one_error_line(done)
    assert line.startswith("INVALID_ARGUMENT: input 0 has 302 tokens, over the limit max_input_tokens=256")
    assert line.endswith("; drop --no-truncate to cut it"), line  # the server says "send truncate=true"


def test_a_reader_that_stops_early_ends_the_output_quietly_as_sigpipe_does(server):
    """`minilm-embed embed ... | head -c 10`: the client printed "client: error: [Errno 32] Broken pipe"."""
    texts = [f"text {i}" for i in range(30)]  # ~230 kB of JSON: more than a pipe's buffer holds
    environment = {k: v for k, v in os.environ.items() if not k.startswith("EMBED_")}
    command = [sys.executable, "-m", "minilm_embed.client", "--address", server.address, "embed", *texts]
    with subprocess.Popen(
        command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(10) == b'{"dimensio'
        proc.stdout.close()  # with the rest unread: the client's write fails EPIPE
        stderr = proc.stderr.read().decode()
        proc.wait(60)
    assert stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


# A job's task under embed-file's Stop: the first signal cancels it at an await; one that outlives the
# cancel (a teardown that hangs) is stopped at once by a second signal.
STOP_SCRIPT = """
import asyncio, os, signal, sys
from minilm_embed.client.__main__ import Stop

stop = Stop()
hang_on_cancel = sys.argv[1] == "hang"

async def job():
    stop.cancels(asyncio.current_task())
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("cancelled", stop.signum, flush=True)
        if not hang_on_cancel:
            raise
        await asyncio.Event().wait()

try:
    asyncio.run(job())
except asyncio.CancelledError:
    print("stopped by cancel", flush=True)
except KeyboardInterrupt:
    print("stopped at once", stop.signum, flush=True)
"""


@pytest.mark.parametrize("hang", [False, True])
def test_a_signal_cancels_the_job_at_an_await_and_a_second_stops_it_at_once(hang):
    """A signal handler that raised KeyboardInterrupt wherever the main thread was could land inside
    grpc.aio's completion callbacks, which swallow it ("Exception ignored in ... functor_run"): the job
    went on, a call's answer was lost, and it hung (once in CI; 2 of 450 hammered jobs here)."""
    job = subprocess.Popen(
        [sys.executable, "-c", STOP_SCRIPT, "hang" if hang else "return"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None
    assert job.stdout.readline() == "ready\n"
    job.send_signal(signal.SIGTERM)
    assert job.stdout.readline() == "cancelled 15\n"
    if hang:
        job.send_signal(signal.SIGINT)
    job.wait(timeout=30)
    out = job.stdout.read()  # after readline(), not communicate(): that skips what readline() buffered
    assert out == ("stopped at once 2\n" if hang else "stopped by cancel\n")
    assert job.returncode == 0
