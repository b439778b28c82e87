"""Tracing: a front and the engine in this process (the real model), the gRPC instrumentation's
interceptor in front of the service, spans caught by OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.requests import Request

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server import logs
from minilm_embed.server.config import ServerConfig
from minilm_embed.server.engine import create_engine, onnx_backend
from minilm_embed.server.front import Front, create_front, start, start_tracing
from minilm_embed.server.http import HttpApi, ModelCard
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.place import SharedQueue
from minilm_embed.server.tracing import RequestTracer
from tests.server_process import model_dir, serving, wait_until

Scenario = Callable[[Front, InMemorySpanExporter], Awaitable[None]]


def traced(scenario: Scenario, tmp_path: Path) -> None:
    asyncio.run(_traced(scenario, tmp_path))


async def _traced(scenario: Scenario, tmp_path: Path) -> None:
    """`scenario` on a started front (traced into memory) over an engine serving the real model, both
    in this event loop."""
    config = ServerConfig(model_dir=model_dir(), threads=1, model_instances=1, max_batch_tokens=256)
    queue = SharedQueue.local()
    engine = create_engine(config, onnx_backend, Metrics(), queue)
    address, stop = f"ipc://{tmp_path}/engine.sock", asyncio.Event()
    engine_task = asyncio.create_task(engine.serve(address, stop, lambda facts: None))
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(SimpleSpanProcessor(exporter))
    front = create_front(config, 0, "127.0.0.1:0", address, queue, "127.0.0.1:0", tracer)
    await start(front)
    try:
        await scenario(front, exporter)
    finally:
        assert front.http is not None
        await front.http.stop()
        await front.server.stop(None)
        front.engine.close()
        stop.set()
        await engine_task


async def embed(
    front: Front, texts: list[str], request_id: str, *metadata: tuple[str, str]
) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        metadata += ((logs.REQUEST_ID_HEADER, request_id),)
        call = stub.Embed(pb.EmbedRequest(texts=texts), metadata=metadata)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call
        return await call.code()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def test_an_embed_call_is_a_server_span_with_tokenize_queue_wait_and_model_run_inside(tmp_path):
    traced(an_embed_call, tmp_path)


async def an_embed_call(front: Front, exporter: InMemorySpanExporter) -> None:
    texts = ["a first sentence to embed", "and a second, somewhat longer, sentence to embed"]
    assert await embed(front, texts, "traced-1") == grpc.StatusCode.OK
    spans = by_name(exporter.get_finished_spans())
    server = spans["/embedding.v1.EmbeddingService/Embed"]
    assert server.kind == SpanKind.SERVER and server.attributes["request.id"] == "traced-1"
    assert server.attributes["rpc.method"] == "Embed"
    children = [spans["tokenize"], spans["queue_wait"], spans["model_run"]]
    for child in children:
        assert child.parent is not None and child.parent.span_id == server.context.span_id
        assert child.context.trace_id == server.context.trace_id
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time, child.name
        assert child.attributes["request.id"] == "traced-1" and child.attributes["embed.inputs"] == 2
    tokenize, queue_wait, model_run = children
    assert tokenize.end_time <= queue_wait.start_time  # tokenized before SUBMIT was sent
    assert queue_wait.end_time == model_run.start_time
    assert model_run.attributes["embed.tokens"] == tokenize.attributes["embed.tokens"] > 2 * 5
    assert model_run.end_time - model_run.start_time > 10_000  # the real model: more than 10 us


TRACE_ID, PARENT_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


def test_a_refused_call_has_its_server_span_with_the_error_and_no_children(tmp_path):
    traced(a_refused_call, tmp_path)


async def a_refused_call(front: Front, exporter: InMemorySpanExporter) -> None:
    caller = ("traceparent", f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01")
    assert await embed(front, [], "refused-1", caller) == grpc.StatusCode.INVALID_ARGUMENT
    # Its span ends after the status is on the wire: grpc's abort sends it, then raises out through
    # the interceptor, and this caller, in the same event loop, may be resumed first.
    await wait_until(exporter.get_finished_spans)
    (server,) = exporter.get_finished_spans()
    assert server.context.trace_id == TRACE_ID and server.parent is not None
    assert server.parent.span_id == PARENT_ID  # the caller's trace goes on
    assert server.attributes["request.id"] == "refused-1"
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_an_http_embed_is_one_trace_under_a_server_span_continuing_the_callers(tmp_path):
    traced(an_http_embed, tmp_path)


def post_embeddings(port: int, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/embeddings",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


async def an_http_embed(front: Front, exporter: InMemorySpanExporter) -> None:
    assert front.http is not None
    caller = {"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01", logs.REQUEST_ID_HEADER: "http-1"}
    status = await asyncio.to_thread(post_embeddings, front.http.port, {"input": ["over HTTP"]}, caller)
    assert status == 200
    await wait_until(lambda: "POST /v1/embeddings" in by_name(exporter.get_finished_spans()))
    spans = by_name(exporter.get_finished_spans())
    server = spans["POST /v1/embeddings"]
    assert server.kind == SpanKind.SERVER and server.attributes["request.id"] == "http-1"
    assert server.attributes["http.response.status_code"] == 200
    assert server.context.trace_id == TRACE_ID and server.parent is not None
    assert server.parent.span_id == PARENT_ID
    for name in ("tokenize", "queue_wait", "model_run"):
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == server.context.span_id, name
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time, name


def test_a_refused_http_call_has_its_server_span_with_the_status_and_no_children(tmp_path):
    traced(a_refused_http_call, tmp_path)


async def a_refused_http_call(front: Front, exporter: InMemorySpanExporter) -> None:
    assert front.http is not None
    assert await asyncio.to_thread(post_embeddings, front.http.port, {"input": []}, {}) == 400
    await wait_until(exporter.get_finished_spans)
    (server,) = exporter.get_finished_spans()
    assert server.name == "POST /v1/embeddings" and server.parent is None
    assert server.attributes["http.response.status_code"] == 400


def test_an_http_call_the_server_fails_marks_its_server_span_an_error(tmp_path):
    traced(an_http_call_while_draining, tmp_path)


async def an_http_call_while_draining(front: Front, exporter: InMemorySpanExporter) -> None:
    assert front.http is not None
    await front.readiness.not_serving("draining")
    assert await asyncio.to_thread(post_embeddings, front.http.port, {"input": ["late"]}, {}) == 503
    await wait_until(exporter.get_finished_spans)
    (server,) = exporter.get_finished_spans()
    assert server.attributes["http.response.status_code"] == 503
    assert server.status.status_code == StatusCode.ERROR


def test_a_traced_http_call_is_named_by_its_route_without_scope_route():
    """Starlette 0.47-0.50 (which pyproject allows) set no scope["route"]: reading it, every traced
    HTTP call was a bare 500 from a KeyError. Each endpoint names its own route template now:
    served here with a scope as those Starlettes leave it."""
    exporter = InMemorySpanExporter()
    embedder = types.SimpleNamespace(tracer=RequestTracer(SimpleSpanProcessor(exporter)))
    card = ModelCard("sentence-transformers/all-MiniLM-L6-v2", 0, 384)
    api = HttpApi(embedder, Metrics(), card, None, 1 << 20)  # type: ignore[arg-type]

    def request(path: str, **scope: Any) -> Request:
        fields = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}
        return Request({**fields, **scope})

    async def calls() -> list[int]:
        listing = await api.models(request("/v1/models"))
        one = await api.model(
            request("/v1/models/all-MiniLM-L6-v2", path_params={"model": "all-MiniLM-L6-v2"})
        )
        return [listing.status_code, one.status_code]

    assert asyncio.run(calls()) == [200, 200]
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["GET /v1/models", "GET /v1/models/{model:path}"]
    assert [span.attributes["http.route"] for span in spans] == ["/v1/models", "/v1/models/{model:path}"]


def test_health_checks_are_not_traced(tmp_path):
    traced(a_health_check, tmp_path)


async def a_health_check(front: Front, exporter: InMemorySpanExporter) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert exporter.get_finished_spans() == ()


def test_otel_service_name_names_the_service(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "embeddings-eu")
    tracer = RequestTracer(SimpleSpanProcessor(InMemorySpanExporter()))
    assert tracer.provider.resource.attributes["service.name"] == "embeddings-eu"


def test_without_an_otlp_endpoint_there_is_no_tracer_and_opentelemetry_is_not_imported():
    assert start_tracing(ServerConfig()) is None
    code = "import server.front, sys; assert not [m for m in sys.modules if m.startswith('opentelemetry')]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_with_an_otlp_endpoint_spans_go_to_an_otlp_exporter(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    tracer = start_tracing(ServerConfig(otlp_endpoint="http://127.0.0.1:4317"))
    assert tracer is not None
    try:
        assert tracer.provider.resource.attributes["service.name"] == "embedding-server"
        processor = tracer.provider._active_span_processor._span_processors[0]
        assert type(processor._batch_processor._exporter).__name__ == "OTLPSpanExporter"
    finally:
        tracer.shutdown()


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A stand-in OTLP/gRPC collector: keeps every span it is sent, by name."""

    def __init__(self) -> None:
        self.spans: dict[str, Any] = {}

    def Export(self, request: Any, context: Any) -> Any:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.update({span.name: span for span in scope.spans})
        return trace_service_pb2.ExportTraceServiceResponse()


