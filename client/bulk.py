"""Bulk jobs: a file of texts in, a file of vectors out, row for row, in constant memory.

Input is read as bytes and split on b"\\n" only (a trailing "\\r" is dropped), so output row i is
input line i whatever the texts hold: `str.splitlines()` would also break at \\v, \\f, \\x1c-\\x1e,
U+0085, U+2028 and U+2029 and shift every later row. Two input formats:

- text: one text per line; the row's id is its line number (1-based).
- JSONL (`jsonl=True`): one `{"id": ..., "text": "..."}` object per line.

An empty line is refused by its number, wherever it is (the last line too): skipped, it would move
every later row off its line. A line of spaces is a text and gets its row.

Two output formats, chosen by the suffix of the output path:

- `.npy`: float32 [rows, dimensions], rows appended as they come. Until the job ends, the file's magic
  is PARTIAL_MAGIC (numpy refuses to load it); the header with the row count and numpy's magic are
  written last. For JSONL input the ids go beside it, one JSON value per line, in `<stem>.ids.jsonl`
  (that name from the start: only as many ids are read as the vectors have rows). Each row's id is
  handed to the OS before its vector, so a killed job leaves no row without its id; a resume refuses
  a finished .npy with fewer ids than rows (an ids file that is not its own) rather than drop rows,
  and a new job an ids file already there without its .npy.
- `.jsonl`: one `{"id": ..., "embedding": [...]}` object per line, each float with the 9 significant
  digits that give back the same float32.

Rows go to `<out>.partial` (PARTIAL_SUFFIX) while the job runs; it is renamed to `<out>` (os.replace,
atomic) once the last row is written and a .npy sealed, so a file under the output's own name is always
a finished one. A job that fails or is killed leaves `<out>.partial`, and its message says so; a new
job that fails before its first row is written leaves no file. No file a job writes may be its input.

CSV is not read as columns: a header or a quoted newline would become rows of their own, so a `.csv`
or `.tsv` input is refused (give JSONL instead, or one text per line). A `.jsonl` or `.json` input
without `jsonl` is refused too: each row would be the vector of a line's JSON. JSON numbers are read as
Python's json reads them (ints, float64); one past float64 (1e400, read as inf) is refused at its line,
as NaN and Infinity are, since written back it would not be JSON.

Before the first request the job learns the server's limits from its Info: requests hold at most
`max_inputs_per_request` texts and at most `queue_limit` (a larger request can never be admitted; any
up to it fits an empty queue, bulk or not), half `max_message_bytes` of text and as many rows as one
answer of `max_message_bytes` holds (that matters only on a server run with a lower limit), and a
line over `max_text_chars`, or too large for any request, ends the job naming its line, as any bad
line does, after every row before it is written. A request refused later for one of those limits
(the server restarted with lower ones) ends the job (LimitsChanged): a resume reads them again.

Rows are written in input order as soon as they and every row before them are back (also while the
job waits for input), and handed to the OS, so at most `concurrency` requests of `batch_size` texts are
held. From a pipe, the lines read go as a request once no line has come for STALL_S: a producer that
pauses finds every row of the lines it sent in the output. A request refused with RESOURCE_EXHAUSTED
(queue full), UNAVAILABLE (warming up, draining) or DEADLINE_EXCEEDED (a long queue; the server
dropped it before computing it) is retried for up to 10 minutes: after the wait the server's
refusal asks for (its RetryInfo), with jitter, or else with exponential backoff; a message over the
server's size limit is not (it would fail again), nor a TLS handshake that failed.

Resuming (`resume=True`) counts the whole rows already in `<out>.partial`, or else in a finished
`<out>` (a row cut short by a kill is dropped), skips that many input records and appends the rest; a
finished output becomes `<out>.partial` again only once a record is there to append. Where both files
exist the job is refused (which one to go on with is the user's to say), as is a job without `resume`
where either does. With ids (JSONL input or output) the last id written must be the id of the input
record at that position (as JSON values: true is not 1), so a different input is refused. Line numbers
cannot tell one file from another, nor ids a changed text, so the record at the last row's place is also
embedded again and must come back at cosine >= 0.999 to that row (SAME_ROW_COSINE): a different file,
or another model or precision, is refused; a `.npy` made from JSONL input (ids beside it) resumes only
with JSONL input, and one made from text only with text. The last row's length tells whether the
output was normalised (length 1) or not (the model's mean-pooled vectors: lengths 1.96-7.76 over
STS-B dev's 3,006 sentences), and a resume with the other setting is refused: the file would mix the
two. The output is read, not changed, until the input has been checked against it: a refused resume
leaves it as it was, sealed or not.
The server batches requests together, so a vector is equal across runs within the batch invariance the
server guarantees (cosine >= 0.99999), not bit for bit.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import os
import random
import re
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

import grpc
import numpy as np

from minilm_embed.client.client import embed_request, lone_surrogate, to_array
from minilm_embed.client.errors import EmbeddingError, TooLarge, from_rpc_error
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb

# Refusals that may pass later. A request past its deadline is one: the server drops inputs whose
# deadline passed before computing them, so sending it again does the work once.
RETRYABLE = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
PARTIAL_MAGIC = b"\x93PARTL"  # in place of numpy's b"\x93NUMPY" while the job runs
NPY_MAGIC = b"\x93NUMPY"
IDS_SUFFIX = ".ids.jsonl"
PARTIAL_SUFFIX = ".partial"  # <out>.partial: the output until the job has written it all
T = TypeVar("T")
FLOAT32 = "{:.9g}"  # 9 significant digits give back every float32 exactly; float64's 17 only take room
NOT_COLUMNS = (".csv", ".tsv")
JSON_INPUT = (".jsonl", ".json")  # read as text, each row would be the vector of a line's JSON
# The server's reasons for refusing a request over a limit the job sized its requests by (Info's, read at
# its start); gRPC's own refusal of a message over max_message_bytes has none, and is a TooLarge.
SIZED_BY = ("TOO_MANY_INPUTS", "OVER_QUEUE_LIMIT", "ANSWER_TOO_LARGE")
# A normalised float32 row's length is 1 within 1e-6; the model's mean-pooled rows are nowhere near it.
NORM_TOLERANCE = 1e-3
# A request's or a response's bytes beyond its texts or vectors: protobuf's tags and lengths and the
# other fields (a response row's usage takes ~12), kept clear of the server's max_message_bytes.
MESSAGE_FRAMING = 1024
ROW_FRAMING = 32
# A resumed output's last row against the input's record at that place, embedded again: the server
# gives the same text the same vector within 0.99999 (its batch invariance); another text, or
# another model or precision (int8 against fp32: 0.989), falls below this.
SAME_ROW_COSINE = 0.999
# No line for this long from a pipe: its producer paused, and the lines read so far go as a request.
STALL_S = 0.05
# A refused request waits the server's RetryInfo delay times a random factor in [1, HINT_SPREAD]: never
# sooner (the queue said it has no room until then), and spread over half that again so that the
# requests a job has in flight, refused together, are sent again one by one as room appears.
HINT_SPREAD = 1.5


class InputFileError(Exception):
    """Input that cannot be embedded as given; the message names the file and the line."""


class GraphChanged(Exception):
    """An answer computed by another graph than the job's first (Info's): its vectors and those
    written are not comparable, so the job stops before writing it."""


class LimitsChanged(Exception):
    """A request refused for a limit the job sized its requests by (SIZED_BY): the server's limits are
    lower than its Info said when the job began (a restart with other settings). A resume reads them
    again; the job itself does not shrink its requests mid-way."""


class OutputFileError(Exception):
    """An output file that cannot be written or resumed; the message says why."""


@dataclass(frozen=True)
class Record:
    id: Any  # the line number for text input, the object's "id" for JSONL
    text: str
    line: int  # in the input file, for messages


# Input.


class PipeLines:
    """The lines of a pipe, a FIFO or a terminal (each with its b"\\n", as a file's iteration gives
    them), read with os.read into a buffer of its own so that `ready` can tell whether a whole line is
    there, or comes within a wait, without blocking on it: a buffered reader cannot tell, and a
    producer may pause for as long as it likes with the pipe open."""

    READ_SIZE = 1 << 16

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()
        self.start = 0  # where the next line begins
        self.scanned = 0  # no b"\n" in buffer[start:scanned]: a long line is searched once
        self.eof = False

    def ready(self, wait_s: float) -> bool:
        """Whether the next line (or the end) is there, or comes within `wait_s` seconds."""
        if self._line_end() >= 0 or self.eof:  # as a stream that flows mostly is: no clock read
            return True
        deadline = time.monotonic() + wait_s
        while self._line_end() < 0 and not self.eof:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return False
            self._fill()
        return True

    def __iter__(self) -> PipeLines:
        return self

    def __next__(self) -> bytes:
        while (end := self._line_end()) < 0 and not self.eof:
            select.select([self.fd], [], [])  # a stdin left O_NONBLOCK by its parent: no BlockingIOError
            self._fill()
        if end < 0 and self.start == len(self.buffer):
            raise StopIteration
        end = len(self.buffer) - 1 if end < 0 else end  # the last line, without its b"\n"
        line = bytes(self.buffer[self.start : end + 1])
        self.start = self.scanned = end + 1
        return line

    def _line_end(self) -> int:
        end = self.buffer.find(b"\n", self.scanned)
        self.scanned = len(self.buffer) if end < 0 else end
        return end

    def _fill(self) -> None:
        data = os.read(self.fd, self.READ_SIZE)
        self.eof = not data
        del self.buffer[: self.start]  # the lines read: O(1) at a bytearray's front
        self.scanned -= self.start
        self.start = 0
        self.buffer += data


def lines_of(stream: IO[bytes]) -> IO[bytes] | PipeLines:
    """A regular file's own iteration (the fastest; a file never stalls), else PipeLines."""
    try:
        fd = stream.fileno()
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (OSError, ValueError):  # not a file (stdin replaced: in-process callers, tests)
        return stream
    return stream if regular else PipeLines(fd)


