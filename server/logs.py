"""Log lines for every server process: text or JSON, each carrying the request id it is about.

A request's id (from its `x-request-id` metadata, or made up) is set in a context variable while the
front handles the request, so every line logged meanwhile carries it without being passed around.
Lines logged outside the request's task (the engine's batch failures) name it with
`extra={"request_id": ...}`, or `extra={"request_ids": [...]}` for a batch of several requests.

JSON lines come from a small Formatter over json.dumps rather than a library: the fields are fixed
(ts, level, process, logger, message, request_id(s), exception) and it costs no dependency.

Not every line comes through `logging`: gRPC's C core (absl's format), ONNX Runtime's native logger, a
traceback printed by a dying interpreter and faulthandler's dumps write to fd 2 directly. With JSON
lines, the supervisor routes fd 2 through pipes it reads, its own and one per child (`relay_stderr`,
`child_stderr`), and `StderrLines` turns whatever is not a JSON object already into one that names
the process that wrote it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import selectors
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from multiprocessing import resource_tracker
from typing import Any

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_HEADER = "x-request-id"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"

# fd 2's pipe: a line longer than this is cut (the rest dropped), and a record of several lines ends
# before it would grow past it; a record's message stays under about this many characters.
MAX_LINE_BYTES = 64 * 1024
# The lines of one record (a traceback's) come in separate writes: the reader waits this long for the
# next before writing out what it holds, so a child that dies loses nothing and the wait is short.
GROUP_WAIT_S = 0.1
DRAIN_S = 2.0  # at exit, at most this long for the lines still in the pipe (a stray child may write on)
# The pipe's buffer (Linux's fs.pipe-max-size by default): a burst of lines does not block a child.
PIPE_BYTES = 1 << 20
# A field of our own JSON line kept whole up to this many characters when the line would pass
# MAX_LINE_BYTES: two of them, each character at most 6 bytes escaped, fit.
KEPT_FIELD_CHARS = 4096
# gRPC's C core: "E1127 12:00:00.123456  1234 ssl_transport_security.cc:1519] Handshake failed"
ABSL_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
# ONNX Runtime: "2026-11-27 12:00:00.123456789 [W:onnxruntime:, session_state.cc:1166 Verify...] ..."
ORT_LINE = re.compile(r"\S+ \S+ \[([VIWEF]):onnxruntime:")
NATIVE_LEVELS = {"V": "DEBUG", "I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
# Lines after a blank one that still belong to the record: a chained exception's, and the parts of
# faulthandler's dump ("Fatal Python error: ...").
LATER_PARTS = (
    "During handling of the above exception",
    "The above exception was the direct cause",
    "Current thread 0x",
    "Thread 0x",
    "Stack (most recent call first)",
    "Extension modules:",
)

current_request_id: ContextVar[str] = ContextVar("request_id", default="")

log = logging.getLogger(__name__)


def new_request_id() -> str:
    return uuid.uuid4().hex


def given_request_id(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The `x-request-id` value in a call's metadata, or None."""
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER:
            return str(value)
    return None


def request_id_from(given: str | None) -> tuple[str, str]:
    """The request id to use for a caller's `x-request-id` value (None: absent), and why it was not
    taken as given ("" when it was, or when there was none)."""
    if given is None:
        return new_request_id(), ""
    if not 0 < len(given) <= MAX_REQUEST_ID_CHARS:
        return new_request_id(), f"{len(given)} characters, not 1 to {MAX_REQUEST_ID_CHARS}"
    if not (given.isascii() and given.isprintable()):
        return new_request_id(), "not printable ASCII"
    return given, ""


REPLACED_ID_WARN_EVERY_S = 60.0  # a client that sends unusable ids on every call logs once a minute
_replaced_warned_at: dict[str, float] = {}  # protocol -> when its last such warning was logged


