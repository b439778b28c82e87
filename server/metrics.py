"""Every Prometheus metric the server exports, declared in one place.

The registry is injectable so tests get a fresh one. Names follow Prometheus practice: one prefix
(`embed_`), base units (`_seconds`), `_total` on counters, `_info` for the model, no unbounded labels.
The padding ratio is a PromQL expression over two counters:
    1 - rate(embed_tokens_total[5m]) / rate(embed_batch_tokens_total[5m])
"""

from __future__ import annotations

import prometheus_client as prom
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Sub-millisecond to seconds: a short text's model run is ~1 ms on a GPU, a queued burst seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        prom.ProcessCollector(registry=r)
        prom.PlatformCollector(registry=r)
        prom.GCCollector(registry=r)
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
            "Time from receiving an RPC to its response.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "embed_queue_wait_seconds",
            "Time an input waited for its batch.",
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
        self.queue_depth = Gauge("embed_queue_depth", "Inputs waiting for a batch.", registry=r)
        self.in_flight = Gauge("embed_requests_in_flight", "RPCs being served.", registry=r)
        self.refused = Counter(
            "embed_requests_refused", "Requests refused at once because the queue was full.", registry=r
        )
        self.dropped = Counter(
            "embed_inputs_dropped",
            "Inputs dropped before compute: deadline passed or client cancelled while queued.",
            ["reason"],
            registry=r,
        )
        self.truncated = Counter("embed_inputs_truncated", "Inputs cut at the maximum length.", registry=r)
        self.batch_failures = Counter("embed_batch_failures", "Batches whose model run failed.", registry=r)
        self.model = Info(
            "embed_model", "The model served and the execution provider really in use.", registry=r
        )
        self.load_seconds = Gauge("embed_model_load_seconds", "Time to load the model session.", registry=r)
        self.warmup_seconds = Gauge("embed_model_warmup_seconds", "Time the warm-up took.", registry=r)
        self.ready = Gauge("embed_ready", "1 once warm and serving, 0 while warming or draining.", registry=r)
        for reason in ("deadline", "cancelled"):
            self.dropped.labels(reason)


def serve_metrics(metrics: Metrics, address: str) -> int:
    """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
    host, _, port = address.rpartition(":")
    server, _thread = prom.start_http_server(int(port), addr=host or "0.0.0.0", registry=metrics.registry)
    return int(server.server_port)