def read_lines(stream: Iterable[bytes], name: str) -> Iterator[tuple[int, str]]:
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
        yield Record(number, text, number)


def jsonl_records(lines: Iterable[tuple[int, str]], name: str) -> Iterator[Record]:
    for number, line in lines:
        line = line.removeprefix(BOM) if number == 1 else line  # as text input keeps reading past it
        if not line:
            raise InputFileError(
                f'{name}:{number}: empty line (expected an object {{"id": ..., "text": "..."}})'
            )
        try:
            item = json.loads(line, parse_constant=_not_json, parse_float=_finite)
        except json.JSONDecodeError as e:
            raise InputFileError(f"{name}:{number}: not JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # NaN, Infinity, 1e400: Python's json reads them as floats JSON has not
            raise InputFileError(f"{name}:{number}: not JSON ({e})") from None
        if not isinstance(item, dict):
            raise InputFileError(f'{name}:{number}: expected an object {{"id": ..., "text": "..."}}')
        for key in ("id", "text"):
            if key not in item:
                raise InputFileError(f'{name}:{number}: the object has no "{key}"')
        text = item["text"]
        if not isinstance(text, str) or not text:
            raise InputFileError(
                f'{name}:{number}: "text" must be a non-empty string, not {json.dumps(text)}'
            )
        if at := lone_surrogate(text):
            raise InputFileError(f'{name}:{number}: "text" {at}')
        yield Record(item["id"], text, number)


BOM = "\ufeff"


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


def _finite(number: str) -> float:
    """A JSON number as Python's json reads it, unless it overflows float64: read as inf, an id would
    be written back as Infinity, which no JSON parser reads."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(
            f"{number} is beyond float64: read as {value}, it would be written back as "
            f"{json.dumps(value)}, which is not JSON; give the id as a string"
        )
    return value


def within(
    records: Iterable[Record], max_chars: int, name: str, max_message_bytes: int = 0
) -> Iterator[Record]:
    """The records, ending at the first over the server's max_text_chars, or too large for a request
    of its max_message_bytes however alone (0: no limit known)."""
    most = max_message_bytes - MESSAGE_FRAMING
    for record in records:
        if max_chars and len(record.text) > max_chars:
            raise InputFileError(
                f"{name}:{record.line}: {len(record.text)} characters, over the server's limit "
                f"max_text_chars={max_chars}"
            )
        if max_message_bytes and len(record.text) > most // 4 and (size := utf8_size(record.text)) > most:
            raise InputFileError(
                f"{name}:{record.line}: {size} bytes of UTF-8, more than one request can carry under "
                f"max_message_bytes={max_message_bytes} (the server's limit, or the client's own where "
                "that is smaller)"
            )
        yield record


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def chunks(
    records: Iterator[Record], most: int, max_bytes: int, ready: Callable[[float], bool] | None = None
) -> Iterator[tuple[list[Record], InputFileError | None]]:
    """Requests' worth of records: up to `most` of them and `max_bytes` of UTF-8 text (at least one
    each), so no request passes the server's message limit. The input error that ended the file, if
    one did, comes with the last chunk. Where the input can stall (a pipe; `ready(s)`: whether the
    next line comes within s seconds), a chunk also goes as it is once no line has come for STALL_S:
    the rows of lines already read do not wait for lines that may be long in coming."""
    chunk: list[Record] = []
    size = 0
    try:
        for record in records:
            cost = utf8_size(record.text)
            if chunk and size + cost > max_bytes:
                yield chunk, None
                chunk, size = [], 0
            chunk.append(record)
            size += cost
            if len(chunk) == most or (ready is not None and not ready(STALL_S)):
                yield chunk, None
                chunk, size = [], 0
    except InputFileError as e:
        yield chunk, e
        return
    if chunk:
        yield chunk, None


# Output.


class Sink(Protocol):
    """Where rows go. `inspect` reads what an existing output holds and changes nothing; `open` starts
    writing (`resume`: after what `inspect` found, else into an empty output); `close(complete=True)`
    seals it; `held`, once closed, counts the whole rows it holds, as a resume would (a write that
    failed may have left some of its rows); `remove`, once closed, deletes what `open` wrote."""

    path: Path
    rows: int  # written, by the job's count

    def inspect(self) -> Written: ...
    def held(self) -> int: ...
    def open(self, resume: bool) -> None: ...
    def write(self, records: list[Record], vectors: np.ndarray) -> None: ...
    def close(self, complete: bool) -> None: ...
    def remove(self) -> None: ...


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
    last_row: tuple[float, ...] = ()  # the last row's vector, () where there are no rows

    def check_normalized(self, normalize: bool, out: Path) -> None:
        """A resume must keep the output's setting: normalised rows have length 1, pooled ones not."""
        if not self.last_row or normalized(np.asarray(self.last_row, dtype=np.float32)) == normalize:
            return
        flag, was = ("with", "not normalised") if normalize else ("without", "normalised")
        raise OutputFileError(f"{out}: its rows are {was}: resume it {flag} --no-normalize")


