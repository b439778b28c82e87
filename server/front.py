"""A front process: the gRPC server and the HTTP API (validation, tokenization, responses) over the one
engine.

Several fronts serve one port per protocol (SO_REUSEPORT: the kernel spreads connections over them).
Each listens at once with health NOT_SERVING (HTTP /health 503), says HELLO to the engine, and serves
once the engine answers that it is warm. SIGTERM drains it: NOT_SERVING at once, a moment for
clients' health watches to move new calls elsewhere, then accepted calls (gRPC and HTTP) finish
within the drain timeout (an open EmbedStream answers the requests it has read, then ends
UNAVAILABLE). If the engine process ends, every waiting call gets UNAVAILABLE at once and the front
exits non-zero.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import multiprocessing
import os
import platform
import signal
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import tokenizers
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minilm_embed.model.repository import (
    MANIFEST_FILE,
    Manifest,
    ModelRepositoryError,
    read_manifest,
    verified_tokenizer,
)
from minilm_embed.model.tokenizer import Tokenizer
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server import __version__, logs, protocol
from minilm_embed.server.budget import Budget, held_bytes_budget, request_bytes_budget, tokenizing_budget
from minilm_embed.server.config import ServerConfig
from minilm_embed.server.embedder import Embedder
from minilm_embed.server.errors import cut_at_drain
from minilm_embed.server.health import SERVICE_NAME, StreamLimit, new_health
from minilm_embed.server.http import HttpApi, HttpListener, ModelCard, http_listener
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.place import Place, SharedQueue, dump_stacks_on_signal, heartbeat, reuseport_socket
from minilm_embed.server.proctitle import name_process
from minilm_embed.server.readiness import Readiness
from minilm_embed.server.security import BearerAuth, Secrets, read_secrets
from minilm_embed.server.service import EmbeddingService, register
from minilm_embed.server.tokenization import InputLimits, RequestTokenizer
from minilm_embed.server.transport import EngineClient

if TYPE_CHECKING:
    from minilm_embed.server.tracing import RequestTracer

log = logging.getLogger(__name__)

SHUTDOWN_NOTICE_S = 1.0
DRAIN_CUT_MARGIN_S = 0.5  # before the drain timeout: calls still waiting then are answered, not cut
# Not "restarting": the supervisor exits 1, and only what runs it (Kubernetes, systemd) starts it again.
ENGINE_GONE = (
    "the engine process stopped; this server is stopping (exit 1): retry, on another replica or once "
    "it is started again"
)
_POOLING = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS}
_PRECISION = {"fp32": pb.PRECISION_FP32, "fp16": pb.PRECISION_FP16, "int8": pb.PRECISION_INT8}


@dataclass
class Front:
    config: ServerConfig
    server: grpc.aio.Server
    port: int
    service: EmbeddingService
    engine: EngineClient
    readiness: Readiness
    manifest: Manifest
    health_calls: StreamLimit
    http: HttpListener | None = None


# Health's and reflection's calls, beyond the service's own places, that gRPC admits (health.StreamLimit
# refuses the rest at once): LONG_LIVED_CALLS streams clients hold open (health Watch, reflection's
# ServerReflectionInfo), and HEALTH_CHECKS more for Check, which probes use. The project's client holds
# one Watch per connection (its channel's health checking): at 32 streams a front, the 33rd client's
# connection was refused its Watch and its calls UNAVAILABLE, and 32 anonymous streams did it to every
# new client (an acceptance pass). As many as --http-max-connections' default: a connection each.
LONG_LIVED_CALLS = 1024
HEALTH_CHECKS = 32
OTHER_CALLS = LONG_LIVED_CALLS + HEALTH_CHECKS
# More of gRPC's places, for calls on their way to being refused at once by the service's places or by
# StreamLimit (each frees its place as it is refused): with gRPC's cap exactly the sum of both counts,
# a client holding every embedding place and every health place with calls that sent no message had
# a probe's Check refused by gRPC itself ("Concurrent RPC limit exceeded!"), before StreamLimit could
# give it the place of a call waiting for its message (a review; auth is off by default).
REFUSING_CALLS = 64


# Half the 10 s floor of grpc-go's and grpc-java's client keepalive: a ping a little early (timer
# jitter) is not a strike, and strikes add up over an idle connection's life.
MIN_CLIENT_PING_MS = 5000
# How long a pinged client may take to answer (gRPC's default), before its connection is closed; at
# most --keepalive-s itself.
KEEPALIVE_TIMEOUT_MS = 20_000


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    age_ms = int(config.max_connection_age_s * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        # Closing connections at a maximum age makes clients re-resolve DNS and spread over new pods.
        # No grace limit (gRPC's default: unlimited): the GOAWAY at that age stops new calls on the
        # connection, and the calls open on it, a long EmbedStream too, end as they would have.
        ("grpc.max_connection_age_ms", age_ms),
        # Clients' keepalive pings: one every MIN_CLIENT_PING_MS, with or without a call open. gRPC's
        # default allows one per 5 minutes and none on an idle connection: a client pinging as Go's
        # and Java's allow (every 10 s) was sent GOAWAY too_many_pings at its third ping, its idle
        # connection dropped and an open EmbedStream cut with UNAVAILABLE "Too many pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
        *keepalive_options(config.keepalive_s),
        # Every front binds the same port; the supervisor holds it reserved (see app.py).
        ("grpc.so_reuseport", 1),
        # No HTTP/2 BDP probing: with it gRPC widens every stream's receive window, and reads the
        # messages of calls it has not handed to a handler yet, refused ones included: 1,200
        # callers of 2 MiB took a bare server to 1.9 GB under a 64-call cap, 267 MB without it.
        # A call being read opens its window to the whole message anyway.
        ("grpc.http2.bdp_probe", 0),
    ]


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """The server's own pings (gRPC's default: every 2 hours): a peer gone without a FIN holds its open
    calls' places, an EmbedStream's or a health Watch's, until one goes unanswered."""
    every_ms = int(keepalive_s * 1000)
    timeout_ms = min(KEEPALIVE_TIMEOUT_MS, every_ms)
    return [
        ("grpc.keepalive_time_ms", every_ms),
        # gRPC 1.85 waits for a keepalive ping's answer as for any ping, ping_timeout_ms (60 s), not
        # keepalive_timeout_ms alone (seen in its http_keepalive trace): both are set.
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),  # else 2 pings, then none until a data frame
    ]


