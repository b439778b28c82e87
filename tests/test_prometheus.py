"""A real Prometheus scrapes a real server every second under a bounded load, with the repository's rules.

Through Prometheus' HTTP query API the tests check what an operator would see: the target up, a request
rate, a finite p99, a padding ratio in [0, 1], refusals and deadline drops counted when the test provokes
them, every recording rule and every dashboard query answering, and the CPU-fallback alert following the
execution provider really in use. Needs Debian's `prometheus` (scripts/install-prometheus.sh); fails
without it, never skips.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from minilm_embed.client.client import AsyncEmbeddingClient, EmbeddingClient, embed_request
from minilm_embed.server.metrics import REFUSAL_REASONS
from tests.conftest import REPO_ROOT
from tests.server_process import ServerProcess, start_server, wait_for
from tests.test_metrics import (
    METHODS,
    assert_labels_bounded,
    promtool_check_metrics,
    samples,
    scrape,
    server_error_codes,
)

RULE_FILES = sorted((REPO_ROOT / "deploy" / "prometheus").glob("*.rules.yml"))
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "embed.json"
JOB = "embed"  # the job name the alerts select
CUDA = "CUDAExecutionProvider"
QUEUE_LIMIT = 64
LOAD_THREADS = 8
LOAD_INPUTS = 4  # per request: the load alone (8 x 4 inputs) never fills the queue
LOAD_SECONDS = 12.0
SENTENCE = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree"
WORDS = SENTENCE.split()
LONG_TEXT = "word " * 400  # truncated at 256 tokens: the longest input, the slowest batch


@dataclass(frozen=True)
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def wait_for(self, expr: str, ok: Callable[[list[float]], bool], timeout: float = 30.0) -> list[dict]:
        """Poll until the query has samples and `ok` holds for their values (scrapes and rules run each
        second); returns the samples."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            values = [float(r["value"][1]) for r in result]
            if values and ok(values):
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"after {timeout:.0f}s, {expr} = {values}", pytrace=False)
            time.sleep(0.5)

    def rules(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as r:
            return json.load(r)["data"]["groups"]


def positive(values: list[float]) -> bool:
    return values[0] > 0


def finite_positive(values: list[float]) -> bool:
    return math.isfinite(values[0]) and values[0] > 0


def in_unit_interval(values: list[float]) -> bool:
    return 0 <= values[0] <= 1


def anything(values: list[float]) -> bool:
    return True


@dataclass(frozen=True)
class Provoked:
    """What the load and the provocations did, as the clients saw it."""

    served: int
    refused: int
    deadline_exceeded: int
    provider: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(directory: Path, metrics_port: int) -> Path:
    """Scrape and evaluate every second; the target is labelled as a GPU replica, so the CPU-fallback
    alert is evaluated against the provider this server really uses."""
    target = {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"expected_provider": CUDA}}
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [{"job_name": JOB, "static_configs": [target]}],
    }
    path = directory / "prometheus.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def wait_ready(prometheus: Prometheus, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    pytest.fail(f"prometheus did not become ready:\n{log.read_text()[-3000:]}", pytrace=False)


