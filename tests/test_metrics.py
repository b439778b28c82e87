"""Metrics: names, types and bounded labels on a fresh registry; the batcher and the front's budgets move
the counters an operator reads (padding, refusals by reason, drops); a live scrape of a real server has
every family and passes `promtool check metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import NoReturn

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from starlette.routing import Route
from starlette.testclient import TestClient

from minilm_embed.client.client import EmbeddingClient, embed_request
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server.batcher import Batcher, BatchLimits, Done, Rows
from minilm_embed.server.budget import held_bytes_budget, request_bytes_budget, tokenizing_budget
from minilm_embed.server.config import AUTO_BATCH_LIMITS
from minilm_embed.server.embedder import Embedder
from minilm_embed.server.errors import Dropped, NotReady, Overloaded
from minilm_embed.server.http import HttpApi, ModelCard
from minilm_embed.server.metrics import (
    BATCH_SIZE_BUCKETS,
    BATCH_TOKEN_BUCKETS,
    DROP_REASONS,
    REFUSAL_REASONS,
    Metrics,
    SupervisorMetrics,
    serve_metrics,
)
from tests.conftest import REPO_ROOT
from tests.server_process import ServerProcess, serving


async def submit(batcher: Batcher, rows: list[list[int]], deadline: float | None = None) -> Done:
    """One request of these token-id rows."""
    return await batcher.submit(Rows.of(rows), deadline)


Served = tuple[ServerProcess, pb.InfoResponse, str]
DOCS = REPO_ROOT / "docs" / "metrics.md"
RECORDING_RULES = REPO_ROOT / "deploy" / "prometheus" / "recording.rules.yml"
INFO_LABELS = {"model_id", "sha256", "precision", "provider"}
# Family name as the client library reports it (counters without `_total`) -> (type, label names).
FAMILIES: dict[str, tuple[str, set[str]]] = {
    "embed_requests": ("counter", {"method", "code"}),
    "embed_inputs": ("counter", set()),
    "embed_tokens": ("counter", set()),
    "embed_batch_tokens": ("counter", set()),
    "embed_request_duration_seconds": ("histogram", {"method", "size"}),
    "embed_queue_wait_seconds": ("histogram", set()),
    "embed_tokenization_duration_seconds": ("histogram", set()),
    "embed_model_run_duration_seconds": ("histogram", set()),
    "embed_batch_size": ("histogram", set()),
    "embed_batch_padded_tokens": ("histogram", set()),
    "embed_queue_depth": ("gauge", set()),
    "embed_queue_interactive_depth": ("gauge", set()),
    "embed_requests_in_flight": ("gauge", set()),
    "embed_requests_refused": ("counter", {"reason"}),
    "embed_inputs_dropped": ("counter", {"reason"}),
    "embed_inputs_truncated": ("counter", set()),
    "embed_batch_failures": ("counter", set()),
    "embed_batches_given_back": ("counter", set()),
    "embed_model_info": ("gauge", INFO_LABELS),
    "embed_model_load_seconds": ("gauge", set()),
    "embed_model_warmup_seconds": ("gauge", set()),
    "embed_ready": ("gauge", set()),
    "embed_front_restarts": ("counter", set()),  # the supervisor's own (SupervisorMetrics)
}
DEFAULT_COLLECTOR_SAMPLES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "python_info",
    "python_gc_collections_total",
)


class _WarmingUp:
    """An embedder whose engine is still warming up: a call to embed ends at once (503)."""

    tracer = None

    def receiving(self, size: int) -> NoReturn:
        raise NotReady("warming up")


def http_methods() -> set[str]:
    """The `method` labels the HTTP API really counts its calls under: one call to each of its
    routes but /health (not counted)."""
    metrics = Metrics(CollectorRegistry())
    app = HttpApi(_WarmingUp(), metrics, ModelCard("m", 0, 384), None, 1 << 20).app()  # type: ignore[arg-type]
    with TestClient(app) as client:
        for route in app.routes:
            assert isinstance(route, Route) and route.methods
            [method] = route.methods - {"HEAD"}
            if route.path != "/health":
                client.request(method, re.sub(r"{[^}]*}", "m", route.path))  # "{model:path}": "m"
    [requests] = [f for f in metrics.registry.collect() if f.name == "embed_requests"]
    return {s.labels["method"] for s in requests.samples if s.name.endswith("_total") and s.value}


# Every label's values come from a closed set: a label taking a request's data would be unbounded.
METHODS = {m.name for m in pb.DESCRIPTOR.services_by_name["EmbeddingService"].methods} | http_methods()
BOUNDED = {
    "method": METHODS,
    "code": {c.name for c in grpc.StatusCode},
    "reason": set(DROP_REASONS) | set(REFUSAL_REASONS),
    "size": {"0", "1", "2-8", "9-64", "65+"},
}


def server_error_codes() -> set[str]:
    """The codes the error-ratio recording rule (and EmbedHighErrorRatio on it) counts as failures."""
    groups = yaml.safe_load(RECORDING_RULES.read_text())["groups"]
    rule = "job:embed_request_errors:ratio_rate5m"
    [expr] = [r["expr"] for g in groups for r in g["rules"] if r.get("record") == rule]
    [codes] = set(re.findall(r'code=~"([A-Z_|]+)"', expr))
    return set(codes.split("|"))


# The codes dashboards and alerts query by name: a series each must exist from start-up, at 0.
QUERIED_CODES = {"OK"} | server_error_codes()


def requests_missing_at_zero(value_of: Callable[[str, str], float | None]) -> list[tuple[str, str]]:
    """(method, code) pairs queried by name whose embed_requests_total is not exported at 0."""
    return [(m, c) for m in sorted(METHODS) for c in sorted(QUERIED_CODES) if value_of(m, c) != 0]


def exposed_name(name: str, kind: str) -> str:
    """The name a scrape shows for a family: counters end in _total, info metrics in _info."""
    return {"counter": f"{name}_total", "info": f"{name}_info"}.get(kind, name)


def exercised_metrics() -> Metrics:
    """Fresh metrics with one child of each labelled family, so every family has samples; and the
    supervisor's, as /metrics serves them together."""
    m = Metrics(CollectorRegistry())
    m.registry.register(SupervisorMetrics())
    m.requests.labels("Embed", "OK").inc()
    m.request_duration.labels("Embed", "1").observe(0.01)
    m.model.labels("m", "0" * 64, "fp32", "CPUExecutionProvider").set(1)
    return m