def normalized(row: np.ndarray) -> bool:
    return abs(float(np.linalg.norm(row.astype(np.float64))) - 1.0) < NORM_TOLERANCE


@dataclass(frozen=True)
class Lines:
    """A line-per-row file's first complete lines: how many, the bytes they take, the last of them."""

    count: int = 0
    size: int = 0
    last: bytes = b""


def whole_lines(path: Path, keep: int | None = None, start: int = 0) -> Lines:
    """The complete lines (at most `keep`) at the start of a line-per-row file, or from byte `start`.
    Streams: a resumed 1M-row job reads, never holds, its rows."""
    count, size, last = 0, 0, b""
    with path.open("rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n") or count == keep:
                break
            count, size, last = count + 1, size + len(line), line
    return Lines(count, size, last)


def same_layout(a: bytes, b: bytes) -> bool:
    """Two .npy headers alike but for the magic and the row count."""
    return a[len(NPY_MAGIC) :].split(b"'shape'")[0] == b[len(NPY_MAGIC) :].split(b"'shape'")[0]


@dataclass
class NpySink:
    path: Path
    dims: int
    ids_path: Path | None = None  # for JSONL input: the ids, one JSON value per line
    rows: int = 0
    _ids_size: int = 0  # bytes of the ids file that hold `rows` ids, from inspect()
    _vectors: IO[bytes] | None = field(default=None, repr=False)
    _ids: IO[bytes] | None = field(default=None, repr=False)

    @property
    def header_size(self) -> int:
        return len(npy_header(0, self.dims))

    def inspect(self) -> Written:
        self.rows, sealed = self._whole_rows()
        if self.ids_path is None:
            if self.rows and (beside := ids_beside(self.path)).exists():
                if sealed and (count := whole_lines(beside, keep=self.rows).count) < self.rows:
                    raise OutputFileError(self._fewer_ids(beside, count))
                raise OutputFileError(
                    f"{self.path}: made from JSONL input (its ids are in {beside}): resume it with --jsonl"
                )
            return Written(self.rows, last_row=self.row(self.rows - 1))
        if self.rows and not self.ids_path.exists():
            raise OutputFileError(
                f"{self.path}: no {self.ids_path} beside it: made from text input (then resume it "
                "without --jsonl), or its ids file was moved or deleted (put it back)"
            )
        ids = whole_lines(self.ids_path, keep=self.rows) if self.ids_path.exists() else Lines()
        if ids.count < self.rows and sealed:
            raise OutputFileError(self._fewer_ids(self.ids_path, ids.count))
        # Unfinished, its ids may lag its rows: clients before 2026-11-29 wrote the vectors first (a
        # kill then left rows without ids), and a power loss keeps what the page cache chose. The rows
        # past the last id go (the vectors are cut there as the job opens the file) and are redone.
        self.rows, self._ids_size = min(self.rows, ids.count), ids.size
        return Written(self.rows, (json.loads(ids.last),) if self.rows else (), self.row(self.rows - 1))

    def held(self) -> int:
        """The rows a resume would go on from: the whole rows, and of those only the ones with an id
        where it keeps ids (each batch's ids reach the OS before its vectors)."""
        rows, _ = self._whole_rows()
        if self.ids_path is None:
            return rows
        return whole_lines(self.ids_path, keep=rows).count if self.ids_path.exists() else 0

    def _whole_rows(self) -> tuple[int, bool]:
        """The rows in the file, its header checked (a row cut short by a kill is not counted), and
        whether it is sealed (a finished output, numpy's magic) rather than unfinished."""
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
        return (self.path.stat().st_size - self.header_size) // (4 * self.dims), magic == NPY_MAGIC

    def _fewer_ids(self, ids_file: Path, ids: int) -> str:
        """A sealed file's ids were all written before it was sealed, so fewer ids than rows are not
        this output's ids, or not all of them: going on from the last id would throw away the rows
        past it, and without ids the file could not be told from one made from text input."""
        return (
            f"{self.path} has {self.rows} rows but {ids_file} holds {ids} ids: cannot resume it as it is "
            f"(if it was made from text input, remove {ids_file} and resume without --jsonl)"
        )

    def row(self, index: int) -> tuple[float, ...]:
        """Row `index` of the file as it is, () for none (index -1)."""
        if index < 0:
            return ()
        with self.path.open("rb") as f:
            f.seek(self.header_size + 4 * self.dims * index)
            return tuple(np.frombuffer(f.read(4 * self.dims), dtype="<f4").tolist())

    def open(self, resume: bool) -> None:
        if not resume:
            self.rows = self._ids_size = 0
        with self.path.open("r+b" if self.path.exists() else "wb") as f:
            f.write(npy_header(0, self.dims, PARTIAL_MAGIC))
            f.truncate(self.header_size + 4 * self.dims * self.rows)
        self._vectors = self.path.open("r+b")
        self._vectors.seek(0, os.SEEK_END)
        if self.ids_path is not None:
            self._ids = self.ids_path.open("r+b" if self.ids_path.exists() else "wb")
            self._ids.truncate(self._ids_size)
            self._ids.seek(0, os.SEEK_END)

    def write(self, records: list[Record], vectors: np.ndarray) -> None:
        assert self._vectors is not None and vectors.shape == (len(records), self.dims)
        if self._ids is not None:
            # Handed to the OS before the vectors: a killed job never leaves a row without its id
            # (a resume refuses that), only ids past the rows, which it drops.
            self._ids.write("".join(json.dumps(r.id) + "\n" for r in records).encode())
            self._ids.flush()
        self._vectors.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
        self._vectors.flush()  # on the OS's side: a job waiting on its input has every row it counted there
        self.rows += len(records)

    def close(self, complete: bool) -> None:
        assert self._vectors is not None
        if self._ids is not None:
            if complete:
                synced(self._ids)
            self._ids.close()  # before the header: a sealed file always has every id beside it
        if complete:
            self._vectors.seek(0)
            self._vectors.write(npy_header(self.rows, self.dims))
            synced(self._vectors)
        self._vectors.close()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.ids_path is not None:
            self.ids_path.unlink(missing_ok=True)