def installed(name: str) -> str:
    """The path of Debian's `prometheus` or `promtool`; the test fails (never skips) without it."""
    binary = shutil.which(name)
    if binary is None:
        pytest.fail(f"{name} not found on PATH: run scripts/install-prometheus.sh", pytrace=False)
    return binary


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return installed("prometheus")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    server = start_server("--queue-limit", str(QUEUE_LIMIT)).wait_serving()
    assert server.metrics_port is not None
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    directory = tmp_path_factory.mktemp("prometheus")
    assert server.metrics_port is not None
    config = write_config(directory, server.metrics_port)
    prometheus = Prometheus(f"http://127.0.0.1:{free_port()}")
    log = directory / "prometheus.log"
    command = [
        prometheus_binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address={prometheus.url.removeprefix('http://')}",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(prometheus, proc, log)
        yield prometheus
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_load(address: str) -> int:
    """LOAD_THREADS clients sending Embed calls of mixed lengths for LOAD_SECONDS; returns calls served."""
    stop_at = time.monotonic() + LOAD_SECONDS
    served = [0] * LOAD_THREADS

    def client(i: int) -> None:
        rng = random.Random(i)
        with EmbeddingClient(address) as c:
            while time.monotonic() < stop_at:
                texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 60))) for _ in range(LOAD_INPUTS)]
                c.embed(texts)
                served[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(LOAD_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(served)


async def _burst(address: str, requests: int, inputs: int) -> list[grpc.StatusCode]:
    texts = [" ".join(WORDS * 4)] * inputs
    async with AsyncEmbeddingClient(address) as c:
        calls = [c.embed_response(embed_request(texts)) for _ in range(requests)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    codes = []
    for r in results:
        if isinstance(r, grpc.aio.AioRpcError):
            codes.append(r.code())
        else:
            assert not isinstance(r, BaseException), r
            codes.append(grpc.StatusCode.OK)
    return codes


def provoke_refusals(address: str) -> int:
    """Bursts of concurrent requests whose inputs overflow the queue; returns how many were refused."""
    refused = 0
    for _ in range(5):
        codes = asyncio.run(_burst(address, requests=24, inputs=16))
        refused += codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        if refused:
            return refused
    pytest.fail(f"5 bursts of 24 x 16 inputs never overflowed --queue-limit {QUEUE_LIMIT}", pytrace=False)


def server_value(metrics_port: int, name: str) -> float:
    """A sample summed over its labels, read from the server's own /metrics."""
    return sum(s.value for s in samples(scrape(metrics_port)) if s.name == name)


def provoke_deadline_drops(server: ServerProcess, rounds: int = 3) -> int:
    """Short calls with a 10 ms deadline queued behind batches of the longest inputs, until the server
    has dropped some of them before compute; returns how many calls got DEADLINE_EXCEEDED."""
    port = server.metrics_port
    assert port is not None
    exceeded = 0
    for _ in range(rounds):
        with EmbeddingClient(server.address, timeout=60) as busy, EmbeddingClient(server.address) as c:
            blocker = threading.Thread(target=busy.embed, args=([LONG_TEXT] * 16,))
            blocker.start()
            # Until the long inputs wait in the queue (a fast machine may drain it first: then retry).
            wait_for(lambda: server_value(port, "embed_queue_depth") > 0, timeout=5, interval=0.01)
            for _ in range(8):
                try:
                    c.stub.Embed(embed_request(["late"]), timeout=0.01)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                    exceeded += 1
            blocker.join()
        if server_value(port, "embed_inputs_dropped_total") > 0:
            break
    return exceeded


ERRORS = "|".join(sorted(server_error_codes()))
# What a pod just started, before its first call, shows: each a query a panel, the dashboard's job
# variable or an alert makes, and what it should answer then.
FRESH_QUERIES = {
    'sum by (method) (rate(embed_requests_total{code="OK"}[1m]))': [0.0] * len(METHODS),
    f'sum(rate(embed_requests_total{{code=~"{ERRORS}"}}[5m]))': [0.0],
    f'job:embed_requests:rate1m{{job="{JOB}"}}': [0.0],  # label_values() of it lists the job
    f'job_method_code:embed_requests:rate1m{{job="{JOB}", method="Embed", code="OK"}}': [0.0],
}


@pytest.fixture(scope="module")
def fresh_pod(prometheus: Prometheus) -> dict[str, list[float]]:
    """FRESH_QUERIES' answers on the server before its first call, once each has samples (20 s at
    most: a rate needs two scrapes, a recording rule an evaluation after them)."""
    prometheus.wait_for(f'up{{job="{JOB}"}}', lambda v: v == [1.0])
    deadline = time.monotonic() + 20
    while True:
        answers = {q: sorted(float(r["value"][1]) for r in prometheus.query(q)) for q in FRESH_QUERIES}
        if all(answers.values()) or time.monotonic() > deadline:
            return answers
        time.sleep(0.5)


@pytest.fixture(scope="module")
def provoked(server: ServerProcess, prometheus: Prometheus, fresh_pod: dict[str, list[float]]) -> Provoked:
    """The load, then a full queue, then expired deadlines; Prometheus scrapes throughout (after the
    fresh pod was looked at)."""
    prometheus.wait_for(f'up{{job="{JOB}"}}', lambda v: v == [1.0])  # counters scraped at 0 first
    with EmbeddingClient(server.address) as c:
        provider = c.info().execution_provider
    served = run_load(server.address)
    refused = provoke_refusals(server.address)
    exceeded = provoke_deadline_drops(server)
    return Provoked(served, refused, exceeded, provider)


def test_a_fresh_pod_shows_zero_requests_and_errors_not_no_data(fresh_pod: dict[str, list[float]]) -> None:
    assert fresh_pod == FRESH_QUERIES


def test_the_server_target_is_up(prometheus: Prometheus, provoked: Provoked) -> None:
    prometheus.wait_for(f'up{{job="{JOB}"}}', lambda v: v == [1.0])


def test_request_rate_is_above_zero(prometheus: Prometheus, provoked: Provoked) -> None:
    assert provoked.served > 0
    prometheus.wait_for('sum(rate(embed_requests_total{method="Embed", code="OK"}[1m]))', positive)
    prometheus.wait_for(f'job:embed_requests:rate1m{{job="{JOB}"}}', positive)
    prometheus.wait_for(f'job:embed_tokens:rate1m{{job="{JOB}"}}', positive)


def test_p99_latency_is_finite_and_positive(prometheus: Prometheus, provoked: Provoked) -> None:
    buckets = 'embed_request_duration_seconds_bucket{method="Embed"}'
    raw = f"histogram_quantile(0.99, sum by (le) (rate({buckets}[1m])))"
    prometheus.wait_for(raw, finite_positive)
    rule = f'job_method:embed_request_duration_seconds:p99_5m{{job="{JOB}", method="Embed"}}'
    prometheus.wait_for(rule, finite_positive)
    prometheus.wait_for(f"{rule} - {rule.replace('p99', 'p50')}", lambda v: v[0] >= 0)


def test_padding_ratio_lies_between_0_and_1(prometheus: Prometheus, provoked: Provoked) -> None:
    raw = "1 - sum(rate(embed_tokens_total[5m])) / sum(rate(embed_batch_tokens_total[5m]))"
    prometheus.wait_for(raw, in_unit_interval)
    prometheus.wait_for(f'job:embed_padding:ratio_rate5m{{job="{JOB}"}}', in_unit_interval)


def test_refusals_are_counted_as_the_queues_when_the_queue_is_full(
    prometheus: Prometheus, provoked: Provoked
) -> None:
    assert provoked.refused > 0
    queue = 'embed_requests_refused_total{reason="queue"}'
    prometheus.wait_for(queue, lambda v: v == [provoked.refused])
    # The fronts' budgets refused none of them: each reason is exported, the others at 0.
    others = [0.0] * (len(REFUSAL_REASONS) - 1)
    prometheus.wait_for("embed_requests_refused_total", lambda v: sorted(v) == [*others, provoked.refused])
    prometheus.wait_for(
        'sum(embed_requests_total{code="RESOURCE_EXHAUSTED"})', lambda v: v == [provoked.refused]
    )
    prometheus.wait_for(f"increase({queue}[5m])", positive)
    prometheus.wait_for(f'job_reason:embed_requests_refused:rate5m{{job="{JOB}", reason="queue"}}', positive)


def test_no_front_restarted_and_the_counter_says_so(prometheus: Prometheus, provoked: Provoked) -> None:
    prometheus.wait_for("embed_front_restarts_total", lambda v: v == [0])
    prometheus.wait_for(f'job:embed_front_restarts:increase15m{{job="{JOB}"}}', lambda v: v == [0])


def test_expired_deadlines_are_counted_as_dropped_inputs(prometheus: Prometheus, provoked: Provoked) -> None:
    assert provoked.deadline_exceeded > 0
    prometheus.wait_for('increase(embed_inputs_dropped_total{reason="deadline"}[5m])', positive)
    # The calls themselves count as the service's errors, not as callers that gave up.
    prometheus.wait_for('sum(embed_requests_total{code="DEADLINE_EXCEEDED"})', positive)


def test_every_rule_is_loaded_and_evaluates(prometheus: Prometheus, provoked: Provoked) -> None:
    groups = prometheus.rules()
    assert {Path(g["file"]).name for g in groups} == {p.name for p in RULE_FILES}
    rules = [r for g in groups for r in g["rules"]]
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, broken
    recorded = sorted(r["name"] for r in rules if r["type"] == "recording")
    alerts = {r["name"] for r in rules if r["type"] == "alerting"}
    assert {"EmbedServerDown", "EmbedHighErrorRatio", "EmbedLatencyP99High"} <= alerts
    assert {
        "EmbedQueueSaturated",
        "EmbedFrontSaturated",
        "EmbedFrontRestarting",
        "EmbedCpuFallback",
    } <= alerts
    for name in recorded:  # the load provoked every case, so each rule has a sample
        prometheus.wait_for(f'{name}{{job="{JOB}"}}', lambda v: any(not math.isnan(x) for x in v))


def test_cpu_fallback_alert_follows_the_provider_in_use(prometheus: Prometheus, provoked: Provoked) -> None:
    expr = 'ALERTS{alertname="EmbedCpuFallback"}'
    if provoked.provider != CUDA:
        [alert] = prometheus.wait_for(expr, anything)
        labels = alert["metric"]
        assert labels["provider"] == provoked.provider and labels["expected_provider"] == CUDA
    else:
        time.sleep(3)  # several evaluations
        assert prometheus.query(expr) == []


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_answers(prometheus: Prometheus, provoked: Provoked) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    for title, expr in queries:
        concrete = expr.replace("$job", JOB)
        assert "$" not in concrete, f"{title}: unknown variable in {expr}"
        prometheus.wait_for(concrete, anything)


def test_dashboard_is_built_on_the_recording_rules(prometheus: Prometheus) -> None:
    recorded = {r["name"] for g in prometheus.rules() for r in g["rules"] if r["type"] == "recording"}
    raw_allowed = {"embed_model_info"}  # labels to show, not a rate to compute
    for title, expr in dashboard_queries():
        names = _metric_names(expr)
        assert names and names <= recorded | raw_allowed, f"{title}: {expr}"


def _metric_names(expr: str) -> set[str]:
    """Recorded series (level:metric:operations) and raw embed_ metrics named in a query."""
    return set(re.findall(r"\b(?:[a-z_]+:[a-z0-9_]+:[a-z0-9_]+|embed_[a-z0-9_]+)", expr))


def test_a_scrape_after_the_load_passes_promtool_and_keeps_labels_bounded(
    server: ServerProcess, provoked: Provoked
) -> None:
    assert server.metrics_port is not None
    text = scrape(server.metrics_port)
    assert_labels_bounded(text)
    promtool_check_metrics(text)