def test_every_family_has_its_name_type_and_labels_and_nothing_else_is_exported() -> None:
    families = {f.name: f for f in exercised_metrics().registry.collect() if f.name.startswith("embed_")}
    assert set(families) == set(FAMILIES)
    for name, (kind, labels) in FAMILIES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.documentation, f"{name} has no help text"
        sample_labels = {k for s in family.samples for k in s.labels} - {"le"}
        assert sample_labels == labels, name


def test_names_follow_prometheus_practice() -> None:
    """One prefix, snake case, base units: a family that measures time ends in _seconds."""
    timed = ("duration", "wait", "load", "warmup", "latency", "time")
    for name in FAMILIES:
        assert re.fullmatch(r"embed_[a-z0-9_]+", name), name
        assert not any(unit in name for unit in ("_ms", "millis", "micro")), f"{name}: use base units"
        if any(word in name for word in timed):
            assert name.endswith("_seconds"), f"{name}: a duration is in seconds"
    for family in exercised_metrics().registry.collect():
        for s in family.samples:
            assert s.name.startswith(("embed_", "process_", "python_")), s.name
            if family.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name


def test_latency_buckets_span_sub_millisecond_to_seconds() -> None:
    m = exercised_metrics()
    for name in (
        "embed_request_duration_seconds",
        "embed_queue_wait_seconds",
        "embed_model_run_duration_seconds",
    ):
        [family] = [f for f in m.registry.collect() if f.name == name]
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        finite = [b for b in bounds if b != math.inf]
        assert min(finite) < 0.001 and max(finite) >= 5.0, (name, finite)


