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
    TooLarge,
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
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
    "service_config",
]
