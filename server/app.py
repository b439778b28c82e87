"""Build, start and stop the server. `create_app` is separate from `serve` so tests bind port 0."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import onnxruntime
import tokenizers
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from model.tokenizer import Tokenizer
from proto.embedding.v1 import embedding_pb2 as pb
from server import __version__
from server.backend import ModelRepository, OnnxBackend, open_repository
from server.batcher import Batcher, BatchLimits, RunFn
from server.config import ServerConfig
from server.health import SERVICE_NAME, new_health, set_serving
from server.metrics import Metrics, serve_metrics
from server.security import BearerAuth, load_token, server_credentials
from server.service import EmbeddingService, Readiness, register
from server.tokenization import InputLimits, RequestTokenizer

log = logging.getLogger(__name__)

SHUTDOWN_NOTICE_S = 1.0
_POOLING = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS}
_PRECISION = {"fp32": pb.PRECISION_FP32, "fp16": pb.PRECISION_FP16, "int8": pb.PRECISION_INT8}


@dataclass
class App:
    config: ServerConfig
    server: grpc.aio.Server
    port: int
    health: object
    batcher: Batcher
    backend: OnnxBackend
    readiness: Readiness
    metrics: Metrics
    repo: ModelRepository


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    age_ms = int(config.max_connection_age_s * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        # Closing connections at a maximum age makes clients re-resolve DNS and spread over new pods.
        ("grpc.max_connection_age_ms", age_ms),
        ("grpc.max_connection_age_grace_ms", int(config.drain_timeout_s * 1000)),
        ("grpc.so_reuseport", 0),
    ]


def _info(config: ServerConfig, repo: ModelRepository, backend: OnnxBackend, vocab: int) -> pb.InfoResponse:
    m = repo.manifest
    limits = pb.Limits(
        max_inputs_per_request=config.max_inputs_per_request,
        max_input_tokens=repo.max_input_tokens,
        max_text_chars=config.max_text_chars,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_size=config.max_batch_size,
        max_queue_delay_us=int(config.max_queue_delay_ms * 1000),
        queue_limit=config.queue_limit,
        max_message_bytes=config.max_message_bytes,
        max_stream_in_flight=config.max_stream_in_flight,
    )
    versions = {
        "server": __version__,
        "onnxruntime": onnxruntime.__version__,
        "grpcio": grpc.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }
    return pb.InfoResponse(
        model_id=m["model_id"],
        weights_sha256=m["weights_sha256"],
        onnx_sha256=m["onnx_sha256"],
        dimensions=repo.dimensions,
        max_input_tokens=repo.max_input_tokens,
        vocab_size=vocab,
        pooling=_POOLING[m["pooling"]],
        normalize_default=True,
        precision=_PRECISION[backend.precision],
        execution_provider=backend.provider,
        limits=limits,
        versions=versions,
        model_instances=backend.instances,
        threads_per_instance=backend.threads,
    )


def _with_fault(run: RunFn, fault_ids: list[int] | None) -> RunFn:
    """Test-only (off unless --fault-text is set): fail any batch that holds the fault input."""
    if not fault_ids:
        return run
    n = len(fault_ids)

    def faulty(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        for row, length in zip(ids, lengths, strict=True):
            if length == n and row[:n].tolist() == fault_ids:
                raise RuntimeError("injected backend fault")
        return run(ids, lengths)

    return faulty


def create_app(config: ServerConfig, metrics: Metrics | None = None) -> App:
    """Load the model and build the server, not yet started; port 0 in the address picks a free port."""
    metrics = metrics or Metrics()
    repo = open_repository(config.model_dir)
    if config.max_batch_tokens < repo.max_input_tokens:
        raise ValueError(
            f"max_batch_tokens {config.max_batch_tokens} cannot hold one input of "
            f"max_input_tokens {repo.max_input_tokens}"
        )
    backend = OnnxBackend(repo, config.device, config.threads, config.precision, config.model_instances)
    tokenizer = Tokenizer(repo.directory / "tokenizer.json", repo.max_input_tokens)
    limits = InputLimits(config.max_inputs_per_request, repo.max_input_tokens, config.max_text_chars)
    request_tokenizer = RequestTokenizer(tokenizer, limits)
    fault_ids = tokenizer.encode([config.fault_text]).ids[0] if config.fault_text else None
    batch_limits = BatchLimits(
        config.max_batch_tokens,
        config.max_batch_size,
        config.max_queue_delay_ms / 1000,
        config.queue_limit,
        config.max_padding,
    )
    batcher = Batcher(_with_fault(backend.run, fault_ids), batch_limits, metrics, workers=backend.instances)
    readiness = Readiness()
    info = _info(config, repo, backend, tokenizer.vocab_size)
    service = EmbeddingService(
        request_tokenizer, batcher, info, metrics, readiness, config.max_stream_in_flight
    )
    token = load_token(config.auth_token, config.auth_token_file)
    interceptors = [BearerAuth(token, metrics)] if token else []
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
    register(service, server)
    health = new_health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    if credentials is None:
        port = server.add_insecure_port(config.address)
    else:
        port = server.add_secure_port(config.address, credentials)
    metrics.model.info(
        {
            "model_id": info.model_id,
            "sha256": info.weights_sha256,
            "precision": backend.precision,
            "provider": backend.provider,
        }
    )
    metrics.load_seconds.set(backend.load_seconds)
    return App(config, server, port, health, batcher, backend, readiness, metrics, repo)


def warm_up(app: App) -> float:
    """Run representative shapes, up to the batch budget, on every instance at once.

    First requests then do not pay for ORT's first-run allocations, and its memory arena reaches
    the high-water mark of concurrent full batches before serving. Without the concurrent part the
    600 s soak saw resident memory creep up 6.6% as rarer pairs of big batches met; with it, an
    in-process run of random batches stayed within 0.2%.
    """
    started = time.perf_counter()
    longest = app.repo.max_input_tokens
    shapes = []
    for length in (8, 16, 32, 64, 128, longest):
        rows = max(1, min(app.config.max_batch_size, app.config.max_batch_tokens // length))
        shapes += [(batch, length) for batch in sorted({1, rows})]

    def one_instance() -> None:
        for batch, length in shapes:
            ids = np.full((batch, length), 1000, dtype=np.int64)
            app.backend.run(ids, np.full(batch, length, dtype=np.int64))

    with ThreadPoolExecutor(app.backend.instances, thread_name_prefix="warm-up") as pool:
        for done in [pool.submit(one_instance) for _ in range(app.backend.instances)]:
            done.result()
    return time.perf_counter() - started


async def start(app: App) -> None:
    """Listen at once (health answers NOT_SERVING), warm up, then serve."""
    await set_serving(app.health, False)
    await app.server.start()
    log.info("listening on port %d; warming up", app.port)
    app.batcher.start()
    seconds = await asyncio.to_thread(warm_up, app)
    app.metrics.warmup_seconds.set(seconds)
    app.readiness.ready = True
    app.metrics.ready.set(1)
    await set_serving(app.health, True)
    log.info(
        "serving %s on port %d with %s (warm-up %.2fs)",
        app.repo.manifest["model_id"],
        app.port,
        app.backend.provider,
        seconds,
    )


async def shutdown(app: App) -> None:
    """Health NOT_SERVING, refuse new calls, let in-flight calls finish within the drain timeout."""
    app.readiness.ready = False
    app.readiness.reason = "the server is shutting down"
    app.metrics.ready.set(0)
    await set_serving(app.health, False)
    # Let clients' health watches move new calls elsewhere before the listener closes: a call that
    # arrives in the instant the server stops is cancelled by gRPC, and CANCELLED is not retried.
    await asyncio.sleep(min(SHUTDOWN_NOTICE_S, app.config.drain_timeout_s))
    await app.server.stop(app.config.drain_timeout_s)
    await app.batcher.stop()
    log.info("stopped")


async def serve(config: ServerConfig) -> None:
    app = create_app(config)
    if config.metrics_address:
        port = serve_metrics(app.metrics, config.metrics_address)
        log.info("metrics on :%d/metrics", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await start(app)
    await stop.wait()
    log.info("signal received: draining for up to %.0fs", config.drain_timeout_s)
    await shutdown(app)


def configure_process(config: ServerConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The tokenizer's own thread pool would compete with ONNX Runtime's threads for the same cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