def build_info(
    config: ServerConfig, manifest: Manifest, facts: protocol.EngineFacts, vocab: int
) -> pb.InfoResponse:
    limits = pb.Limits(
        max_inputs_per_request=config.max_inputs_per_request,
        max_input_tokens=manifest.config.max_seq_length,
        max_text_chars=config.max_text_chars,
        max_batch_tokens=facts.max_batch_tokens,
        max_batch_size=facts.max_batch_size,
        max_queue_delay_us=int(config.max_queue_delay_ms * 1000),
        queue_limit=config.queue_limit,
        max_message_bytes=config.max_message_bytes,
        max_stream_in_flight=config.max_stream_in_flight,
        bulk_queue_share=config.bulk_queue_share,
    )
    versions = {
        "server": __version__,
        "onnxruntime": facts.onnxruntime_version,
        "grpcio": grpc.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }
    return pb.InfoResponse(
        model_id=manifest.model_id,
        weights_sha256=manifest.weights_sha256,
        onnx_sha256=facts.graph_sha256,
        dimensions=manifest.config.hidden_size,
        max_input_tokens=manifest.config.max_seq_length,
        vocab_size=vocab,
        pooling=_POOLING[manifest.config.pooling],
        normalize_default=True,
        precision=_PRECISION[facts.precision],
        execution_provider=facts.provider,
        limits=limits,
        versions=versions,
        model_instances=facts.instances,
        threads_per_instance=facts.threads,
    )


def model_card(config: ServerConfig, manifest: Manifest) -> ModelCard:
    created = int((config.model_dir / MANIFEST_FILE).stat().st_mtime)
    return ModelCard(manifest.model_id, created, manifest.config.hidden_size)


def create_http(
    config: ServerConfig, address: str, embedder: Embedder, manifest: Manifest, token: str | None
) -> HttpListener:
    """The HTTP API over the same Embedder as gRPC, on `address` (not yet started)."""
    api = HttpApi(
        embedder,
        embedder.metrics,
        model_card(config, manifest),
        token,
        config.max_message_bytes,
        config.http_body_timeout_s,
        config.drain_timeout_s,
    )
    return http_listener(api, reuseport_socket(address), config)


