"""Every Prometheus metric the server exports, declared in one place.

The server is several processes (fronts and an engine); each records into prometheus_client's
multiprocess files, and the supervisor serves one /metrics summing them (`scrape_registry`), with its
own count of front restarts beside them (`SupervisorMetrics`): counters and histograms add up, each
gauge says how it combines (`multiprocess_mode`). Outside a server (tests,
benchmarks) the same classes record in memory. The registry is injectable so tests get a fresh one.
Names follow Prometheus practice: one prefix
(`embed_`), base units (`_seconds`), `_total` on counters, `_info` for the model, no unbounded labels.
The padding ratio is a PromQL expression over two counters:
    1 - rate(embed_tokens_total[5m]) / rate(embed_batch_tokens_total[5m])
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, make_server

import prometheus_client as prom
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, exposition, multiprocess
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

# Sub-millisecond to a minute: a short text's model run is ~1 ms on a GPU; a queued burst of bulk
# requests on a small CPU takes 10-20 s (docs/benchmarks.md: the p99 at 256 callers of 32 inputs is
# 18 s), and a quantile past the last finite bucket would read as that bucket's bound. Each latency
# objective of deploy/prometheus/alerting.rules.yml (1, 2, 5 and 20 s) is a bucket's bound: between two
# bounds histogram_quantile interpolates, and with none at 2 s a p99 of 1.2 s read as 2.2 s (an
# acceptance pass), so the 2 s objective fired on calls that met it.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 20.0, 30.0,
    60.0
)  # fmt: skip
# Up to the CUDA defaults' batches (1,024 rows, 131,072 padded tokens): past the last bucket a batch
# counts only in +Inf, and the gpu overlay's batches mostly did.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Inputs per request, as the `size` label of request latency: a 64-input call is not slow for being
# slower than a 1-input one, so latency is judged per class. "0": calls without inputs (Info, streams).
SIZE_CLASSES = ((0, "0"), (1, "1"), (8, "2-8"), (64, "9-64"))
LARGEST_CLASS = "65+"
# The `method` label: the gRPC methods, written out because the engine records here too and never
# imports protobuf, then the HTTP endpoints counted, named here for http.py (which the engine never
# imports either; /health is not counted: probes would drown the calls). tests/test_metrics.py checks
# that every method of the proto and every endpoint http.py counts has its series.
HTTP_EMBEDDINGS, HTTP_MODELS = "http_embeddings", "http_models"
METHODS = ("Embed", "EmbedStream", "Tokenize", "Info", HTTP_EMBEDDINGS, HTTP_MODELS)
# The codes that count as the server failing: the error-ratio recording rule and its alert select
# these by name (deploy/prometheus/recording.rules.yml).
SERVER_ERROR_CODES = ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "DEADLINE_EXCEEDED")
DROP_REASONS = ("deadline", "cancelled", "failed")
# What refused a request at once: the engine's queue (--queue-limit), or one of a front's budgets:
# bytes of requests being parsed (--max-request-bytes-in-flight), characters being tokenized
# (--max-tokenizing-chars), gRPC calls being served (--max-concurrent-calls), HTTP connections open
# (--http-max-connections). The first says the model is saturated, the others the fronts.
REFUSAL_REASONS = (
    "queue",
    "bulk_queue",
    "request_bytes",
    "request_bytes_held",
    "tokenizing",
    "calls",
    "http_connections",
)


def size_class(inputs: int) -> str:
    return next((name for most, name in SIZE_CLASSES if inputs <= most), LARGEST_CLASS)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        prom.ProcessCollector(registry=r)
        prom.PlatformCollector(registry=r)
        prom.GCCollector(registry=r)
        # Gauges combine over processes as their multiprocess_mode says (ignored in one process).
        self.requests = Counter(
            "embed_requests", "RPCs finished, by method and gRPC status code.", ["method", "code"], registry=r
        )
        self.inputs = Counter("embed_inputs", "Inputs embedded.", registry=r)
        self.tokens = Counter("embed_tokens", "Real (unpadded) tokens embedded.", registry=r)
        self.batch_tokens_total = Counter(
            "embed_batch_tokens",
            "Tokens of the padded grid (rows x longest row), padding included.",
            registry=r,
        )
        self.request_duration = Histogram(
            "embed_request_duration_seconds",
            "Time from receiving an RPC to its response, by method and inputs per request.",
            ["method", "size"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "embed_queue_wait_seconds",
            "Time a request's inputs waited for their batches (the longest wait among them), or, for "
            "a request dropped while inputs of it were queued (its deadline passed, its caller went "
            "away), until it was dropped.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize_duration = Histogram(
            "embed_tokenization_duration_seconds",
            "Time to tokenize one request's texts.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_run_duration = Histogram(
            "embed_model_run_duration_seconds",
            "Time of one batch's model run.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "embed_batch_size", "Inputs per batch.", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_padded_tokens = Histogram(
            "embed_batch_padded_tokens",
            "Padded tokens per batch (rows x longest row).",
            buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "embed_queue_depth", "Inputs waiting for a batch.", registry=r, multiprocess_mode="livesum"
        )
        self.queue_interactive_depth = Gauge(
            "embed_queue_interactive_depth",
            "Of embed_queue_depth, the inputs of interactive requests.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.in_flight = Gauge(
            "embed_requests_in_flight", "RPCs being served.", registry=r, multiprocess_mode="livesum"
        )
        # reason: "queue" (full; counted where admission is checked: the batcher, a front's engine
        # client), "bulk_queue" (a bulk request held back at --bulk-queue-share: pacing, not a full
        # queue), "request_bytes" or "tokenizing" (a front's budgets, embedder.py), "calls"
        # (service.py), "http_connections" (http.py).
        self.refusals = Counter(
            "embed_requests_refused",
            "Requests refused at once (RESOURCE_EXHAUSTED), by the limit that refused them.",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "embed_inputs_dropped",
            "Inputs dropped before compute: deadline passed or client cancelled while queued.",
            ["reason"],
            registry=r,
        )
        self.truncated = Counter("embed_inputs_truncated", "Inputs cut at the maximum length.", registry=r)
        self.batch_failures = Counter("embed_batch_failures", "Batches whose model run failed.", registry=r)
        self.batches_given_back = Counter(
            "embed_batches_given_back",
            "Batches prepared ahead that went back to the queue unrun (interactive inputs came first, "
            "or none of their requests was still wanted).",
            registry=r,
        )
        # An info metric (value 1, facts in labels) as a gauge: Info has no multiprocess mode.
        self.model = Gauge(
            "embed_model_info",
            "The model served and the execution provider really in use.",
            ["model_id", "sha256", "precision", "provider"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.load_seconds = Gauge(
            "embed_model_load_seconds",
            "Time to load the model session.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.warmup_seconds = Gauge(
            "embed_model_warmup_seconds", "Time the warm-up took.", registry=r, multiprocess_mode="livemax"
        )
        self.ready = Gauge(
            "embed_ready",
            "1 while a front process serves (the model warm), 0 while warming, draining, or no front "
            "process is alive to serve.",
            registry=r,
            # The most over the live processes: a front started again beside one serving writes its
            # own 0 while it starts, which the least over them read as the server not ready (0.25-0.55
            # s at each front restart, an acceptance pass). Only fronts write it.
            multiprocess_mode="livemax",
        )
        self._start_at_zero()

    def _start_at_zero(self) -> None:
        """Export at 0 the series that dashboards and alerts name, before anything happens (as
        client_python advises for known label values): rate() over a series not yet there is no data,
        not 0, and one born at 1 hides its first increment from rate() and increase()."""
        for method in METHODS:
            for code in ("OK", *SERVER_ERROR_CODES):
                self.requests.labels(method, code)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)


# Where the dead fronts' counts are kept, one file per kind (counter_dead.db): prometheus_client reads
# a counter or histogram file's type from its name's first part only.
DEAD_PROCESSES = "dead"


def _fold(source: Path, dead: Path) -> None:
    """`dead`'s values plus `source`'s, written to a file that then replaces `dead`; `source` removed."""
    sums: dict[str, tuple[float, float]] = {}
    for path in (dead, source):
        if path.exists():
            for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(str(path)):
                total, _ = sums.get(key, (0.0, 0.0))
                sums[key] = (total + value, timestamp)
    new = dead.with_suffix(".new")  # not *.db: the scrape never reads it
    new.unlink(missing_ok=True)
    merged = MmapedDict(str(new))
    try:
        for key, (value, timestamp) in sums.items():
            merged.write_value(key, value, timestamp)
    finally:
        merged.close()
    os.replace(new, dead)
    source.unlink()


class SupervisorMetrics(Collector):
    """The supervisor's own metrics, kept in its memory and served beside the children's sums.

    The supervisor imports prometheus_client before the multiprocess directory exists, so a Counter of
    its own would record in memory where MultiProcessCollector never looks (or, with the variable
    already set, in the files too, and counted twice if also registered): a collector avoids both.
    """

    def __init__(self) -> None:
        self.front_restarts = 0
        # Front processes alive and serving, as the supervisor counts them (set from its own thread,
        # read by the scrape's: one int).
        self.fronts_serving = 0
        # Held while the scrape reads the processes' files and while a dead front's are folded.
        self.files_lock = threading.Lock()

    def fold_dead(self, pid: int) -> None:
        """Add a dead front's counters and histograms into the files of the dead, and remove its own.

        prometheus_client keeps a dead process's counter and histogram files for good (only live
        gauges' go), so that its counts stay in the sums: each front restart left ~90 kB, and a front
        dying every 30 s for a day would have filled the pod's 64 MiB /tmp (an acceptance pass: 184
        kB after 2 restarts). Under the scrape's lock: a scrape between the addition and the removal
        would count the dead front twice, and the counter falling back would read as a reset. The sums
        are written to a new file that then takes the old one's name, so a failure (a full /tmp, a
        damaged file) changes nothing: it is logged, the dead front's files stay, the server serves on.
        """
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return
        with self.files_lock:
            for kind in ("counter", "histogram"):
                source = Path(directory, f"{kind}_{pid}.db")
                dead = Path(directory, f"{kind}_{DEAD_PROCESSES}.db")
                try:
                    if source.exists():
                        _fold(source, dead)
                except Exception:
                    log.exception("could not fold the %s file of front pid %d into %s", kind, pid, dead.name)

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "embed_front_restarts",
            "Front processes started again after one died.",
            value=self.front_restarts,
        )


class ProcessTreeCollector(Collector):
    """process_* metrics (CPU seconds, resident memory, open fds) summed over the server's processes."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self.pids = pids
        self.cpu_seconds = 0.0  # the highest process_cpu_seconds_total served
        self.lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        # Read first: a child reaped while the live ones are read is then counted in neither (the
        # clamp holds the counter), never in both (which the clamp would hold for good).
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        totals: dict[str, Metric] = {}
        for pid in self.pids():
            for family in prom.ProcessCollector(pid=_constant(pid), registry=None).collect():
                kept = totals.setdefault(family.name, family)
                if kept is family or family.name in ("process_start_time_seconds", "process_max_fds"):
                    continue  # for these, the first process's (the supervisor's) value stands
                pairs = zip(kept.samples, family.samples, strict=False)
                kept.samples = [a._replace(value=a.value + b.value) for a, b in pairs]
        if cpu := totals.get("process_cpu_seconds"):
            cpu.samples = [s._replace(value=self._cpu_seconds(s.value, reaped)) for s in cpu.samples]
        return list(totals.values())

    def _cpu_seconds(self, live: float, reaped: resource.struct_rusage) -> float:
        """A counter: the live processes' CPU time and that of the children reaped (a front that died,
        whose time the sum over live processes lost), never below what was served before (a child
        dead but not reaped yet is in neither)."""
        with self.lock:
            self.cpu_seconds = max(self.cpu_seconds, live + reaped.ru_utime + reaped.ru_stime)
            return self.cpu_seconds