def embed_once(address: str, request_id: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        metadata = [(logs.REQUEST_ID_HEADER, request_id)]
        stub.Embed(pb.EmbedRequest(texts=["sent to a collector"]), metadata=metadata, timeout=30)


def test_a_server_with_an_otlp_endpoint_exports_each_calls_spans_to_the_collector():
    collector = Collector()
    receiver = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    try:
        with serving("--otlp-endpoint", f"http://127.0.0.1:{port}") as server:
            embed_once(server.address, "exported-1")
        # Stopped (SIGTERM): each front exports what it buffered before it exits.
        assert {"/embedding.v1.EmbeddingService/Embed", "tokenize", "queue_wait", "model_run"} <= set(
            collector.spans
        )
        server_span = collector.spans["/embedding.v1.EmbeddingService/Embed"]
        attributes = {a.key: a.value.string_value for a in server_span.attributes}
        assert attributes["request.id"] == "exported-1"
        assert collector.spans["model_run"].parent_span_id == server_span.span_id
    finally:
        receiver.stop(None)


def test_a_collector_that_never_answers_holds_a_stopping_server_at_most_the_flush_time():
    """A collector that takes the connection and never answers held each stopping front for the
    exporter's 10 s, past the supervisor's margin (killed, exit 1, past the pod's grace: an operator's
    pass). Now the last export is given FLUSH_S (2 s), then its spans are dropped, said in the log."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the kernel's backlog), never answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with serving("--otlp-endpoint", endpoint, "--drain-timeout-s", "1") as server:
            embed_once(server.address, "never-exported")
            stopped = time.monotonic()
            server.terminate()
            code = server.wait(30)
            took = time.monotonic() - stopped
    assert code == 0
    # The notice (1 s) + the drain with nothing open + FLUSH_S, with room: the exporter's 10 s is not.
    assert took < 8, took
    assert any("the collector had not taken the last spans after 2 s" in line for line in server.lines)
