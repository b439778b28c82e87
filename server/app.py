"""The supervisor: one engine process, N front processes on one port, one /metrics; signals and deaths.

    minilm-embed-serve  ->  supervisor ─┬─ engine   (batcher + ONNX Runtime; the only process on the device)
                                      ├─ front 0  (gRPC + HTTP: validate, tokenize, respond) ─┐
                                      └─ front N-1                                            ┴─ one port each

Fronts talk to the engine over ZeroMQ on a Unix socket (protocol.py). The supervisor reserves the
gRPC port and the HTTP port (SO_REUSEPORT, so every front can bind them, and port 0 resolves once for
all), serves /metrics summed over every process (prometheus_client's multiprocess mode), and
watches its children:
- SIGTERM, SIGINT or SIGHUP: every front drains (NOT_SERVING, accepted calls finish), then the engine stops;
  exit 0. A second one meanwhile (Ctrl-C twice) kills every child at once, cutting the calls in
  flight; exit 128 + its number (130 for SIGINT), as a death by that signal reads in a shell.
- a front that dies is started again on the same port (capacity never shrinks silently), after a
  backoff that grows while it keeps dying, and counted (embed_front_restarts_total);
- the engine dying: every front answers UNAVAILABLE at once and exits; the supervisor exits 1 so
  the orchestrator restarts the server.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import fcntl
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import multiprocess

from minilm_embed.model.host import gpu_present, usable_cores
from minilm_embed.model.repository import CUDA_PROVIDER, read_manifest
from minilm_embed.server import logs, signals
from minilm_embed.server.config import (
    ConfigError,
    ListenAddress,
    ServerConfig,
    env_name,
    setting,
    unknown_variables,
)
from minilm_embed.server.metrics import SupervisorMetrics
from minilm_embed.server.place import DUMP_SIGNAL, HEARTBEAT_S, Place, SharedQueue, reuseport_socket
from minilm_embed.server.security import Secrets, read_secrets

if TYPE_CHECKING:
    from minilm_embed.server.engine import BackendFactory

log = logging.getLogger(__name__)

STOP_MARGIN_S = 10.0  # beyond the drain timeout, before a child that will not stop is killed
# A further stop signal this soon after the one that began the stop is the same stop: process managers
# (honcho, foreman, some CI runners) signal the process group and forward the signal too.
SAME_STOP_S = 1.0
# glibc's allocator in the fronts (read when they start): two arenas, not one per thread. Large
# blocks (requests, texts) stay in the heap and front.reclaim_memory hands freed pages back with
# malloc_trim. Mapping each block of 64 kB or more on its own (MALLOC_MMAP_THRESHOLD_) gave memory
# back at once, but every 2 MB request then cost an mmap, its page faults and an munmap: a front in a
# flood read a third of the requests it reads now, and a probe waited 100 ms (bench/bench_hostile.py).
FRONT_MALLOC = {"MALLOC_ARENA_MAX": "2"}
# ...and in the engine: one arena for all its threads. With one per thread (glibc's default), the
# batcher's and ONNX Runtime's threads left freed memory in heaps of their own, and a warm engine
# under the soak's load grew in steps of 3-36 MB (a 64 MB thread heap filling) at a random moment of
# its first minute; with one arena it stayed flat, at the same throughput (the arena of ONNX
# Runtime's own allocator keeps tensors off malloc).
ENGINE_MALLOC = {"MALLOC_ARENA_MAX": "1"}
# A dead front is started again after RESTART_FIRST_S, doubling up to RESTART_MAX_S while it keeps
# dying: a front that dies at start-up, or on a request that clients keep retrying, must not spin
# the supervisor and the engine's hello. Once a front has served for RESTART_RESET_S, its next death
# is a new incident and waits RESTART_FIRST_S again.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0


class StartupError(Exception):
    """A child could not start (a setting or file it cannot use); the message says why."""


def plan_fronts(config: ServerConfig, cores: int) -> int:
    """Front processes: as set, or auto: on CUDA half the cores (at most 8), on the CPU one. `cores`
    is what `usable_cores` says: a pod's CPU limit, not its node's cores.

    On the CPU provider the model's own cost dwarfs the front's, and the cores are the model's: a
    second front added little or lost on 2 cores (docs/benchmarks.md, "Scaling across cores").
    """
    if config.front_processes:
        return config.front_processes
    if cuda_first(config.device):
        return max(1, min(8, cores // 2))
    return 1


def cuda_first(device: str) -> bool:
    """Whether the engine will ask for CUDA first (backend.wanted_providers). ONNX Runtime is imported
    only on a host with an NVIDIA driver: the supervisor does not load it otherwise."""
    if device != "auto":
        return device == "cuda"
    if not gpu_present():
        return False
    from minilm_embed.server.backend import wanted_providers

    return wanted_providers("auto")[0] == CUDA_PROVIDER


def engine_process(
    config: ServerConfig,
    address: str,
    queue: SharedQueue,
    beat: Any,
    events: Connection,
    stop_when: Connection,
    backend_factory: BackendFactory | None,
) -> None:
    """The engine process's target: its modules (ONNX Runtime, the batcher) are imported there only."""
    from minilm_embed.server.engine import onnx_backend, run_engine

    run_engine(config, address, queue, beat, events, stop_when, backend_factory or onnx_backend)


