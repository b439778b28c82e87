"""Client library over the generated stubs.

Channels use round_robin over every address the target resolves to (`dns:///name:port` for a
Kubernetes headless Service) and retry UNAVAILABLE (a replica draining or warming up) with backoff,
through the gRPC service config, so a rolling restart costs the caller nothing. A call that fails
raises one of client.errors' exceptions (InvalidInput, Overloaded, Unavailable, ...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from minilm_embed.client.errors import from_rpc_error
from minilm_embed.proto.embedding.v1 import BEARER_TOKEN, SERVICE_NAME
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


# The largest message the client's channels send or receive: an answer past it is refused by the
# client's own gRPC (RESOURCE_EXHAUSTED), whatever the server's max_message_bytes.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """gRPC channel options: the service config, retries on, and the largest message either way."""
    return [
        ("grpc.service_config", service_config()),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class Security:
    """TLS and/or a bearer token. With `ca_cert` the channel uses TLS; client cert+key add mutual TLS.

    Paths may be given as str or Path. The token is stripped of surrounding whitespace (a token file's
    newline), and one no header can carry is refused here (ValueError), not by gRPC mid-call."""

    ca_cert: Path | str | None = None
    client_cert: Path | str | None = None
    client_key: Path | str | None = None
    token: str | None = None
    server_name: str | None = None  # check the certificate against this name instead of the address

    def __post_init__(self) -> None:
        for name in ("ca_cert", "client_cert", "client_key"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if self.token is not None:
            token = self.token.strip()
            if token and not BEARER_TOKEN.fullmatch(token):
                raise ValueError("the token holds characters a header cannot carry: printable ASCII only")
            object.__setattr__(self, "token", token or None)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel (no `ca_cert`)."""
        if self.ca_cert is None:
            return None
        key = Path(self.client_key).read_bytes() if self.client_key else None
        chain = Path(self.client_cert).read_bytes() if self.client_cert else None
        return grpc.ssl_channel_credentials(Path(self.ca_cert).read_bytes(), key, chain)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the `authorization: Bearer` header when a token is set."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple[str, Any]]:
        """`channel_options()`, plus the certificate name override when `server_name` is set."""
        override = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return channel_options() + override


def text_list(texts: str | Iterable[str] | None) -> list[str]:
    """The texts as a list: a lone str is one text (not one per character); any iterable of str
    (a list, a numpy array, a pandas Series) is accepted; anything else is a TypeError naming it.
    (A str UTF-8 cannot encode is named as the message is built: `naming_unencodable_text`.)"""
    if texts is None:
        return []
    if isinstance(texts, bytes | bytearray):  # iterating it would give ints
        raise TypeError(f"texts is {type(texts).__name__}: decode it to str first")
    items = [texts] if isinstance(texts, str) else list(texts)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is {type(text).__name__}, not str")
    return items


def lone_surrogate(text: str) -> str:
    """Where `text` holds a lone UTF-16 surrogate (JSON's "\\udc80" escape parses to one, and a shell
    argument's bytes that are not UTF-8 arrive as them, PEP 383), which UTF-8 cannot encode and so no
    request can carry; "" when it holds none."""
    if text.isascii():
        return ""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"U+{ord(text[e.start]):04X} at character {e.start}"
        return f"holds a lone surrogate, {where}, which is not Unicode text"
    return ""


@contextmanager
def naming_unencodable_text(texts: list[str]) -> Iterator[None]:
    """protobuf's bare UnicodeEncodeError, while building a message of `texts`, as a ValueError naming
    texts[i]. Looked for only once protobuf has refused one: the normal path encodes each text once."""
    try:
        yield
    except UnicodeEncodeError:
        i, at = next((i, at) for i, text in enumerate(texts) if (at := lone_surrogate(text)))
        raise ValueError(f"texts[{i}] {at}") from None


def embed_request(
    texts: str | Iterable[str] | None = None,
    token_ids: Iterable[Sequence[int]] | None = None,
    normalize: bool = True,
    truncate: bool = True,
    priority: str = "interactive",
) -> pb.EmbedRequest:
    """An Embed request for texts or token-id sequences (one of the two), asking for float32 bytes.
    `priority`: "interactive" (a caller waits on it) or "bulk" (batched after interactive requests,
    within the server's --bulk-queue-share of its queue)."""
    items = text_list(texts)
    with naming_unencodable_text(items):
        return pb.EmbedRequest(
            texts=items,
            token_ids=[pb.TokenIds(ids=list(ids)) for ids in (() if token_ids is None else token_ids)],
            normalize=normalize,
            truncate=truncate,
            format=pb.EMBEDDING_FORMAT_FLOAT32_BYTES,
            priority=_priority(priority),
        )


