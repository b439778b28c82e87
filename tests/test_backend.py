"""The ONNX Runtime backend: how many instances, and instances running at once each answer their own batch."""

from __future__ import annotations

import contextlib
import functools
import gc
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from minilm_embed.export.optimize import cpu_session
from minilm_embed.model.repository import CPU_PROVIDER as CPU
from minilm_embed.model.repository import CUDA_PROVIDER as CUDA
from minilm_embed.model.runtime import run_graph
from minilm_embed.server.backend import (
    BoundSession,
    OnnxBackend,
    bucket,
    bucket_warm_shapes,
    open_repository,
    plan_instances,
)
from minilm_embed.server.config import ServerConfig
from minilm_embed.server.engine import WarmUpError, cpu_warm_shapes, warm_up
from tests.stand_in_server import ARENA_FULL


@pytest.mark.parametrize(
    ("provider", "instances", "threads", "cores", "planned"),
    [
        (CPU, 0, 0, 2, (2, 1)),  # auto on 2 cores: two one-thread instances
        (CPU, 0, 0, 16, (2, 8)),
        (CPU, 0, 0, 1, (1, 1)),
        (CUDA, 0, 0, 16, (1, 16)),  # one instance on the GPU
        (CPU, 3, 0, 12, (3, 4)),  # threads split the cores between the instances asked for
        (CPU, 4, 0, 2, (4, 1)),  # never fewer than one thread
        (CPU, 1, 2, 16, (1, 2)),  # both given: taken as they are
        (CPU, 0, 2, 2, (1, 2)),  # threads given: as many instances as fit the cores, at most 2
        (CPU, 0, 4, 16, (2, 4)),
    ],
)
def test_plan_instances(provider, instances, threads, cores, planned):
    assert plan_instances(provider, instances, threads, cores) == planned


def test_plan_instances_refuses_negative_counts():
    with pytest.raises(ValueError, match="0 \\(auto\\) or more"):
        plan_instances(CPU, -1, 0, 2)


@pytest.fixture(scope="module")
def repo(model_dir):
    return open_repository(model_dir)


