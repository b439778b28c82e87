"""The messages between front processes and the engine: a thin, explicit binary protocol over ZeroMQ.

Each message is one ZeroMQ multipart message. Its first frame is a fixed struct header whose first
byte is the kind; arrays follow as raw little-endian frames (no per-input objects, no pickling):

    front -> engine  HELLO    header(front index)                     engine answers READY once warm
    front -> engine  SUBMIT   header(request id, deadline, normalize, bulk, n, tag), lengths int32 (n,),
                              ids int32
    front -> engine  CANCEL   header(request id)                      drop its inputs before compute
    engine -> front  READY    header, JSON of the engine's facts (provider, precision, instances...)
    engine -> front  RESULT   header(request id, status, queue us, inference us), vectors float32 (n, D)
                              or, for a status other than OK, the error message in UTF-8 and JSON of
                              the error's reason, field, metadata and retry delay (server/errors.py)

The engine's ROUTER socket adds the front's identity in front of these frames; fronts use DEALER
sockets. Deadlines are `time.monotonic()` values: CLOCK_MONOTONIC is one clock for every process on
the machine. Status values are gRPC status code numbers (0 is OK). A request id is the front's own
number for the call; its tag is the caller's `x-request-id` (server/logs.py), carried only so that the
engine's log lines about the request name it.

Besides the messages, the engine publishes its queue in shared memory (place.SharedQueue), which the
fronts read to refuse overload before they tokenize.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import zmq

log = logging.getLogger(__name__)
HELLO, SUBMIT, CANCEL, READY, RESULT = b"H", b"S", b"C", b"R", b"O"
DRAIN_AT_MOST = 256  # messages handled per event-loop turn, so a flood never starves the loop
OK = 0
NO_DEADLINE = 0.0

_HELLO = struct.Struct("<cI")  # kind, front index
TAG_BYTES = 128  # logs.MAX_REQUEST_ID_CHARS: printable ASCII, so no NUL inside
_SUBMIT = struct.Struct(f"<cQdBBI{TAG_BYTES}s")  # kind, request id, deadline, normalize, bulk, inputs, tag
_CANCEL = struct.Struct("<cQ")  # kind, request id
_RESULT = struct.Struct("<cQBQQ")  # kind, request id, status, queue us, inference us


@dataclass(frozen=True)
class EngineFacts:
    """What the engine tells each front once warm: the model run as it really is."""

    provider: str
    precision: str
    instances: int
    threads: int
    load_seconds: float
    warmup_seconds: float
    pid: int
    # The repository the engine verified: a front that reads another (replaced while serving, then
    # the front restarted) would tokenize for graphs the engine is not running.
    tokenizer_sha256: str
    # The batch limits the engine runs with: auto (0) settings resolved for its provider.
    max_batch_size: int
    max_batch_tokens: int
    # The graph the engine runs: Info's onnx_sha256 (under --precision int8 it said the fp32 graph's).
    graph_sha256: str
    # The ONNX Runtime the engine runs the model on: Info's versions. The fronts never load it.
    onnxruntime_version: str


@dataclass(frozen=True)
class Submit:
    request_id: int
    deadline: float | None
    normalize: bool
    lengths: np.ndarray  # (n,) int32
    ids: np.ndarray  # (sum(lengths),) int32, the inputs' token ids one after another
    tag: str = ""  # the caller's request id, for log lines
    bulk: bool = False  # queued behind interactive requests (server/batcher.py)


@dataclass(frozen=True)
class Result:
    request_id: int
    status: int
    queue_us: int
    inference_us: int
    vectors: np.ndarray | None  # (n, D) float32 when status is OK
    message: str = ""
    reason: str = ""
    field: str = ""
    metadata: dict[str, str] | None = None
    retry_after_s: float | None = None


def kind(frames: list[bytes]) -> bytes:
    return frames[0][:1]


def hello(front: int) -> list[bytes]:
    return [_HELLO.pack(HELLO, front)]


def parse_hello(frames: list[bytes]) -> int:
    return int(_HELLO.unpack(frames[0])[1])


def submit(
    request_id: int,
    deadline: float | None,
    normalize: bool,
    lengths: np.ndarray,
    ids: np.ndarray,
    tag: str = "",
    bulk: bool = False,
) -> list[Any]:
    assert lengths.dtype == np.int32 and ids.dtype == np.int32 and int(lengths.sum()) == ids.size
    encoded = tag.encode("ascii")
    assert len(encoded) <= TAG_BYTES and b"\0" not in encoded, "a tag is checked by logs.request_id_from"
    header = _SUBMIT.pack(SUBMIT, request_id, deadline or NO_DEADLINE, normalize, bulk, lengths.size, encoded)
    return [header, lengths, ids]


def parse_submit(frames: list[bytes]) -> Submit:
    _, request_id, deadline, normalize, bulk, n, tag = _SUBMIT.unpack(frames[0])
    lengths = np.frombuffer(frames[1], dtype=np.int32)
    ids = np.frombuffer(frames[2], dtype=np.int32)
    assert lengths.size == n and int(lengths.sum()) == ids.size, "malformed SUBMIT"
    deadline = deadline if deadline != NO_DEADLINE else None
    tag = tag.rstrip(b"\0").decode("ascii")
    return Submit(request_id, deadline, bool(normalize), lengths, ids, tag, bool(bulk))


def cancel(request_id: int) -> list[bytes]:
    return [_CANCEL.pack(CANCEL, request_id)]


def parse_cancel(frames: list[bytes]) -> int:
    return int(_CANCEL.unpack(frames[0])[1])


def ready(facts: EngineFacts) -> list[bytes]:
    return [READY, json.dumps(asdict(facts)).encode()]


def parse_ready(frames: list[bytes]) -> EngineFacts:
    return EngineFacts(**json.loads(frames[1]))


def result(request_id: int, queue_us: int, inference_us: int, vectors: np.ndarray) -> list[Any]:
    assert vectors.dtype == np.float32 and vectors.flags.c_contiguous
    return [_RESULT.pack(RESULT, request_id, OK, queue_us, inference_us), vectors]


def failure(
    request_id: int,
    status: int,
    message: str,
    reason: str,
    field: str = "",
    metadata: dict[str, str] | None = None,
    retry_after_s: float | None = None,
) -> list[bytes]:
    assert status != OK
    about = json.dumps(
        {"reason": reason, "field": field, "metadata": metadata or {}, "retry_after_s": retry_after_s}
    )
    return [_RESULT.pack(RESULT, request_id, status, 0, 0), message.encode(), about.encode()]


def parse_result(frames: list[bytes], dimensions: int) -> Result:
    _, request_id, status, queue_us, inference_us = _RESULT.unpack(frames[0])
    if status != OK:
        about = json.loads(frames[2])
        message = bytes(frames[1]).decode()
        return Result(
            request_id,
            status,
            0,
            0,
            None,
            message,
            about["reason"],
            about["field"],
            about["metadata"],
            about["retry_after_s"],
        )
    vectors = np.frombuffer(frames[1], dtype=np.float32).reshape(-1, dimensions)
    return Result(request_id, status, queue_us, inference_us, vectors)


class Channel:
    """A ZeroMQ socket served from the asyncio event loop, without a future per message.

    Sends never wait (NOBLOCK; no high-water mark: what is in flight is bounded by the queue limit
    and the callers). Arrivals are drained in one go whenever the socket's descriptor signals.
    ZeroMQ's descriptor is edge-triggered and a send may consume the edge, so the socket's events
    are checked again after every send.
    """

    def __init__(self, sock: zmq.Socket[bytes], on_message: Callable[[list[bytes]], None]) -> None:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        self.sock = sock
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        self.fd = int(sock.getsockopt(zmq.FD))
        self.loop.add_reader(self.fd, self._drain)
        self.loop.call_soon(self._drain)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, flags=zmq.NOBLOCK)  # copying: zero-copy costs more below ~64 kB
        self._check()

    def _check(self) -> None:
        if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        for _ in range(DRAIN_AT_MOST):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.on_message(frames)
            except Exception:  # a bug in one message's handling: the edge must not be lost with it
                log.exception("a message of %d frames could not be handled", len(frames))
        self._check()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        self.sock.close(linger=0)
