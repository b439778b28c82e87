"""TLS credentials and optional bearer-token authentication.

Health and reflection stay open so that probes and tooling work without the token; only the
embedding service's methods require it (and HTTP's /v1/*, server/http.py, with the same comparison).
The token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from minilm_embed.proto.embedding.v1 import SERVICE_NAME
from minilm_embed.server import logs
from minilm_embed.server.metrics import Metrics

PROTECTED_PREFIX = f"/{SERVICE_NAME}/"


class SecurityConfigError(Exception):
    """A TLS or token file that cannot be used; the message names the file."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{path}: cannot read the {what} ({e.strerror})") from e


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    """TLS when a certificate is given; with a client CA, clients must present a certificate it signed."""
    if not cert and not key:
        if client_ca:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise SecurityConfigError("TLS needs both --tls-cert and --tls-key")
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    roots = _read(client_ca, "client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=roots is not None)


def load_token(token: str, token_file: str) -> str | None:
    if token and token_file:
        raise SecurityConfigError("give the auth token either directly or as a file, not both")
    if token_file:
        token = _read(token_file, "auth token file").decode("utf-8").strip()
        if not token:
            raise SecurityConfigError(f"{token_file}: the auth token file is empty")
    return token or None


def bearer_matches(header: str, expected: bytes) -> bool:
    """Whether an `authorization` value is `Bearer <expected>`, for gRPC metadata and HTTP headers.

    The scheme is case-insensitive (RFC 7235 2.1); the token is compared in constant time.
    """
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


class BearerAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for embedding calls without `authorization: Bearer <token>`."""

    def __init__(self, token: str, metrics: Metrics) -> None:
        self._expected = token.encode()
        self._metrics = metrics

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                text = value if isinstance(value, str) else bytes(value).decode("latin-1")
                return bearer_matches(text, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler
        self._metrics.requests.labels(method.removeprefix(PROTECTED_PREFIX), "UNAUTHENTICATED").inc()
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or invalid bearer token (send metadata `authorization: Bearer <token>`)"

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        request_id, _ = logs.request_id_from(logs.given_request_id(context.invocation_metadata()))
        trailing = ((logs.REQUEST_ID_HEADER, request_id),)  # as on the service's own refusals
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing)

    # The handler's own kind: refused before its request is read, as the service refuses past its
    # calls (a unary method is served as stream-unary there).
    kinds = {
        (True, True): grpc.stream_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (False, False): grpc.unary_unary_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(refuse, handler.request_deserializer, handler.response_serializer)
