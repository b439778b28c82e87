"""Whether a front serves, and why not: the one owner of health, the ready gauge and refusals.

NOT_SERVING (grpc.health.v1, for "" and the embedding service by name) until the engine says it is
warm, and again from the first moment of a drain or once the engine is gone; while not serving,
embedding calls get UNAVAILABLE naming the reason, which the client library retries elsewhere.
"""

from __future__ import annotations

from minilm_embed.server.errors import NotReady
from minilm_embed.server.health import HealthServicer, set_serving
from minilm_embed.server.metrics import Metrics


class Readiness:
    def __init__(self, health_servicer: HealthServicer, metrics: Metrics) -> None:
        self.health = health_servicer
        self.metrics = metrics
        self.ready = False
        self.reason = "the model is warming up"
        self.error_reason = "WARMING_UP"  # the same as an error's reason (server/errors.py)

    def check(self) -> None:
        if not self.ready:
            raise NotReady(f"not serving: {self.reason}; retry", self.error_reason)

    async def serving(self) -> None:
        self.ready = True
        self.metrics.ready.set(1)
        await set_serving(self.health, True)

    async def not_serving(self, reason: str, error_reason: str = "SHUTTING_DOWN") -> None:
        self.ready = False
        self.reason, self.error_reason = reason, error_reason
        self.metrics.ready.set(0)
        await set_serving(self.health, False)
