"""The server as processes: several fronts on one port over one engine, end to end with the real model.

What each test holds true is what a user of a multi-process server relies on: every front serves
the same vectors, /metrics counts every process's calls once, a front that dies comes back, the
engine's death is answered at once and ends the server non-zero, SIGTERM drains every front.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import string
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minilm_embed.client.client import AsyncEmbeddingClient, EmbeddingClient, embed_request, to_array
from minilm_embed.model.host import gpu_present
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server.app import STOP_MARGIN_S
from minilm_embed.server.front import watch_process
from minilm_embed.server.place import DUMP_SIGNAL
from tests.reference import Reference
from tests.server_process import (
    ServerProcess,
    fault_entry,
    serving,
    start_server,
    wait_for,
    wait_until,
)
from tests.stand_in_server import HOLD_S, HOLD_TEXT
from tests.test_server import error_details

ROOT = Path(__file__).resolve().parents[1]
SHORT = (ROOT / "export" / "parity_sentences.txt").read_text(encoding="utf-8").splitlines()
FRONTS = 2
# A front's budget for the bytes of requests being parsed and tokenized, held to one 1.2 MB request
# (its default largest message, 2 MiB, set too): two_fronts' other tests send only small requests.
BYTE_BUDGET = 2 << 20


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def two_fronts() -> Iterator[ServerProcess]:
    budget = ("--max-message-bytes", str(BYTE_BUDGET), "--max-request-bytes-in-flight", str(BYTE_BUDGET))
    with serving("--front-processes", str(FRONTS), *budget) as process:
        yield process


def running(pid: int) -> bool:
    """Alive, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counter(process: ServerProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read()
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


async def embed_on_fresh_connections(address: str, texts: list[str], at_once: int) -> list[np.ndarray]:
    """Each text on a connection of its own, `at_once` at a time: the kernel spreads connections (not
    calls) over the fronts. Channels share connections unless they keep a local subchannel pool."""
    slots = asyncio.Semaphore(at_once)

    async def one(text: str) -> np.ndarray:
        async with slots:
            options = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(address, options=options) as channel:
                stub = pb_grpc.EmbeddingServiceStub(channel)
                return to_array(await stub.Embed(embed_request([text]), timeout=60))

    return await asyncio.gather(*(one(t) for t in texts))


def test_every_front_serves_the_same_vectors_and_metrics_count_each_call_once(two_fronts, reference):
    fronts = two_fronts.front_pids()
    assert len(fronts) == FRONTS
    before = {pid: cpu_seconds(pid) for pid in fronts}
    texts = [SHORT[i % len(SHORT)] for i in range(200)]
    ok_before = counter(two_fronts, "embed_requests_total", method="Embed", code="OK")
    got = np.concatenate(asyncio.run(embed_on_fresh_connections(two_fronts.address, texts, 16)))
    cosines = np.sum(got * reference.embed(texts), axis=1)
    assert cosines.min() >= 0.99999
    busy = [pid for pid in fronts if cpu_seconds(pid) - before[pid] > 0.05]
    assert busy == fronts, "a front served no calls"
    assert counter(two_fronts, "embed_requests_total", method="Embed", code="OK") - ok_before == 200
    assert counter(two_fronts, "embed_ready") == 1


def test_only_the_engine_loads_onnx_runtime_and_info_names_the_one_it_runs(two_fronts):
    """Neither the fronts nor the supervisor touch the model: ONNX Runtime (18 MB resident, 0.2 s of
    import) is mapped in the engine alone, and Info's version of it is the engine's. (A supervisor on
    a host with an NVIDIA driver imports it to ask whether CUDA is usable.)"""

    def maps_onnx_runtime(pid: int) -> bool:
        return "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()

    assert two_fronts.engine_pid is not None and maps_onnx_runtime(two_fronts.engine_pid)
    assert [pid for pid in two_fronts.front_pids() if maps_onnx_runtime(pid)] == []
    assert gpu_present() or not maps_onnx_runtime(two_fronts.proc.pid)
    with EmbeddingClient(two_fronts.address, timeout=30) as c:
        assert c.info().versions["onnxruntime"] == onnxruntime.__version__


def test_ps_names_each_child_by_its_process_name_and_its_command_line(two_fronts):
    """`ps -e`, `top` and `pgrep` read /proc/PID/comm, `ps aux`, `ps -ef` and `pgrep -f` read
    /proc/PID/cmdline (a spawned child's otherwise reads `python -B -c from multiprocessing.spawn
    ...`). Both name the child; its environment stays readable; the supervisor keeps the command
    line it was started with."""

    def shown(pid: int) -> tuple[str, str]:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        return comm, Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()

    assert two_fronts.engine_pid is not None
    assert shown(two_fronts.engine_pid) == ("embed-engine", "minilm-embed-serve: embed-engine")
    fronts = [f"embed-front-{i}" for i in range(FRONTS)]
    assert sorted(shown(pid) for pid in two_fronts.front_pids()) == [
        (name, f"minilm-embed-serve: {name}") for name in fronts
    ]
    for pid in [two_fronts.engine_pid, *two_fronts.front_pids()]:
        assert b"PATH=" in Path(f"/proc/{pid}/environ").read_bytes()
    assert "--front-processes" in shown(two_fronts.proc.pid)[1]


def test_a_front_that_dies_is_started_again_and_calls_go_on(two_fronts, reference):
    victim = two_fronts.front_pids()[0]
    os.kill(victim, signal.SIGKILL)
    restarted = wait_for(
        lambda: len(two_fronts.front_pids()) == FRONTS and victim not in two_fronts.front_pids(), timeout=60
    )
    assert restarted, (
        f"fronts now {two_fronts.front_pids()}, killed {victim}:\n{''.join(two_fronts.lines[-8:])}"
    )
    assert wait_for(lambda: any("starting it again" in line for line in two_fronts.lines))
    # Until then the new front says NOT_SERVING, and a client whose connection it took waits.
    assert wait_for(lambda: any("serving again" in line for line in two_fronts.lines), timeout=60)
    assert counter(two_fronts, "embed_ready") == 1
    texts = SHORT[:40]
    with EmbeddingClient(two_fronts.address, timeout=60) as c:
        got = np.concatenate([c.embed([t]) for t in texts])
    assert np.sum(got * reference.embed(texts), axis=1).min() >= 0.99999
    assert two_fronts.proc.poll() is None


def test_a_hung_model_run_ends_the_engine_so_the_server_is_restarted_not_left_ready():
    """A stuck kernel cannot be cancelled: past --batch-timeout-s the engine exits, every caller gets
    UNAVAILABLE at once, and the server exits 1 (Kubernetes restarts it). HOLD_TEXT's batch sleeps
    HOLD_S (4 s), over the 1 s given here."""
    process = start_server("--front-processes", "1", "--batch-timeout-s", "1", entry=fault_entry("__fault__"))
    process.wait_serving()
    try:
        with grpc.insecure_channel(process.address) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.EmbeddingServiceStub(channel).Embed(embed_request([HOLD_TEXT]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert 1.0 <= time.monotonic() - started < HOLD_S  # at the timeout, not when the run ends
        assert process.wait(30) == 1
        assert any("over --batch-timeout-s 1.0s: taken as hung" in line for line in process.lines)
        # Read once reaped: it said "exited with code None", read as its sentinel closed.
        assert any("the engine process exited with code 3" in line for line in process.lines)
    finally:
        process.stop()


def test_a_frozen_engine_is_killed_so_the_server_is_restarted_not_left_ready():
    """An operator's pass stopped the engine (SIGSTOP): health stayed SERVING and every call timed
    out, for --batch-timeout-s is watched by a task on the loop that froze. Its heartbeat stops; past
    --liveness-timeout-s the supervisor kills it, callers get UNAVAILABLE and the server exits 1."""
    process = start_server("--front-processes", "1", "--liveness-timeout-s", "5").wait_serving()
    try:
        assert process.engine_pid is not None
        os.kill(process.engine_pid, signal.SIGSTOP)
        started = time.monotonic()
        with grpc.insecure_channel(process.address) as channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.EmbeddingServiceStub(channel).Embed(embed_request(["hello"]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert time.monotonic() - started < 20  # at the liveness timeout, not the call's deadline (30 s)
        assert process.wait(30) == 1
        said = [line for line in process.lines if "taken as frozen" in line]
        assert len(said) == 1, said
        assert "the engine's event loop has not run for" in said[0] and "--liveness-timeout-s 5" in said[0]
        assert any("the engine process exited with code -9" in line for line in process.lines)
    finally:
        process.stop()


def test_a_process_taken_as_frozen_writes_its_stacks_to_the_log_before_it_is_killed():
    """The supervisor sends DUMP_SIGNAL, then kills: a process whose Python code runs no more (here
    its main thread stuck in a call) writes where each thread was, from faulthandler's C handler,
    which needs neither the GIL nor an event loop."""
    code = (
        "import time\n"
        "from minilm_embed.server.place import dump_stacks_on_signal\n"
        "def stuck_here():\n"
        "    print('ready', flush=True)\n"  # from inside: the dump cannot come before the call
        "    time.sleep(60)\n"
        "dump_stacks_on_signal()\n"
        "stuck_here()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        os.kill(child.pid, DUMP_SIGNAL)
        time.sleep(1)
    finally:
        child.kill()
    _, stderr = child.communicate(timeout=10)
    assert b"most recent call first" in stderr and b"in stuck_here" in stderr, stderr


def test_a_server_paused_whole_and_resumed_is_not_taken_for_frozen():
    """Ctrl-Z then fg, `docker pause`, a cgroup freezer: the supervisor and its children stop together.
    A review saw the supervisor wake first, find every heartbeat older than --liveness-timeout-s, and
    kill a healthy server. Here it is resumed first, its children a moment later."""
    process = start_server("--front-processes", "1", "--liveness-timeout-s", "3").wait_serving()
    try:
        assert process.engine_pid is not None
        children = [process.engine_pid, *process.front_pids()]
        for pid in [process.proc.pid, *children]:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(process.proc.pid, signal.SIGCONT)
        time.sleep(1.2)  # the supervisor looks at the beats every second
        for pid in children:
            os.kill(pid, signal.SIGCONT)
        time.sleep(2.5)
        assert process.proc.poll() is None, "".join(process.lines[-10:])
        assert not [line for line in process.lines if "taken as frozen" in line]
        with EmbeddingClient(process.address, timeout=30) as client:
            assert client.embed(["hello"]).shape == (1, 384)
    finally:
        process.stop()


def test_the_engine_dying_is_answered_at_once_and_ends_the_server_non_zero(model_dir):
    process = start_server("--front-processes", "1", "--max-batch-size", "1").wait_serving()
    try:
        assert process.engine_pid is not None
        outcome: dict[str, object] = {}
        long_request = embed_request([" ".join(SHORT)] * 200)  # seconds of work, one input at a time

        def call() -> None:
            with grpc.insecure_channel(process.address) as channel:  # no retries: the first answer
                try:
                    pb_grpc.EmbeddingServiceStub(channel).Embed(long_request, timeout=60)
                    outcome["code"] = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    outcome["code"], outcome["details"] = e.code(), e.details()
                    outcome["reason"] = error_details(e)["ErrorInfo"].reason
                outcome["at"] = time.monotonic()

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(1.0)  # the request is queued and computing
        killed = time.monotonic()
        os.kill(process.engine_pid, signal.SIGKILL)
        caller.join(30)
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
        assert "engine process stopped; this server is stopping" in str(outcome["details"])
        assert outcome["reason"] == "ENGINE_STOPPED"
        assert float(outcome["at"]) - killed < 1.0  # at once, not at the call's deadline
        assert process.wait(30) == 1
        assert any("engine process exited" in line for line in process.lines)
    finally:
        process.stop()


@pytest.mark.parametrize("after_s", [0.3, 0.8, 1.5])
def test_sigterm_while_the_server_starts_up_stops_it_cleanly(after_s):
    """A rollout may stop a pod the moment it started: fronts still importing, building, or waiting
    for the engine. Exit 0, not 1 (a front killed by the signal's default action read as a crash)."""
    process = start_server("--front-processes", str(FRONTS))
    time.sleep(after_s)
    process.terminate()
    assert process.wait(60) == 0, "".join(process.lines[-20:])
    assert "Traceback" not in "".join(process.lines)


def test_the_stop_signals_are_caught_before_the_server_imports_its_second_of_modules():
    """What `python -m minilm_embed.server` runs before main() catches SIGTERM must stay light, or a
    SIGTERM in that second kills the server by the signal instead of stopping it (exit 0)."""
    code = (
        "import sys, minilm_embed.server.__main__; "
        "heavy = [m for m in ('grpc', 'numpy', 'onnxruntime', 'zmq') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_sigterm_while_the_engine_loads_stops_the_server_without_waiting_for_the_load():
    """A GPU engine can take minutes to load: a SIGTERM then must not wait for it (nor for
    STOP_MARGIN_S before a kill), since nothing was served and nothing can be lost."""
    process = start_server(
        "--front-processes", str(FRONTS), entry=("tests.stand_in_server", "slow-start", "60")
    )
    try:
        time.sleep(3.0)  # the fronts up and waiting for the engine, which loads for 60 s
        stopped = time.monotonic()
        process.terminate()
        assert process.wait(30) == 0, "".join(process.lines[-20:])
        assert time.monotonic() - stopped < STOP_MARGIN_S, "waited for the loading engine"
        assert any("the engine was still starting" in line for line in process.lines), process.lines[-20:]
        assert not any("did not stop in time" in line for line in process.lines), process.lines[-20:]
    finally:
        process.stop()


def test_sigterm_drains_every_front_answers_every_accepted_call_and_exits_0(reference):
    process = start_server("--front-processes", str(FRONTS)).wait_serving()
    texts = [SHORT[i % len(SHORT)] for i in range(64)]
    results: list[object] = []

    async def load() -> None:
        async def one(text: str) -> None:
            async with AsyncEmbeddingClient(process.address, timeout=60) as c:
                try:
                    results.append((text, await c.embed([text] * 8)))
                except grpc.RpcError as e:
                    results.append((text, e))

        await asyncio.gather(*(one(t) for t in texts))

    children = [*process.front_pids(), process.engine_pid]
    assert len(children) == FRONTS + 1 and None not in children, children
    loader = threading.Thread(target=lambda: asyncio.run(load()))
    loader.start()
    time.sleep(0.5)
    process.terminate()
    loader.join(60)
    assert process.wait(60) == 0
    answered = [(t, r) for t, r in results if isinstance(r, np.ndarray)]
    refused = [r for _, r in results if isinstance(r, grpc.RpcError)]
    assert len(answered) + len(refused) == len(texts)
    assert answered, "no call was answered before the drain"
    for text, vectors in answered:
        assert np.sum(vectors * reference.embed([text] * 8), axis=1).min() >= 0.99999
    # A call is refused only as UNAVAILABLE (never accepted, retried elsewhere in production).
    assert {r.code() for r in refused} <= {grpc.StatusCode.UNAVAILABLE}
    assert not [pid for pid in children if running(pid)], "a child outlived the server"


def test_requests_past_the_fronts_byte_budget_are_refused_unparsed_and_streams_wait_instead(
    two_fronts, reference
):
    """A request's bytes are held while it is parsed and tokenized. Where the budget holds one
    1.2 MB request, a second one sent while the first is tokenized whole (~0.5 s) is refused
    at once naming the setting; a short one still fits; a stream's two such items both get answers
    (the stream waits for room instead). On two_fronts, started with this budget: the calls share one
    channel, so one connection, so one front and its budget."""
    budget = BYTE_BUDGET
    rng = random.Random(0)
    words = [("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 12)))) for _ in range(12_000)]
    big = [" ".join(words)[:100_000]] * 12  # 1.2 MB on the wire, ~0.5 s to tokenize whole

    async def scenario(process: ServerProcess) -> None:
        async with grpc.aio.insecure_channel(process.address) as channel:
            stub = pb_grpc.EmbeddingServiceStub(channel)
            whole = pb.TokenizeRequest(texts=big, truncate=False)
            first = asyncio.ensure_future(stub.Tokenize(whole, timeout=60))
            # Received (its bytes held) and being tokenized whole: not a fixed sleep, which a busy
            # machine outran before the first request had even arrived.
            await wait_until(lambda: counter(process, "embed_requests_in_flight") >= 1, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Embed(embed_request(big), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"max_request_bytes_in_flight is {budget}" in refused.value.details()
            short = await stub.Embed(embed_request([SHORT[0]]), timeout=60)
            assert np.dot(to_array(short)[0], reference.embed([SHORT[0]])[0]) > 0.99999
            assert all(t.usage.original_tokens > 12_000 for t in (await first).tokens)
            items = [pb.EmbedStreamRequest(id=str(i), request=embed_request(big)) for i in range(2)]
            answers = [a async for a in stub.EmbedStream(iter(items), timeout=60)]
            assert sorted(a.id for a in answers) == ["0", "1"]
            assert all(a.WhichOneof("result") == "response" for a in answers)

    asyncio.run(scenario(two_fronts))


def test_a_kernel_without_pidfd_open_is_named_not_only_its_errno(monkeypatch):
    """Before Linux 5.3 (or under a seccomp profile refusing it) the server ended with only
    "[Errno 38] Function not implemented"."""

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)

    async def watch() -> None:
        watch_process(os.getpid(), lambda: None)

    with pytest.raises(OSError, match=r"pidfd_open failed \(Function not implemented\).*Linux 5\.3") as e:
        asyncio.run(watch())
    assert e.value.errno == errno.ENOSYS