def batches(count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of different shapes, with padding, so each has an answer of its own."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        rows, longest = 1 + i % 5, 4 + 3 * i
        lengths = rng.integers(1, longest + 1, rows)
        lengths[0] = longest
        ids = rng.integers(1000, 20000, (rows, longest))
        ids[np.arange(longest)[None, :] >= lengths[:, None]] = 0
        out.append((ids.astype(np.int64), lengths.astype(np.int64)))
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_each_instance_has_a_session_of_its_own(repo, threads):
    backend = OnnxBackend(repo, "cpu", threads=threads, instances=2)
    assert (backend.instances, backend.threads) == (2, threads)
    assert backend.sessions[0] is not backend.sessions[1]


def mappings_of(path: Path) -> int:
    return sum(
        line.rstrip("\n").endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines()
    )


def test_every_instance_uses_one_mapping_of_the_shared_word_embedding_table(repo):
    """Left to itself, ONNX Runtime maps a graph's external data once per session; given the values,
    it maps nothing: the one mapping is the backend's, whatever the instance count."""
    [shared] = repo.manifest.shared_tensors
    path = repo.path(shared).resolve()
    gc.collect()  # sessions other tests left for the collector would drop their mappings mid-test
    before = mappings_of(path)  # other tests' live sessions (e.g. the reference's) may hold some
    plain = [cpu_session(repo.path(repo.graph_for(CPU, "fp32")), threads=1) for _ in range(2)]
    assert mappings_of(path) == before + 2  # what a session per instance costs without sharing
    del plain
    gc.collect()
    assert mappings_of(path) == before
    backend = OnnxBackend(repo, "cpu", threads=1, instances=3)
    assert mappings_of(path) == before + 1
    assert list(backend.shared) == [shared.name]
    ids, lengths = batches(1)[0]
    want = run_graph(cpu_session(repo.path(repo.graph_for(CPU, "fp32")), threads=1), ids, lengths)
    for _ in range(backend.instances):  # each run takes the next free instance
        np.testing.assert_array_equal(backend.run(ids, lengths)[0], want[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_concurrent_runs_each_get_their_own_batch_answer(repo, threads):
    backend = OnnxBackend(repo, "cpu", threads=threads, instances=2)
    work = batches(12)
    want = [backend.run(ids, lengths) for ids, lengths in work]
    got: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def caller(part: list[int]) -> None:
        for _ in range(3):
            for i in part:
                got[i] = backend.run(*work[i])

    callers = [threading.Thread(target=caller, args=(list(range(k, len(work), 2)),)) for k in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    for i, (normalised, pooled) in enumerate(want):
        np.testing.assert_allclose(got[i][0], normalised, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[i][1], pooled, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "positions", "bucketed"),
    [
        (1, 1, (1, 16)),
        (3, 17, (4, 32)),
        (33, 100, (64, 128)),
        (64, 16, (64, 16)),
        (65, 16, (128, 16)),  # past 64 rows, multiples of 64
        (129, 16, (192, 16)),
        (523, 30, (576, 32)),  # a served batch: 1,024 rows as powers of two
        (256, 256, (256, 256)),
        (5, 129, (8, 192)),
    ],
)
def test_cuda_batches_are_padded_up_to_few_shapes(rows, positions, bucketed):
    assert bucket(rows, positions) == bucketed


def test_rows_go_to_powers_of_two_throughout_with_no_row_step():
    assert [bucket(r, 16, row_step=0)[0] for r in (65, 129, 523, 1000)] == [128, 256, 1024, 1024]


def test_a_batch_size_limit_reaches_few_row_buckets():
    assert len({bucket(r, 16)[0] for r in range(1, 1025)}) == 7 + 15  # 1..64 by powers, then by 64s


@pytest.mark.parametrize(
    ("max_rows", "max_tokens", "longest"), [(32, 1024, 256), (256, 32768, 256), (9, 300, 100)]
)
def test_the_cuda_warm_up_runs_every_bucket_a_batch_can_reach_at_its_most_tokens(
    max_rows, max_tokens, longest
):
    shapes = bucket_warm_shapes(max_rows, max_tokens, longest)
    assert all(r <= max_rows and r * n <= max_tokens and n <= longest for r, n in shapes)
    warmed = {bucket(r, n): r * n for r, n in shapes}
    assert len(warmed) == len(shapes)  # one batch a bucket
    most: dict[tuple[int, int], int] = {}  # every batch the limits allow, by bucket
    for r in range(1, max_rows + 1):
        for n in range(1, min(longest, max_tokens // r) + 1):
            most[bucket(r, n)] = max(most.get(bucket(r, n), 0), r * n)
    assert warmed == most
    # Largest first, so each batch runs in arena memory a larger one freed (kSameAsRequested):
    # smallest first overran the 4 GiB arena at the auto CUDA limits on an H200.
    tokens = [r * n for r, n in shapes]
    assert tokens == sorted(tokens, reverse=True)


class Recording:
    """A backend that records the shapes each of its instances ran, handing instances out as
    OnnxBackend does (the next free one per run, or one held for a block)."""

    threads, precision, load_seconds = 1, "fp16", 0.0

    def __init__(self, provider: str, instances: int = 1) -> None:
        self.provider, self.instances = provider, instances
        self.ran: list[list[tuple[int, int]]] = [[] for _ in range(instances)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(instances):
            self.free.put(i)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [shape for ran in self.ran for shape in ran]

    def run(self, ids, lengths):
        with self.instance() as run:
            return run(ids, lengths)

    @contextlib.contextmanager
    def instance(self):
        i = self.free.get()
        try:
            yield functools.partial(self._run_on, i)
        finally:
            self.free.put(i)

    def _run_on(self, i, ids, lengths):
        self.ran[i].append(ids.shape)
        assert (lengths == ids.shape[1]).all()
        time.sleep(0.002 * i)  # instances of unequal speed: a fast one freed first is taken again
        return np.zeros((len(ids), 4), np.float32), np.zeros((len(ids), 4), np.float32)


def test_the_engine_warms_a_cuda_backend_through_every_bucket_and_a_cpu_one_with_its_largest_batches():
    config = ServerConfig(max_batch_size=64, max_batch_tokens=4096)
    cuda, cpu = Recording(CUDA), Recording(CPU)
    with ThreadPoolExecutor(1) as pool:
        warm_up(cuda, config, 256, pool)
        warm_up(cpu, config, 256, pool)
    assert cuda.shapes == bucket_warm_shapes(64, 4096, 256)
    # 7 row buckets (1-64) x 7 length buckets, less rows 33-64 past 128 tokens (33 x 129 > 4,096)
    assert len({bucket(*shape) for shape in cuda.shapes}) == 7 * 7 - 2
    assert cpu.shapes == [(16, 256), (64, 64)]


def test_a_warm_up_batch_that_fails_names_its_shape_the_limits_and_what_ran_out():
    class Full(Recording):
        def _run_on(self, i, ids, lengths):
            raise RuntimeError(ARENA_FULL)

    config = ServerConfig(max_batch_size=1024, max_batch_tokens=131072)
    with ThreadPoolExecutor(1) as pool, pytest.raises(WarmUpError) as caught:
        warm_up(Full(CUDA), config, 256, pool)
    message = str(caught.value)
    rows, length = bucket_warm_shapes(1024, 131072, 256)[0]  # the largest, run first
    assert message.startswith(f"the warm-up batch of {rows} rows x {length} tokens failed on {CUDA}: ")
    assert (
        ": the CUDA memory arena is full (Available memory of 311442688 is smaller than requested "
        "bytes of 327155712); " in message
    )
    assert message.endswith(
        "the batch limits (--max-batch-size 1024, --max-batch-tokens 131072) ask more than a model "
        "instance can run here: lower them"
    )
    assert "\n" not in message and len(message) < 600


@pytest.mark.parametrize(
    ("max_rows", "max_tokens", "longest"), [(32, 1024, 256), (1, 256, 256), (64, 4096, 256), (9, 300, 100)]
)
def test_the_cpu_warm_up_runs_the_largest_footprint_and_the_most_rows_the_limits_allow(
    max_rows, max_tokens, longest
):
    shapes = cpu_warm_shapes(max_rows, max_tokens, longest)
    assert all(1 <= r <= max_rows and r * n <= max_tokens and 1 <= n <= longest for r, n in shapes)
    allowed = [(r, n) for r in range(1, max_rows + 1) for n in range(1, min(longest, max_tokens // r) + 1)]
    # Attention's scores, rows x length x length, are the largest tensor a batch makes.
    assert max(r * n * n for r, n in shapes) == max(r * n * n for r, n in allowed)
    most_rows = max(r for r, _ in allowed)
    assert (most_rows, max(n for r, n in allowed if r == most_rows)) in shapes


def test_the_bound_path_answers_what_session_run_does_through_every_bucket_and_reuses_its_buffers(repo):
    """The CUDA path's I/O binding (device buffers per shape bucket, rows and positions padded), run
    here on CPU buffers: the same code, without a GPU."""
    session = cpu_session(repo.path(repo.graph_for(CPU, "fp32")), 1)
    bound = BoundSession(session, repo.dimensions, device="cpu")
    rng = np.random.default_rng(0)
    worst = 1.0
    for _ in range(24):  # small batches: on one CPU thread the padded attention is what costs
        rows = int(rng.integers(1, 13))
        lengths = rng.integers(1, 100, rows)
        ids = rng.integers(1000, 30000, (rows, int(lengths.max())))
        ids[np.arange(ids.shape[1]) >= lengths[:, None]] = 0
        got, got_pooled = bound.run(ids, lengths)
        want, want_pooled = run_graph(session, ids, lengths)
        assert got.shape == want.shape == (rows, repo.dimensions)
        worst = min(worst, float(np.min(np.sum(got * want, axis=1))))
        np.testing.assert_allclose(got_pooled, want_pooled, atol=1e-4)
    assert worst >= 0.99999
    assert 4 <= len(bound.shapes) <= 5 * 5  # rows 1..12 in 5 powers of two, positions in 5 buckets
    shape = next(iter(bound.shapes.values()))
    buffer = shape.device_ids.data_ptr()
    key = next(iter(bound.shapes))
    bound.run(np.ones((key[0], key[1]), np.int64), np.full(key[0], key[1], np.int64))
    assert bound.shapes[key] is shape and shape.device_ids.data_ptr() == buffer  # reused, not remade


def test_the_warm_up_runs_on_every_model_thread_those_of_batches_prepared_ahead_too():
    # A run goes to whichever model thread is free, and ORT's CUDA provider (by its source) makes
    # per-thread state at a thread's first run: the prepared batch's thread was left cold (a review).
    config = ServerConfig(max_batch_size=64, max_batch_tokens=4096)
    backend = Recording(CUDA, instances=1)
    threads: list[set[int]] = [set()]
    run_on = backend._run_on

    def recording_thread(i, ids, lengths):
        threads[0].add(threading.get_ident())
        return run_on(i, ids, lengths)

    backend._run_on = recording_thread
    with ThreadPoolExecutor(2) as pool:
        warm_up(backend, config, 256, pool, threads=2)
        assert threads[0] == {t.ident for t in pool._threads}
    assert backend.ran[0] == 2 * bucket_warm_shapes(64, 4096, 256)


@pytest.mark.parametrize("provider", [CUDA, CPU])
def test_the_warm_up_runs_every_shape_on_every_instance(provider):
    """Each warm-up thread holds an instance of its own: taking the next free instance per run, two
    threads could both run on one and leave the other's shapes cold (most likely why 2 CUDA
    instances on an H100 ran their first served level at 33 ms a batch against 4.3, p99 0.4 s)."""
    config = ServerConfig(max_batch_size=64, max_batch_tokens=4096)
    backend = Recording(provider, instances=2)
    with ThreadPoolExecutor(2) as pool:
        warm_up(backend, config, 256, pool)
    shapes = (bucket_warm_shapes if provider == CUDA else cpu_warm_shapes)(64, 4096, 256)
    assert backend.ran[0] == backend.ran[1] == shapes
