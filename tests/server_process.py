"""A real server in a child process on loopback ports chosen by the OS, for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server.health import SERVICE_NAME
from tests.proc_tree import children
from tests.stand_in_server import HOLD_TEXT

ROOT = Path(__file__).resolve().parents[1]
_GRPC_PORT = re.compile(r"serving .* on port (\d+)")
_METRICS_PORT = re.compile(r"metrics on \S*:(\d+)/metrics")  # host:port, [v6]:port
_HTTP_PORT = re.compile(r"http on port (\d+)")
_ENGINE_PID = re.compile(r"engine pid (\d+)")


def flags(settings: Mapping[str, object]) -> list[str]:
    """Server settings as command-line flags: {"max_batch_size": 8} -> ["--max-batch-size", "8"]."""
    return [part for name, value in settings.items() for part in ("--" + name.replace("_", "-"), str(value))]


def loopback_command(*args: str, entry: Sequence[str] = ("minilm_embed.server",)) -> list[str]:
    """`python -m minilm_embed.server` (or another entry) on ports the OS picks (HTTP too: never the
    default :8080 of a shared machine), without /metrics."""
    listen = ["--address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--metrics-address", ""]
    return [sys.executable, "-m", *entry, *listen, *args]


def model_dir() -> Path:
    return Path(os.environ.get("EMBED_MODEL_DIR", ROOT / "build" / "model"))


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    port: int | None = None
    metrics_port: int | None = None
    http_port: int | None = None
    engine_pid: int | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL (OpenAI clients take it with /v1 appended)."""
        return f"http://127.0.0.1:{self.http_port}"

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if m := _METRICS_PORT.search(line):
                self.metrics_port = int(m.group(1))
            if m := _HTTP_PORT.search(line):
                self.http_port = int(m.group(1))
            if m := _GRPC_PORT.search(line):
                self.port = int(m.group(1))
                self.engine_pid = int(m2.group(1)) if (m2 := _ENGINE_PID.search(line)) else None
                self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    def wait_serving(self, timeout: float = 120.0) -> ServerProcess:
        if not self._ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-30:]))
        return self

    def health(self, service: str = SERVICE_NAME) -> int:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def front_pids(self) -> list[int]:
        """The front processes now: the supervisor's children other than the engine (and
        multiprocessing's resource tracker)."""
        fronts = []
        for pid in children(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue  # ended meanwhile
            if pid != self.engine_pid and b"resource_tracker" not in cmdline and state != "Z":
                fronts.append(pid)
        return sorted(fronts)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0, then: float = 30.0) -> int:
        """Its exit code, once it exits within `timeout`; else an AssertionError with its log's end,
        read once it has exited after all (or `then` seconds more): what it did last, not only
        what it had done when the wait ran out (the supervisor logs a child it has to kill)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                late = f"it exited {self.proc.wait(then)} within {then:g} s more"
            except subprocess.TimeoutExpired:
                late = f"it was still running {then:g} s later"
            time.sleep(0.5)  # the reader thread takes the last lines
            tail = "".join(self.lines[-40:])
            message = f"the server had not exited after {timeout:g} s ({late}); its log ends:\n{tail}"
            raise AssertionError(message) from None

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def serving(
    *args: str, env: dict[str, str] | None = None, entry: Sequence[str] = ("minilm_embed.server",)
) -> Iterator[ServerProcess]:
    """A started server, serving, for the body of the with-block; stopped (SIGTERM) after it."""
    process = start_server(*args, env=env, entry=entry).wait_serving()
    try:
        yield process
    finally:
        process.stop()


def fault_entry(fault_text: str) -> tuple[str, ...]:
    """The entry for a real server whose batches holding exactly `fault_text` fail (tests only)."""
    return ("tests.stand_in_server", "fault", fault_text)


@contextlib.asynccontextmanager
async def one_instance_held(address: str) -> AsyncIterator[None]:
    """On a fault server (`fault_entry`): keep one model instance busy for HOLD_S seconds, so that the
    inputs sent meanwhile wait in the queue for company (up to --max-queue-delay-ms) as under load."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        held = asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=[HOLD_TEXT]), timeout=60))
        await asyncio.sleep(0.5)  # taken into a batch: a lone input on an idle server runs at once
        try:
            yield
        finally:
            await held


def start_server(
    *args: str,
    metrics: bool = True,
    env: dict[str, str] | None = None,
    entry: Sequence[str] = ("minilm_embed.server",),
) -> ServerProcess:
    """Start `minilm-embed-serve` (or another entry) on 127.0.0.1:0 with the built model, HTTP too (never
    on the default port 8080); call wait_serving() to block."""
    cmd = [sys.executable, "-m", *entry, "--address", "127.0.0.1:0", "--model-dir", str(model_dir())]
    cmd += ["--metrics-address", "127.0.0.1:0" if metrics else ""]
    cmd += ["--http-address", "127.0.0.1:0"]
    cmd += list(args)
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=environment
    )
    server = ServerProcess(proc)
    threading.Thread(target=server._pump, daemon=True).start()
    return server


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(interval)
    return False


async def wait_until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    """wait_for in an event loop that must go on running meanwhile (a server in the same loop)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)
