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
with `code()` and `details()`, so code written against raw gRPC errors keeps working. What the
server's google.rpc error details say is read there too: `reason` (a stable UPPER_SNAKE_CASE name
to branch on: TOO_MANY_INPUTS, TEXT_TOO_LONG, QUEUE_FULL, ...), `error_metadata` (the limit's
setting, the limit, the value, the input), `field` (the request field at fault) and `retry_after`
(seconds the server asks a refused caller to wait).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class EmbeddingError(grpc.aio.AioRpcError):
    """A call that did not return a result: `code()` is the gRPC status, `details()` the server's message.

    It subclasses grpc.aio.AioRpcError, the one concrete gRPC error class that carries a status, so
    that `except grpc.RpcError` and `except grpc.aio.AioRpcError` both still catch it.
    """

    reason: str = ""  # google.rpc.ErrorInfo's reason; empty when the server sent none (gRPC's own errors)
    error_metadata: dict[str, str]  # ErrorInfo's metadata, e.g. {"setting": ..., "limit": ..., "value": ...}
    field: str = ""  # google.rpc.BadRequest's field at fault, e.g. "texts[3]"
    retry_after: float | None = None  # google.rpc.RetryInfo's delay, in seconds

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.error_metadata = {}


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
    mapped = kind(
        code,
        grpc.aio.Metadata(*(error.initial_metadata() or ())),
        grpc.aio.Metadata(*(error.trailing_metadata() or ())),
        details,
        error.debug_error_string(),
    )
    _read_details(mapped, error)
    return mapped


def _read_details(mapped: EmbeddingError, error: grpc.RpcError) -> None:
    """The google.rpc error details of `error`'s trailer, where the server sent them."""
    try:
        status = rpc_status.from_call(error)
    except (ValueError, DecodeError):  # not the call's own details (a proxy's, or garbled): ignored
        return
    if status is None:
        return
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            mapped.reason, mapped.error_metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            mapped.field = bad.field_violations[0].field if bad.field_violations else ""
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            mapped.retry_after = retry.retry_delay.ToTimedelta().total_seconds()
