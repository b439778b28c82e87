"""grpc.health.v1 for the whole server ("") and for the embedding service by name.

Both say NOT_SERVING until the model is warm and again from the moment draining starts, so a
Kubernetes readiness probe on the service name takes the pod out of rotation before it stops.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from minilm_embed.proto.embedding.v1 import SERVICE_NAME

__all__ = ["SERVICE_NAME", "new_health", "set_serving"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def new_health() -> health.aio.HealthServicer:
    return health.aio.HealthServicer()


async def set_serving(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)
