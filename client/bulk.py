"""Bulk jobs: a file of texts in, a file of vectors out, row for row, in constant memory.

Input is read as bytes and split on b"\\n" only (a trailing "\\r" is dropped), so output row i is
input line i whatever the texts hold: `str.splitlines()` would also break at \\v, \\f, \\x1c-\\x1e,
U+0085, U+2028 and U+2029 and shift every later row. Two input formats:

- text: one text per line; the row's id is its line number (1-based).
- JSONL (`jsonl=True`): one `{"id": ..., "text": "..."}` object per line.

Two output formats, chosen by the suffix of the output path:

- `.npy`: float32 [rows, dimensions], rows appended as they come. Until the job ends, the file's magic
  is PARTIAL_MAGIC (numpy refuses to load it); the header with the row count and numpy's magic are
  written last. For JSONL input the ids go beside it, one JSON value per line, in `<out>.ids.jsonl`.
- `.jsonl`: one `{"id": ..., "embedding": [...]}` object per line.

Rows are written in input order as soon as they and every row before them are back, so at most
`concurrency` requests of `batch_size` texts are held. A request refused with RESOURCE_EXHAUSTED
(queue full) or UNAVAILABLE (warming up, draining) is retried with exponential backoff.

Resuming (`resume=True`) counts the whole rows already in the output (a row cut short by a kill is
dropped), skips that many input records and appends the rest. With ids (JSONL input or output) the
last id written must be the id of the input record at that position, so a different input is refused.
The server batches requests together, so a vector is equal across runs within the batch invariance the
server guarantees (cosine >= 0.99999), not bit for bit.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import random
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import grpc
import numpy as np

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
PARTIAL_MAGIC = b"\x93PARTL"  # in place of numpy's b"\x93NUMPY" while the job runs
NPY_MAGIC = b"\x93NUMPY"
IDS_SUFFIX = ".ids.jsonl"


class InputFileError(Exception):
    """Input that cannot be embedded as given; the message names the file and the line."""


class OutputFileError(Exception):
    """An output file that cannot be written or resumed; the message says why."""


@dataclass(frozen=True)
class Record:
    id: Any  # the line number for text input, the object's "id" for JSONL
    text: str


# Input.


def read_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, str]]:
    """(line number, text) per line: split on b"\\n" only, "\\r\\n" accepted, UTF-8 checked per line."""
    for number, raw in enumerate(stream, start=1):
        line = raw[:-1] if raw.endswith(b"\n") else raw
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            yield number, line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputFileError(f"{name}:{number}: not UTF-8 ({e.reason} at byte {e.start})") from None


def text_records(lines: Iterable[tuple[int, str]], name: str) -> Iterator[Record]:
    for number, text in lines:
        if not text:
            raise InputFileError(f"{name}:{number}: empty line (the file holds one text per line)")
        yield Record(number, text)


def jsonl_records(lines: Iterable[tuple[int, str]], name: str) -> Iterator[Record]:
    for number, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputFileError(f"{name}:{number}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(item, dict) or "id" not in item:
            raise InputFileError(f'{name}:{number}: expected an object {{"id": ..., "text": "..."}}')
        text = item.get("text")
        if not isinstance(text, str) or not text:
            raise InputFileError(f'{name}:{number}: "text" must be a non-empty string, not {text!r}')
        yield Record(item["id"], text)


def chunks(
    records: Iterator[Record], most: int, max_bytes: int
) -> Iterator[tuple[list[Record], InputFileError | None]]:
    """Requests' worth of records: up to `most` of them and `max_bytes` of UTF-8 text (at least one
    each), so no request passes the server's message limit. The input error that ended the file, if
    one did, comes with the last chunk."""
    chunk: list[Record] = []
    size = 0
    try:
        for record in records:
            cost = len(record.text) if record.text.isascii() else len(record.text.encode())
            if chunk and size + cost > max_bytes:
                yield chunk, None
                chunk, size = [], 0
            chunk.append(record)
            size += cost
            if len(chunk) == most:
                yield chunk, None
                chunk, size = [], 0
    except InputFileError as e:
        yield chunk, e
        return
    if chunk:
        yield chunk, None


# Output.


class Sink(Protocol):
    """Where rows go: `open` says what is already there, `close(complete=True)` seals the output."""

    def open(self, resume: bool) -> Written: ...
    def write(self, records: list[Record], vectors: np.ndarray) -> None: ...
    def close(self, complete: bool) -> None: ...


def npy_header(rows: int, dims: int, magic: bytes = NPY_MAGIC) -> bytes:
    """numpy's own v1.0 header; numpy leaves room for the row count to grow, so it never changes size."""
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (rows, dims)}
    np.lib.format.write_array_header_1_0(buffer, header)
    return magic + buffer.getvalue()[len(magic) :]


