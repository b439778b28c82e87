"""What the reliability tests observe of a server process: its /metrics and its resident memory."""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.proc_tree import children
from tests.server_process import ServerProcess, wait_for


@dataclass(frozen=True)
class Scrape:
    """One reading of /metrics: sample name and labels -> value."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def requests(self, code: str, method: str = "Embed") -> float:
        return self.value("embed_requests_total", method=method, code=code)

    def dropped(self, reason: str) -> float:
        return self.value("embed_inputs_dropped_total", reason=reason)

    def refused(self) -> float:
        """Requests refused at once, whatever the reason (the queue, a front's budgets)."""
        return sum(v for (name, _), v in self.samples.items() if name == "embed_requests_refused_total")

    def __sub__(self, before: Scrape) -> Scrape:
        """Counter increases since `before` (gauges come out as differences too: read those alone)."""
        keys = self.samples.keys() | before.samples.keys()
        return Scrape({k: self.samples.get(k, 0.0) - before.samples.get(k, 0.0) for k in keys})


def metrics_text(server: ServerProcess, host: str = "127.0.0.1") -> str:
    assert server.metrics_port is not None, "the server was started without metrics"
    url = f"http://{host}:{server.metrics_port}/metrics"
    return str(urllib.request.urlopen(url, timeout=10).read().decode())


def scrape(server: ServerProcess) -> Scrape:
    return parse(metrics_text(server))


def parse(text: str) -> Scrape:
    samples = {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return Scrape(samples)


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> Scrape:
    """Wait until the queue-depth and in-flight gauges read 0; the last reading."""
    last: list[Scrape] = []

    def idle() -> bool:
        last[:] = [scrape(server)]
        return last[0].value("embed_queue_depth") == 0 and last[0].value("embed_requests_in_flight") == 0

    assert wait_for(idle, timeout, 0.2), f"gauges never returned to 0: {gauges(last[0])}"
    return last[0]


def gauges(s: Scrape) -> dict[str, float]:
    return {name: s.value(name) for name in ("embed_queue_depth", "embed_requests_in_flight")}


def rss_by_process(pid: int) -> dict[str, int]:
    """VmRSS of a live process and every process under it (the server's supervisor, engine and
    fronts), from /proc (Linux), by name and pid: {"embed-engine:1234": bytes, ...}."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    assert "VmRSS" in status, f"no VmRSS for process {pid}"
    found = {f"{status['Name'].strip()}:{pid}": int(status["VmRSS"].split()[0]) * 1024}
    for child in children(pid):
        try:
            found.update(rss_by_process(child))
        except (FileNotFoundError, AssertionError):
            continue  # it ended meanwhile
    return found


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process tree, in all."""
    return sum(rss_by_process(pid).values())


@dataclass
class RssSampler:
    """Samples a process tree's resident memory every `interval` seconds in a thread: (time, bytes),
    and each process's alone."""

    pid: int
    interval: float = 1.0
    samples: list[tuple[float, int]] = field(default_factory=list)
    by_process: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now, each = time.monotonic(), rss_by_process(self.pid)
            self.by_process.append((now, each))
            self.samples.append((now, sum(each.values())))
            self._stop.wait(self.interval)

    def process_medians_mb(self, start: float, end: float) -> dict[str, float]:
        """Each process's median resident MB between two times: which one grew."""
        window = [each for t, each in self.by_process if start <= t < end]
        names = sorted({name for each in window for name in each})
        return {n: round(statistics.median(e[n] for e in window if n in e) / 2**20, 1) for n in names}

    def window_median(self, start: float, end: float) -> float:
        """Median resident bytes between two times: steady under the allocator's ups and downs."""
        values = [b for t, b in self.samples if start <= t < end]
        assert values, f"no memory samples between {start:.1f} and {end:.1f}"
        return float(statistics.median(values))
