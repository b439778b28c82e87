"""Client library over the generated stubs.

Channels use round_robin over every address the target resolves to (`dns:///name:port` for a
Kubernetes headless Service) and retry UNAVAILABLE (a replica draining or warming up) with backoff,
through the gRPC service config, so a rolling restart costs the caller nothing. A call that fails
raises one of client.errors' exceptions (InvalidInput, Overloaded, Unavailable, ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from minilm_embed.client.errors import from_rpc_error
from minilm_embed.proto.embedding.v1 import SERVICE_NAME
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


def service_config(max_attempts: int = 5) -> str:
    """The channel's service config (JSON): round_robin over healthy replicas, UNAVAILABLE retried."""
    policy = {
        "maxAttempts": max_attempts,
        "initialBackoff": "0.05s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            # Client-side health checking: round_robin skips replicas that say NOT_SERVING
            # (warming up, draining) instead of spending retries on them.
            "healthCheckConfig": {"serviceName": SERVICE_NAME},
            "methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": policy}],
        }
    )


def channel_options(max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, Any]]:
    """gRPC channel options: the service config, retries on, and the largest message either way."""
    return [
        ("grpc.service_config", service_config()),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class Security:
    """TLS and/or a bearer token. With `ca_cert` the channel uses TLS; client cert+key add mutual TLS."""

    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    token: str | None = None
    server_name: str | None = None  # check the certificate against this name instead of the address

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel (no `ca_cert`)."""
        if self.ca_cert is None:
            return None
        key = self.client_key.read_bytes() if self.client_key else None
        chain = self.client_cert.read_bytes() if self.client_cert else None
        return grpc.ssl_channel_credentials(self.ca_cert.read_bytes(), key, chain)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the `authorization: Bearer` header when a token is set."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple[str, Any]]:
        """`channel_options()`, plus the certificate name override when `server_name` is set."""
        override = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return channel_options() + override


def text_list(texts: str | Iterable[str] | None) -> list[str]:
    """The texts as a list: a lone str is one text (not one per character); any iterable of str
    (a list, a numpy array, a pandas Series) is accepted; anything else is a TypeError naming it."""
    if texts is None:
        return []
    items = [texts] if isinstance(texts, str) else list(texts)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is {type(text).__name__}, not str")
    return items


def embed_request(
    texts: str | Iterable[str] | None = None,
    token_ids: Iterable[Sequence[int]] | None = None,
    normalize: bool = True,
    truncate: bool = True,
) -> pb.EmbedRequest:
    """An Embed request for texts or token-id sequences (one of the two), asking for float32 bytes."""
    return pb.EmbedRequest(
        texts=text_list(texts),
        token_ids=[pb.TokenIds(ids=list(ids)) for ids in (() if token_ids is None else token_ids)],
        normalize=normalize,
        truncate=truncate,
        format=pb.EMBEDDING_FORMAT_FLOAT32_BYTES,
    )


def to_array(response: pb.EmbedResponse) -> np.ndarray:
    """(N, D) float32 from a response in either format."""
    rows = [
        np.frombuffer(e.float32_le, dtype="<f4") if e.float32_le else np.asarray(e.values, dtype=np.float32)
        for e in response.embeddings
    ]
    return np.stack(rows) if rows else np.zeros((0, response.dimensions), dtype=np.float32)


def open_channel(address: str, security: Security, api: Any) -> Any:
    """A channel from `api` (grpc or grpc.aio): TLS when the security says so, plaintext otherwise."""
    credentials = security.credentials()
    if credentials is None:
        return api.insecure_channel(address, options=security.options())
    return api.secure_channel(address, credentials, options=security.options())


class EmbeddingClient:
    """Blocking client. `with EmbeddingClient() as c: vectors = c.embed(["some text"])`.

    `timeout` is seconds per call (None: no deadline). Every method raises a client.errors.EmbeddingError
    subclass when the call fails.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float | None = 30.0, security: Security | None = None
    ) -> None:
        security = security or Security()
        self.channel = open_channel(address, security, grpc)
        self.stub = pb_grpc.EmbeddingServiceStub(self.channel)
        self.timeout = timeout
        self.metadata = security.metadata()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def embed_response(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """The whole Embed response (vectors, per-input usage, timing) for a request you built."""
        return self._call(self.stub.Embed, request)

    def embed(self, texts: str | Iterable[str], normalize: bool = True, truncate: bool = True) -> np.ndarray:
        """(len(texts), D) float32 vectors, in input order (a lone str is one text: (1, D));
        `truncate=False` refuses over-long texts."""
        return to_array(self.embed_response(embed_request(texts, normalize=normalize, truncate=truncate)))

    def embed_ids(self, token_ids: Sequence[Sequence[int]], normalize: bool = True) -> np.ndarray:
        """(N, D) float32 vectors for token-id sequences already tokenized with the model's tokenizer."""
        return to_array(self.embed_response(embed_request(token_ids=token_ids, normalize=normalize)))

    def tokenize(self, texts: str | Iterable[str], truncate: bool = True) -> pb.TokenizeResponse:
        """The ids the server would embed for each text, with each one's usage."""
        return self._call(self.stub.Tokenize, pb.TokenizeRequest(texts=text_list(texts), truncate=truncate))

    def info(self) -> pb.InfoResponse:
        """The served model (id, hashes, dimensions, precision, provider) and the server's limits."""
        return self._call(self.stub.Info, pb.InfoRequest())

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self.channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEmbeddingClient:
    """asyncio client. `async with AsyncEmbeddingClient() as c: vectors = await c.embed([...])`.

    The same methods, arguments and exceptions as EmbeddingClient, awaited.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float | None = 30.0, security: Security | None = None
    ) -> None:
        security = security or Security()
        self.channel = open_channel(address, security, grpc.aio)
        self.stub = pb_grpc.EmbeddingServiceStub(self.channel)
        self.timeout = timeout
        self.metadata = security.metadata()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    async def embed_response(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """The whole Embed response (vectors, per-input usage, timing) for a request you built."""
        return await self._call(self.stub.Embed, request)

    async def embed(
        self, texts: str | Iterable[str], normalize: bool = True, truncate: bool = True
    ) -> np.ndarray:
        """(len(texts), D) float32 vectors, in input order (a lone str is one text: (1, D));
        `truncate=False` refuses over-long texts."""
        return to_array(
            await self.embed_response(embed_request(texts, normalize=normalize, truncate=truncate))
        )

    async def embed_ids(self, token_ids: Sequence[Sequence[int]], normalize: bool = True) -> np.ndarray:
        """(N, D) float32 vectors for token-id sequences already tokenized with the model's tokenizer."""
        return to_array(await self.embed_response(embed_request(token_ids=token_ids, normalize=normalize)))

    async def tokenize(self, texts: str | Iterable[str], truncate: bool = True) -> pb.TokenizeResponse:
        """The ids the server would embed for each text, with each one's usage."""
        request = pb.TokenizeRequest(texts=text_list(texts), truncate=truncate)
        return await self._call(self.stub.Tokenize, request)

    async def info(self) -> pb.InfoResponse:
        """The served model (id, hashes, dimensions, precision, provider) and the server's limits."""
        return await self._call(self.stub.Info, pb.InfoRequest())

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self.channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