def test_registries_are_independent() -> None:
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.refusals.labels("queue").inc(3)
    assert a.registry.get_sample_value("embed_requests_refused_total", {"reason": "queue"}) == 3
    assert b.registry.get_sample_value("embed_requests_refused_total", {"reason": "queue"}) == 0


def test_dropped_and_refused_reasons_are_exported_at_zero_before_any_drop_or_refusal() -> None:
    m = Metrics(CollectorRegistry())
    for reason in DROP_REASONS:
        assert m.registry.get_sample_value("embed_inputs_dropped_total", {"reason": reason}) == 0
    for reason in REFUSAL_REASONS:
        assert m.registry.get_sample_value("embed_requests_refused_total", {"reason": reason}) == 0


def test_requests_are_exported_at_zero_for_every_method_with_each_queried_code() -> None:
    """rate() over a series that does not exist yet is no data, not 0, and a series born at 1 hides its
    first call from rate(): each method's OK and server-side error codes exist from the start."""
    m = Metrics(CollectorRegistry())
    labels = {"method": "", "code": ""}

    def value_of(method: str, code: str) -> float | None:
        labels.update(method=method, code=code)
        return m.registry.get_sample_value("embed_requests_total", labels)

    assert requests_missing_at_zero(value_of) == []


def test_the_supervisor_counts_front_restarts_from_zero() -> None:
    registry = CollectorRegistry()
    supervisor = SupervisorMetrics()
    registry.register(supervisor)
    assert registry.get_sample_value("embed_front_restarts_total") == 0
    supervisor.front_restarts += 2
    assert registry.get_sample_value("embed_front_restarts_total") == 2


class _Checked:
    """The tokenizer's checks, passing: only the budgets are under test."""

    def check_texts(self, texts: list[str]) -> None:
        pass


def budget_embedder(metrics: Metrics) -> Embedder:
    """An Embedder with small budgets (100 characters being tokenized, 100 bytes of requests being
    handled, 150 not yet answered); the tokenizer and engine are never reached by the refusals tested."""
    budgets = tokenizing_budget(100), request_bytes_budget(100), held_bytes_budget(150)
    return Embedder(_Checked(), None, metrics, None, *budgets)  # type: ignore[arg-type]


def test_a_fronts_budgets_count_their_refusals_by_reason_not_as_a_full_queue() -> None:
    m = Metrics(CollectorRegistry())
    embedder = budget_embedder(m)
    with embedder.receiving(60), pytest.raises(Overloaded, match="max_request_bytes_in_flight"):
        embedder.receiving(60)
    embedder.budget.reserve(60)  # another request's texts being tokenized
    with pytest.raises(Overloaded, match="max_tokenizing_chars"):
        asyncio.run(embedder.tokenize(["x" * 60], truncate=True))
    assert value(m, "embed_requests_refused_total", reason="request_bytes") == 1
    assert value(m, "embed_requests_refused_total", reason="tokenizing") == 1
    assert value(m, "embed_requests_refused_total", reason="queue") == 0


def test_requests_waiting_for_their_answers_hold_their_bytes_until_answered() -> None:
    """The queue limit counts inputs; a front's memory is what its unanswered requests hold (their
    bytes, parsed messages, strings), so that is bounded too, and freed by the answer."""
    m = Metrics(CollectorRegistry())
    embedder = budget_embedder(m)
    first, second = embedder.receiving(60), embedder.receiving(40)
    first.release(), second.release()  # tokenized: waiting for the engine
    assert embedder.request_bytes.in_use == 0 and embedder.held_bytes.in_use == 100
    with pytest.raises(Overloaded, match="max_request_bytes_held"):
        embedder.receiving(60)  # room to parse it, none to keep it
    first.close()  # answered
    with embedder.receiving(60):
        assert embedder.held_bytes.in_use == 100
    second.close()
    assert embedder.held_bytes.in_use == 0 and embedder.request_bytes.in_use == 0
    assert value(m, "embed_requests_refused_total", reason="request_bytes_held") == 1
    assert value(m, "embed_requests_refused_total", reason="request_bytes") == 0


