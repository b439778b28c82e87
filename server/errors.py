"""The service's errors. Each carries the gRPC status it maps to; service.py maps them in one place.

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

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.UNKNOWN


class InvalidInput(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class TooLarge(InvalidInput):
    """An HTTP request body over the size limit: the client's error, like any invalid input, but HTTP
    has a status of its own for it (413). gRPC refuses an oversize message itself."""


class SlowBody(InvalidInput):
    """An HTTP request body still arriving after http_body_timeout_s: its bytes were held against the
    front's budgets, so a stalled upload is ended (HTTP 408)."""


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Overloaded(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotReady(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Dropped(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ClientGone(ServiceError):
    code = grpc.StatusCode.CANCELLED


class BackendFailure(ServiceError):
    code = grpc.StatusCode.INTERNAL
