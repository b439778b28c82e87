"""`minilm-embed embed-file` (client/bulk.py) against real servers: rows stay on their lines, refusals
are retried, a killed job resumes to the same output, stdin and JSONL work, bad input names its line."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from minilm_embed.client import bulk
from minilm_embed.client.client import EmbeddingClient
from tests import test_client
from tests.server_process import ServerProcess, serving
from tests.test_client import run_client
from tests.test_metrics import samples, scrape
from tests.test_server import SHORT, assert_close

ROOT = Path(__file__).resolve().parents[1]
# Every character str.splitlines() breaks at, besides \n and \r\n: each must stay inside its text.
LINE_BREAKS = ["\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"]


# A real server and a client of it for this module, as tests/test_client.py has them.
server = test_client.server
client = test_client.client


def corpus(n: int) -> list[str]:
    """n distinct lines; neighbours hold different sentences, so a shifted row is far from its line."""
    return [f"{i}: {SHORT[i % len(SHORT)]}" for i in range(n)]


def embed_file(
    server: ServerProcess, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return run_client("--address", server.address, "embed-file", *args, stdin=stdin)


def alone(client: EmbeddingClient, texts: list[str]) -> np.ndarray:
    return np.concatenate([client.embed([t]) for t in texts])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_every_line_break_character_stays_inside_its_row(server, client, tmp_path):
    texts = [f"before{c}after {name}" for name, c in enumerate(LINE_BREAKS)] + ["last line, CRLF ended"]
    path = tmp_path / "breaks.txt"
    # \r\n ends some lines: accepted as a line end, and dropped from the text.
    path.write_bytes(b"".join(t.encode() + (b"\r\n" if i % 2 else b"\n") for i, t in enumerate(texts)))
    assert len(path.read_bytes().decode().splitlines()) == 2 * len(texts) - 1  # what went wrong before
    out = tmp_path / "vectors.npy"
    done = embed_file(server, str(path), "--out", str(out), "--batch-size", "4")
    assert done.returncode == 0, done.stderr
    vectors = np.load(out)
    assert vectors.shape == (len(texts), 384)
    assert_close(vectors, alone(client, texts))


def test_stdin_and_jsonl_in_and_out_keep_ids_in_order(server, client, tmp_path):
    items = [{"id": f"doc-{i}", "text": t} for i, t in enumerate(corpus(40))]
    items[3]["text"] = "line\u2028separator and\x85next line inside one text"
    out = tmp_path / "vectors.jsonl"
    stdin = "".join(json.dumps(item) + "\n" for item in items)
    done = embed_file(server, "-", "--jsonl", "--out", str(out), "--batch-size", "7", stdin=stdin)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [item["id"] for item in items]
    got = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    assert_close(got, alone(client, [item["text"] for item in items]))


def test_jsonl_input_to_npy_writes_the_ids_beside_it(server, client, tmp_path):
    items = [{"id": 100 + i, "text": t} for i, t in enumerate(corpus(10))]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    out = tmp_path / "vectors.npy"
    done = embed_file(server, str(path), "--jsonl", "--out", str(out))
    assert done.returncode == 0, done.stderr
    ids = [json.loads(line) for line in (tmp_path / "vectors.ids.jsonl").read_text().splitlines()]
    assert ids == [item["id"] for item in items]
    assert_close(np.load(out), alone(client, [item["text"] for item in items]))


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        ("one\n\nthree\n", [], "in.txt:2: empty line"),
        ("one\r\n\r\nthree\r\n", [], "in.txt:2: empty line"),
        ('{"id": 1, "text": "a"}\n{"text": "b"}\n', ["--jsonl"], "in.txt:2: expected an object"),
        ('{"id": 1, "text": "a"}\n{"id": 2, "text": ""}\n', ["--jsonl"], 'in.txt:2: "text" must be'),
        ('{"id": 1, "text": "a"}\nnot json\n', ["--jsonl"], "in.txt:2: not JSON"),
    ],
)
def test_bad_input_names_the_line(server, tmp_path, content, flags, message):
    path = tmp_path / "in.txt"
    path.write_text(content, encoding="utf-8")
    out = tmp_path / "v.jsonl"
    done = embed_file(server, str(path), "--out", str(out), *flags)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert len(read_jsonl(out)) == 1  # the row before the bad line is written: a resume starts at it


def test_invalid_utf8_names_the_line(server, tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"fine\nbad \xff byte\n")
    done = embed_file(server, str(path), "--out", str(tmp_path / "v.npy"))
    assert done.returncode == 2
    assert "in.txt:2: not UTF-8" in done.stderr, done.stderr


def test_an_existing_output_is_kept_unless_resumed(server, tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("one\n", encoding="utf-8")
    out = tmp_path / "v.npy"
    out.write_bytes(b"precious")
    done = embed_file(server, str(path), "--out", str(out))
    assert done.returncode == 2
    assert "exists: add --resume" in done.stderr
    assert out.read_bytes() == b"precious"


def test_refusals_from_a_full_queue_are_retried_until_every_row_is_written(tmp_path):
    lines = corpus(400)
    path = tmp_path / "in.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "v.npy"
    # 16 requests of 4 inputs in flight against a queue of 8: most are refused at first.
    with serving("--queue-limit", "8") as server:
        done = embed_file(server, str(path), "--out", str(out), "--batch-size", "4", "--concurrency", "16")
        assert server.metrics_port is not None
        refused = sum(
            s.value for s in samples(scrape(server.metrics_port)) if s.name == "embed_requests_refused_total"
        )
        with EmbeddingClient(server.address, timeout=60) as c:
            want = alone(c, lines[:50])
    assert done.returncode == 0, done.stderr
    assert refused > 0
    retried = int(done.stderr.split(" refusals retried")[0].rsplit(" ", 1)[1])
    assert retried == refused  # every refusal the server counted was sent again
    vectors = np.load(out)
    assert vectors.shape == (len(lines), 384)
    assert_close(vectors[:50], want)


def start_job(server: ServerProcess, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "minilm_embed.client", "--address", server.address, "embed-file", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def rows_on_disk(out: Path) -> int:
    if not out.exists():
        return 0
    if out.suffix == ".jsonl":
        return out.read_bytes().count(b"\n")
    return (out.stat().st_size - len(bulk.npy_header(0, 384))) // (4 * 384)


def load(out: Path) -> tuple[list, np.ndarray]:
    if out.suffix == ".npy":
        return [], np.load(out)
    rows = read_jsonl(out)
    return [r["id"] for r in rows], np.asarray([r["embedding"] for r in rows], dtype=np.float32)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_a_killed_job_resumes_to_what_an_uninterrupted_one_writes(server, tmp_path, suffix):
    lines = corpus(1200)
    path = tmp_path / "in.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    whole, resumed = tmp_path / f"whole{suffix}", tmp_path / f"resumed{suffix}"
    flags = ["--batch-size", "8", "--concurrency", "4"]
    job = start_job(server, str(path), "--out", str(resumed), *flags)
    deadline = time.monotonic() + 60
    while rows_on_disk(resumed) < 100 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait(10)
    assert job.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    killed_at = rows_on_disk(resumed)
    assert 0 < killed_at < len(lines)
    if suffix == ".npy":
        with pytest.raises(ValueError):  # a partial .npy never loads as if it were whole
            np.load(resumed)
    done = embed_file(server, str(path), "--out", str(resumed), "--resume", *flags)
    assert done.returncode == 0, done.stderr
    assert f"{killed_at} of them from before" in done.stderr
    done = embed_file(server, str(path), "--out", str(whole), *flags)
    assert done.returncode == 0, done.stderr
    (ids, got), (want_ids, want) = load(resumed), load(whole)
    assert got.shape == (len(lines), 384)
    assert ids == want_ids
    assert_close(got, want)


def test_resuming_against_another_input_is_refused(server, tmp_path):
    first, other = tmp_path / "first.txt", tmp_path / "other.jsonl"
    first.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n', encoding="utf-8")
    other.write_text('{"id": "a", "text": "x"}\n{"id": "c", "text": "y"}\n{"id": "d", "text": "z"}\n')
    out = tmp_path / "v.jsonl"
    assert embed_file(server, str(first), "--jsonl", "--out", str(out)).returncode == 0
    done = embed_file(server, str(other), "--jsonl", "--out", str(out), "--resume")
    assert done.returncode == 2
    assert "record 2 has id 'c'" in done.stderr and "another input" in done.stderr


# Without a server: the pieces a resume depends on.


def test_lines_split_on_newline_only(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes("a\u2028b\r\nc\rd\ne\x85f".encode())
    with path.open("rb") as f:
        assert list(bulk.read_lines(f, "in")) == [(1, "a\u2028b"), (2, "c\rd"), (3, "e\x85f")]


def test_a_cut_short_row_is_dropped_on_resume(tmp_path):
    out = tmp_path / "v.npy"
    sink = bulk.NpySink(out, dims=4)
    sink.open(resume=False)
    records = [bulk.Record(i, "t") for i in range(3)]
    sink.write(records, np.arange(12, dtype=np.float32).reshape(3, 4))
    sink.close(complete=False)
    with out.open("ab") as f:
        f.write(b"\x00" * 6)  # half a row: the kill came mid-write
    resumed = bulk.NpySink(out, dims=4)
    assert resumed.open(resume=True).rows == 3
    resumed.write([bulk.Record(3, "t")], np.full((1, 4), 7, dtype=np.float32))
    resumed.close(complete=True)
    assert np.load(out).tolist() == [*np.arange(12).reshape(3, 4).tolist(), [7] * 4]


def test_unavailable_and_resource_exhausted_are_retried_and_others_are_not():
    def error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")

    outcomes = [error(grpc.StatusCode.UNAVAILABLE), error(grpc.StatusCode.RESOURCE_EXHAUSTED), np.ones(1)]

    async def call() -> np.ndarray:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    stats = bulk.Stats()
    backoff = bulk.Backoff(retries=2, first_s=0.001)
    assert asyncio.run(bulk.with_retries(call, backoff, stats)).tolist() == [1.0]
    assert stats.retried == 2
    outcomes[:] = [error(grpc.StatusCode.INVALID_ARGUMENT), np.ones(1)]
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(bulk.with_retries(call, backoff, stats))
    outcomes[:] = [error(grpc.StatusCode.UNAVAILABLE)] * 3
    with pytest.raises(grpc.aio.AioRpcError):  # retries spent: the last error is the job's
        asyncio.run(bulk.with_retries(call, backoff, stats))


def test_chunks_stop_at_the_byte_budget_as_well_as_the_count():
    texts = ["a" * 600, "é" * 300, "b" * 10, "c" * 2000, "d", "e", "f"]  # "é" is 2 bytes in UTF-8
    records = iter(bulk.Record(i, t) for i, t in enumerate(texts))
    got = [[r.id for r in chunk] for chunk, error in bulk.chunks(records, 3, 1000)]
    # 600 + 600 > 1000; 600 + 10 fits; a 2000-byte text goes alone; then the count of 3 cuts
    assert got == [[0], [1, 2], [3], [4, 5, 6]]


def test_a_file_of_long_texts_fits_the_servers_message_limit(server, client, tmp_path):
    """32 texts of 100 kB would be a 3.2 MB request, over the server's 2 MiB default: the job splits
    by bytes and every row is written."""
    texts = [f"{i} " + SHORT[i % len(SHORT)] * (100_000 // len(SHORT[i % len(SHORT)])) for i in range(40)]
    texts = [t[:100_000] for t in texts]
    path = tmp_path / "long.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "long.npy"
    done = embed_file(server, str(path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert_close(np.load(out), alone(client, texts))