def warn_replaced_id(protocol: str, given: str, why: str) -> None:
    """A WARNING that a caller's x-request-id was not used, at most once every REPLACED_ID_WARN_EVERY_S
    per protocol in this process."""
    now = time.monotonic()
    if now - _replaced_warned_at.get(protocol, -math.inf) >= REPLACED_ID_WARN_EVERY_S:
        _replaced_warned_at[protocol] = now
        log.warning("%s x-request-id %.64r not used (%s): this call's id is made up", protocol, given, why)


# uvicorn's lines, as the handler `configure` installs lets them out (UvicornFilter).
UVICORN_WARN_EVERY_S = 60.0  # each of uvicorn's warnings at most once a minute in a process
UVICORN_WARNINGS_KEPT = 256  # different warnings rate-limited; one more is left out
# uvicorn's advice after "Unsupported upgrade request." when it has no WebSocket protocol: the HTTP API
# serves none (ws="none", server/http.py), and the package it names is what made uvicorn log a
# WebSocket upgrade's headers.
UVICORN_WEBSOCKET_ADVICE = "No supported WebSocket library detected."


class UvicornFilter(logging.Filter):
    """uvicorn's lines (loggers uvicorn, uvicorn.error, uvicorn.access, uvicorn.asgi): none below WARNING,
    each WARNING at most once every UVICORN_WARN_EVERY_S, ERRORs as they are.

    Below WARNING uvicorn writes about requests: with the `websockets` package importable, at DEBUG a
    WebSocket upgrade's headers (the websockets library logs through uvicorn.error), a caller's
    `authorization: Bearer` token among them, and at INFO a line per WebSocket request with the
    client's address, path and query string, uncut (an acceptance pass: a 6 kB path and
    `?text=my%20private%20query`); its access log (off) the same for every request. Its other lines
    below WARNING ("Started server process") say what the front's own lines say.

    Its WARNINGs come per request, to whoever connects ("Invalid HTTP request received.",
    "Unsupported upgrade request."): one line each a request let anyone flood the log. Each is let
    out at most once every UVICORN_WARN_EVERY_S, its message uvicorn's text alone (never its
    arguments) saying so and how many were left out since. ERRORs (a port in use, an exception in the
    app) pass unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.logged_at: dict[str, float] = {}  # a warning's text -> when it was last let out
        self.left_out: dict[str, int] = {}  # a warning's text -> how many since

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "uvicorn" and not record.name.startswith("uvicorn."):
            return True
        if record.levelno >= logging.ERROR:
            return True
        text = str(record.msg)
        if record.levelno < logging.WARNING or text.startswith(UVICORN_WEBSOCKET_ADVICE):
            return False
        now = time.monotonic()
        with self.lock:
            if now - self.logged_at.get(text, -math.inf) < UVICORN_WARN_EVERY_S:
                self.left_out[text] = self.left_out.get(text, 0) + 1
                return False
            if text not in self.logged_at and len(self.logged_at) >= UVICORN_WARNINGS_KEPT:
                return False
            self.logged_at[text] = now
            left_out = self.left_out.pop(text, 0)
        since = f"; {left_out} more since it was last logged" if left_out else ""
        record.msg = f"{text} [rate-limited: logged at most once every {UVICORN_WARN_EVERY_S:g} s{since}]"
        record.args = ()
        return True


class RequestIdFilter(logging.Filter):
    """Gives each record a `request_id` (the current request's, unless the call named one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


def _ids(record: logging.LogRecord) -> str:
    many = getattr(record, "request_ids", None)
    return ",".join(many) if many else getattr(record, "request_id", "")


class TextFormatter(logging.Formatter):
    """The classic line, with ` [request_id=...]` after the logger name when the line is about one."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        ids = _ids(record)
        if not ids:
            return line
        head, sep, message = line.partition(": ")
        return f"{head} [request_id={ids}]{sep}{message}"


def line_object(ts: datetime, level: str, process: str | None, logger: str, message: str) -> dict[str, Any]:
    """The keys every JSON line starts with, ours and the relayed ones alike."""
    iso = ts.isoformat(timespec="milliseconds")
    return {"ts": iso, "level": level, "process": process, "logger": logger, "message": message}


def refusal(message: str, log_format: str) -> None:
    """The server's one line when it cannot start: plain, or with `json` one object (its own, not a
    relayed plain line, so the same whether the settings could be read or not)."""
    if log_format == "json":
        message = json.dumps(line_object(datetime.now(UTC), "ERROR", "MainProcess", "server", message))
    print(message, file=sys.stderr, flush=True)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, process, logger, message, request_id or
    request_ids when the line is about requests, exception (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, UTC)
        line = line_object(
            created, record.levelname, str(record.processName), record.name, record.getMessage()
        )
        if many := getattr(record, "request_ids", None):
            line["request_ids"] = list(many)
        elif one := getattr(record, "request_id", ""):
            line["request_id"] = one
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        out = json.dumps(line, ensure_ascii=False)
        if len(out) * 4 <= MAX_LINE_BYTES or len(out.encode()) <= MAX_LINE_BYTES:
            return out
        # Over the stderr relay's line limit it would be cut and re-wrapped, losing level and ids:
        # each long field keeps its start and end (a traceback's last line says what failed).
        for key in ("message", "exception"):
            if len(text := line.get(key, "")) > KEPT_FIELD_CHARS:
                half = KEPT_FIELD_CHARS // 2
                line[key] = f"{text[:half]} [... {len(text) - 2 * half} characters cut ...] {text[-half:]}"
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """The root logger of this process: `level`, lines to stderr as `log_format` (text or json), and
    uvicorn's lines limited (UvicornFilter)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(UvicornFilter())
    # uvicorn's lines below WARNING are not even made (UvicornFilter would drop them): its loggers
    # otherwise take the root's level, DEBUG with --log-level DEBUG.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(logging.WARNING)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def _native(line: str) -> tuple[str, str] | None:
    """The level and logger of a native library's line (gRPC's C core, ONNX Runtime), or None."""
    if m := ABSL_LINE.match(line):
        return NATIVE_LEVELS[m[1]], "grpc"
    if m := ORT_LINE.match(line):
        return NATIVE_LEVELS[m[1]], "onnxruntime"
    return None


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def wrapped(block: list[str], read_at: datetime, process: str = "unknown") -> str:
    """Lines that were not JSON as one JSON object, with the keys JsonFormatter writes; `process`, the
    name of the process whose fd 2 they came from (`child_stderr`)."""
    level, logger = _native(block[0]) or ("ERROR", "stderr")  # a traceback, a fatal error
    line = line_object(read_at, level, process, logger, "\n".join(block).rstrip())
    return json.dumps(line, ensure_ascii=False)