@dataclass
class JsonlSink:
    path: Path
    dims: int
    rows: int = 0
    _size: int = 0  # bytes that hold `rows` rows, from inspect() and then each write
    _out: IO[bytes] | None = field(default=None, repr=False)

    def inspect(self) -> Written:
        lines = whole_lines(self.path)
        self.rows, self._size = lines.count, lines.size
        if not self.rows:
            return Written()
        try:
            last = json.loads(lines.last)
        except ValueError:
            last = None
        row = last.get("embedding") if isinstance(last, dict) and "id" in last else None
        if not isinstance(row, list) or not all(isinstance(x, float | int) for x in row):
            raise OutputFileError(
                f'{self.path}: its row {self.rows} is not a row of embed-file\'s ({{"id": ..., '
                '"embedding": [...]}): not an output of this client; cannot resume it'
            )
        if len(row) != self.dims:
            raise OutputFileError(f"{self.path}: rows of {len(row)} floats, but the server gives {self.dims}")
        return Written(self.rows, (last["id"],), tuple(row))

    def open(self, resume: bool) -> None:
        if not resume:
            self.rows = self._size = 0
        self._out = self.path.open("r+b" if self.path.exists() else "wb")
        self._out.truncate(self._size)
        self._out.seek(0, os.SEEK_END)

    def write(self, records: list[Record], vectors: np.ndarray) -> None:
        assert self._out is not None
        rows = (
            f'{{"id": {json.dumps(r.id)}, "embedding": [{",".join(map(FLOAT32.format, v.tolist()))}]}}\n'
            for r, v in zip(records, vectors, strict=True)
        )
        data = "".join(rows).encode()
        self._out.write(data)
        self._out.flush()  # on the OS's side: a job waiting on its input has every row it counted there
        self.rows, self._size = self.rows + len(records), self._size + len(data)

    def held(self) -> int:
        """The whole rows: those written, and any whole lines that a write which failed left past them
        (counted from there, not from the start: a failed job's file may be gigabytes)."""
        return self.rows + whole_lines(self.path, start=self._size).count

    def close(self, complete: bool) -> None:
        assert self._out is not None
        if complete:
            synced(self._out)
        self._out.close()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def synced(file: IO[Any]) -> None:
    """On the disk, not only in the page cache, before the output takes its final name: after a power
    cut a renamed file must not be one whose rows were never written."""
    file.flush()
    os.fsync(file.fileno())


