"""OpenTelemetry traces of embedding calls: off unless --otlp-endpoint names a collector.

Imported only when tracing is on (front.py), so a server without it pays neither the import nor more
than a None check per request. When on, the gRPC instrumentation's aio server interceptor makes a
server span per call (health checks and reflection excepted), `http_call` one per counted HTTP call
(POST /v1/embeddings, GET /v1/models), and each Embed gets three children:

    Embed or POST /v1/embeddings (server span: rpc.* or http.* attributes, and request.id)
    ├── tokenize     in this front, timed as it ran
    ├── queue_wait   in the engine: the longest any of its inputs waited for a batch
    └── model_run    in the engine: the time during which at least one of its batches ran

The engine is another process with its own event loop; rather than carry trace context there and
export from it too, the two engine spans are placed from the timings its RESULT reports (queue us,
inference us), laid end to end from when the front sent SUBMIT and cut at when RESULT came back. They
are the engine's durations, shifted by the one-way ZeroMQ transit (tens of microseconds), and cost the
engine nothing; for a request split over several batches, which overlap waiting and running in the
engine, end to end is an approximation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from minilm_embed.server.embedder import Embedded, EmbedJob

SERVICE_NAME = "embedding-server"  # unless OTEL_SERVICE_NAME (read by the SDK) names the service
# A stopping front's last export, after its drain: well inside the supervisor's STOP_MARGIN_S (10 s)
# and the pod's grace beyond the drain (docs/deploy.md).
FLUSH_S = 2.0

log = logging.getLogger(__name__)


class RequestTracer:
    """Spans for one front process: the interceptor that opens each call's server span, and the
    child spans of an Embed."""

    def __init__(self, processor: SpanProcessor) -> None:
        # Shut down by the front, bounded (shutdown): the SDK's own at exit would wait on a collector
        # that never answers without bound (an SDK >= 1.30 that pyproject allows has no guard).
        self.provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(__name__)

    def interceptor(self) -> object:
        untraced = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
        return aio_server_interceptor(tracer_provider=self.provider, filter_=filters.negate(untraced))

    @contextmanager
    def http_call(
        self, verb: str, route: str, headers: Mapping[str, str], request_id: str
    ) -> Iterator[Callable[[int], None]]:
        """The server span of an HTTP call, continuing the caller's `traceparent`: current while the
        call is served, so an Embed's children nest under it as under a gRPC call's. Yields what
        records the response's status (5xx marks the span an error, as for a server span it should)."""
        attributes = {"http.request.method": verb, "http.route": route, "request.id": request_id}
        context = propagate.extract(headers)
        name = f"{verb} {route}"
        with self.tracer.start_as_current_span(name, context, SpanKind.SERVER, attributes) as span:

            def answered(status: int) -> None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))

            yield answered

    def tag(self, request_id: str) -> None:
        """Name the request id on the current call's server span."""
        trace.get_current_span().set_attribute("request.id", request_id)

    def record(self, job: EmbedJob, embedded: Embedded) -> None:
        """The tokenize, queue_wait and model_run spans of a finished Embed, under the server span."""
        to_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter() seconds -> epoch ns
        answer, prepared = embedded.answer, embedded.prepared

        def at(seconds: float) -> int:
            return to_ns + int(seconds * 1e9)

        sent, received = at(answer.sent), at(answer.received)
        queued = min(sent + answer.queue_us * 1000, received)
        ran = min(queued + answer.inference_us * 1000, received)
        inputs, tokens = len(prepared.lengths), int(prepared.lengths.sum())
        shared: dict[str, str | int] = {"request.id": job.request_id, "embed.inputs": inputs}
        counted = {**shared, "embed.tokens": tokens}
        self._span("tokenize", at(embedded.tokenizing), at(embedded.tokenized), counted)
        self._span("queue_wait", sent, queued, shared)
        self._span("model_run", queued, ran, counted)

    def _span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, str | int]) -> None:
        span = self.tracer.start_span(name, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    def shutdown(self, timeout_s: float = FLUSH_S) -> bool:
        """Export what is still buffered, for at most `timeout_s`; False if that was not enough (the
        spans left are dropped). A collector that took the connection and never answered held a
        stopping front for the exporter's own 10 s, past the supervisor's margin: it was killed, and
        the server exited 1 (an operator's pass)."""
        flush = threading.Thread(target=self.provider.shutdown, name="trace flush", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            log.warning(
                "traces: the collector had not taken the last spans after %g s: they are dropped", timeout_s
            )
        return not flush.is_alive()


def _resource() -> Resource:
    """What the SDK finds (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), named SERVICE_NAME if unnamed."""
    found = Resource.create()
    if str(found.attributes.get("service.name", "")).startswith("unknown_service"):
        return found.merge(Resource({"service.name": SERVICE_NAME}))
    return found


def otlp_tracer(endpoint: str) -> RequestTracer:
    """Spans exported in batches to the OTLP/gRPC collector at `endpoint` (http:// is plaintext).

    The exporter still reads the standard OTEL_EXPORTER_OTLP_* variables for what the flag does not
    set (headers, certificate, timeout), as OpenTelemetry defines them.
    """
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return RequestTracer(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
