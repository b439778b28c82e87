"""The client's exceptions: one class for each way a call fails that a caller handles differently.

    EmbeddingError            every failed call (INTERNAL, CANCELLED and the rest are this base class)
    +-- Unavailable           no replica took the call, after the channel's retries: try again later
    +-- InvalidInput          the request broke a rule or a limit, named in the message: fix the request
    +-- Overloaded            the server refused at once (queue full, message too large): back off
    +-- Unauthenticated       missing or wrong bearer token
    +-- DeadlineExceeded      the call's timeout passed; the server dropped the input before compute

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
    """RESOURCE_EXHAUSTED: the server's queue is full (retry after a backoff, or send less at once), or a
    message is over the size limit (the message says which)."""


class Unauthenticated(EmbeddingError):
    """UNAUTHENTICATED: the server requires a bearer token (`Security(token=...)`) and got none or another."""


class DeadlineExceeded(EmbeddingError):
    """DEADLINE_EXCEEDED: the call's timeout passed before its result was ready."""


_BY_STATUS: dict[grpc.StatusCode, type[EmbeddingError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_rpc_error(error: grpc.RpcError) -> EmbeddingError:
    """The client exception for a failed gRPC call (sync or asyncio), keeping its status and metadata."""
    code = error.code()
    return _BY_STATUS.get(code, EmbeddingError)(
        code,
        grpc.aio.Metadata(*(error.initial_metadata() or ())),
        grpc.aio.Metadata(*(error.trailing_metadata() or ())),
        error.details(),
        error.debug_error_string(),
    )
