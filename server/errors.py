"""The service's errors. Each carries the gRPC status it maps to; service.py maps them in one place.

Each also carries a `reason` (UPPER_SNAKE_CASE, stable: what a program branches on, where the message
is for people), `metadata` (the limit's setting, the limit, the value, the input: strings) and, for
an invalid request, the `field` at fault. gRPC sends them as google.rpc error details (service.py),
HTTP as OpenAI's `code` and `param` (http.py).

ServiceError
 +-- InvalidInput       INVALID_ARGUMENT    the request breaks a limit; message names it and the value
 |    +-- TooLarge       INVALID_ARGUMENT    an HTTP body over max_message_bytes (HTTP 413)
 |    +-- SlowBody       INVALID_ARGUMENT    an HTTP body that did not arrive in time (HTTP 408)
 +-- Unauthenticated    UNAUTHENTICATED     a missing or wrong bearer token
 +-- Overloaded         RESOURCE_EXHAUSTED  the queue is full; retry later
 +-- NotReady           UNAVAILABLE         warming up or draining; retry (on another replica)
 +-- Dropped            DEADLINE_EXCEEDED   the deadline passed while the input waited in the queue
 +-- ClientGone         CANCELLED           the HTTP client disconnected before its answer (gRPC
 |                                          cancels the handler itself)
 +-- BackendFailure     INTERNAL            the model run of its batch failed
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

T = TypeVar("T")

# google.rpc.ErrorInfo's domain: the service whose reasons these are.
ERROR_DOMAIN = "minilm-embed"
# How long a refused caller is asked to wait before trying again (HTTP's Retry-After, gRPC's
# RetryInfo) where the server has no better figure: a full queue's refusal says when it will have
# room for the request (batcher.retry_after).
RETRY_AFTER_S = 1.0


class ServiceError(Exception):
    code = grpc.StatusCode.UNKNOWN
    reason = "UNKNOWN"  # each class's default; a raise names a more precise one where it has one

    def __init__(
        self,
        message: str,
        reason: str = "",
        field: str = "",
        *,
        retry_after_s: float | None = None,
        **metadata: object,
    ) -> None:
        """`field`: the request field at fault, as a path into the gRPC request (`texts[3]`);
        `retry_after_s`: when a retry may succeed, where the server can tell (else RETRY_AFTER_S);
        `metadata`: lowerCamelCase keys (google.rpc.ErrorInfo's convention), values made strings."""
        super().__init__(message)
        if reason:
            self.reason = reason
        self.field = field
        self.retry_after_s = RETRY_AFTER_S if retry_after_s is None else retry_after_s
        self.metadata = {key: str(value) for key, value in metadata.items()}


def retry_after_ms(seconds: float) -> int:
    """A retry delay in whole milliseconds (at least 1): RetryInfo's, and the retry-after-ms header
    OpenAI's client reads."""
    return max(1, math.ceil(seconds * 1000))


class InvalidInput(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_REQUEST"


class TooLarge(InvalidInput):
    """An HTTP request body over the size limit: the client's error, like any invalid input, but HTTP
    has a status of its own for it (413). gRPC refuses an oversize message itself."""

    reason = "BODY_TOO_LARGE"


class SlowBody(InvalidInput):
    """An HTTP request body still arriving after http_body_timeout_s: its bytes were held against the
    front's budgets, so a stalled upload is ended (HTTP 408)."""

    reason = "BODY_TIMEOUT"


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class Overloaded(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "OVERLOADED"


class NotReady(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "NOT_SERVING"


def cut_at_drain(timeout_s: float) -> str:
    """What a call still open when the drain timeout passes is told (UNAVAILABLE, HTTP 503)."""
    return f"the server shut down before this call finished (its drain timeout, {timeout_s:g} s, passed)"


class MessageLate(ServiceError):
    """A unary gRPC call's message still arriving after message_timeout_s (it held a call's place)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "MESSAGE_TIMEOUT"


class Dropped(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_PASSED_IN_QUEUE"


class ClientGone(ServiceError):
    code = grpc.StatusCode.CANCELLED
    reason = "CLIENT_GONE"


class BackendFailure(ServiceError):
    code = grpc.StatusCode.INTERNAL
    reason = "MODEL_RUN_FAILED"


INTERNAL_MESSAGE = "internal error; see the server log"


def internal() -> ServiceError:
    """What a caller is told of a bug (the details are in the server's log): INTERNAL, reason
    INTERNAL_ERROR. The fronts, gRPC's and HTTP's, and the engine all answer it so."""
    return BackendFailure(INTERNAL_MESSAGE, "INTERNAL_ERROR")


async def one_request(requests: AsyncIterator[T], timeout_s: float, method: str, since: str) -> T:
    """A unary call's one message, read from the call's request stream within `timeout_s` of `since`
    (MessageLate after; InvalidInput NO_REQUEST for a call that ended without it): a call that never
    sends it must not hold its place for good."""
    try:
        request = await asyncio.wait_for(anext(aiter(requests), None), timeout_s)
    except TimeoutError:
        raise MessageLate(
            f"the {method} call's request had not all arrived {timeout_s:g} s after {since}, the limit "
            f"message_timeout_s={timeout_s:g}",
            setting="message_timeout_s",
            limit=timeout_s,
        ) from None
    if request is None:
        raise InvalidInput(f"the {method} call ended without its request", "NO_REQUEST")
    return request
