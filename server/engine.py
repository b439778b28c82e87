"""The engine process: the only process that touches the model. It batches across every front.

Fronts send SUBMIT messages (token ids as arrays, see protocol.py) to one ZeroMQ ROUTER socket; the
engine admits them against the queue limit, queues their inputs in the batcher, and answers each
request with one RESULT holding its vectors as one contiguous array. A CANCEL drops a request's
inputs that are not yet computed. Fronts that say HELLO before the model is warm get READY when it
is. The engine never sees protobuf or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import onnxruntime
import zmq

from minilm_embed.model.repository import CUDA_PROVIDER
from minilm_embed.server import logs, protocol
from minilm_embed.server.backend import ModelRepository, OnnxBackend, bucket_warm_shapes, open_repository
from minilm_embed.server.batcher import Batcher, BatchLimits, Done, Request, Rows, RunFn
from minilm_embed.server.config import ServerConfig, batch_limits_for
from minilm_embed.server.errors import ServiceError, internal
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.place import SharedQueue, dump_stacks_on_signal, heartbeat
from minilm_embed.server.proctitle import name_process

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the engine needs of a model run: `run(ids, lengths) -> (normalised, pooled)`."""

    provider: str
    precision: str
    graph_sha256: str  # of the graph it runs (the manifest's record): what Info reports
    instances: int
    threads: int
    load_seconds: float

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def instance(self) -> AbstractContextManager[RunFn]:
        """One model instance held for a block, its `run` given (the warm-up's, one per instance)."""
        ...


BackendFactory = Callable[[ServerConfig, ModelRepository], Backend]


def onnx_backend(config: ServerConfig, repo: ModelRepository) -> Backend:
    """The production backend: ONNX Runtime on the device and precision the settings ask for."""
    return OnnxBackend(repo, config.device, config.threads, config.precision, config.model_instances)


def batch_limits(config: ServerConfig) -> BatchLimits:
    return BatchLimits(
        config.max_batch_tokens,
        config.max_batch_size,
        config.max_queue_delay_ms / 1000,
        config.queue_limit,
        config.max_padding,
        bulk_queue_share=config.bulk_queue_share,
    )