def rename_durably(source: Path, target: Path) -> None:
    """os.replace, then the directory's entry synced too (where the platform can open and sync a
    directory)."""
    os.replace(source, target)
    try:
        directory = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory)
    except OSError:  # EINVAL on some FUSE and network filesystems: the rename stands, the job is done
        pass
    finally:
        os.close(directory)


def ids_beside(out: Path) -> Path:
    """Where a .npy output made from JSONL input keeps its ids: the same file for `<out>.partial` (the
    ids are read only up to the rows the vectors hold, so they need no name of their own)."""
    return out.with_name(Path(out.name.removesuffix(PARTIAL_SUFFIX)).stem + IDS_SUFFIX)


def partial_path(out: Path) -> Path:
    """Where a job writes `out` until every row is there."""
    return out.with_name(out.name + PARTIAL_SUFFIX)


def sink_for(out: Path, dims: int, jsonl_input: bool, at: Path | None = None) -> Sink:
    """The sink for output `out`'s format, reading and writing the file `at` (default: `out`)."""
    at = at or out
    if out.suffix == ".npy":
        return NpySink(at, dims, ids_beside(out) if jsonl_input else None)
    if out.suffix == ".jsonl":
        return JsonlSink(at, dims)
    raise OutputFileError(f"{out}: the output must end in .npy or .jsonl")


def refuse_input_as_output(job: Job) -> None:
    """No file the job writes may be its input: it would be written over while it is read, or a
    resume would read the input as rows. Compared as files, so a link or another spelling is caught."""
    if job.source is None:
        return
    writes = {job.out: "the output", partial_path(job.out): "the output until every row is written"}
    if job.jsonl and job.out.suffix == ".npy":
        writes[ids_beside(job.out)] = "the ids of a .npy made from JSONL input"
    for path, role in writes.items():
        if same_file(path, job.source):
            raise OutputFileError(f"{path} ({role}) is the input file {job.source}: give another --out")


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there (yet): their paths, links resolved, tell
        return a.resolve() == b.resolve()


def existing_output(out: Path, resume: bool) -> Path | None:
    """The file a job goes on from: `<out>.partial`, or a finished `out`, or None for a new output.
    Without `resume` neither may exist; with it, not both (which one is meant is the user's to say)."""
    partial = partial_path(out)
    if out.exists() and partial.exists():
        raise OutputFileError(
            f"{out} (finished) and {partial} (an unfinished job's rows) both exist: remove {partial} to "
            f"keep {out}, or remove {out} and run again with --resume to go on with {partial}"
        )
    if out.exists() and not resume:
        raise OutputFileError(f"{out} exists: add --resume to continue it, or remove it")
    if partial.exists() and not resume:
        raise OutputFileError(
            f"{partial} holds the rows of an unfinished job: add --resume to go on with it, or remove it"
        )
    return partial if partial.exists() else out if out.exists() else None


def refuse_stray_ids(out: Path, jsonl: bool) -> None:
    """A new .npy from JSONL input writes its ids beside it: an ids file already there, with no output
    it belongs to, is someone's (an earlier job's whose .npy was moved): never written over."""
    ids = ids_beside(out)
    if jsonl and out.suffix == ".npy" and ids.exists():
        raise OutputFileError(
            f"{ids} exists, but neither {out} nor {partial_path(out)}: this job would write its ids "
            "there; move or remove it, or choose another --out"
        )


def skip_written(records: Iterator[Record], written: Written, name: str) -> Record | None:
    """Consume the input records the output already holds, and give back the last of them; where the
    output keeps ids, its id must match (as JSON: true is not 1)."""
    count, last = 0, None
    for record in itertools.islice(records, written.rows):
        count, last = count + 1, record
    if count < written.rows:
        raise InputFileError(f"{name}: {count} records, but the output already holds {written.rows} rows")
    if written.last_id and last is not None and json.dumps(last.id) != json.dumps(written.last_id[0]):
        raise InputFileError(
            f"{name}: record {count} has id {last.id!r}, but the output's row {count} has id "
            f"{written.last_id[0]!r}: this output was made from another input"
        )
    return last