class StderrLines:
    """The bytes written to fd 2, as JSON lines: a JSON object's line unchanged, any other line wrapped
    (`wrapped`), the lines of one traceback or dump in one record. `feed` what was read; `idle` when
    nothing more came within GROUP_WAIT_S, and at EOF. Each returns the lines to write out. `process`
    names the writer in the lines it wraps."""

    def __init__(self, process: str = "unknown") -> None:
        self.process = process
        self.partial = b""  # a line's start, its newline not read yet
        self.cutting = False  # dropping the rest of a line already written out cut
        self.block: list[str] = []  # the lines of the record being gathered
        self.read_at = datetime.now(UTC)  # when its first line was read
        # Kept as lines come, so that a line costs the same however long the record (a dump of
        # thousands of lines must not be read in quadratic time while every writer waits on the pipe).
        self.block_chars = 0
        self.in_traceback = False
        self.last_text = ""  # the block's last line that is not blank

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if self.cutting:  # the rest of a line written out cut: dropped, up to its newline
            self.partial = self.partial if lines else b""
            lines, self.cutting = lines[1:], not lines
        if len(self.partial) > MAX_LINE_BYTES:
            lines.append(self.partial)
            self.partial, self.cutting = b"", True
        return [out for line in lines for out in self._line(line)]

    def idle(self) -> list[str]:
        """Write out what is held: a child that is about to die must not leave its last lines here."""
        out = self._line(self.partial) if self.partial else []
        self.partial = b""
        return out + self._flush()

    def _line(self, raw: bytes) -> list[str]:
        line = raw[:MAX_LINE_BYTES].decode("utf-8", "replace").rstrip("\r")
        if len(raw) > MAX_LINE_BYTES:
            cut = f"{line} [cut: the line was longer than {MAX_LINE_BYTES} bytes]"
            return [*self._flush(), wrapped([cut], datetime.now(UTC), self.process)]
        if _is_json_object(line):  # written out in the order read: a dead child's traceback first
            return [*self._flush(), line]
        out = []
        if not self.block or _native(line) or not self._continues(line) or self._full(line):
            out = self._flush()
            self.read_at = datetime.now(UTC)
        if line.strip() or self.block:
            self.block.append(line)
            self.block_chars += len(line) + 1
            self.in_traceback = self.in_traceback or line.startswith("Traceback")
            self.last_text = line if line.strip() else self.last_text
        return out

    def _continues(self, line: str) -> bool:
        """Whether `line` (not JSON, not native) belongs to the record being gathered: a traceback's
        frames and its last line, a chained exception's traceback, the parts of faulthandler's dump."""
        if not line.strip() or line[0].isspace() or line.startswith(LATER_PARTS):
            return True
        if line.startswith("Traceback"):  # after "...another exception occurred:" or "Process front-0:"
            return self.last_text.endswith(":")
        return self.in_traceback and self.block[-1][:1].isspace()  # the exception's line, after the frames

    def _full(self, line: str) -> bool:
        return self.block_chars + len(line) > MAX_LINE_BYTES

    def _flush(self) -> list[str]:
        block, self.block = self.block, []
        self.block_chars, self.in_traceback, self.last_text = 0, False, ""
        return [wrapped(block, self.read_at, self.process)] if block else []


