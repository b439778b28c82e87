"""A ServiceError as google.rpc error details: what a gRPC caller's program reads besides the status.

Google's APIs send them this way (AIP-193) and gRPC's libraries read them: an ErrorInfo (the error's
reason, `minilm-embed` as its domain, its metadata) always, a BadRequest naming the field at fault for
an invalid request, a RetryInfo where retrying later helps. The fronts only: the engine carries
reasons as strings (server/protocol.py) and imports no protobuf.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from minilm_embed.server.errors import ERROR_DOMAIN, ServiceError, retry_after_ms

Trailing = tuple[tuple[str, str | bytes], ...]

RETRYABLE = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def details(error: ServiceError) -> Trailing:
    """The error as google.rpc error details, in the trailer gRPC's libraries read them from
    (grpcio-status's `rpc_status.from_call`, Go's `status.FromError(err).Details()`, Java's
    `StatusProto.fromThrowable`). The Status's code and message are the call's own."""
    status = status_pb2.Status(code=error.code.value[0], message=str(error))
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    status.details.add().Pack(info)
    if error.field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=str(error), reason=error.reason
        )
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    if error.code in RETRYABLE:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(retry_after_ms(error.retry_after_s))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return tuple(rpc_status.to_status(status).trailing_metadata)