async def check_same_input(
    embed: Callable[[list[str]], Awaitable[np.ndarray]], last: Record, written: Written, name: str
) -> None:
    """The output's last row must be the vector of the input's record at its place, embedded again:
    line numbers (text input) cannot tell a different file, nor ids a different text or model."""
    (vector,) = np.asarray(await embed([last.text]), dtype=np.float64)
    row = np.asarray(written.last_row, dtype=np.float64)
    cosine = float(vector @ row / max(np.linalg.norm(vector) * np.linalg.norm(row), 1e-30))
    if cosine < SAME_ROW_COSINE:
        raise InputFileError(
            f"{name}:{last.line}: this record's vector is at cosine {cosine:.4f} from the output's row "
            f"{written.rows}, which should hold it: this output was made from another input, or by "
            "another model or precision"
        )


# The job.


@dataclass(frozen=True)
class Backoff:
    """How long a refused request waits before it is sent again. Where the refusal says when to retry
    (the server's RetryInfo: when the queue will have room for it), a random time in
    [hint, HINT_SPREAD * hint], the hint at least first_s: not before room is said to appear, and
    spread so that a job's concurrent requests, refused together, do not come back together. Else
    exponential backoff with jitter: the k-th retry waits a random time in [d/2, d], d = first * 2^k
    up to max_s. Either way for as long as `for_s` seconds after the first attempt (a job outlasts a
    busy spell of that length), and at most `retries` times where that is set."""

    for_s: float = 600.0
    retries: int | None = None
    first_s: float = 0.1
    max_s: float = 10.0

    def wait(self, k: int, hint: float | None) -> float:
        """The k-th retry's wait (k from 0), given the server's hint in seconds (None: it gave none)."""
        if hint is not None and hint > 0:
            hint = max(hint, self.first_s)  # a proxy's or another server's 1 ms: not a tight loop
            return random.uniform(hint, HINT_SPREAD * hint)
        d = min(self.max_s, self.first_s * 2 ** min(k, 64))
        return random.uniform(d / 2, d)

    def allows(self, k: int, ends_s: float) -> bool:
        """Whether the k-th retry may be made, its wait ending `ends_s` after the first attempt."""
        return (self.retries is None or k < self.retries) and ends_s <= self.for_s


@dataclass
class Stats:
    rows: int = 0  # in the output, those of earlier runs included
    resumed: int = 0  # rows that were there when the job started
    retried: int = 0  # requests refused (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED), sent again
    # Told of each refusal that will be retried: a server that is busy or gone must not look like a
    # job that hangs (the command line prints a line now and then).
    on_retry: Callable[[grpc.RpcError], None] = field(default=lambda error: None, repr=False)

    def retry(self, error: grpc.RpcError) -> None:
        self.retried += 1
        self.on_retry(error)


# gRPC's words for a TLS handshake that failed, as its UNAVAILABLE says them: "Custom verification check
# failed with error: UNAUTHENTICATED: Hostname Verification Check failed.", "Tls handshake failed
# (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...:CERTIFICATE_VERIFY_FAILED: ...". A plaintext channel to a
# TLS port says only "Socket closed", as a server that restarts does: that one stays retried.
TLS_FAILURE = re.compile(r"handshake failed|hostname verification|SSL_ERROR_|certificate verif", re.I)


def retryable(error: grpc.RpcError) -> bool:
    """A refusal that may pass later: a full queue, a server warming up or draining, a deadline passed
    in a long queue. A message over the size limit is RESOURCE_EXHAUSTED too, and would fail every time;
    a TLS handshake that fails (a certificate of another name or authority, TLS against a plaintext
    port) is UNAVAILABLE too, and fails again until the settings change."""
    details = error.details() or ""
    too_large = "larger than max" in details
    return error.code() in RETRYABLE and not too_large and TLS_FAILURE.search(details) is None


def retry_after(error: grpc.RpcError) -> float | None:
    """The wait the refusal's RetryInfo asks for, in seconds; None where it has none (gRPC's own
    refusals, DEADLINE_EXCEEDED, an older server)."""
    return (error if isinstance(error, EmbeddingError) else from_rpc_error(error)).retry_after


async def with_retries(call: Callable[[], Awaitable[T]], backoff: Backoff, stats: Stats) -> T:
    start, slept, k = time.monotonic(), 0.0, 0
    while True:
        try:
            return await call()
        except grpc.RpcError as e:
            delay = backoff.wait(k, retry_after(e)) if retryable(e) else None
            # The waits count as well as the clock: the calls between them take time too.
            if delay is None or not backoff.allows(k, max(time.monotonic() - start, slept) + delay):
                raise  # not retryable, or the retries are spent: this error is the job's
            stats.retry(e)
        slept, k = slept + delay, k + 1
        await asyncio.sleep(delay)


class ReadAhead(Generic[T]):
    """next(items) in a daemon thread, one item per call as asked for: a read that blocks (a producer
    that stalls with its pipe open) holds neither the event loop nor the job's stop. Not
    asyncio.to_thread: asyncio.run's teardown and the interpreter's exit wait for its worker, so a job
    reading a stalled stdin went on past SIGTERM and Ctrl-C until the producer closed the pipe."""

    def __init__(self, items: Iterator[T], end: T) -> None:
        self._items, self._end = items, end
        self._asked = threading.Semaphore(0)
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._answers: asyncio.Queue[tuple[T, BaseException | None]] = asyncio.Queue()
        threading.Thread(target=self._read, name="embed-file input", daemon=True).start()

    def _read(self) -> None:
        while True:
            self._asked.acquire()
            if self._closed:
                return
            try:
                answer: tuple[T, BaseException | None] = (next(self._items, self._end), None)
            except BaseException as e:  # the job's to raise, on its own thread
                answer = (self._end, e)
            try:
                self._loop.call_soon_threadsafe(self._answers.put_nowait, answer)
            except RuntimeError:  # the loop is closed: the job ended while this line was read
                return
            if answer[1] is not None:
                return

    async def next(self) -> T:
        self._asked.release()
        item, error = await self._answers.get()
        if error is not None:
            raise error
        return item

    def close(self) -> None:
        """Ends the thread unless it is inside a read; then it ends with the process (a daemon)."""
        self._closed = True
        self._asked.release()


