"""grpc.health.v1 for the whole server ("") and for the embedding service by name.

Both say NOT_SERVING until the model is warm and again from the moment draining starts, so a
Kubernetes readiness probe on the service name takes the pod out of rotation before it stops.
Watch streams end (UNAVAILABLE) when the server stops listening: gRPC's graceful stop waits for
every open call, and a watcher that stays connected (a load balancer's or a monitor's health
watch, not the client library's, which ends its watch at the server's GOAWAY) held every drain
until its timeout: the server exited 21.6 s after SIGTERM at the defaults, 1.6 s with this.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from minilm_embed.proto.embedding.v1 import SERVICE_NAME
from minilm_embed.server.details import details
from minilm_embed.server.errors import InvalidInput, MessageLate, one_request

__all__ = ["SERVICE_NAME", "HealthServicer", "StreamLimit", "new_health", "set_serving"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOPPING = "the server is shutting down"


class HealthServicer(health.aio.HealthServicer):
    """gRPC's health servicer, whose Watch streams can be ended (`end_watches`)."""

    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((watching, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            watching.cancel()  # its own finally (the watcher counts) runs before this returns
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        if not self._ended.is_set():
            return
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(STOPPING)

    def end_watches(self) -> None:
        """Every Watch, open or to come, ends with UNAVAILABLE: the server is shutting down."""
        self._ended.set()


def new_health() -> HealthServicer:
    return HealthServicer()


async def set_serving(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


# The calls of health and reflection that stay open as long as the client likes. Neither needs the
# token, and each holds one of gRPC's places (maximum_concurrent_rpcs, shared by every service) while
# open: without a bound, 704 Watch streams on one connection took every place, and every Embed and
# health Check got RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!" until they closed (an
# acceptance pass).
LONG_LIVED = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
CHECK = "/grpc.health.v1.Health/Check"


class StreamLimit(grpc.aio.ServerInterceptor):
    """Health's and reflection's calls: at most `limit` open at once, of them at most `long_lived`
    LONG_LIVED ones. Each is handled as a call that streams its requests, so that it is counted from
    its arrival, before its message, and Check and Watch must send their message within
    `message_timeout_s` (then DEADLINE_EXCEEDED): gRPC reads a unary request before any handler runs,
    and 80 Check calls that sent their headers and no message held every place, Embed and Check
    refused, for good (seen after the Watch streams were bounded). With the service's own places
    (max_concurrent_calls + max_waiting_calls) they fit gRPC's cap, so neither takes the other's.

    Past either limit the call that has waited longest for its message gives its place to the new
    one (RESOURCE_EXHAUSTED, saying so). Past the streams' limit with none waiting, the oldest stream
    of the connection holding the most gives its place up, where that connection holds more than the
    newcomer's would with it: one connection holding every stream with Watches that did send their
    message had every new client's channel health check (the project's client holds one Watch a
    connection) refused, its calls UNAVAILABLE. Only where neither applies is the new call refused.
    A probe sends its message as it starts: before, an anonymous client that held every place with
    calls that never sent theirs, each opened again after `message_timeout_s`, had every probe's
    Check refused (an acceptance pass's finding, left open then), which Kubernetes' liveness probe
    (6 x 10 s, deploy/k8s) would have taken for a dead server and restarted the pod."""

    def __init__(self, limit: int, long_lived: int, message_timeout_s: float) -> None:
        self.limit = limit
        self.long_lived = long_lived
        self.message_timeout_s = message_timeout_s
        self.open = 0
        self.open_long_lived = 0
        self.waiting: dict[_Place, None] = {}  # calls waiting for their message, oldest first
        self.streams: dict[str, dict[_Place, None]] = {}  # each connection's long-lived calls, oldest first
        self.ending = ""  # why every call ends at once: the server is shutting down (end_all)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or (details.method not in LONG_LIVED and details.method != CHECK):
            return handler
        long_lived = details.method in LONG_LIVED
        codecs = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:  # Check
            unary = handler.unary_unary

            async def check(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async with self._admitted(context, long_lived) as place:
                    return await unary(await self._first(requests, context, details.method, place), context)

            return grpc.stream_unary_rpc_method_handler(check, *codecs)
        if handler.unary_stream is not None:  # Watch: health's writes its answers itself
            watch = handler.unary_stream

            async def watched(requests: Any, context: grpc.aio.ServicerContext) -> None:
                async with self._admitted(context, long_lived) as place:
                    request = await self._first(requests, context, details.method, place)
                    await self._until_taken(place, context, watch(request, context))

            return grpc.stream_stream_rpc_method_handler(watched, *codecs)
        if handler.stream_stream is not None:  # ServerReflectionInfo: reflection's yields its answers
            stream = handler.stream_stream

            async def answered(requests: Any, context: grpc.aio.ServicerContext) -> None:
                answers = stream(requests, context)
                if inspect.isasyncgen(answers):
                    async for answer in answers:
                        await context.write(answer)
                else:
                    await answers

            async def streamed(requests: Any, context: grpc.aio.ServicerContext) -> None:
                async with self._admitted(context, long_lived) as place:
                    await self._until_taken(place, context, answered(requests, context))

            return grpc.stream_stream_rpc_method_handler(streamed, *codecs)
        return handler

    @contextlib.asynccontextmanager
    async def _admitted(self, context: grpc.aio.ServicerContext, long_lived: bool) -> AsyncIterator[_Place]:
        """Counted open for the call's life, or until it gives its place up (`_give_up`). Past the
        streams' bound a call waiting for its message gives its place up, else the oldest stream of
        the connection that holds the most, where that is more than this call's connection would
        hold with it; past the calls' bound a call waiting for its message; else this one is refused."""
        if self.ending:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.ending)
        place = _Place(long_lived, context.peer() or "", asyncio.get_running_loop().create_future())
        self.open += 1
        if long_lived:
            self.open_long_lived += 1
            self.streams.setdefault(place.peer, {})[place] = None
        try:
            held = len(self.streams.get(place.peer, ())) - 1
            if long_lived and self.open_long_lived > self.long_lived and not self._take_a_stream(place):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.long_lived} health Watch and reflection streams are open on this front "
                    f"process, its most ({held} on this connection, none with more than {held + 1}): "
                    "close one, or use health Check",
                )
            if self.open > self.limit and not self._take_a_waiting_place():
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.limit} health and reflection calls are open on this front process, its most: "
                    "retry in a moment",
                )
            yield place
        finally:
            if place.counted:
                self._uncount(place)

    def _take_a_stream(self, newcomer: _Place) -> bool:
        """A long-lived place for `newcomer`, taken from a connection holding at least as many streams
        as the newcomer's does with it: its oldest call waiting for its message; else the oldest stream
        of the connection holding the most, where it holds more; False where neither.

        A waiting place is taken only from such a connection: a new client's Watch, its message come
        with its headers but not read yet, was the one call waiting, and the connection holding every
        other stream took that place back with its next Watch (a review: 16 of 102 new clients'
        calls UNAVAILABLE)."""
        mine = len(self.streams[newcomer.peer])
        victim = next((p for p in self.waiting if p.long_lived and len(self.streams[p.peer]) >= mine), None)
        if victim is not None:
            self._give_up(victim, self._newer_took(victim))
            return True
        heaviest = max(self.streams, key=lambda peer: len(self.streams[peer]))
        held = len(self.streams[heaviest])
        if held <= mine:
            return False
        self._give_up(
            next(iter(self.streams[heaviest])),
            f"this connection held {held} of the {self.long_lived} health Watch and reflection streams "
            "open on this front process, its most, more than any other, when another connection opened "
            "one: its oldest gave its place up",
        )
        return True

    def _take_a_waiting_place(self) -> bool:
        """The oldest call waiting for its message gives its place up; False where none waits."""
        victim = next(iter(self.waiting), None)
        if victim is None:
            return False
        self._give_up(victim, self._newer_took(victim))
        return True

    def _newer_took(self, victim: _Place) -> str:
        return (
            f"the call's request had not come {time.monotonic() - victim.since:.1f} s after it began, and "
            f"{self.limit} health and reflection calls ({self.long_lived} streams) were open on this front "
            "process, its most: a newer call took its place"
        )

    def end_all(self, why: str) -> None:
        """The server is shutting down: every stream and every call waiting for its message ends now
        (UNAVAILABLE, saying `why`), and every call to come at once. An open reflection stream held
        the drain to its timeout (21 s at the defaults; health's Watches end by themselves,
        HealthServicer.end_watches), and a call still waiting for its message then (--message-timeout-s
        outlasts --drain-timeout-s) was cut off by gRPC with a logged traceback (a review)."""
        self.ending = why
        for place in {*self.waiting, *(p for held in self.streams.values() for p in held)}:
            self._give_up(place, why, grpc.StatusCode.UNAVAILABLE)

    def _give_up(
        self, place: _Place, why: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    ) -> None:
        """`place` is uncounted now, and its call ended with `code`, saying `why`."""
        self._uncount(place)
        place.counted = False
        place.taken.set_result((code, why))

    def _uncount(self, place: _Place) -> None:
        self.open -= 1
        self.waiting.pop(place, None)
        if place.long_lived:
            self.open_long_lived -= 1
            streams = self.streams[place.peer]
            del streams[place]
            if not streams:
                del self.streams[place.peer]

    async def _until_taken(
        self, place: _Place, context: grpc.aio.ServicerContext, work: Awaitable[None]
    ) -> None:
        """`work`, ended where its place is taken (RESOURCE_EXHAUSTED, saying why)."""
        running = asyncio.ensure_future(work)
        try:
            await asyncio.wait((running, place.taken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not running.done():
                running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        if place.taken.done():
            code, why = place.taken.result()
            await context.abort(code, why)

    async def _first(
        self, requests: Any, context: grpc.aio.ServicerContext, method: str, place: _Place
    ) -> Any:
        """The call's one request, within message_timeout_s of its start, as the service's calls';
        meanwhile a newer call may take its place (`_take_a_waiting_place`)."""
        self.waiting[place] = None
        reading = asyncio.ensure_future(one_request(requests, self.message_timeout_s, method, "it began"))
        try:
            await asyncio.wait((reading, place.taken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting.pop(place, None)
            if not reading.done():
                reading.cancel()
            # Its outcome read here, whatever it is: a call the client cancelled (or whose connection
            # closed) also ends its request stream, and the NO_REQUEST that raised in place of the
            # cancellation was logged as the servicer's own error, with a traceback, every time.
            with contextlib.suppress(asyncio.CancelledError, InvalidInput, MessageLate):
                await reading
        if place.taken.done():  # uncounted now, its message come meanwhile or not
            code, why = place.taken.result()
            await context.abort(code, f"{method}: {why}")
        try:
            return reading.result()
        except (InvalidInput, MessageLate) as e:
            await context.abort(e.code, str(e), details(e))


class _Place:
    """One health or reflection call's place in StreamLimit's count: its connection (`peer`), and
    `taken`, done (with the reason) once it has given its place up."""

    __slots__ = ("counted", "long_lived", "peer", "since", "taken")

    def __init__(
        self, long_lived: bool, peer: str, taken: asyncio.Future[tuple[grpc.StatusCode, str]]
    ) -> None:
        self.long_lived = long_lived
        self.peer = peer
        self.taken = taken
        self.since = time.monotonic()
        self.counted = True