class FrontsCollector(Collector):
    """Every process's metric files summed (MultiProcessCollector), with embed_ready 0 while no front
    serves: the gauge is the least over the live processes that wrote it, and with every front dead
    (waiting to be started again) only the engine's 1 was left, so it read 1 while nothing answered
    (an acceptance pass: 1.7 s after a lone front was killed; a front that keeps dying waits up to 30
    s)."""

    def __init__(self, directory: Path, supervisor: SupervisorMetrics) -> None:
        self.files = multiprocess.MultiProcessCollector(None, path=str(directory))
        self.supervisor = supervisor

    def collect(self) -> Iterable[Metric]:
        with self.supervisor.files_lock:
            families = self.files.collect()
        if self.supervisor.fronts_serving:
            return families
        for family in families:
            if family.name == "embed_ready":
                family.samples = [sample._replace(value=0.0) for sample in family.samples]
        return families


def _constant(pid: int) -> Callable[[], int]:
    return lambda: pid


def scrape_registry(
    directory: Path, pids: Callable[[], Iterable[int]], supervisor: SupervisorMetrics
) -> CollectorRegistry:
    """What /metrics shows: every process's metric files summed, the supervisor's own metrics, and the
    process tree's resources."""
    registry = CollectorRegistry()
    registry.register(FrontsCollector(directory, supervisor))
    registry.register(supervisor)
    registry.register(ProcessTreeCollector(pids))
    prom.PlatformCollector(registry=registry)
    prom.GCCollector(registry=registry)
    return registry