def cpu_warm_shapes(max_rows: int, max_tokens: int, longest: int) -> list[tuple[int, int]]:
    """The (rows, length) batches the CPU warm-up runs: the most rows of the longest inputs, the
    largest footprint a batch within the limits has (attention's scores grow with the square of the
    length), and the most rows the limits allow, at their longest.

    Until 2026-11-28 it ran twelve, each length from 8 to the longest alone and at the budget: 3.7-3.9
    CPU-s a start on two one-thread instances of a Zen 3, where these two take 1.3-1.6. Each
    instance is a session of its own whose arena is nearly empty again after each run, so its
    largest batch sets its footprint: in process (MALLOC_ARENA_MAX=1, as the engine runs), 1,500
    pairs of random batches after each warm-up took resident memory to the same level, 301-302 and
    336 MiB, and both warm-ups left it 11-15 MiB below that, reached in the first 300 pairs.
    """
    rows = min(max_rows, max_tokens)
    return sorted(
        {
            (max(1, min(max_rows, max_tokens // longest)), longest),
            (rows, max(1, min(longest, max_tokens // rows))),
        }
    )


# Batches prepared while every instance computes (Batcher.ahead), by provider. On CUDA one: an H200's
# instance ran 67% of the time, idle while the event loop took, padded and answered batches (2.9 ms a
# batch of 557 sentences; docs/gpu.md). None on the CPU, whose two instances already overlap that
# work, and whose cores the event loop shares with them.
BATCHES_AHEAD = {CUDA_PROVIDER: 1}


class WarmUpError(RuntimeError):
    """A warm-up batch failed: the batch limits ask more than a model instance can run (on CUDA, most
    likely more than its bounded memory arena holds). The message is the one line to show."""


def warm_up_failed(backend: Backend, config: ServerConfig, rows: int, tokens: int, error: Exception) -> str:
    # ORT's message is one long line (the node, a source path, a C++ signature) whose end says what
    # ran out: "Available memory of 311442688 is smaller than requested bytes of 327155712".
    reason = " ".join(str(error).split()) or type(error).__name__
    arena = reason.rfind("Available memory of")
    if arena >= 0:
        reason = f"the CUDA memory arena is full ({reason[arena:]})"
    elif len(reason) > 300:
        reason = "..." + reason[-300:]
    return (
        f"the warm-up batch of {rows} rows x {tokens} tokens failed on {backend.provider}: {reason}; "
        f"the batch limits (--max-batch-size {config.max_batch_size}, --max-batch-tokens "
        f"{config.max_batch_tokens}) ask more than a model instance can run here: lower them"
    )


def warm_up(backend: Backend, config: ServerConfig, longest: int, pool: Executor, threads: int = 0) -> float:
    """Run the largest batches the limits allow on every instance at once, on `pool`: the batcher's
    own model threads, `threads` of them (0: one per instance). Threads beyond the instances (the
    batches prepared ahead, Batcher.ahead) each warm too, an instance held in turn: a model run
    goes to whichever thread is free, and ORT's CUDA provider, by its source (a review's reading,
    not measured), makes per-thread state (cuBLAS and cuDNN handles) at a thread's first run.

    First requests then do not pay for ORT's first-run allocations, and each instance's memory
    arena reaches the footprint of its largest batch before serving. Without the concurrent part the
    600 s soak saw resident memory creep up 6.6% as rarer pairs of big batches met; with it, an
    in-process run of random batches stayed within 0.2%. On the model threads themselves, because
    the kernels keep per-thread scratch buffers: warmed on threads of its own, the engine grew
    another 33 MB at its first flood of 256-token batches (bench/bench_hostile.py). On CUDA, every
    shape bucket the batch limits reach, each at its most tokens (backend.bucket_warm_shapes): the
    GPU memory was flat only after each bucket's largest batch had run (H100, docs/gpu.md). On the
    CPU, two batches (cpu_warm_shapes).
    """
    started = time.perf_counter()
    if backend.provider == CUDA_PROVIDER:
        shapes = bucket_warm_shapes(config.max_batch_size, config.max_batch_tokens, longest)
    else:
        shapes = cpu_warm_shapes(config.max_batch_size, config.max_batch_tokens, longest)

    def one_instance() -> None:
        with backend.instance() as run:  # held throughout: each thread warms an instance of its own
            for batch, length in shapes:
                ids = np.full((batch, length), 1000, dtype=np.int64)
                try:
                    run(ids, np.full(batch, length, dtype=np.int64))
                except Exception as e:
                    raise WarmUpError(warm_up_failed(backend, config, batch, length, e)) from e

    # Submitted together to an idle pool of that many threads: one call on each thread.
    for done in [pool.submit(one_instance) for _ in range(threads or backend.instances)]:
        done.result()
    return time.perf_counter() - started


@dataclass
class Engine:
    config: ServerConfig
    repo: ModelRepository
    backend: Backend
    metrics: Metrics
    # Published for the fronts (in process, a queue of its own nobody reads).
    queue: SharedQueue = field(default_factory=lambda: SharedQueue.local())
    facts: protocol.EngineFacts | None = None
    _waiting: list[bytes] = field(default_factory=list)  # fronts that said HELLO before the warm-up ended
    _requests: dict[tuple[bytes, int], Request] = field(default_factory=dict)
    # Each front index's ZeroMQ identity: a front started again after dying says HELLO with its index
    # from a new identity, and what its predecessor left queued is dropped then (`_forget`).
    _fronts: dict[int, bytes] = field(default_factory=dict)
    _watchdog: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        ahead = BATCHES_AHEAD.get(self.backend.provider, 0)
        self.batcher = Batcher(
            self.backend.run,
            batch_limits(self.config),
            self.metrics,
            workers=self.backend.instances,
            ahead=ahead,
            instance=self.backend.instance if ahead else None,  # else each run takes a free one
            on_depth=self.queue.publish_depth,
            on_pace=self.queue.publish_pace,
        )

    async def serve(
        self, address: str, stop: asyncio.Event, on_ready: Callable[[protocol.EngineFacts], None]
    ) -> None:
        """Answer fronts on `address` until `stop` is set; warm up first (HELLOs wait for it)."""
        context = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.bind(address)
        self._channel = protocol.Channel(sock, self._receive)
        self.batcher.start()
        try:
            longest, pool = self.repo.max_input_tokens, self.batcher.executor
            threads = self.batcher.workers + self.batcher.ahead  # the pool's threads
            warm_s = await asyncio.to_thread(warm_up, self.backend, self.config, longest, pool, threads)
            self.metrics.warmup_seconds.set(warm_s)
            b = self.backend
            self.facts = protocol.EngineFacts(
                b.provider,
                b.precision,
                b.instances,
                b.threads,
                b.load_seconds,
                warm_s,
                os.getpid(),
                self.repo.manifest.tokenizer_sha256,
                self.config.max_batch_size,
                self.config.max_batch_tokens,
                b.graph_sha256,
                onnxruntime.__version__,
            )
            for identity in self._waiting:
                self._channel.send([identity, *protocol.ready(self.facts)])
            self._waiting.clear()
            on_ready(self.facts)
            if self.config.batch_timeout_s:
                self._watchdog = asyncio.create_task(self._watch_runs(self.config.batch_timeout_s))
            await stop.wait()
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            await self.batcher.stop()
            self._channel.close()
            context.term()

    async def _watch_runs(self, limit_s: float) -> None:
        """A model run cannot be cancelled from here: one that outlasts `limit_s` ends the engine,
        so the server exits 1 and is restarted, and the fronts answer UNAVAILABLE at once."""
        while True:
            await asyncio.sleep(min(1.0, limit_s / 4))
            if (running := self.batcher.longest_run_s()) > limit_s:
                log.critical(
                    "a model run has taken %.1fs, over --batch-timeout-s %.1fs: taken as hung; the engine "
                    "exits so the server is restarted",
                    running,
                    limit_s,
                )
                logging.shutdown()
                os._exit(3)

    def _receive(self, message: list[bytes]) -> None:
        identity, *frames = message
        kind = protocol.kind(frames)
        if kind == protocol.SUBMIT:
            self._submit(identity, frames)
        elif kind == protocol.CANCEL:
            request = self._requests.pop((identity, protocol.parse_cancel(frames)), None)
            if request is not None:
                self.batcher.cancel(request)  # its inputs are dropped before compute
        elif kind == protocol.HELLO:
            self._greet(protocol.parse_hello(frames), identity)
            if self.facts is None:
                self._waiting.append(identity)
            else:
                self._channel.send([identity, *protocol.ready(self.facts)])
        else:
            log.error("unknown message kind %r from a front; ignored", kind)

    def _greet(self, front: int, identity: bytes) -> None:
        previous = self._fronts.get(front)
        self._fronts[front] = identity
        if previous is not None and previous != identity:
            self._forget(front, previous)

    def _forget(self, front: int, identity: bytes) -> None:
        """Front `front`'s previous process died (a new one said HELLO): nobody reads its answers, so
        its requests' inputs not yet computed are dropped (counted as cancelled). Left queued, a front
        killed with 344 inputs queued held a call sent after its restart for 25 s."""
        gone = [key for key in self._requests if key[0] == identity]
        for key in gone:
            self.batcher.cancel(self._requests.pop(key))
        if gone:
            log.warning(
                "front %d started again: the %d requests its previous process left are dropped",
                front,
                len(gone),
            )

    def _submit(self, identity: bytes, frames: list[bytes]) -> None:
        message = protocol.parse_submit(frames)
        try:
            rows = Rows(message.lengths, message.ids)
            request = self.batcher.enqueue(rows, message.deadline, message.tag, message.bulk)
        except ServiceError as e:
            self._channel.send([identity, *_failure(message.request_id, e)])
            return
        key = (identity, message.request_id)
        self._requests[key] = request

        def answer(future: asyncio.Future[Done]) -> None:
            self._requests.pop(key, None)
            if not future.cancelled():  # cancelled: the front gave up on it, nobody to answer
                self._channel.send([identity, *_answer(message, future)])

        request.future.add_done_callback(answer)


def _failure(request_id: int, error: ServiceError) -> list[bytes]:
    code, retry = error.code.value[0], error.retry_after_s
    return protocol.failure(request_id, code, str(error), error.reason, error.field, error.metadata, retry)


def _answer(message: protocol.Submit, future: asyncio.Future[Done]) -> list[Any]:
    error = future.exception()
    if isinstance(error, ServiceError):
        return _failure(message.request_id, error)
    if error is not None:
        log.error("request failed in the engine", exc_info=error, extra={"request_id": message.tag})
        return _failure(message.request_id, internal())
    done = future.result()
    vectors = done.embeddings if message.normalize else done.pooled
    return protocol.result(message.request_id, int(done.queue_s * 1e6), int(done.inference_s * 1e6), vectors)


def create_engine(
    config: ServerConfig, backend_factory: BackendFactory, metrics: Metrics, queue: SharedQueue
) -> Engine:
    """Load and verify the model repository and the backend (errors: ModelRepositoryError, ValueError)."""
    repo = open_repository(config.model_dir)
    # The supervisor refused such a budget before any child started (app.check_batch_tokens).
    assert not 0 < config.max_batch_tokens < repo.max_input_tokens, config.max_batch_tokens
    backend = backend_factory(config, repo)
    config = batch_limits_for(config, backend.provider)
    log.info(
        "batches of at most %d rows and %d padded tokens", config.max_batch_size, config.max_batch_tokens
    )
    m = repo.manifest
    metrics.model.labels(m.model_id, m.weights_sha256, backend.precision, backend.provider).set(1)
    metrics.load_seconds.set(backend.load_seconds)
    return Engine(config, repo, backend, metrics, queue)


def run_engine(
    config: ServerConfig,
    address: str,
    queue: SharedQueue,
    beat: Any,
    events: Connection,
    stop_when: Connection,
    backend_factory: BackendFactory,
) -> None:
    """The engine process's main: load, warm up, serve until `stop_when` is readable; errors go to the
    supervisor.

    Signals do not stop it: a SIGTERM sent to the whole process group (a terminal, systemd) must not
    stop the engine while fronts still drain their accepted calls onto it. The supervisor closes
    `stop_when` after the fronts have stopped, and its end (a crash included) closes it too.
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    name_process("embed-engine")
    logs.configure(config.log_level, config.log_format)  # a spawned process starts unconfigured
    dump_stacks_on_signal()

    try:
        engine = create_engine(config, backend_factory, Metrics(), queue)
    except Exception as e:  # reported by the supervisor as one line, exit 2
        events.send(("error", str(e)))
        raise SystemExit(2) from None

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_reader(stop_when.fileno(), stop.set)
        beating: list[asyncio.Task[None]] = []  # held until asyncio.run ends, which cancels it

        def ready(facts: Any) -> None:
            # From here on the supervisor holds the loop to its heartbeat (the warm-up may block it).
            beating.append(asyncio.create_task(heartbeat(beat)))
            events.send(("ready", facts))

        await engine.serve(address, stop, ready)

    try:
        asyncio.run(main())
    except WarmUpError as e:  # before ready: reported by the supervisor as one line, exit 2
        events.send(("error", str(e)))
        raise SystemExit(2) from None
    log.info("engine stopped")
