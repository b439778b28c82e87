"""TLS credentials and optional bearer-token authentication.

Health and reflection stay open so that probes and tooling work without the token; only the
embedding service's methods require it (and HTTP's /v1/*, server/http.py, with the same comparison).
The token is compared in constant time and never logged.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from minilm_embed.proto.embedding.v1 import BEARER_TOKEN, SERVICE_NAME
from minilm_embed.server import logs
from minilm_embed.server.config import ConfigError, ServerConfig, setting
from minilm_embed.server.details import details
from minilm_embed.server.errors import Unauthenticated
from minilm_embed.server.metrics import Metrics

PROTECTED_PREFIX = f"/{SERVICE_NAME}/"


class SecurityConfigError(ConfigError):
    """A TLS or token setting that cannot be used; the message names the setting and its file."""


def _read(path: str, name: str, what: str) -> bytes:
    """The file a setting (`name`) names; one that cannot be read is refused naming the setting."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{setting(name)} {path}: cannot read the {what} ({e.strerror})") from e


@dataclass(frozen=True)
class Secrets:
    """The bearer token and the TLS files' bytes, read once by the supervisor before any child starts
    and handed to every front it starts (its spawn arguments, never argv or the environment): a front
    started again after a death serves with what the first fronts served with. Read again by each
    front, a changed token file had two fronts enforce different tokens, and an emptied one made the
    restarted front die at every start (an acceptance pass)."""

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes = b""  # PEM chain; b"": no TLS
    tls_key: bytes = field(default=b"", repr=False)
    tls_client_ca: bytes = b""  # b"": no client certificates asked for

    def with_tls_files(self, config: ServerConfig) -> ServerConfig:
        """`config` with its TLS settings naming this process's own in-memory copies of the bytes
        (memfd, seen as /proc/self/fd/N): the HTTP API's TLS (uvicorn, Python's ssl) loads only files
        by name, and a copy of the key on disk would outlive a killed server in an emptyDir on the
        node's disk. The copies stay open for the process's life. Without TLS, no TLS settings."""
        paths = {}
        for name, data in (("cert", self.tls_cert), ("key", self.tls_key), ("client-ca", self.tls_client_ca)):
            if data:
                fd = os.memfd_create(f"tls-{name}", os.MFD_CLOEXEC)
                with open(fd, "wb", closefd=False) as file:
                    file.write(data)
                paths[name] = f"/proc/self/fd/{fd}"
        return dataclasses.replace(
            config,
            tls_cert=paths.get("cert", ""),
            tls_key=paths.get("key", ""),
            tls_client_ca=paths.get("client-ca", ""),
        )

    def credentials(self) -> grpc.ServerCredentials | None:
        """gRPC's server credentials over these bytes (None: plaintext)."""
        if not self.tls_cert:
            return None
        roots = self.tls_client_ca or None
        pair = (self.tls_key, self.tls_cert)
        return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=bool(roots))


def read_secrets(config: ServerConfig) -> Secrets:
    """The token and the TLS files the settings name, each checked (SecurityConfigError naming the
    setting). TLS when a certificate is given; with a client CA, clients must present a certificate
    it signed."""
    token = load_token(config.auth_token, config.auth_token_file)
    tls = read_tls(config.tls_cert, config.tls_key, config.tls_client_ca)
    return Secrets(token) if tls is None else Secrets(token, *tls)


def read_tls(cert: str, key: str, client_ca: str) -> tuple[bytes, bytes, bytes] | None:
    """The certificate chain, key and client CA (b"": none) the settings name, checked; None without TLS."""
    if not cert and not key:
        if client_ca:
            raise SecurityConfigError(
                f"{setting('tls_client_ca')} {client_ca} needs {setting('tls_cert')} and "
                f"{setting('tls_key')} too: client certificates are asked for in the TLS handshake"
            )
        return None
    if not (cert and key):
        given, missing = ("tls_cert", "tls_key") if cert else ("tls_key", "tls_cert")
        raise SecurityConfigError(
            f"TLS needs both --tls-cert and --tls-key: {setting(given)} {cert or key} is set, "
            f"{setting(missing)} is not"
        )
    # The certificate read first: with both missing, the one a user gives first is reported.
    chain = _read(cert, "tls_cert", "TLS certificate")
    private_key = _read(key, "tls_key", "TLS key")
    roots = _read(client_ca, "tls_client_ca", "client CA") if client_ca else b""
    _check_tls(cert, key, client_ca)
    return chain, private_key, roots


def _check_tls(cert: str, key: str, client_ca: str) -> None:
    """Refuse TLS files that do not parse, or a key that is not the certificate's, with the ssl module
    (uvicorn's own): gRPC would only fail once the model is warm, as 'Failed to bind to address'."""
    _check_certificate(cert, "tls_cert")
    try:
        # No password: an encrypted key is refused, not asked for on the terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise SecurityConfigError(
                f"{setting('tls_key')} {key} does not match {setting('tls_cert')} {cert} ({_reason(e)})"
            ) from None
        what = "no PEM private key could be read (an unencrypted one)"
        raise SecurityConfigError(f"{setting('tls_key')} {key}: {what} ({_reason(e)})") from None
    if client_ca:
        _check_certificate(client_ca, "tls_client_ca")


def _check_certificate(path: str, name: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise SecurityConfigError(
            f"{setting(name)} {path}: no PEM certificate could be read ({_reason(e)})"
        ) from None


def _reason(error: ssl.SSLError) -> str:
    """OpenSSL's reason (KEY_VALUES_MISMATCH), or its message without the C source's line number."""
    return error.reason or re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(error.args[-1]))


def load_token(token: str, token_file: str) -> str | None:
    """The bearer token, from the setting or its file; one no header can carry (every call would be
    UNAUTHENTICATED) is refused naming where it came from, never printing it."""
    if token and token_file:
        raise SecurityConfigError(
            f"give the auth token either directly or as a file, not both: {setting('auth_token')} and "
            f"{setting('auth_token_file')} {token_file} are both set"
        )
    where = f"{setting('auth_token_file')} {token_file}" if token_file else setting("auth_token")
    if token_file:
        try:
            token = _read(token_file, "auth_token_file", "auth token file").decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SecurityConfigError(f"{where}: not UTF-8 text") from None
        if not token:
            raise SecurityConfigError(f"{where}: the auth token file is empty")
    if token and not BEARER_TOKEN.fullmatch(token):
        raise SecurityConfigError(
            f"{where}: the token holds what no header can carry (a line break, a control character, "
            "a non-ASCII character, or spaces around it): printable ASCII only, on one line"
        )
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
    error = Unauthenticated("missing or invalid bearer token (send metadata `authorization: Bearer <token>`)")

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        request_id, _ = logs.request_id_from(logs.given_request_id(context.invocation_metadata()))
        trailing = ((logs.REQUEST_ID_HEADER, request_id), *details(error))  # as the service's refusals
        await context.abort(error.code, str(error), trailing)

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