@dataclass(frozen=True)
class Written:
    """What an output already holds when a job starts: whole rows, and the last row's id if it keeps ids."""

    rows: int = 0
    last_id: tuple[Any, ...] = ()  # (id,) or () where the output keeps no ids


def whole_lines(path: Path, keep: int | None = None) -> tuple[int, bytes]:
    """Count a line-per-row file's complete lines (at most `keep`), truncate what follows them, and
    return the count and the last line kept. Streams: a resumed 1M-row job reads, never holds, its rows."""
    count, offset, last = 0, 0, b""
    with path.open("r+b") as f:
        for line in f:
            if not line.endswith(b"\n") or count == keep:
                break
            count, offset, last = count + 1, offset + len(line), line
        f.truncate(offset)
    return count, last


def same_layout(a: bytes, b: bytes) -> bool:
    """Two .npy headers alike but for the magic and the row count."""
    return a[len(NPY_MAGIC) :].split(b"'shape'")[0] == b[len(NPY_MAGIC) :].split(b"'shape'")[0]


@dataclass
class NpySink:
    path: Path
    dims: int
    ids_path: Path | None = None  # for JSONL input: the ids, one JSON value per line
    rows: int = 0
    _vectors: IO[bytes] | None = field(default=None, repr=False)
    _ids: IO[bytes] | None = field(default=None, repr=False)

    @property
    def header_size(self) -> int:
        return len(npy_header(0, self.dims))

    def open(self, resume: bool) -> Written:
        written = self._resume() if resume and self.path.exists() else self._create()
        self._vectors = self.path.open("r+b")
        self._vectors.seek(0, os.SEEK_END)
        if self.ids_path is not None:
            self._ids = self.ids_path.open("ab")
        return written

    def _create(self) -> Written:
        self.path.write_bytes(npy_header(0, self.dims, PARTIAL_MAGIC))
        if self.ids_path is not None:
            self.ids_path.write_bytes(b"")
        return Written()

    def _resume(self) -> Written:
        with self.path.open("rb") as f:
            head = f.read(self.header_size)
        for magic in (NPY_MAGIC, PARTIAL_MAGIC):
            if head.startswith(magic) and same_layout(head, npy_header(0, self.dims)):
                break
        else:
            raise OutputFileError(f"{self.path}: not a float32 .npy written by this client; cannot resume it")
        columns = int(head.split(b"'shape': (")[1].split(b")")[0].split(b",")[1])
        if columns != self.dims:
            raise OutputFileError(f"{self.path}: rows of {columns} floats, but the server gives {self.dims}")
        self.rows = (self.path.stat().st_size - self.header_size) // (4 * self.dims)
        last_id: tuple[Any, ...] = ()
        if self.ids_path is not None:
            self.rows, last = (
                whole_lines(self.ids_path, keep=self.rows) if self.ids_path.exists() else (0, b"")
            )
            last_id = (json.loads(last),) if self.rows else ()
        with self.path.open("r+b") as f:
            f.write(npy_header(0, self.dims, PARTIAL_MAGIC))
            f.truncate(self.header_size + 4 * self.dims * self.rows)
        return Written(self.rows, last_id)

    def write(self, records: list[Record], vectors: np.ndarray) -> None:
        assert self._vectors is not None and vectors.shape == (len(records), self.dims)
        self._vectors.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
        if self._ids is not None:
            self._ids.write("".join(json.dumps(r.id) + "\n" for r in records).encode())
        self.rows += len(records)

    def close(self, complete: bool) -> None:
        assert self._vectors is not None
        if self._ids is not None:
            self._ids.close()  # before the header: a sealed file always has every id beside it
        if complete:
            self._vectors.seek(0)
            self._vectors.write(npy_header(self.rows, self.dims))
        self._vectors.close()


@dataclass
class JsonlSink:
    path: Path
    rows: int = 0
    _out: IO[bytes] | None = field(default=None, repr=False)

    def open(self, resume: bool) -> Written:
        written = Written()
        if resume and self.path.exists():
            self.rows, last = whole_lines(self.path)
            written = Written(self.rows, (json.loads(last)["id"],) if self.rows else ())
        else:
            self.path.write_bytes(b"")
        self._out = self.path.open("ab")
        return written

    def write(self, records: list[Record], vectors: np.ndarray) -> None:
        assert self._out is not None
        rows = (
            json.dumps({"id": r.id, "embedding": v.tolist()}) for r, v in zip(records, vectors, strict=True)
        )
        self._out.write("".join(row + "\n" for row in rows).encode())
        self.rows += len(records)

    def close(self, complete: bool) -> None:
        assert self._out is not None
        self._out.close()


def sink_for(out: Path, dims: int, jsonl_input: bool) -> Sink:
    if out.suffix == ".npy":
        return NpySink(out, dims, out.with_name(out.stem + IDS_SUFFIX) if jsonl_input else None)
    if out.suffix == ".jsonl":
        return JsonlSink(out)
    raise OutputFileError(f"{out}: the output must end in .npy or .jsonl")


