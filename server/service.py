"""The gRPC servicer, kept thin: protobuf -> validated rows -> batcher -> protobuf.

Errors are mapped to gRPC status codes in one place (`_serve`): a `ServiceError` carries its code and
a message that names the limit and the value.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from proto.embedding.v1 import embedding_pb2 as pb
from proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from server.batcher import Batcher, Result
from server.errors import InvalidInput, NotReady, ServiceError
from server.metrics import Metrics
from server.tokenization import Prepared, RequestTokenizer, Usage

log = logging.getLogger(__name__)
T = TypeVar("T")
# Below this many characters a request tokenizes in well under 100 us (~44k sentences/s on one
# thread): less than handing it to a worker thread and back costs.
INLINE_TOKENIZE_CHARS = 2048


class Undecodable:
    """What a request that is not valid protobuf (e.g. invalid UTF-8 in a string) turns into."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.reason = f"the request is not a valid {type_name}: {error}"


def lenient(message: Any) -> Callable[[bytes], Any]:
    """A request deserializer that turns undecodable bytes into INVALID_ARGUMENT, not INTERNAL."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Undecodable(message.DESCRIPTOR.full_name, e)

    return parse


def _check_decoded(request: object) -> None:
    if isinstance(request, Undecodable):
        raise InvalidInput(request.reason)


class Readiness:
    """Set once the model is warm; cleared when draining."""

    def __init__(self) -> None:
        self.ready = False
        self.reason = "the model is warming up"


class EmbeddingService(pb_grpc.EmbeddingServiceServicer):
    def __init__(
        self,
        tokenizer: RequestTokenizer,
        batcher: Batcher,
        info: pb.InfoResponse,
        metrics: Metrics,
        readiness: Readiness,
        max_stream_in_flight: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.info = info
        self.metrics = metrics
        self.readiness = readiness
        self.max_stream_in_flight = max_stream_in_flight

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        return await self._serve("Embed", request, context, lambda: self._embed(request, _deadline(context)))

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._serve("Tokenize", request, context, lambda: self._tokenize(request))

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        async def info() -> pb.InfoResponse:
            return self.info

        return await self._serve("Info", request, context, info)

    async def EmbedStream(
        self, request_iterator: AsyncIterator[pb.EmbedStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedStreamResponse]:
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        code = grpc.StatusCode.OK
        try:
            async for response in self._stream(request_iterator, _deadline(context)):
                yield response
        except asyncio.CancelledError:
            code = _cancelled_code(context)
            raise
        finally:
            self._record("EmbedStream", code, started)

    async def _serve(
        self,
        method: str,
        request: object,
        context: grpc.aio.ServicerContext,
        handler: Callable[[], Awaitable[T]],
    ) -> T:
        """Run one unary call: the single place where errors become gRPC statuses."""
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        code = grpc.StatusCode.OK
        try:
            _check_decoded(request)
            return await handler()
        except ServiceError as e:
            code = e.code
            await context.abort(e.code, str(e))
            raise  # unreachable: abort raises
        except asyncio.CancelledError:
            code = _cancelled_code(context)
            raise
        except Exception:
            log.exception("%s failed", method)
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, "internal error; see the server log")
            raise
        finally:
            self._record(method, code, started)

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(method, code.name).inc()
        self.metrics.request_duration.labels(method).observe(time.perf_counter() - started)

    async def _prepare(self, request: pb.EmbedRequest) -> Prepared:
        truncate = request.truncate if request.HasField("truncate") else True
        if request.texts and request.token_ids:
            raise InvalidInput("set either `texts` or `token_ids`, not both")
        if request.token_ids:
            return self.tokenizer.from_ids([list(t.ids) for t in request.token_ids], truncate)
        started = time.perf_counter()
        prepared = await self._tokenize_texts(list(request.texts), truncate)
        self.metrics.tokenize_duration.observe(time.perf_counter() - started)
        return prepared

    async def _tokenize_texts(self, texts: list[str], truncate: bool) -> Prepared:
        """Short requests inline (faster than a thread hop); long ones off the event loop."""
        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.from_texts(texts, truncate)
        # Tokenizing a 100 kB text takes milliseconds: off the event loop, which serves everyone.
        return await asyncio.to_thread(self.tokenizer.from_texts, texts, truncate)

    async def _embed(self, request: pb.EmbedRequest, deadline: float | None) -> pb.EmbedResponse:
        started = time.perf_counter()
        if not self.readiness.ready:
            raise NotReady(f"not serving: {self.readiness.reason}; retry")
        count = len(request.texts) or len(request.token_ids)
        self.tokenizer.check_count(count)
        self.batcher.check_capacity(count)  # refuse overload before paying for tokenization
        prepared = await self._prepare(request)
        self.metrics.truncated.inc(sum(u.truncated for u in prepared.usage))
        results = await self.batcher.submit(prepared.rows, deadline)
        normalize = request.normalize if request.HasField("normalize") else True
        return _response(results, prepared.usage, normalize, request.format, started)

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        truncate = request.truncate if request.HasField("truncate") else True
        prepared = await self._tokenize_texts(list(request.texts), True)
        tokens = []
        for text, row, u in zip(request.texts, prepared.rows, prepared.usage, strict=True):
            if u.truncated and not truncate:
                row = await asyncio.to_thread(self.tokenizer.tokenizer.encode_full, text)
                u = Usage(len(row), False, len(row))
            tokens.append(pb.Tokens(ids=row, usage=_usage(u)))
        return pb.TokenizeResponse(tokens=tokens)

    async def _stream(
        self, requests: AsyncIterator[pb.EmbedStreamRequest], deadline: float | None
    ) -> AsyncIterator[pb.EmbedStreamResponse]:
        """Items run concurrently and are answered as they finish; at most N unanswered at once."""
        slots = asyncio.Semaphore(self.max_stream_in_flight)
        answers: asyncio.Queue[pb.EmbedStreamResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def answer(item: pb.EmbedStreamRequest) -> None:
            try:
                _check_decoded(item)
                response = await self._embed(item.request, deadline)
                await answers.put(pb.EmbedStreamResponse(id=item.id, response=response))
            except ServiceError as e:
                await answers.put(_stream_error(item, e.code, str(e)))
            except Exception:  # every item gets an answer, even after a bug
                log.exception("EmbedStream item failed")
                await answers.put(
                    _stream_error(item, grpc.StatusCode.INTERNAL, "internal error; see the server log")
                )

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            slots.release()

        async def read() -> None:
            try:
                async for item in requests:
                    await slots.acquire()  # stop reading while the stream has N items unanswered
                    task = asyncio.create_task(answer(item))
                    tasks.add(task)
                    task.add_done_callback(finished)
                if tasks:
                    await asyncio.gather(*tasks)
            finally:
                await answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                yield response
            await reader  # re-raises a failure of the reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def register(service: EmbeddingService, server: grpc.aio.Server) -> None:
    """Add the service with lenient request parsing (the generated helper would answer INTERNAL)."""
    handlers = {
        "Embed": grpc.unary_unary_rpc_method_handler(
            service.Embed, lenient(pb.EmbedRequest), pb.EmbedResponse.SerializeToString
        ),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedStream, lenient(pb.EmbedStreamRequest), pb.EmbedStreamResponse.SerializeToString
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, lenient(pb.TokenizeRequest), pb.TokenizeResponse.SerializeToString
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, lenient(pb.InfoRequest), pb.InfoResponse.SerializeToString
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def _stream_error(item: object, code: grpc.StatusCode, message: str) -> pb.EmbedStreamResponse:
    item_id = item.id if isinstance(item, pb.EmbedStreamRequest) else ""
    return pb.EmbedStreamResponse(id=item_id, error=pb.Error(code=code.value[0], message=message))


def _cancelled_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """gRPC cancels the handler both when the caller cancels and when the call's deadline passes."""
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _running_time(results: list[Result]) -> float:
    """Seconds during which at least one of these results' batches ran (instances overlap)."""
    spans = sorted({r.batch_id: (r.run_started, r.run_started + r.run_s) for r in results}.values())
    total, covered_to = 0.0, -math.inf
    for start, end in spans:
        total += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return total


def _usage(u: Usage) -> pb.InputUsage:
    return pb.InputUsage(tokens=u.tokens, truncated=u.truncated, original_tokens=u.original_tokens)


def _response(
    results: list[Result], usage: list[Usage], normalize: bool, fmt: int, started: float
) -> pb.EmbedResponse:
    as_bytes = fmt == pb.EMBEDDING_FORMAT_FLOAT32_BYTES
    embeddings = []
    for r, u in zip(results, usage, strict=True):
        vector = r.embedding if normalize else r.pooled
        if as_bytes:
            e = pb.Embedding(float32_le=np.asarray(vector, dtype="<f4").tobytes(), usage=_usage(u))
        else:
            e = pb.Embedding(values=vector.tolist(), usage=_usage(u))
        embeddings.append(e)
    timing = pb.Timing(
        queue_us=int(max(r.queue_s for r in results) * 1e6),
        inference_us=int(_running_time(results) * 1e6),
        total_us=int((time.perf_counter() - started) * 1e6),
    )
    dims = len(results[0].embedding)
    return pb.EmbedResponse(
        embeddings=embeddings, dimensions=dims, total_tokens=sum(u.tokens for u in usage), timing=timing
    )