def create_front(
    config: ServerConfig,
    index: int,
    address: str,
    engine_address: str,
    queue: SharedQueue,
    http_address: str = "",
    tracer: RequestTracer | None = None,
    secrets: Secrets | None = None,
) -> Front:
    """Build one front's gRPC server bound to `address` and, given `http_address`, its HTTP API (not yet
    started; port 0 picks a free port); with a tracer, every gRPC call is traced (server/tracing.py).
    `secrets`: the token and TLS files as the supervisor read them at start; None (a front built in
    process) reads them from the settings here."""
    if secrets is None:
        secrets = read_secrets(config)
    metrics = Metrics()
    manifest = read_manifest(config.model_dir)
    max_tokens = manifest.config.max_seq_length
    tokenizer = Tokenizer(verified_tokenizer(config.model_dir, manifest), max_tokens)
    limits = InputLimits(config.max_inputs_per_request, max_tokens, config.max_text_chars)
    engine = EngineClient(
        engine_address,
        index,
        manifest.config.hidden_size,
        config.queue_limit,
        config.bulk_queue_share,
        queue,
        metrics,
    )
    health = new_health()
    readiness = Readiness(health, metrics)
    embedder = Embedder(
        RequestTokenizer(tokenizer, limits),
        engine,
        metrics,
        readiness,
        tokenizing_budget(config.max_tokenizing_chars),
        request_bytes_budget(config.max_request_bytes_in_flight),
        held_bytes_budget(config.max_request_bytes_held),
        tracer=tracer,
    )
    service = EmbeddingService(
        embedder,
        metrics,
        config.max_stream_in_flight,
        config.max_message_bytes,
        config.max_concurrent_calls,
        config.max_waiting_calls,
        config.message_timeout_s,
    )
    token = secrets.token
    interceptors: list[Any] = [tracer.interceptor()] if tracer else []  # its span covers refusals too
    health_calls = StreamLimit(OTHER_CALLS, LONG_LIVED_CALLS, config.message_timeout_s)
    interceptors.append(health_calls)
    interceptors += [BearerAuth(token, metrics)] if token else []
    # gRPC's own cap on calls, over every service: the backstop for what the service's places and
    # StreamLimit count (each of which gRPC reads whole as well), so neither takes the other's, and
    # room for the calls they refuse at once to reach them.
    calls = config.max_concurrent_calls + config.max_waiting_calls + OTHER_CALLS + REFUSING_CALLS
    server = grpc.aio.server(
        options=grpc_options(config), interceptors=interceptors, maximum_concurrent_rpcs=calls
    )
    register(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server
    )
    credentials = secrets.credentials()
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    http = None
    if http_address:  # its TLS from the bytes read at start, not from the settings' files
        http_config = secrets.with_tls_files(config)
        http = create_http(http_config, http_address, embedder, manifest, token)
    return Front(config, server, port, service, engine, readiness, manifest, health_calls, http)


async def start(front: Front) -> protocol.EngineFacts:
    """Listen at once (health answers NOT_SERVING), wait for the engine to be warm, then serve."""
    await front.readiness.not_serving("the model is warming up", "WARMING_UP")
    await front.server.start()
    if front.http is not None:
        front.http.start()
    front.engine.connect()
    facts = await front.engine.hello()
    if facts.tokenizer_sha256 != front.manifest.tokenizer_sha256:
        raise ModelRepositoryError(
            f"{front.config.model_dir}: its tokenizer.json (sha256 {front.manifest.tokenizer_sha256}) is "
            f"not the one the engine serves with ({facts.tokenizer_sha256}): the repository changed "
            "while the server ran; restart the server"
        )
    vocab = front.service.embedder.tokenizer.vocab_size
    front.service.info = build_info(front.config, front.manifest, facts, vocab)
    await front.readiness.serving()
    return facts