async def run_pipeline(
    records: Iterator[Record],
    embed: Callable[[list[Record]], Coroutine[Any, Any, np.ndarray]],
    write: Callable[[list[Record], np.ndarray], None],
    batch_size: int,
    concurrency: int,
    max_request_bytes: int = 1 << 20,
    ready: Callable[[float], bool] | None = None,
) -> None:
    """Up to `concurrency` requests in flight; results written in input order as the oldest completes,
    also while the next chunk is read (a pipe whose producer paused: `ready`, as chunks() has it).
    A bad input line ends the job after every row before it is written, so a resume starts at it."""
    pending: deque[tuple[list[Record], asyncio.Task[np.ndarray]]] = deque()

    async def write_oldest() -> None:
        done, task = pending.popleft()
        write(done, await task)

    async def next_chunk() -> tuple[list[Record], InputFileError | None]:
        """The next chunk; requests that complete meanwhile are written, in order, as they do."""
        asked = asyncio.ensure_future(source.next())
        try:
            while pending and not asked.done():
                oldest = pending[0][1]
                await asyncio.wait((asked, oldest), return_when=asyncio.FIRST_COMPLETED)
                if oldest.done():
                    await write_oldest()
            return await asked
        finally:
            asked.cancel()

    source = ReadAhead(chunks(records, batch_size, max_request_bytes, ready), ([], None))
    try:
        error: InputFileError | None = None
        while error is None:
            chunk, error = await next_chunk()
            if not chunk:
                break
            if len(pending) >= concurrency:
                await write_oldest()
            pending.append((chunk, asyncio.create_task(embed(chunk))))
        while pending:
            await write_oldest()
        if error is not None:
            raise error
    finally:
        source.close()
        for _, task in pending:
            task.cancel()


@dataclass(frozen=True)
class Job:
    source: Path | None  # None: standard input
    out: Path
    jsonl: bool = False
    resume: bool = False
    batch_size: int = 32  # at most the server's max_inputs_per_request
    # Text per request, at most half the server's max_message_bytes (room for protobuf's framing).
    max_request_bytes: int = 1 << 20
    concurrency: int = 16
    normalize: bool = True
    # Batched after interactive requests, within the server's --bulk-queue-share of its queue: a job
    # beside live traffic uses what that traffic leaves.
    priority: str = "bulk"
    backoff: Backoff = Backoff()


