"""The front's side of the engine connection: one ZeroMQ DEALER socket shared by every call.

Each call sends SUBMIT and awaits its RESULT by request id; a call that is cancelled (its caller
went away or its deadline passed) sends CANCEL so the engine drops its inputs before compute. When
the engine process ends, every waiting call fails at once with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import zmq

from minilm_embed.server import protocol
from minilm_embed.server.batcher import check_capacity, refusal_label
from minilm_embed.server.errors import NotReady, Overloaded, ServiceError
from minilm_embed.server.place import SharedQueue

log = logging.getLogger(__name__)

_ERRORS = {cls.code.value[0]: cls for cls in ServiceError.__subclasses__()}


@dataclass(frozen=True)
class Answer:
    vectors: np.ndarray  # (n, D) float32
    queue_us: int
    inference_us: int
    sent: float  # time.perf_counter() when SUBMIT left, and when RESULT came back: for tracing
    received: float


def error_for(result: protocol.Result) -> ServiceError:
    """The ServiceError a failed RESULT stands for: its gRPC status number's class, its message,
    reason, field and metadata."""
    cls = _ERRORS.get(result.status, ServiceError)
    metadata = result.metadata or {}
    error = cls(result.message, result.reason, result.field, retry_after_s=result.retry_after_s, **metadata)
    if cls is ServiceError:
        error.code = next(c for c in grpc.StatusCode if c.value[0] == result.status)
    return error


@dataclass
class EngineClient:
    address: str
    front: int
    dimensions: int
    queue_limit: int
    bulk_queue_share: float
    queue: SharedQueue  # the engine's, read for admission before tokenizing
    metrics: Any
    gone: str = ""  # why the engine can no longer answer, once it cannot
    gone_reason: str = ""  # the same as an error reason (server/errors.py)
    _pending: dict[int, asyncio.Future[protocol.Result]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _ready: asyncio.Future[protocol.EngineFacts] | None = None

    def connect(self) -> None:
        self._context = zmq.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.connect(self.address)
        self._channel = protocol.Channel(sock, self._receive)
        self._ready = asyncio.get_running_loop().create_future()

    async def hello(self) -> protocol.EngineFacts:
        """Wait until the engine is warm; returns what it says about itself."""
        assert self._ready is not None, "connect() first"
        self._channel.send(protocol.hello(self.front))
        return await self._ready

    def check_capacity(self, count: int, bulk: bool = False) -> None:
        """Admission before tokenizing, against the engine's published queue depth (and its pace per
        waiting input, for a refusal's retry time)."""
        share = self.bulk_queue_share if bulk else None
        try:
            queue = self.queue
            check_capacity(queue.depth, count, self.queue_limit, share, queue.s_per_input)
        except Overloaded as e:
            self.metrics.refusals.labels(refusal_label(e)).inc()
            raise

    async def embed(
        self,
        lengths: np.ndarray,
        ids: np.ndarray,
        deadline: float | None,
        normalize: bool,
        tag: str = "",
        bulk: bool = False,
    ) -> Answer:
        if self.gone:
            raise NotReady(self.gone, self.gone_reason)
        request_id = next(self._ids)
        future: asyncio.Future[protocol.Result] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            sent = time.perf_counter()
            self._channel.send(protocol.submit(request_id, deadline, normalize, lengths, ids, tag, bulk))
            result = await future
            received = time.perf_counter()
        except asyncio.CancelledError:
            if not self.gone:
                self._channel.send(protocol.cancel(request_id))
            raise
        finally:
            self._pending.pop(request_id, None)
        if result.status != protocol.OK:
            raise error_for(result)
        assert result.vectors is not None
        return Answer(result.vectors, result.queue_us, result.inference_us, sent, received)

    def close(self) -> None:
        """Close the socket and its context (a context left with an open socket blocks at exit)."""
        self._channel.close()
        self._context.term()

    def engine_gone(self, why: str, reason: str = "ENGINE_STOPPED") -> int:
        """Every waiting call and every later one gets UNAVAILABLE saying why (`reason`: the same as
        an error reason); how many waited."""
        self.gone, self.gone_reason = why, reason
        waiting = [future for future in self._pending.values() if not future.done()]
        for future in waiting:
            future.set_exception(NotReady(why, reason))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(NotReady(why, reason))
        return len(waiting)

    def _receive(self, frames: list[bytes]) -> None:
        if protocol.kind(frames) == protocol.READY:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(protocol.parse_ready(frames))
            return
        result = protocol.parse_result(frames, self.dimensions)
        future = self._pending.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)
