"""The client's exceptions: one class for each way a call fails that a caller handles differently.

    EmbeddingError            every failed call (INTERNAL, CANCELLED and the rest are this base class)
    +-- Unavailable           no replica took the call, after the channel's retries: try again later
    +-- InvalidInput          the request broke a rule or a limit, named in the message: fix the request
    +-- Overloaded            the server refused at once (queue full, a front's budget): back off
    +-- TooLarge              a message over gRPC's size limit (either way): send fewer or shorter texts
    +-- Unauthenticated       missing or wrong bearer token
    +-- DeadlineExceeded      the call's timeout passed (queued too long, or spent retrying a server
                              that could not be reached); the server drops inputs past it before compute

The gRPC status is mapped in one place, `from_rpc_error`. Each class is still a `grpc.RpcError`
with `code()` and `details()`, so code written against raw gRPC errors keeps working.
"""

from __future__ import annotations

import grpc


class EmbeddingError(grpc.aio.AioRpcError):
    """A call that did not return a result: `code()` is the gRPC status, `details()` the server's message.

    It subclasses grpc.aio.AioRpcError, the one concrete gRPC error class that carries a status, so
    that `except grpc.RpcError` and `except grpc.aio.AioRpcError` both still catch it.
    """


class Unavailable(EmbeddingError):
    """UNAVAILABLE: no server answered (down, warming up, draining) within the retries the channel makes."""


class InvalidInput(EmbeddingError):
    """INVALID_ARGUMENT: the message names the input, the limit and the value; retrying cannot help."""


class Overloaded(EmbeddingError):
    """RESOURCE_EXHAUSTED: the server's queue is full, or a front's budget (retry after a backoff, or
    send less at once)."""


class TooLarge(EmbeddingError):
    """RESOURCE_EXHAUSTED from gRPC itself: a request or response over a max message size (the
    server's max_message_bytes, 2 MiB by default; `details()` gives both sizes). It fails again
    whenever retried: send fewer or shorter texts a call. Not an Overloaded, so that a loop retrying
    those does not retry this for ever."""


class Unauthenticated(EmbeddingError):
    """UNAUTHENTICATED: the server requires a bearer token (`Security(token=...)`) and got none or another."""


class DeadlineExceeded(EmbeddingError):
    """DEADLINE_EXCEEDED: the call's timeout passed before its result was ready: it queued too long,
    or the channel spent it retrying a server it could not reach (a short timeout against a server that
    is down ends here, not in Unavailable)."""


_BY_STATUS: dict[grpc.StatusCode, type[EmbeddingError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


# gRPC's own words: for a message over a size limit (either side's), and for a channel whose every
# server says NOT_SERVING to the health checks the channel makes (service_config's healthCheckConfig).
_TOO_LARGE = "larger than max"
_UNHEALTHY = "backend unhealthy"
UNHEALTHY_NOTE = (
    " (the server answers gRPC health checks NOT_SERVING: warming up, draining, or its engine "
    "stopped; the call was not sent)"
)


def from_rpc_error(error: grpc.RpcError) -> EmbeddingError:
    """The client exception for a failed gRPC call (sync or asyncio), keeping its status and metadata."""
    code, details = error.code(), error.details() or ""
    kind = _BY_STATUS.get(code, EmbeddingError)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in details:
        kind = TooLarge
    if code == grpc.StatusCode.UNAVAILABLE and _UNHEALTHY in details:
        details += UNHEALTHY_NOTE
    return kind(
        code,
        grpc.aio.Metadata(*(error.initial_metadata() or ())),
        grpc.aio.Metadata(*(error.trailing_metadata() or ())),
        details,
        error.debug_error_string(),
    )
