"""A small client for the embedding service, sync and asyncio, with retries on UNAVAILABLE."""

from minilm_embed.client.client import (
    DEFAULT_ADDRESS,
    AsyncEmbeddingClient,
    EmbeddingClient,
    Security,
    service_config,
)
from minilm_embed.client.errors import (
    DeadlineExceeded,
    EmbeddingError,
    InvalidInput,
    Overloaded,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncEmbeddingClient",
    "DeadlineExceeded",
    "EmbeddingClient",
    "EmbeddingError",
    "InvalidInput",
    "Overloaded",
    "Security",
    "Unauthenticated",
    "Unavailable",
    "service_config",
]