def tokenize_request(texts: str | Iterable[str], truncate: bool = True) -> pb.TokenizeRequest:
    items = text_list(texts)
    with naming_unencodable_text(items):
        return pb.TokenizeRequest(texts=items, truncate=truncate)


PRIORITIES = {"interactive": pb.PRIORITY_INTERACTIVE, "bulk": pb.PRIORITY_BULK}


def _priority(name: str) -> pb.Priority:
    if name not in PRIORITIES:
        raise ValueError(f"priority must be interactive or bulk, not {name!r}")
    return PRIORITIES[name]


def to_array(response: pb.EmbedResponse) -> np.ndarray:
    """(N, D) float32 from a response in either format."""
    rows = [
        np.frombuffer(e.float32_le, dtype="<f4") if e.float32_le else np.asarray(e.values, dtype=np.float32)
        for e in response.embeddings
    ]
    return np.stack(rows) if rows else np.zeros((0, response.dimensions), dtype=np.float32)


# gRPC keeps a deadline as nanoseconds since the epoch in an int64: one past about 7.4e9 s from now
# overflows and is taken as already past (DEADLINE_EXCEEDED at once), as an infinite one is.
MAX_TIMEOUT_S = 1e9  # about 31.7 years


def checked_timeout(timeout: float | None) -> float | None:
    """Seconds above 0 and at most MAX_TIMEOUT_S, or None: no deadline."""
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout is {timeout!r}: give seconds above 0 and at most {MAX_TIMEOUT_S:g},"
            " or None for no deadline"
        )
    return timeout


CLOSED = "the client is closed"
# What gRPC's blocking channel says of a call its close() cut off (CANCELLED): grpc.aio's only
# cancels the call, and the await raises a bare asyncio.CancelledError.
CHANNEL_CLOSED = "Channel closed!"


def open_channel(address: str, security: Security, api: Any) -> Any:
    """A channel from `api` (grpc or grpc.aio): TLS when the security says so, plaintext otherwise."""
    credentials = security.credentials()
    if credentials is None:
        return api.insecure_channel(address, options=security.options())
    return api.secure_channel(address, credentials, options=security.options())