# prometheus_client's start_http_server holds a thread per connection for as long as its client
# keeps it open: 500 connections that sent half a request made 500 supervisor threads (+13 MB), held
# 20-62 s, while it accepted ~10 connections a second. A scrape's request comes in one packet and its
# answer takes ~20 ms.
METRICS_TIMEOUT_S = 5.0  # for a request's line and headers, in all; then for each write of its answer
METRICS_MAX_CONNECTIONS = 32  # served at once; one more is closed at once, unanswered


def serve_metrics(
    registry: CollectorRegistry,
    address: str,
    *,
    timeout_s: float = METRICS_TIMEOUT_S,
    max_connections: int = METRICS_MAX_CONNECTIONS,
) -> int:
    """Start the /metrics HTTP endpoint (prometheus_client's WSGI app) in a daemon thread; returns the
    bound port. A connection whose request has not all come within `timeout_s`, or whose client reads
    nothing of the answer for `timeout_s`, is closed; past `max_connections` open, one more is closed
    at once."""
    host, _, port = address.rpartition(":")

    class Server(_MetricsServer):
        pass

    Server.address_family, addr = exposition._get_best_family(host or "0.0.0.0", int(port))
    Server.max_connections, Server.lock = max_connections, threading.Lock()
    Server.open, Server.reading = 0, {}
    Handler = type("Handler", (_MetricsHandler,), {"timeout": timeout_s})
    server = make_server(addr, int(port), exposition.make_wsgi_app(registry), Server, Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return int(server.server_port)


class _MetricsServer(exposition.ThreadingWSGIServer):
    """prometheus_client's server (a daemon thread per connection), at most `max_connections` at once.
    At the bound, a new connection takes the place of the oldest one still sending its request (its
    socket shut, its thread ends), and is refused only when every one has sent its request: 32 silent
    connections, opened again every 5 s, otherwise had every scrape refused (an acceptance pass)."""

    max_connections: int
    lock: threading.Lock
    open: int  # connections with a thread
    reading: dict[Any, None]  # of those, the ones still sending their request, oldest first

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            if self.open >= self.max_connections:
                oldest = next(iter(self.reading), None)
                if oldest is None:
                    self.shutdown_request(request)
                    return
                del self.reading[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self.open += 1
            self.reading[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._ended(request)  # no thread started to end it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._ended(request)

    def request_read(self, request: Any) -> None:
        with self.lock:
            self.reading.pop(request, None)

    def _ended(self, request: Any) -> None:
        with self.lock:
            self.open -= 1
            self.reading.pop(request, None)


class _MetricsHandler(WSGIRequestHandler):
    """wsgiref's handler (prometheus_client's, which logs nothing) with a deadline: the request's line
    and headers must all come within `timeout` of the connection's start (each byte within it was not
    enough: a client sending a byte every few seconds would hold its thread), then each write of the
    answer must go out within `timeout`. A client too slow, or gone, is left without a line in the log;
    an error of the app's (a collector's) is still written out."""

    timeout = METRICS_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file: closed, or closing the socket waits for it
        self.rfile = io.BufferedReader(_ReadBy(self.connection, time.monotonic() + self.timeout))

    def handle(self) -> None:
        """wsgiref's, with the answer's writes given `timeout` each, and a client too slow (a read or a
        write timed out) or gone left without a traceback."""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.parse_request():  # an error answer was sent
                return
            self.server.request_read(self.request)  # type: ignore[attr-defined]
            self.connection.settimeout(self.timeout)
            streams = (self.rfile, self.wfile, self.get_stderr())
            answer = _Answer(*streams, self.get_environ(), multithread=False)  # type: ignore[arg-type]
            answer.request_handler = self  # type: ignore[attr-defined]  # wsgiref's, for log_request
            answer.run(self.server.get_app())  # type: ignore[attr-defined]
        except (TimeoutError, ConnectionError):
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Answer(ServerHandler):
    def log_exception(self, exc_info: Any) -> None:
        if not isinstance(exc_info[1], TimeoutError):  # the client's: it read nothing for the timeout
            super().log_exception(exc_info)


class _ReadBy(io.RawIOBase):
    """A socket's bytes, each read given what is left until `deadline` (time.monotonic())."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not all come in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)