def _write_out(fd: int, lines: list[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode()
    with contextlib.suppress(OSError):  # stderr's reader gone: go on reading, or every writer blocks
        while data:
            data = data[os.write(fd, data) :]


class _Relay:
    """The reader of fd 2's pipes, in the supervisor: one pipe of its own (and of whatever it starts
    outside `child_stderr`, multiprocessing's resource tracker among them) and one per child, each
    read into its own StderrLines so that a line names the process that wrote it. A child's pipe is
    read to EOF (the child and anything it started have exited), then closed."""

    def __init__(self, own: int, out: int) -> None:
        self.out = out
        self.closing = threading.Event()
        self.closed_at = 0.0  # time.monotonic() when closing was set
        self.selector = selectors.DefaultSelector()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.selector.register(self.wake_read, selectors.EVENT_READ, None)
        self.added: list[tuple[int, StderrLines]] = []  # pipes handed over, not yet registered
        self.lock = threading.Lock()
        self.last_read: dict[int, float] = {}  # pipe -> when it was last read (time.monotonic())
        self.add(own, StderrLines("MainProcess"))

    def add(self, read_end: int, lines: StderrLines) -> None:
        with self.lock:
            self.added.append((read_end, lines))
        self.wake()

    def close(self) -> None:
        self.closed_at = time.monotonic()
        self.closing.set()
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the reader is awake already
            os.write(self.wake_write, b"x")

    def run(self) -> None:
        """Until every pipe is at EOF, or, once closing, until they all stay empty for GROUP_WAIT_S."""
        while True:
            self._register_added()
            closing = self.closing.is_set()  # once a pass: set meanwhile, the wake byte brings a next
            now = time.monotonic()
            held = [(key.fd, key.data) for key in self.selector.get_map().values() if key.data is not None]
            due = [self.last_read[fd] + GROUP_WAIT_S for fd, lines in held if lines.block or lines.partial]
            # Closing, a stray writer gets GROUP_WAIT_S after the last line read, or after the close.
            closing_due = max([self.closed_at, *self.last_read.values()]) + GROUP_WAIT_S
            due += [closing_due] if closing else []
            ready = self.selector.select(max(0.0, min(due) - now) if due else None)
            if not ready and closing and time.monotonic() >= closing_due:
                self._read_what_is_left()
                break
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(OSError):
                        os.read(self.wake_read, 4096)
                    continue
                self._read(key.fd, key.data)
            now = time.monotonic()
            for fd, lines in held:  # a pause in one pipe writes out what it holds, whatever the others do
                if fd in self.last_read and now >= self.last_read[fd] + GROUP_WAIT_S:
                    _write_out(self.out, lines.idle())
            if not self.closing.is_set() and len(self.selector.get_map()) == 1 and not self.added:
                break  # every pipe at EOF: nothing can write to a pipe of ours any more
        for key in list(self.selector.get_map().values()):
            if key.data is not None:
                _write_out(self.out, key.data.idle())

    def _read_what_is_left(self) -> None:
        """Whatever the pipes hold now, read without waiting (each pipe until empty or at EOF)."""
        while ready := [key for key, _ in self.selector.select(0) if key.data is not None]:
            for key in ready:
                self._read(key.fd, key.data)

    def _register_added(self) -> None:
        with self.lock:
            added, self.added = self.added, []
        for read_end, lines in added:
            self.selector.register(read_end, selectors.EVENT_READ, lines)
            self.last_read[read_end] = time.monotonic()

    def _read(self, fd: int, lines: StderrLines) -> None:
        chunk = os.read(fd, 65536)
        self.last_read[fd] = time.monotonic()
        if chunk:
            _write_out(self.out, lines.feed(chunk))
            return
        _write_out(self.out, lines.idle())  # EOF: the writers are gone
        self.selector.unregister(fd)
        del self.last_read[fd]
        os.close(fd)


_active: _Relay | None = None  # the relay fd 2 goes through, in the supervisor (relay_stderr)


@contextlib.contextmanager
def child_stderr(name: str) -> Iterator[None]:
    """Start a child inside this (`process.start()`) and its fd 2 is a pipe of its own, whose lines
    name it (`name`, as its own JSON lines do) rather than "unknown". Nothing changes without a relay."""
    relay = _active
    if relay is None:
        yield
        return
    read_end, write_end = _pipe()
    own = os.dup(2)
    os.dup2(write_end, 2)
    try:
        yield
    finally:
        os.dup2(own, 2)
        os.close(own)
        os.close(write_end)  # the child holds its copy: EOF when it and whatever it started are gone
        relay.add(read_end, StderrLines(name))


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read_end, write_end


def relay_stderr() -> Callable[[], None]:
    """Route fd 2 through a pipe whose lines a thread of this process writes to the real stderr as
    JSON (StderrLines); children started from now on inherit the pipe as their fd 2, or, started in
    `child_stderr`, get one of their own. Returns the drain, to call once at exit, after the children
    have ended: it writes out the lines still in the pipes.

    The reader is in the supervisor, which outlives its children when one crashes; only the
    supervisor's own sudden death (SIGKILL) loses the lines not yet read. Without a stderr (started
    with fd 2 closed) there is nothing to relay to, and nothing changes."""
    global _active
    if sys.stderr is None:
        return lambda: None
    sys.stderr.flush()
    try:
        real = os.dup(2)
    except OSError:
        return lambda: None
    read_end, write_end = _pipe()
    os.dup2(write_end, 2)
    # multiprocessing starts its resource tracker with the first child: started now, it writes to
    # this pipe (its lines JSON too, as MainProcess's), and holds it rather than a child's, which would
    # then never reach EOF.
    with contextlib.suppress(Exception):
        resource_tracker.ensure_running()
    relay = _active = _Relay(read_end, real)
    reader = threading.Thread(target=relay.run, name="stderr", daemon=True)
    reader.start()

    def drain() -> None:
        global _active
        # Not to EOF: multiprocessing's resource tracker holds the pipe until this process is gone.
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        _active = None
        os.dup2(real, 2)  # what is written from here on goes out directly
        os.close(write_end)
        relay.close()
        reader.join(DRAIN_S)

    return drain