async def drain(
    front: Front,
    index: int,
    reason: str = "the server is shutting down",
    error_reason: str = "SHUTTING_DOWN",
) -> None:
    """NOT_SERVING, then let clients move away before the listener closes, then finish accepted calls.

    Logs what it waits for and how long each API took, and says when the drain timeout cut calls off
    (gRPC then cancels them; uvicorn cancels its requests): a front that never served says nothing,
    so a server that cannot start stops with its one line of why."""
    served = front.readiness.ready
    await front.readiness.not_serving(reason, error_reason)
    # A call that arrives in the instant the server stops is cancelled by gRPC (not retried), so
    # clients' health watches get a moment to move new calls elsewhere first. Not when the supervisor
    # is gone (killed): the engine stops with it, so there is nothing to serve, and a server started
    # again 0.2 s after the kill found the port still held (an operator's pass): "in use", exit 2.
    if not supervisor_gone():
        await asyncio.sleep(min(SHUTDOWN_NOTICE_S, front.config.drain_timeout_s))
    places = front.service.places
    # Health and reflection calls are open too: one whose client stopped reading its answers cannot
    # be sent its end past them, and holds the drain to its timeout (a review: "drained in 20.00s").
    health = front.health_calls.open
    if served:
        http = f", {front.http.calls} HTTP calls being served" if front.http is not None else ""
        log.info(
            "front %d: draining: %d gRPC calls being served, %d waiting%s, %d health and reflection calls",
            index,
            places.taken,
            places.waiting,
            http,
            health,
        )
    # An open Watch, reflection stream or EmbedStream would hold the drain to its timeout: each ends
    # (UNAVAILABLE), an EmbedStream once the requests it has read are answered, and so does a health
    # call still waiting for its message.
    front.readiness.health.end_watches()
    front.health_calls.end_all(reason)
    front.service.end_streams()
    timeout = front.config.drain_timeout_s

    # Just before gRPC and uvicorn cancel what is still open, the calls waiting for the engine get
    # UNAVAILABLE (HTTP 503 in OpenAI's shape, Retry-After) naming why: cancelled by uvicorn, an HTTP
    # call got a bare 500 and a 40-line traceback in the log.
    def cut_off() -> None:
        if front.http is not None:
            front.http.api.cut_off = True  # what uvicorn cancels next is answered 503, not 500
        if waiting := front.engine.engine_gone(cut_at_drain(timeout), "SHUTTING_DOWN"):
            log.warning(
                "front %d: %d calls still waiting for the engine at the drain timeout (%gs) were answered "
                "UNAVAILABLE",
                index,
                waiting,
                timeout,
            )

    cut = asyncio.get_running_loop().call_later(
        max(0.0, timeout - min(DRAIN_CUT_MARGIN_S, timeout / 10)), cut_off
    )
    # What was open as the listeners stop: at --drain-timeout-s 0 every stop takes "the timeout", and
    # said that calls were cancelled when none was open.
    open_calls = {"gRPC": places.taken + places.waiting + health}
    stopping = {"gRPC": _seconds(front.server.stop(timeout))}
    if front.http is not None:
        open_calls["HTTP"] = front.http.calls
        stopping["HTTP"] = _seconds(front.http.stop())
    took = dict(zip(stopping, await asyncio.gather(*stopping.values()), strict=True))
    cut.cancel()
    if not served:
        return
    for api, seconds in took.items():
        if seconds >= timeout and open_calls[api]:
            log.warning(
                "front %d: %s: calls open past the drain timeout (%.0fs) were cancelled", index, api, timeout
            )
        else:
            log.info("front %d: %s drained in %.2fs", index, api, seconds)


def supervisor_gone() -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


async def _seconds(awaitable: Awaitable[None]) -> float:
    started = time.monotonic()
    await awaitable
    return time.monotonic() - started


# Checked ten times a second: at 1 s, a flood of 1,200 callers' 2 MiB requests (most refused after
# they were read) left ~250 MB more of them in cycles between two checks.
RECLAIM_EVERY_S = 0.1
RECLAIM_AFTER_BYTES = 64 << 20
# Seconds into a quiet spell (nothing received, nothing being answered): each of the first five. With
# only 1 and 5, the front held 30-80 MB more through the 5 s after a flood (freed after the first
# trim, handed back only at the last), past the hostile test's 10% (a CI run).
RECLAIM_QUIET_S = (1, 2, 3, 4, 5)