def test_docs_describe_every_exported_metric() -> None:
    text = DOCS.read_text()
    missing = [exposed_name(n, k) for n, (k, _) in FAMILIES.items() if exposed_name(n, k) not in text]
    assert not missing, f"{DOCS} does not describe {missing}"


# The batcher with a fake model: the counters move as a real batch flows through.


class FakeRun:
    """Stands in for the backend: counts runs; optionally blocks until released."""

    def __init__(self, blocked: bool = False) -> None:
        self.runs = 0
        self.gate = threading.Event()
        if not blocked:
            self.gate.set()

    def __call__(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.runs += 1
        assert self.gate.wait(10), "the test never released the fake model"
        vectors = np.ones((len(lengths), 4), dtype=np.float32) / 2  # (B, D) unit length
        return vectors, vectors


def run_with_batcher(
    run: FakeRun, scenario: Callable[[Batcher], Awaitable[None]], queue_limit: int = 64
) -> Metrics:
    """Run `scenario(batcher)` on an event loop with a started batcher; returns its metrics."""
    metrics = Metrics(CollectorRegistry())

    async def main() -> None:
        batcher = Batcher(run, BatchLimits(1024, 32, 0.001, queue_limit), metrics)
        batcher.start()
        try:
            await scenario(batcher)
        finally:
            await batcher.stop()

    asyncio.run(main())
    return metrics


def value(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    assert v is not None, f"no sample {name}{labels}"
    return v


def test_one_batch_moves_the_real_and_padded_token_counters() -> None:
    rows = [[5] * 2, [5] * 4, [5] * 8]  # padded to 3 x 8 = 24 tokens, 14 of them real

    async def scenario(batcher: Batcher) -> None:
        assert len(await submit(batcher, rows)) == 3

    m = run_with_batcher(FakeRun(), scenario)
    assert value(m, "embed_tokens_total") == 14
    assert value(m, "embed_batch_tokens_total") == 24
    assert value(m, "embed_inputs_total") == 3
    assert value(m, "embed_batch_size_count") == 1 and value(m, "embed_batch_size_sum") == 3
    assert value(m, "embed_batch_padded_tokens_sum") == 24
    assert value(m, "embed_queue_wait_seconds_count") == 1  # one request
    assert value(m, "embed_model_run_duration_seconds_count") == 1
    assert value(m, "embed_queue_depth") == value(m, "embed_queue_interactive_depth") == 0
    padding = 1 - value(m, "embed_tokens_total") / value(m, "embed_batch_tokens_total")
    assert padding == pytest.approx(10 / 24)


def test_a_full_queue_is_refused_and_counted_without_compute() -> None:
    run = FakeRun(blocked=True)

    async def scenario(batcher: Batcher) -> None:
        first = asyncio.create_task(submit(batcher, [[1]]))  # taken into a batch; the model blocks
        await _wait_until(lambda: run.runs == 1)
        waiting = asyncio.create_task(submit(batcher, [[2], [3]]))  # fills the queue (limit 2)
        await _wait_until(lambda: batcher.depth == 2)
        with pytest.raises(Overloaded):
            await submit(batcher, [[4]])
        run.gate.set()
        await asyncio.gather(first, waiting)

    m = run_with_batcher(run, scenario, queue_limit=2)
    assert value(m, "embed_requests_refused_total", reason="queue") == 1
    assert value(m, "embed_inputs_total") == 3  # the refused input was never computed


def test_an_expired_deadline_is_dropped_before_compute_and_counted() -> None:
    run = FakeRun()

    async def scenario(batcher: Batcher) -> None:
        with pytest.raises(Dropped):
            await submit(batcher, [[1, 2, 3]], deadline=time.monotonic() - 0.001)

    m = run_with_batcher(run, scenario)
    assert value(m, "embed_inputs_dropped_total", reason="deadline") == 1
    assert value(m, "embed_inputs_dropped_total", reason="cancelled") == 0
    assert run.runs == 0 and value(m, "embed_tokens_total") == 0


async def _wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def _queue_behind_a_running_batch(batcher: Batcher, run: FakeRun, deadline: float | None) -> None:
    """Queue one input behind a blocked batch, cancel its caller (at its deadline, if it has one)."""
    first = asyncio.create_task(submit(batcher, [[1, 1]]))
    await _wait_until(lambda: run.runs == 1)
    waiting = asyncio.create_task(submit(batcher, [[2, 2]], deadline=deadline))
    await _wait_until(lambda: batcher.depth == 1)
    if deadline is not None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
    waiting.cancel()  # as gRPC does to the handler when the caller cancels or the deadline passes
    run.gate.set()
    await first
    await _wait_until(lambda: batcher.depth == 0)


def test_a_cancelled_caller_is_dropped_before_compute_and_counted() -> None:
    run = FakeRun(blocked=True)
    m = run_with_batcher(run, lambda b: _queue_behind_a_running_batch(b, run, None))
    assert value(m, "embed_inputs_dropped_total", reason="cancelled") == 1
    assert value(m, "embed_inputs_dropped_total", reason="deadline") == 0
    assert run.runs == 1


def test_a_call_cancelled_by_its_deadline_counts_as_a_deadline_drop() -> None:
    """gRPC cancels the handler when the deadline passes, usually before the batcher looks at the input."""
    run = FakeRun(blocked=True)
    deadline = time.monotonic() + 0.05
    m = run_with_batcher(run, lambda b: _queue_behind_a_running_batch(b, run, deadline))
    assert value(m, "embed_inputs_dropped_total", reason="deadline") == 1
    assert value(m, "embed_inputs_dropped_total", reason="cancelled") == 0
    assert run.runs == 1


# A live scrape of a real server.


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> list[Sample]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def settled_scrape(metrics_port: int, timeout: float = 10.0) -> str:
    """A scrape once no RPC is in flight: a call is counted just after its caller sees the status."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(metrics_port)
        in_flight = [s.value for s in samples(text) if s.name == "embed_requests_in_flight"]
        if in_flight == [0] or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def promtool_check_metrics(text: str) -> None:
    """`promtool check metrics` (lint of names, units, help) on a scrape; fails if promtool is missing."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found on PATH: run scripts/install-prometheus.sh", pytrace=False)
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}{done.stderr}"


