"""Log lines for every server process: text or JSON, each carrying the request id it is about.

A request's id (from its `x-request-id` metadata, or made up) is set in a context variable while the
front handles the request, so every line logged meanwhile carries it without being passed around.
Lines logged outside the request's task (the engine's batch failures) name it with
`extra={"request_id": ...}`, or `extra={"request_ids": [...]}` for a batch of several requests.

JSON lines come from a small Formatter over json.dumps rather than a library: the fields are fixed
(ts, level, process, logger, message, request_id(s), exception) and it costs no dependency.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_HEADER = "x-request-id"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"

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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, process, logger, message, request_id or
    request_ids when the line is about requests, exception (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "process": record.processName,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if many := getattr(record, "request_ids", None):
            line["request_ids"] = list(many)
        elif one := getattr(record, "request_id", ""):
            line["request_id"] = one
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """The root logger of this process: `level`, lines to stderr as `log_format` (text or json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
