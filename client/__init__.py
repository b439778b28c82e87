"""A small client for the embedding service, sync and asyncio, with retries on UNAVAILABLE."""

from client.client import DEFAULT_ADDRESS, AsyncEmbeddingClient, EmbeddingClient, Security, service_config

__all__ = ["DEFAULT_ADDRESS", "AsyncEmbeddingClient", "EmbeddingClient", "Security", "service_config"]