class EmbeddingClient:
    """Blocking client. `with EmbeddingClient() as c: vectors = c.embed(["some text"])`.

    `timeout` is seconds per call (None: no deadline). Every method raises a client.errors.EmbeddingError
    subclass when the call fails, and ValueError once the client is closed, or for a text UTF-8 cannot
    encode (a lone surrogate), naming it.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float | None = 30.0, security: Security | None = None
    ) -> None:
        security = security or Security()
        self.timeout = checked_timeout(timeout)
        self.channel = open_channel(address, security, grpc)
        self.stub = pb_grpc.EmbeddingServiceStub(self.channel)
        self.metadata = security.metadata()
        self.closed = False

    def _call(self, method: Any, request: Any) -> Any:
        if self.closed:
            raise ValueError(CLOSED)
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def embed_response(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """The whole Embed response (vectors, per-input usage, timing) for a request you built."""
        return self._call(self.stub.Embed, request)

    def embed(
        self,
        texts: str | Iterable[str],
        normalize: bool = True,
        truncate: bool = True,
        priority: str = "interactive",
    ) -> np.ndarray:
        """(len(texts), D) float32 vectors, in input order (a lone str is one text: (1, D)).

        `normalize=False` gives the mean-pooled vectors; `truncate=False` refuses a text over the
        model's max_input_tokens (256) instead of cutting it. The server's limits (`info().limits`):
        at most max_inputs_per_request texts a call (256 by default; the client does not split a
        longer list, `minilm-embed embed-file` does), each of at most max_text_chars, and
        max_message_bytes a message. A failed call raises a client.errors exception: InvalidInput
        (the limit or rule, named), Overloaded (queue full: back off), TooLarge (a message over the
        size limit), Unavailable, Unauthenticated, DeadlineExceeded. `priority="bulk"` for work
        nobody waits on (indexing): batched after interactive requests, and admitted only while the
        server's queue holds less than its --bulk-queue-share (else Overloaded: back off).
        """
        request = embed_request(texts, normalize=normalize, truncate=truncate, priority=priority)
        return to_array(self.embed_response(request))

    def embed_ids(
        self,
        token_ids: Sequence[Sequence[int]],
        normalize: bool = True,
        truncate: bool = True,
        priority: str = "interactive",
    ) -> np.ndarray:
        """(N, D) float32 vectors for token-id sequences from the model's tokenizer (the server's
        `tokenize`), each framed by [CLS] (101) and [SEP] (102) as `tokenize` returns them;
        `truncate=False` refuses a sequence over 256 ids. Limits, errors and priority as `embed`'s."""
        request = embed_request(
            token_ids=token_ids, normalize=normalize, truncate=truncate, priority=priority
        )
        return to_array(self.embed_response(request))

    def tokenize(self, texts: str | Iterable[str], truncate: bool = True) -> pb.TokenizeResponse:
        """The ids the server would embed for each text, with each one's usage."""
        return self._call(self.stub.Tokenize, tokenize_request(texts, truncate))

    def info(self) -> pb.InfoResponse:
        """The served model (id, hashes, dimensions, precision, provider) and the server's limits."""
        return self._call(self.stub.Info, pb.InfoRequest())

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Closing twice is harmless."""
        self.closed = True
        self.channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEmbeddingClient:
    """asyncio client. `async with AsyncEmbeddingClient() as c: vectors = await c.embed([...])`.

    The same methods, arguments and exceptions as EmbeddingClient, awaited. It may be made outside
    an event loop (at import, say): its channel opens at its first call, on that call's loop, and
    serves that loop only (a call from another raises RuntimeError: make one client per loop).
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float | None = 30.0, security: Security | None = None
    ) -> None:
        self.security = security or Security()
        self.address = address
        self.timeout = checked_timeout(timeout)
        self.metadata = self.security.metadata()
        self.closed = False
        self._channel: Any = None
        self._stub: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def stub(self) -> Any:
        """The service stub, on a channel opened in the running loop at first use."""
        if self.closed:
            raise ValueError(CLOSED)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._channel = open_channel(self.address, self.security, grpc.aio)
            self._stub, self._loop = pb_grpc.EmbeddingServiceStub(self._channel), loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncEmbeddingClient's channel belongs to the event loop of its first call; "
                "make one client per event loop (inside asyncio.run)"
            )
        return self._stub

    async def _call(self, name: str, request: Any) -> Any:
        method = getattr(self.stub, name)
        try:
            return await method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.closed or (task is not None and task.cancelling()):
                raise  # the awaiting task was cancelled (or something else cut the call): it ends so
            # close() cut the call off: CANCELLED, as EmbeddingClient raises it
            closed = grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), CHANNEL_CLOSED
            )
            raise from_rpc_error(closed) from None

    async def embed_response(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """The whole Embed response (vectors, per-input usage, timing) for a request you built."""
        return await self._call("Embed", request)

    async def embed(
        self,
        texts: str | Iterable[str],
        normalize: bool = True,
        truncate: bool = True,
        priority: str = "interactive",
    ) -> np.ndarray:
        """As EmbeddingClient.embed (its limits, errors and priority), awaited."""
        request = embed_request(texts, normalize=normalize, truncate=truncate, priority=priority)
        return to_array(await self.embed_response(request))

    async def embed_ids(
        self,
        token_ids: Sequence[Sequence[int]],
        normalize: bool = True,
        truncate: bool = True,
        priority: str = "interactive",
    ) -> np.ndarray:
        """As EmbeddingClient.embed_ids, awaited."""
        request = embed_request(
            token_ids=token_ids, normalize=normalize, truncate=truncate, priority=priority
        )
        return to_array(await self.embed_response(request))

    async def tokenize(self, texts: str | Iterable[str], truncate: bool = True) -> pb.TokenizeResponse:
        """The ids the server would embed for each text, with each one's usage."""
        return await self._call("Tokenize", tokenize_request(texts, truncate))

    async def info(self) -> pb.InfoResponse:
        """The served model (id, hashes, dimensions, precision, provider) and the server's limits."""
        return await self._call("Info", pb.InfoRequest())

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled (each raises EmbeddingError, CANCELLED,
        as EmbeddingClient's do). Closing twice is harmless."""
        self.closed = True
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