async def reclaim_memory(received: Budget) -> None:
    """A garbage collection, then glibc's malloc_trim: after every 64 MB of requests received
    (`received.asked`: admitted or refused), and each of the first 5 s of the quiet after them (nothing
    received and the last request answered: those admitted in a flood wait seconds for the engine
    after it, holding their text; the later times catch what is freed after the first, e.g. when
    gRPC lets go of the callers' connections).

    Large requests end up in reference cycles inside grpc.aio's call handling (a refused 2 MB
    request is one), which only the cyclic collector frees, and it runs by object counts, blind to
    megabytes: a flood of 16 callers' refused 8 MB requests held 200+ MB more after each flood
    until this ran. malloc_trim hands the freed pages back: the fronts' heap keeps large blocks
    (mapping each one on its own made every 2 MB request cost a fresh mmap, its page faults and an
    munmap: a third of the requests a front could read in a flood, bench/bench_hostile.py). Objects
    from before serving are frozen out of the collector (`gc.freeze` in serve_front): a collection
    took 40-60 ms of the event loop without that, ~15 ms with it.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    reclaimed = previous = received.asked
    # Checks since requests last came in or were being answered; None before the first request and
    # once the quiet spell's last trim is done.
    quiet: int | None = None
    quiet_due = [round(s / RECLAIM_EVERY_S) for s in RECLAIM_QUIET_S]
    while True:
        await asyncio.sleep(RECLAIM_EVERY_S)
        now = received.asked
        if now != previous or received.open:
            quiet = 0
        elif quiet is not None:
            quiet += 1
        previous = now
        due = now - reclaimed >= RECLAIM_AFTER_BYTES or quiet in quiet_due
        if quiet == quiet_due[-1]:
            quiet = None  # this quiet spell is done with: nothing more to hand back until requests come
        if due:
            reclaimed = now
            gc.collect()
            if trim is not None:  # off the event loop: ctypes releases the GIL during the call
                await asyncio.to_thread(trim, 0)


def watch_process(pid: int, on_exit: Any) -> None:
    """Call `on_exit` on the event loop the moment process `pid` ends (a pidfd; Linux >= 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:  # ENOSYS before Linux 5.3, or a seccomp profile that refuses the call
        raise OSError(
            e.errno,
            f"pidfd_open failed ({e.strerror}): a front watches the engine through a pidfd, which needs "
            "Linux 5.3 or later and a seccomp profile that allows pidfd_open",
        ) from None
    loop = asyncio.get_running_loop()

    def ended() -> None:
        loop.remove_reader(fd)
        on_exit()

    loop.add_reader(fd, ended)


def start_tracing(config: ServerConfig) -> RequestTracer | None:
    """Tracing when an OTLP endpoint is set; otherwise OpenTelemetry is never imported."""
    if not config.otlp_endpoint:
        return None
    from minilm_embed.server.tracing import otlp_tracer

    return otlp_tracer(config.otlp_endpoint)


async def serve_front(config: ServerConfig, place: Place, secrets: Secrets) -> int:
    index = place.index
    tracer = start_tracing(config)
    front = create_front(
        config, index, place.address, place.engine_address, place.queue, place.http_address, tracer, secrets
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    outcome = {"code": 0}

    def engine_gone() -> None:
        # An engine that never became ready failed to start: the supervisor reports why, in one line.
        if front.readiness.ready:
            log.error("front %d: %s", index, ENGINE_GONE)
        front.engine.engine_gone(ENGINE_GONE)
        outcome["code"] = 1
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if TERMINATED.is_set():  # SIGTERM came while the front was being built
        stop.set()
    watch_process(place.engine_pid, engine_gone)
    parent = multiprocessing.parent_process()
    if parent is not None:

        def orphaned() -> None:
            log.error("front %d: the supervisor is gone (killed?): stopping at once", index)
            loop.remove_reader(parent.sentinel)
            stop.set()

        loop.add_reader(parent.sentinel, orphaned)
    # Every request is asked of the held budget first, admitted or refused.
    reclaiming = asyncio.create_task(reclaim_memory(front.service.embedder.held_bytes))
    starting = asyncio.create_task(start(front))
    stopping = asyncio.create_task(stop.wait())
    beating: list[asyncio.Task[None]] = []
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and not starting.cancelled() and starting.exception() is None:
        place.events.send(("serving", index, front.port))
        beating.append(asyncio.create_task(heartbeat(place.beat)))  # until the process ends
        gc.collect()
        gc.freeze()  # what exists now lives as long as the process: the collector skips it from here on
        await stopping
    elif starting.done() and not outcome["code"]:  # not the engine's end: a failure to start
        reclaiming.cancel()
        starting.result()  # raises it: run_front reports it to the supervisor
    starting.cancel()
    reclaiming.cancel()
    try:
        if outcome["code"]:
            await drain(front, index, ENGINE_GONE, "ENGINE_STOPPED")
        else:
            await drain(front, index)
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # export what is buffered, for at most FLUSH_S
    except Exception:  # logged here, not sent as a start-up failure: that would end the whole server
        log.exception("front %d: the drain failed", index)
        return 1
    return outcome["code"]


# Set by a SIGTERM that comes before the front's event loop takes the signal over: the front then
# drains as soon as it can (and exits 0), instead of dying of the signal's default action.
TERMINATED = threading.Event()


def run_front(config: ServerConfig, place: Place, secrets: Secrets) -> None:
    """A front process's main (multiprocessing target)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: TERMINATED.set())
    # Ctrl-C and a closed terminal's SIGHUP reach the whole group: the supervisor decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    name_process(f"embed-front-{place.index}")
    configure_logging(config)
    dump_stacks_on_signal()
    try:
        code = asyncio.run(serve_front(config, place, secrets))
    except Exception as e:  # a setting or file that cannot be used: the supervisor reports it
        place.events.send(("error", str(e)))
        raise SystemExit(2) from None
    raise SystemExit(code)


def configure_logging(config: ServerConfig) -> None:
    logs.configure(config.log_level, config.log_format)