def skip_written(records: Iterator[Record], written: Written, name: str) -> None:
    """Consume the input records the output already holds; where it keeps ids, the last must match."""
    count, last = 0, None
    for record in itertools.islice(records, written.rows):
        count, last = count + 1, record
    if count < written.rows:
        raise InputFileError(f"{name}: {count} records, but the output already holds {written.rows} rows")
    if written.last_id and last is not None and last.id != written.last_id[0]:
        raise InputFileError(
            f"{name}: record {count} has id {last.id!r}, but the output's row {count} has id "
            f"{written.last_id[0]!r}: this output was made from another input"
        )


# The job.


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: the k-th retry waits a random time in [d/2, d], d = first * 2^k."""

    retries: int = 10
    first_s: float = 0.1
    max_s: float = 10.0

    def delays(self) -> Iterator[float]:
        for k in range(self.retries):
            d = min(self.max_s, self.first_s * 2**k)
            yield random.uniform(d / 2, d)


@dataclass
class Stats:
    rows: int = 0  # in the output, those of earlier runs included
    resumed: int = 0  # rows that were there when the job started
    retried: int = 0  # requests refused (RESOURCE_EXHAUSTED, UNAVAILABLE) and sent again


async def with_retries(
    call: Callable[[], Awaitable[np.ndarray]], backoff: Backoff, stats: Stats
) -> np.ndarray:
    for delay in backoff.delays():
        try:
            return await call()
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE:
                raise
        stats.retried += 1
        await asyncio.sleep(delay)
    return await call()  # the last attempt: its error is the job's


async def run_pipeline(
    records: Iterator[Record],
    embed: Callable[[list[str]], Coroutine[Any, Any, np.ndarray]],
    write: Callable[[list[Record], np.ndarray], None],
    batch_size: int,
    concurrency: int,
    max_request_bytes: int = 1 << 20,
) -> None:
    """Up to `concurrency` requests in flight; results written in input order as the oldest completes.
    A bad input line ends the job after every row before it is written, so a resume starts at it."""
    pending: deque[tuple[list[Record], asyncio.Task[np.ndarray]]] = deque()

    async def write_oldest() -> None:
        done, task = pending.popleft()
        write(done, await task)

    try:
        error: InputFileError | None = None
        source = chunks(records, batch_size, max_request_bytes)
        while error is None:
            chunk, error = await asyncio.to_thread(next, source, ([], None))
            if not chunk:
                break
            if len(pending) >= concurrency:
                await write_oldest()
            pending.append((chunk, asyncio.create_task(embed([r.text for r in chunk]))))
        while pending:
            await write_oldest()
        if error is not None:
            raise error
    finally:
        for _, task in pending:
            task.cancel()


@dataclass(frozen=True)
class Job:
    source: Path | None  # None: standard input
    out: Path
    jsonl: bool = False
    resume: bool = False
    batch_size: int = 32
    # Text per request: half the server's default --max-message-bytes (2 MiB), for protobuf's framing.
    max_request_bytes: int = 1 << 20
    concurrency: int = 16
    normalize: bool = True
    backoff: Backoff = Backoff()


class Embedder(Protocol):
    async def embed(self, texts: list[str], normalize: bool = True) -> np.ndarray: ...


@contextmanager
def input_stream(source: Path | None) -> Iterator[tuple[IO[bytes], str]]:
    if source is None:
        yield sys.stdin.buffer, "<stdin>"
        return
    with source.open("rb") as stream:
        yield stream, str(source)


async def run_job(job: Job, client: Embedder, dims: int, progress: Callable[[int], None]) -> Stats:
    """Embed job.source into job.out. On an error the output holds whole rows only and resumes."""
    if job.out.exists() and not job.resume:
        raise OutputFileError(f"{job.out} exists: add --resume to continue it, or remove it")
    sink = sink_for(job.out, dims, job.jsonl)
    with input_stream(job.source) as (stream, name):
        parse = jsonl_records if job.jsonl else text_records
        records = parse(read_lines(stream, name), name)
        written = sink.open(job.resume)
        stats = Stats(rows=written.rows, resumed=written.rows)
        complete = False
        try:
            skip_written(records, written, name)

            def write(done: list[Record], vectors: np.ndarray) -> None:
                sink.write(done, vectors)
                stats.rows += len(done)
                progress(len(done))

            async def embed(texts: list[str]) -> np.ndarray:
                return await with_retries(
                    lambda: client.embed(texts, normalize=job.normalize), job.backoff, stats
                )

            await run_pipeline(records, embed, write, job.batch_size, job.concurrency, job.max_request_bytes)
            complete = True
        finally:
            sink.close(complete)
    return stats