@dataclass(frozen=True)
class Served:
    """What a job needs of the server, from its Info; a limit of 0 is one the server did not say."""

    dims: int
    max_inputs_per_request: int = 0
    max_text_chars: int = 0
    max_message_bytes: int = 0
    queue_limit: int = 0
    graph: str = ""  # Info.onnx_sha256: every answer's must be it ("" from a server that says none)

    def batch_size(self, job: Job) -> int:
        """At most the server's max_inputs_per_request; at most its queue_limit (a larger request is
        refused OVER_QUEUE_LIMIT however long it waits, and any up to it fits an empty queue, even a
        bulk one); and as many rows as one response of its max_message_bytes holds (a server run with
        a lower limit sends no larger answer)."""
        most = [job.batch_size, *(n for n in (self.max_inputs_per_request, self.queue_limit) if n)]
        if self.max_message_bytes:
            most.append((self.max_message_bytes - MESSAGE_FRAMING) // (4 * self.dims + ROW_FRAMING))
        return max(1, min(most))

    def request_bytes(self, job: Job) -> int:
        return min(job.max_request_bytes, self.max_message_bytes // 2 or job.max_request_bytes)


class Embedder(Protocol):
    async def embed_response(self, request: pb.EmbedRequest) -> pb.EmbedResponse: ...


def same_graph(response: pb.EmbedResponse, graph: str) -> np.ndarray:
    """The answer's vectors, if the graph the job began with computed them. A server restarted with
    another --precision or model, or replicas that differ behind one address (a rolling redeploy),
    answer with vectors that look right and are not comparable with those written (int8 against
    fp32: 0.996-0.999 cosine), so the job stops here rather than write a file of two graphs."""
    if graph and response.onnx_sha256 and response.onnx_sha256 != graph:
        raise GraphChanged(
            f"the server now answers with another graph (onnx_sha256 {response.onnx_sha256[:12]}..., "
            f"where the job began with {graph[:12]}...: another precision, model or export, a restart "
            "or a redeploy): vectors of the two are not comparable, so none of the new graph's is written"
        )
    return to_array(response)


def stdin_bytes() -> IO[bytes]:
    """A reader of fd 0 of its own, never closed: the daemon thread that reads it may be blocked inside
    it when the job stops, and at exit the interpreter closes sys.stdin, whose buffer that thread would
    hold locked ("Fatal Python error: _enter_buffered_busy"). No other reader shares it."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # stdin replaced (in-process callers, tests)
        return sys.stdin.buffer
    return open(fd, "rb", closefd=False)  # nothing closes it, by design


@contextmanager
def input_stream(source: Path | None, jsonl: bool) -> Iterator[tuple[IO[bytes] | PipeLines, str]]:
    if source is None:
        yield lines_of(stdin_bytes()), "<stdin>"
        return
    if source.suffix.lower() in NOT_COLUMNS:
        raise InputFileError(
            f"{source}: CSV is not read as columns (its header and any quoted newline would be rows "
            'of their own): give one text per line, or {"id": ..., "text": "..."} lines with --jsonl'
        )
    if source.suffix.lower() in JSON_INPUT and not jsonl:
        raise InputFileError(
            f"{source}: a {source.suffix} file without --jsonl would be read as one text per line, each "
            'row the vector of a line\'s JSON: give --jsonl to read {"id": ..., "text": "..."} lines, one '
            "object per line (a JSON array is not read: `jq -c '.[]' FILE` makes such lines of it)"
        )
    with source.open("rb") as stream:
        yield lines_of(stream), str(source)


INPUT_AT = re.compile(r"input (\d+)\b")


def refused_line(error: grpc.RpcError, chunk: list[Record], name: str) -> InputFileError | None:
    """The server's INVALID_ARGUMENT for "input K" of a request, as the file's line: "input K" is the
    position inside the request, which the user cannot map back to the file."""
    match = INPUT_AT.match(error.details() or "")
    if error.code() != grpc.StatusCode.INVALID_ARGUMENT or match is None or int(match[1]) >= len(chunk):
        return None
    return InputFileError(f"{name}:{chunk[int(match[1])].line}: refused by the server: {error.details()}")


def limits_changed(error: grpc.RpcError, count: int) -> LimitsChanged | None:
    """A refusal of a request of `count` inputs for a limit the job sized it by: the user has nothing to
    split (the job splits the file), so say what changed and how to go on."""
    mapped = error if isinstance(error, EmbeddingError) else from_rpc_error(error)
    if mapped.reason not in SIZED_BY and not isinstance(mapped, TooLarge):
        return None
    return LimitsChanged(
        f"a request of {count} inputs was refused ({mapped.code().name}: {mapped.details()}), though the "
        "job sized its requests by the limits the server gave when the job began: the server's limits "
        "changed since; run again with --resume, which reads them again"
    )


async def run_job(
    job: Job,
    client: Embedder,
    served: Served,
    progress: Callable[[int], None],
    on_retry: Callable[[grpc.RpcError], None] = lambda error: None,
) -> Stats:
    """Embed job.source into job.out, by way of `<out>.partial`. On an error that file holds whole rows
    only and resumes; the error carries a note that says so. A new job that fails before its first row
    leaves no file."""
    refuse_input_as_output(job)
    existing = existing_output(job.out, job.resume)
    if existing is None:
        refuse_stray_ids(job.out, job.jsonl)
    partial = partial_path(job.out)
    sink = sink_for(job.out, served.dims, job.jsonl, at=existing or partial)
    with input_stream(job.source, job.jsonl) as (stream, name):
        parse = jsonl_records if job.jsonl else text_records
        ready = stream.ready if isinstance(stream, PipeLines) else None
        lines = parse(read_lines(stream, name), name)
        records = within(lines, served.max_text_chars, name, served.max_message_bytes)
        written = sink.inspect() if existing else Written()
        # Before the output is touched: a refusal leaves it as it was.
        written.check_normalized(job.normalize, sink.path)
        stats = Stats(rows=written.rows, resumed=written.rows, on_retry=on_retry)

        async def embed_texts(texts: list[str]) -> np.ndarray:
            request = embed_request(texts, normalize=job.normalize, priority=job.priority)
            response = await with_retries(lambda: client.embed_response(request), job.backoff, stats)
            return same_graph(response, served.graph)

        if last := skip_written(records, written, name):
            await check_same_input(embed_texts, last, written, name)
        if existing == job.out:  # finished: it stays so unless a record follows its last row
            if (following := next(records, None)) is None:
                return stats
            records = itertools.chain([following], records)
            os.replace(job.out, partial)
            sink.path = partial

        def write(done: list[Record], vectors: np.ndarray) -> None:
            sink.write(done, vectors)
            stats.rows += len(done)
            progress(len(done))

        async def embed(chunk: list[Record]) -> np.ndarray:
            try:
                return await embed_texts([r.text for r in chunk])
            except grpc.RpcError as e:
                refusal = refused_line(e, chunk, name) or limits_changed(e, len(chunk))
                if refusal is None:
                    raise
                raise refusal from e

        sink.open(resume=written.rows > 0)
        with closing_sink(sink, job.out, new=existing is None):
            await run_pipeline(
                records,
                embed,
                write,
                served.batch_size(job),
                job.concurrency,
                served.request_bytes(job),
                ready,
            )
    rename_durably(partial, job.out)  # sealed, synced and closed: only now does the output have its name
    return stats


@contextmanager
def closing_sink(sink: Sink, out: Path, new: bool) -> Iterator[None]:
    """Seals the sink when the rows are all written. Else its whole rows stay for a resume, and the
    error's note says where and how many: counted in the file, not by the job, since a write that
    failed (a full disk, a file size limit) may have left some of its rows whole. But a new output
    with no row is removed: a --resume of nothing would only be one more thing to know, and without
    --resume the next run would be refused."""
    try:
        yield
    except BaseException as e:
        with suppress(OSError):  # a write's error again, as the buffer is flushed: the job's is told
            sink.close(complete=False)
        try:
            rows = sink.held()
        except (OSError, OutputFileError):  # the file gone or unreadable: the job's error is the one told
            rows = sink.rows
        if new and not rows:
            sink.remove()
        else:
            e.add_note(
                f"{sink.path} holds the {rows} whole rows before this; run again with --resume to "
                f"go on from there ({out} is written when every row is)"
            )
        raise
    sink.close(complete=True)
