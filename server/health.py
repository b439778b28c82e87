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
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from minilm_embed.proto.embedding.v1 import SERVICE_NAME

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


class StreamLimit(grpc.aio.ServerInterceptor):
    """At most `limit` LONG_LIVED calls open at once, in all; past it a call is refused at once with
    RESOURCE_EXHAUSTED, so that those left of gRPC's cap stay for health Check and the service."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in LONG_LIVED:
            return handler
        if handler.unary_stream is not None:  # Watch
            make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        elif handler.stream_stream is not None:  # ServerReflectionInfo
            make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
        else:
            return handler
        return make(self._bounded(behavior), handler.request_deserializer, handler.response_serializer)

    def _bounded(self, behavior: Callable[..., Any]) -> Callable[..., Awaitable[None]]:
        async def bounded(request: Any, context: grpc.aio.ServicerContext) -> None:
            if self.open >= self.limit:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.limit} health Watch and reflection streams are open on this front process, "
                    "its most: close one, or use health Check",
                )
            self.open += 1
            try:
                answers = behavior(request, context)
                if inspect.isasyncgen(answers):  # reflection's servicer yields its answers
                    async for answer in answers:
                        await context.write(answer)
                else:  # health's writes them itself
                    await answers
            finally:
                self.open -= 1

        return bounded