def front_process(config: ServerConfig, place: Place, secrets: Secrets) -> None:
    """A front process's target: its modules (gRPC's server, HTTP, the tokenizer) are imported there only."""
    from minilm_embed.server.front import run_front

    run_front(config, place, secrets)


def restart_delay(previous: float, served_s: float) -> float:
    """Seconds before a dead front starts again: RESTART_FIRST_S, then double the previous delay up to
    RESTART_MAX_S, and RESTART_FIRST_S again for a front that served RESTART_RESET_S before it died."""
    if previous <= 0.0 or served_s >= RESTART_RESET_S:
        return RESTART_FIRST_S
    return min(RESTART_MAX_S, 2.0 * previous)


def cannot_listen(name: str, where: ListenAddress, error: OSError) -> ConfigError:
    """The one line for an address a setting names that cannot be listened on."""
    if error.errno == errno.EADDRINUSE:
        return ConfigError(f"{setting(name)} {where} is in use: another server listening there?")
    if isinstance(error, socket.gaierror):
        return ConfigError(f"{setting(name)} {where}: cannot resolve {where.host!r} ({error.strerror})")
    return ConfigError(f"{setting(name)} {where}: cannot listen there ({error.strerror or error})")


def check_ports(config: ServerConfig) -> None:
    """Refuse an address another process listens on, before any socket of ours is bound.

    Our own sockets take SO_REUSEPORT (every front binds the port), and so would a stale second server
    started as the same user: the kernel would share the port between the two, silently. A probe
    without it is refused by any listener there; with SO_REUSEADDR, connections of ours left in
    TIME_WAIT are not, as our listeners set it too (reuseport_socket; gRPC's own)."""
    for name, where in config.listen_addresses().items():
        with socket.socket(where.family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((where.host, where.port))
            except OSError as e:
                raise cannot_listen(name, where, e) from None


def check_cores(config: ServerConfig, cores: int) -> None:
    """Refuse --threads, --model-instances or --front-processes above `cores` (usable_cores: the CPU
    affinity, at most the cgroup's CPU limit), and warn when both of the first two set ask for more
    threads than that.

    ONNX Runtime starts every thread asked for (a user-acceptance pass reported --threads 100000
    hanging or exhausting the machine), and the supervisor every front: --front-processes 1000 on 2
    cores started a process for each (about 94 MiB resident once serving) until the machine ran out of
    memory and even SIGTERM took minutes. More of any of them than cores cannot run at once: they only
    take turns.
    """
    for name in ("threads", "model_instances", "front_processes"):
        value = getattr(config, name)
        if value > cores:
            raise ConfigError(
                f"{setting(name)} {value} is more than the {cores} cores this server may use (its CPU "
                "affinity, at most its cgroup's CPU limit)"
            )
    if config.threads * config.model_instances > cores:
        log.warning(
            "--threads %d x --model-instances %d is %d threads on %d usable cores: they will take turns",
            config.threads,
            config.model_instances,
            config.threads * config.model_instances,
            cores,
        )


def check_batch_tokens(config: ServerConfig, max_input_tokens: int) -> None:
    """Refuse a token budget that cannot hold one input of the model's longest: found before any
    child starts (the engine found it after the fronts had started, naming no flag)."""
    if 0 < config.max_batch_tokens < max_input_tokens:
        raise ConfigError(
            f"{setting('max_batch_tokens')} {config.max_batch_tokens} cannot hold one input of the "
            f"model's max_input_tokens {max_input_tokens}: set at least {max_input_tokens}, or 0 (auto)"
        )


def warn_of_limits(config: ServerConfig) -> None:
    """A request within max_inputs_per_request that can never fit the queue is refused OVER_QUEUE_LIMIT:
    legitimate (a small queue refuses sooner), but clients sized by the advertised limit meet it."""
    if config.queue_limit < config.max_inputs_per_request:
        log.warning(
            "%s %d is below %s %d: requests of more than %d inputs are refused (OVER_QUEUE_LIMIT); "
            "clients read both in Info.limits",
            setting("queue_limit"),
            config.queue_limit,
            setting("max_inputs_per_request"),
            config.max_inputs_per_request,
            config.queue_limit,
        )


@contextmanager
def reserved_port(config: ServerConfig, name: str) -> Iterator[str]:
    """Hold the port of setting `name`'s address (resolving port 0) with SO_REUSEPORT while the fronts
    bind it too; its address with that port."""
    where = config.listen_addresses()[name]
    try:
        sock = reuseport_socket(str(where))
    except OSError as e:
        raise cannot_listen(name, where, e) from None
    with sock:
        yield str(dataclasses.replace(where, port=sock.getsockname()[1]))


@contextmanager
def reserved_ports(config: ServerConfig) -> Iterator[tuple[str, str]]:
    """The gRPC address and the HTTP address ("" when off), each with a concrete port, held."""
    http = reserved_port(config, "http_address") if config.http_address else nullcontext("")
    with reserved_port(config, "address") as address, http as http_address:
        yield address, http_address


@dataclass
class Supervisor:
    config: ServerConfig
    backend_factory: BackendFactory | None  # None: ONNX Runtime (engine.onnx_backend)
    run_dir: Path
    address: str
    fronts_wanted: int
    http_address: str = ""
    secrets: Secrets = field(default_factory=Secrets)  # read once at start: every front, restarted too
    context: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    engine: BaseProcess | None = None
    fronts: dict[int, BaseProcess] = field(default_factory=dict)
    events: dict[Connection, str] = field(default_factory=dict)  # read end -> whose
    serving: set[int] = field(default_factory=set)
    facts: Any = None
    announced: bool = False
    start_error: str = ""  # what a child that could not start said (it is exiting by itself)
    metrics: SupervisorMetrics = field(default_factory=SupervisorMetrics)
    serving_since: dict[int, float] = field(default_factory=dict)  # front -> time.monotonic()
    delays: dict[int, float] = field(default_factory=dict)  # front -> its last restart delay
    restart_at: dict[int, float] = field(default_factory=dict)  # dead front -> when it starts again
    # The stop signals caught (signals.catch's list) and the read end of the signal wakeup pipe: the
    # first signal drains, a second one during the drain stops every child at once (`force`).
    caught: list[int] = field(default_factory=list)
    wakeup: int | None = None
    forced: bool = False
    cut: bool = False  # a forced stop killed a front: calls in flight may have been lost
    engine_killed: bool = False  # a forced stop killed the engine (its exit code is then no failure)
    _stop_signals: int = 1  # the signals caught that count as the stop under way
    _stop_started: float = 0.0  # time.monotonic() when stop() began

    def __post_init__(self) -> None:
        self.engine_address = f"ipc://{self.run_dir}/engine.sock"
        self.queue = SharedQueue.shared(self.context)
        # Heartbeats (place.heartbeat): 0.0 until the process serves; each child gets a fresh one.
        self.engine_beat = self.context.RawValue("d", 0.0)
        self.front_beats: dict[int, Any] = {}
        self._looked = self._awake_since = time.monotonic()  # see _kill_frozen

    def pids(self) -> list[int]:
        children = [self.engine, *self.fronts.values()]
        return [os.getpid(), *(p.pid for p in children if p is not None and p.pid and p.is_alive())]

    def start_engine(self) -> None:
        receive, send = self.context.Pipe(duplex=False)
        stop_when, self._stop_engine = self.context.Pipe(duplex=False)
        args = (
            self.config,
            self.engine_address,
            self.queue,
            self.engine_beat,
            send,
            stop_when,
            self.backend_factory,
        )
        self.engine = self.context.Process(target=engine_process, args=args, name="engine")
        with logs.child_stderr("engine"):
            self.engine.start()
        self.events[receive] = "engine"

    def start_front(self, index: int) -> None:
        assert self.engine is not None and self.engine.pid is not None
        receive, send = self.context.Pipe(duplex=False)
        beat = self.front_beats[index] = self.context.RawValue("d", 0.0)
        place = Place(
            index,
            self.address,
            self.http_address,
            self.engine_address,
            self.engine.pid,
            self.queue,
            send,
            beat,
        )
        args = (self.config, place, self.secrets)
        front = self.context.Process(target=front_process, args=args, name=f"front-{index}")
        with logs.child_stderr(front.name):
            front.start()
        self.fronts[index] = front
        self.events[receive] = f"front-{index}"

    def on_event(self, whose: str, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "error" and self.announced and whose.startswith("front"):
            # A front started again that could not start: it exits, and is restarted after its
            # backoff like any front that dies. Only at the server's own start is it the end.
            log.error("%s could not start: %s", whose, event[1])
            return
        if kind == "error":
            self.start_error = event[1]
            raise StartupError(event[1])
        if kind == "ready":
            self.facts = event[1]
        elif kind == "serving":
            self.serving.add(event[1])
            self.metrics.fronts_serving = len(self.serving)
            self.serving_since[event[1]] = time.monotonic()
            if self.announced:  # a front started again after it died
                log.info("front %d serving again", event[1])
        if not self.announced and self.facts is not None and len(self.serving) == self.fronts_wanted:
            self.announced = True
            port = self.address.rpartition(":")[2]
            log.info(
                "serving %s on port %s with %s (warm-up %.2fs, %d front process(es), engine pid %d)",
                self.config.model_dir,
                port,
                self.facts.provider,
                self.facts.warmup_seconds,
                self.fronts_wanted,
                self.facts.pid,
            )

    def watch(self) -> int:
        """Until a signal (0) or the engine's end (1): restart fronts that die, handle events."""
        assert self.engine is not None and self.wakeup is not None
        while not self.caught:
            fronts = {p.sentinel: i for i, p in self.fronts.items()}
            ready = wait([self.wakeup, self.engine.sentinel, *fronts, *self.events], self._next_wake())
            for item in ready:
                if item == self.wakeup:
                    os.read(self.wakeup, 512)
                elif isinstance(item, Connection):
                    if item in self.events:  # not the pipe of a front that died in this pass
                        self._read(item)
                elif item == self.engine.sentinel:
                    self.engine.join(STOP_MARGIN_S)  # reaped: else its exit code may still read None
                    log.error("the engine process exited with code %s: stopping", self.engine.exitcode)
                    return 1
                elif item in fronts:
                    self._front_died(fronts[item])
            if not self.caught:
                self._restart_due()
                self._kill_frozen()
        return 0

    def _next_wake(self) -> float | None:
        """The longest `watch` may wait: until the next restart, and a heartbeat's period."""
        until = self._until_restart()
        if not self.config.liveness_timeout_s:
            return until
        return HEARTBEAT_S if until is None else min(until, HEARTBEAT_S)

    def _kill_frozen(self) -> None:
        """Kill a child whose event loop has not run for liveness_timeout_s (heartbeats start once it
        serves): nothing inside a frozen process can act (the engine's own --batch-timeout-s watch is
        a task on the loop that froze), and health kept answering SERVING from the other processes
        while its calls timed out. A killed front is started again; the engine's death stops the server.

        Silence is counted from when this process last looked, too: paused with its children (Ctrl-Z,
        `docker pause`, a cgroup freezer), it would find every beat old on waking, before the children
        had run, and kill a healthy server (a review saw it)."""
        limit = self.config.liveness_timeout_s
        now = time.monotonic()
        if now - self._looked > 2 * HEARTBEAT_S:  # this process did not run meanwhile either
            self._awake_since = now
        self._looked = now
        if not limit:
            return
        assert self.engine is not None
        # Whose loop, as the log names it: "the engine's", "front 0 (pid P): its".
        children = [("the engine's", self.engine, self.engine_beat, logging.CRITICAL)]
        for index, front in self.fronts.items():
            whose = f"front {index} (pid {front.pid}): its"
            children.append((whose, front, self.front_beats[index], logging.ERROR))
        for name, process, beat, level in children:
            if self._silent(beat, now) > limit:
                # A stopped process (SIGSTOP, a debugger) cannot take the dump's signal: not promised.
                dump = (
                    "it is stopped (SIGSTOP?): no stack dump can come"
                    if _stopped(process)
                    else "its threads' stacks are dumped to the log"
                )
                log.log(
                    level,
                    "%s event loop has not run for %.0fs, over --liveness-timeout-s %g: taken as frozen; "
                    "%s, then it is killed",
                    name,
                    now - beat.value,
                    limit,
                    dump,
                )
                beat.value = 0.0
                _dump_then_kill(process)

    def _silent(self, beat: Any, now: float) -> float:
        """Seconds a serving child's loop has not beaten while this process ran; 0 before it serves."""
        if not beat.value:
            return 0.0
        return min(now - beat.value, now - self._awake_since)

    def _read(self, conn: Connection) -> None:
        try:
            event = conn.recv()
        except EOFError:
            del self.events[conn]
            return
        self.on_event(self.events[conn], event)

    def _front_died(self, index: int) -> None:
        """Schedule the front's restart after its backoff; until then it is out of `fronts`."""
        self._last_events(f"front-{index}")  # a "serving" read after this would revive a dead front
        front = self.fronts.pop(index)
        front.join(STOP_MARGIN_S)  # reaped: its sentinel can close a moment before its exit code is set
        now = time.monotonic()
        served = now - self.serving_since.pop(index, now)
        delay = self.delays[index] = restart_delay(self.delays.get(index, 0.0), served)
        self.restart_at[index] = now + delay
        log.error(
            "front %d (pid %s) exited with code %s after serving %.0fs: starting it again in %.1fs",
            index,
            front.pid,
            front.exitcode,
            served,
            delay,
        )
        multiprocess.mark_process_dead(front.pid)
        if front.pid is not None:
            self.metrics.fold_dead(front.pid)
        self.serving.discard(index)
        self.metrics.fronts_serving = len(self.serving)

    def _last_events(self, whose: str) -> None:
        """Read what a dead child sent before it died, then forget its pipe."""
        for conn in [c for c, name in self.events.items() if name == whose]:
            while conn in self.events and conn.poll():
                self._read(conn)
            if self.events.pop(conn, None) is not None:
                conn.close()

    def _until_restart(self) -> float | None:
        """Seconds until the next scheduled restart (the longest `watch` may wait); None if none."""
        if not self.restart_at:
            return None
        return max(0.0, min(self.restart_at.values()) - time.monotonic())

    def _restart_due(self) -> None:
        now = time.monotonic()
        for index in [i for i, at in self.restart_at.items() if at <= now]:
            del self.restart_at[index]
            self.metrics.front_restarts += 1
            log.info("front %d: starting again (restart %d)", index, self.metrics.front_restarts)
            self.start_front(index)

    def stop(self) -> int:
        """Drain every front, then stop the engine; the exit status for the server: 128 + the signal's
        number when a second stop signal cut the drain short (a shell's code for a death by it)."""
        started = self._stop_started = time.monotonic()
        self._stop_signals = max(len(self.caught), 1)
        deadline = started + self.config.drain_timeout_s + STOP_MARGIN_S
        for front in self.fronts.values():
            _signal(front, signal.SIGTERM)
        self._wait_for(list(self.fronts.values()), deadline)
        # A front still starting up (importing, before run_front's first line) dies of the SIGTERM
        # itself, or of a terminal's SIGHUP to the group: it had accepted no call, a clean stop too.
        codes = [_join(front, deadline) for front in self.fronts.values()]
        codes = [0 if code is not None and -code in signals.STOP_SIGNALS else code for code in codes]
        served = self.announced or self.serving
        if codes and served and not self.forced:  # one that never served stops with its one line of why
            log.info("fronts stopped after %.1fs, exit codes %s", time.monotonic() - started, codes)
        if self.engine is not None and self.facts is None and not self.start_error and self.engine.is_alive():
            # Still loading or warming up (a rollout's SIGTERM during a slow start): no front is left
            # that could use it and it holds nothing to finish, so it is not waited for.
            log.info("the engine was still starting: stopped without waiting for it")
            self.engine.kill()
            self.engine.join()
        elif self.engine is not None:
            self._stop_engine.close()  # the engine stops when this pipe closes
            engine_deadline = time.monotonic() + STOP_MARGIN_S  # one grace for both waits
            self._wait_for([self.engine], engine_deadline)
            code = _join(self.engine, engine_deadline)
            # Killed by a second signal with only the engine left, nothing to answer: a clean stop.
            codes.append(0 if self.engine_killed else code)
        if self.cut:
            return 128 + self.caught[-1]
        # Stopped before it ever served: no call was accepted, so none was lost.
        return 0 if all(code == 0 for code in codes) or not served else 1

    def _wait_for(self, processes: list[BaseProcess], deadline: float) -> None:
        """Until `processes` have ended or `deadline` passes, or a second stop signal came (`force`)."""
        while not self._second_signal() and (alive := [p.sentinel for p in processes if p.is_alive()]):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wakeup = [] if self.wakeup is None else [self.wakeup]
            if self.wakeup in wait([*alive, *wakeup], left):
                os.read(self.wakeup, 512)

    def _second_signal(self) -> bool:
        if len(self.caught) > self._stop_signals and not self.forced:
            if time.monotonic() - self._stop_started < SAME_STOP_S:
                self._stop_signals = len(self.caught)  # the same stop, delivered twice
            else:
                self.force()
        return self.forced

    def force(self) -> None:
        """Kill every child now: an operator's second Ctrl-C must not wait out the drain (as uvicorn's,
        gunicorn's). Calls in flight are cut: their clients see the connection close (UNAVAILABLE)."""
        self.forced = True
        children = [p for p in (*self.fronts.values(), self.engine) if p is not None and p.is_alive()]
        self.cut = any(front.is_alive() for front in self.fronts.values())
        self.engine_killed = self.engine is not None and self.engine.is_alive()
        name = signal.Signals(self.caught[-1]).name
        if self.cut:
            log.warning(
                "a second stop signal (%s) while draining: stopping now, calls in flight are cut (%d "
                "processes killed, exit %d)",
                name,
                len(children),
                128 + self.caught[-1],
            )
        else:  # the drain was over: no call is lost, and exit 130 would say one might have been
            log.info(
                "a second stop signal (%s) after the fronts had stopped: the engine stopped at once",
                name,
            )
        for process in children:
            process.kill()


DUMP_WAIT_S = 0.5


def _dump_then_kill(process: BaseProcess) -> None:
    """DUMP_SIGNAL first (place.dump_stacks_on_signal): the log gets what the process was stuck in."""
    _signal(process, DUMP_SIGNAL)
    process.join(DUMP_WAIT_S)  # the dump's time (a stopped process cannot take it: it is killed all the same)
    process.kill()


def _stopped(process: BaseProcess) -> bool:
    """Whether the process is stopped (state T: SIGSTOP; t: a debugger's)."""
    try:
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def _signal(process: BaseProcess, signum: int) -> None:
    if process.is_alive() and process.pid is not None:
        os.kill(process.pid, signum)


def _join(process: BaseProcess, deadline: float) -> int:
    process.join(max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        log.error("%s did not stop in time: killed", process.name)
        process.kill()
        process.join()
    return process.exitcode or 0


def check_security(config: ServerConfig) -> Secrets:
    """The token and TLS files, read once: unusable settings are refused before anything starts
    (SecurityConfigError)."""
    return read_secrets(config)


def children_config(config: ServerConfig) -> ServerConfig:
    """The settings every child gets: no token, no token file, no TLS files. The fronts take the token
    and the TLS bytes from the `Secrets` the supervisor read at start (the HTTP API's TLS from
    in-memory copies of them: Secrets.tls_files), so a front started again after the files changed
    serves with what the first fronts served with; the engine needs none of them."""
    return dataclasses.replace(
        config, auth_token="", auth_token_file="", tls_cert="", tls_key="", tls_client_ca=""
    )


def warn_of_unknown_variables(environ: Mapping[str, str]) -> None:
    """One warning naming EMBED_* variables that are no setting: a misspelt one is otherwise ignored."""
    unknown = unknown_variables(environ)
    if unknown:
        named = ", ".join(
            f"{name} (closest setting: {closest})" if closest else f"{name} (no setting close to it)"
            for name, closest in unknown
        )
        log.warning("ignoring EMBED_* variables that are no server setting: %s", named)


def serve(
    config: ServerConfig,
    backend_factory: BackendFactory | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0 after draining) or the engine's end (exit 1).
    `environ`, the environment load_config read: its EMBED_* variables that are no setting are named
    in one warning, once logging is set up."""
    secrets = check_security(config)
    check_cores(config, usable_cores())
    # The manifest's one line before any port is bound or announced (the graphs' checksums are the
    # engine's to verify, as it loads them): a wrong --model-dir must not look like a server starting.
    check_batch_tokens(config, read_manifest(config.model_dir).config.max_seq_length)
    check_ports(config)
    warn_of_unknown_variables(environ or {})
    warn_of_limits(config)
    with run_directory() as run_dir, reserved_ports(config) as addresses:
        metrics_dir = run_dir / "metrics"
        metrics_dir.mkdir()
        # Read by prometheus_client when each child imports it: every process records into files there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        address, http_address = addresses
        fronts = plan_fronts(config, usable_cores())
        children = children_config(config)
        supervisor = Supervisor(
            children, backend_factory, run_dir, address, fronts, http_address, secrets=secrets
        )
        return _supervise(supervisor, metrics_dir)


RUN_PREFIX = "embed-"
RUN_LOCK = "supervisor.lock"


@contextmanager
def run_directory() -> Iterator[Path]:
    """The server's directory (the metrics files, the engine's socket) in the temp dir, removed at the
    end and locked (flock) for the supervisor's life; those of servers killed before they could
    remove theirs (SIGKILL, the OOM killer) are removed first. An operator's pass saw one left by every
    such death (84 kB for one front; more with more fronts and restarts), and under Kubernetes /tmp is
    an emptyDir with a 64 MiB limit that outlives the container's restarts: past it the pod is evicted."""
    remove_stale_run_directories(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=RUN_PREFIX) as name:
        # Locked before it has its name: a server sweeping meanwhile never finds it free.
        making = Path(name) / f"{RUN_LOCK}.new"
        lock = os.open(making, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            making.rename(Path(name) / RUN_LOCK)
            yield Path(name)
        finally:
            os.close(lock)


def remove_stale_run_directories(temp: Path) -> None:
    """Remove this user's run directories whose lock no process holds: the kernel lets go of a flock
    when its holder dies, however it dies, and a pid could be reused (a container's supervisor is
    often pid 1 after every restart). A directory without the lock file (still being made, or not
    a run directory) is left alone."""
    for directory in temp.glob(RUN_PREFIX + "*"):
        try:
            if directory.is_symlink() or directory.stat().st_uid != os.getuid():
                continue
            lock = os.open(directory / RUN_LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a server running
            os.close(lock)
            continue
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock)
        if directory.exists():
            log.warning("could not remove all of %s, left by a server that was killed", directory)
        else:
            log.info("removed %s, left by a server that was killed", directory)


def _supervise(supervisor: Supervisor, metrics_dir: Path) -> int:
    from minilm_embed.server.metrics import (  # after PROMETHEUS_MULTIPROC_DIR is set
        scrape_registry,
        serve_metrics,
    )

    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    supervisor.wakeup = wakeup_read
    supervisor.caught = signals.catch()  # holds any signal that came while the server was still importing
    if supervisor.config.metrics_address:  # first: a port in use fails here, before any child starts
        registry = scrape_registry(metrics_dir, supervisor.pids, supervisor.metrics)
        where = supervisor.config.listen_addresses()["metrics_address"]
        try:  # host:port unbracketed, as serve_metrics splits it ([::1] is no host to resolve)
            port = serve_metrics(registry, f"{where.host}:{where.port}")
        except OSError as e:
            raise cannot_listen("metrics_address", where, e) from None
        log.info("metrics on %s/metrics", dataclasses.replace(where, port=port))
    # No child needs the token in its environment: the fronts get it as `Secrets`, the engine never.
    os.environ.pop(env_name("auth_token"), None)
    try:
        os.environ.update(ENGINE_MALLOC)
        supervisor.start_engine()
        os.environ.update(FRONT_MALLOC)  # the fronts' environment from here on, not the engine's
        for index in range(supervisor.fronts_wanted):
            supervisor.start_front(index)
        if supervisor.http_address:
            log.info("http on port %s", supervisor.http_address.rpartition(":")[2])
        code = supervisor.watch()
        if code == 0:
            log.info(
                "%s received: draining for up to %.0fs (a second signal stops at once)",
                signal.Signals(supervisor.caught[0]).name,
                supervisor.config.drain_timeout_s,
            )
    except BaseException:  # a child that cannot start, or a bug here: no child outlives the server
        supervisor.stop()
        raise
    stopped = supervisor.stop()
    log.info("stopped")
    return code or stopped


def configure_process(config: ServerConfig) -> None:
    """The supervisor's set-up, before any child starts (they inherit its environment and fd 2)."""
    if config.log_format == "json":
        # gRPC's C core, ONNX Runtime and a dying interpreter write to fd 2 past Python's logging:
        # every process's fd 2 goes through a pipe this process turns into JSON lines. Drained at exit
        # (after an uncaught exception too), after the children have stopped.
        atexit.register(logs.relay_stderr())
    logs.configure(config.log_level, config.log_format)
    # The tokenizer's own thread pool would compete with ONNX Runtime's threads for the same cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # gRPC's C core logs past Python's logging, and since it moved to absl its default prints INFO
    # lines too: one per client that fails the TLS handshake (a port scan, a plaintext client). Errors
    # only, gRPC's documented default, unless the operator sets it; read by each child as it starts gRPC.
    if not os.environ.get("GRPC_VERBOSITY"):
        os.environ["GRPC_VERBOSITY"] = "ERROR"