def assert_labels_bounded(text: str) -> None:
    for s in samples(text):
        for key, allowed in BOUNDED.items():
            if key in s.labels:
                assert s.labels[key] in allowed, f"{s.name}{s.labels}: {key} outside {sorted(allowed)}"


@pytest.fixture(scope="module")
def live_server(model_dir: object) -> Iterator[ServerProcess]:
    with serving() as server:
        assert server.metrics_port is not None
        yield server


@pytest.fixture(scope="module")
def fresh(live_server: ServerProcess) -> str:
    """The scrape of the server before its first call, as Prometheus sees a pod just started."""
    assert live_server.metrics_port is not None
    return settled_scrape(live_server.metrics_port)


@pytest.fixture(scope="module")
def served(live_server: ServerProcess, fresh: str) -> Served:
    """The server after one call of each kind (gRPC's and HTTP's embeddings), one of them invalid and
    one truncated; and its scrape."""
    server = live_server
    assert server.metrics_port is not None
    with EmbeddingClient(server.address) as client:
        client.embed(["a short text", "word " * 400])  # the second is truncated
        client.tokenize(["tokens"])
        info = client.info()
        with pytest.raises(grpc.RpcError) as e:
            client.embed_response(embed_request([]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    http = f"http://127.0.0.1:{server.http_port}/v1/embeddings"
    with urllib.request.urlopen(http, data=b'{"input": "over HTTP"}', timeout=30) as answer:
        assert answer.status == 200
    return server, info, settled_scrape(server.metrics_port)


def test_a_fresh_server_exports_each_methods_requests_at_zero_with_each_queried_code(fresh: str) -> None:
    found = {
        (s.labels["method"], s.labels["code"]): s.value
        for s in samples(fresh)
        if s.name == "embed_requests_total"
    }
    assert requests_missing_at_zero(lambda method, code: found.get((method, code))) == []


def test_live_scrape_has_every_family_and_the_default_collectors(served: Served) -> None:
    _, _, text = served
    names = {s.name for s in samples(text)}
    for name, (kind, _) in FAMILIES.items():
        assert exposed_name(name, kind) in names or f"{name}_count" in names, name
    for name in DEFAULT_COLLECTOR_SAMPLES:
        assert name in names, name


def test_live_scrape_counts_the_calls_made(served: Served) -> None:
    _, _, text = served
    by_key = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples(text)}

    def get(name: str, **labels: str) -> float:
        return by_key.get((name, tuple(sorted(labels.items()))), 0.0)

    assert get("embed_requests_total", method="Embed", code="OK") == 1
    assert get("embed_requests_total", method="Embed", code="INVALID_ARGUMENT") == 1
    assert get("embed_requests_total", method="Tokenize", code="OK") == 1
    assert get("embed_requests_total", method="Info", code="OK") == 1
    assert get("embed_requests_total", method="http_embeddings", code="OK") == 1
    assert get("embed_request_duration_seconds_count", method="http_embeddings", size="1") == 1
    assert get("embed_inputs_total") == 3
    assert get("embed_inputs_truncated_total") == 1
    assert 0 < get("embed_tokens_total") <= get("embed_batch_tokens_total")
    assert get("embed_request_duration_seconds_count", method="Embed", size="2-8") == 1
    assert get("embed_request_duration_seconds_count", method="Embed", size="0") == 1
    assert get("embed_ready") == 1
    assert get("embed_requests_in_flight") == 0
    assert get("embed_model_load_seconds") > 0 and get("embed_model_warmup_seconds") > 0


def test_live_info_names_the_model_and_the_provider_in_use(served: Served) -> None:
    _, info, text = served
    [model] = [s for s in samples(text) if s.name == "embed_model_info"]
    assert model.value == 1
    assert model.labels == {
        "model_id": info.model_id,
        "sha256": info.weights_sha256,
        "precision": pb.Precision.Name(info.precision).removeprefix("PRECISION_").lower(),
        "provider": info.execution_provider,
    }


def test_live_labels_are_bounded(served: Served) -> None:
    _, _, text = served
    assert_labels_bounded(text)


def test_live_scrape_passes_promtool_check_metrics(served: Served) -> None:
    _, _, text = served
    promtool_check_metrics(text)


def test_live_histograms_are_consistent(served: Served) -> None:
    """Cumulative buckets never decrease and +Inf equals _count: what histogram_quantile relies on."""
    _, _, text = served
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series: dict[tuple, list[tuple[float, float]]] = {}
        counts = {}
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name.endswith("_bucket"):
                series.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[key] = s.value
        for key, buckets in series.items():
            buckets.sort()
            values = [v for _, v in buckets]
            assert values == sorted(values), (family.name, key)
            assert buckets[-1][0] == math.inf and values[-1] == counts[key], (family.name, key)


def test_the_batch_histograms_reach_the_largest_automatic_batches():
    """The gpu overlay's batches (1,024 rows, 131,072 padded tokens, CUDA's automatic limits) counted
    only in +Inf when the buckets stopped at 256 rows and 16,384 tokens."""
    for rows, tokens in AUTO_BATCH_LIMITS.values():
        assert rows <= BATCH_SIZE_BUCKETS[-1] and tokens <= BATCH_TOKEN_BUCKETS[-1]


# The /metrics port: every connection held a supervisor thread for as long as its client kept it open.


def _metrics_port(timeout_s: float, max_connections: int = 32) -> int:
    registry = CollectorRegistry()
    registry.register(SupervisorMetrics())
    return serve_metrics(registry, "127.0.0.1:0", timeout_s=timeout_s, max_connections=max_connections)


def _half_requests(port: int, n: int) -> list[socket.socket]:
    """`n` connections that sent half a request line, as the acceptance pass's 500 did."""
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    for sock in held:
        sock.sendall(b"GET /metr")
    return held


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closed `sock` (read its end, or a reset), at most its timeout."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(100) == b""
    return time.monotonic() - started


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_metrics_request_not_all_sent_in_time_is_closed():
    """500 connections that sent half a request held 500 supervisor threads for 20-62 s. The request
    must all come within the timeout, however its bytes trickle in."""
    port = _metrics_port(timeout_s=1.0)
    [half] = _half_requests(port, 1)
    trickled = socket.create_connection(("127.0.0.1", port), timeout=0.3)
    for byte in b"GET /metrics HTTP/1.1\r\n":  # a byte every 0.3 s: within any per-read timeout
        trickled.sendall(bytes([byte]))
        with contextlib.suppress(TimeoutError):
            if trickled.recv(100) == b"":
                break
    else:
        raise AssertionError("a request trickled in for 7 s was still being read")
    assert _closed_after(half) < 1.5
    assert "embed_front_restarts_total" in _scrape(port)
    half.close()
    trickled.close()


def test_a_scrape_past_the_bound_takes_the_place_of_the_oldest_connection_still_sending():
    """32 silent connections, opened again every 5 s, had every scrape refused: at the bound a new
    connection now takes the oldest one's place while that one has not sent its request."""
    port = _metrics_port(timeout_s=10.0, max_connections=4)
    held = _half_requests(port, 4)
    time.sleep(0.2)  # each taken by the server
    assert "embed_front_restarts_total" in _scrape(port)
    assert _closed_after(held[0]) < 1.0  # the oldest made room
    for sock in held:
        sock.close()


def _counter_file(path, values: dict[str, float]) -> None:
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    counts = MmapedDict(str(path))
    try:
        for code, value in values.items():
            key = mmap_key("embed_requests", "embed_requests_total", ["code"], [code], "RPCs.")
            counts.write_value(key, value, 0.0)
    finally:
        counts.close()


def _totals(directory) -> dict[str, float]:
    from prometheus_client import multiprocess

    collector = multiprocess.MultiProcessCollector(None, path=str(directory))
    return {
        s.labels["code"]: s.value
        for family in collector.collect()
        for s in family.samples
        if s.name == "embed_requests_total"
    }


def test_dead_fronts_counts_are_folded_into_one_file_and_kept(tmp_path, monkeypatch):
    """Each dead front's counter file is added into counter_dead.db and removed: the sums stay."""
    from minilm_embed.server.metrics import SupervisorMetrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    _counter_file(tmp_path / "counter_101.db", {"OK": 3, "INTERNAL": 1})
    _counter_file(tmp_path / "counter_102.db", {"OK": 5})
    _counter_file(tmp_path / "counter_103.db", {"OK": 7})  # alive: stays
    before = _totals(tmp_path)
    supervisor = SupervisorMetrics()
    supervisor.fold_dead(101)
    supervisor.fold_dead(102)
    supervisor.fold_dead(104)  # no files: nothing to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter_103.db", "counter_dead.db"]
    assert _totals(tmp_path) == before == {"OK": 15, "INTERNAL": 1}


def test_a_fold_that_fails_changes_nothing_and_is_logged(tmp_path, monkeypatch, caplog):
    """A damaged file (or a full /tmp) must not stop the server, nor count anything twice."""
    from minilm_embed.server.metrics import SupervisorMetrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    _counter_file(tmp_path / "counter_dead.db", {"OK": 2})
    # Not a file prometheus_client wrote: 64 bytes used, a first key said to be 1,000 bytes long.
    (tmp_path / "counter_101.db").write_bytes(struct.pack("ii", 64, 0) + struct.pack("i", 1000) + b"x" * 52)
    SupervisorMetrics().fold_dead(101)
    assert "could not fold the counter file of front pid 101" in caplog.text
    assert (tmp_path / "counter_101.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter_101.db", "counter_dead.db"]
    _counter_file(tmp_path / "counter_102.db", {"OK": 1})
    SupervisorMetrics().fold_dead(102)
    (tmp_path / "counter_101.db").unlink()
    assert _totals(tmp_path) == {"OK": 3}
