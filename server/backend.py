"""The model run: an ONNX Runtime session that sees only ready batches (ids + lengths).

CUDA execution provider first where a GPU is usable, CPU fallback. The provider really in use comes
from `session.get_providers()`: onnxruntime-gpu lists CUDA as *available* even where its libraries
cannot load, and then silently runs on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator

import numpy as np
import onnxruntime as ort

from minilm_embed.model.host import gpu_present, usable_cores
from minilm_embed.model.repository import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    EMBEDDINGS,
    INPUT_IDS,
    LENGTHS,
    POOLED,
    ModelRepository,
    ModelRepositoryError,
    open_repository,
    read_manifest,
)
from minilm_embed.model.runtime import new_session, run_graph, shared_initializers
from minilm_embed.server.config import Device

# The repository's reader is re-exported: the server opens the model through this module.
__all__ = [
    "ModelRepository",
    "ModelRepositoryError",
    "OnnxBackend",
    "open_repository",
    "plan_instances",
    "read_manifest",
]

log = logging.getLogger(__name__)


def wanted_providers(device: Device) -> list[str]:
    if device == "cpu":
        return [CPU_PROVIDER]
    if device == "cuda" or (CUDA_PROVIDER in ort.get_available_providers() and gpu_present()):
        return [CUDA_PROVIDER, CPU_PROVIDER]
    return [CPU_PROVIDER]


def plan_instances(provider: str, instances: int, threads: int, cores: int) -> tuple[int, int]:
    """(model instances, intra-op threads each); 0 means auto for either.

    Auto on the CPU provider: two instances splitting the cores (on 2 cores, one thread each ran
    6-40% faster than one instance with two threads, and is not stalled when the event loop takes
    a core), or as many as fit the cores at the threads asked for. On CUDA: one instance. A second
    overlaps one batch's host-side work with the other's GPU run, but on an H100 the GPU got through
    about the same rows per second either way (87k and 91k served sentences/s; docs/gpu.md), and
    it doubles the GPU memory.
    """
    if instances < 0 or threads < 0:
        raise ValueError(f"instances and threads must be 0 (auto) or more, not {instances} and {threads}")
    if instances == 0:
        fit = cores if threads == 0 else max(1, cores // threads)
        instances = 1 if provider == CUDA_PROVIDER else min(2, fit)
    threads = threads or max(1, cores // instances)
    return instances, threads


class OnnxBackend:
    """`run(ids, lengths) -> (normalised, pooled)`, safe to call from `instances` threads at once.

    Each call takes a free instance, and each instance is a session of its own, with its own memory
    arena and thread pool. Two one-thread instances sharing one session interleaved their runs in one
    arena and fragmented it: at random moments of serving, resident memory stepped up by 26-32 MB
    (docs/reliability.md). A session runs one batch at a time and its intermediate tensors are freed
    when the run ends, so its footprint follows its largest batch, which the warm-up runs. On the CPU
    the instances share one mapping of the word-embedding table (model/runtime.py), 47 of the fp32
    graph's 87 MB of weights; each holds its own copy of the rest.
    """

    def __init__(
        self,
        repo: ModelRepository,
        device: Device,
        threads: int = 0,
        precision: str = "auto",
        instances: int = 0,
    ) -> None:
        started = time.perf_counter()
        if device == "cuda" and not gpu_present():
            raise ModelRepositoryError(
                "--device cuda: no NVIDIA GPU driver on this host (/proc/driver/nvidia)"
            )
        providers = wanted_providers(device)
        graph = repo.graph_for(providers[0], precision)
        self.instances, self.threads = plan_instances(providers[0], instances, threads, usable_cores())

        # On the CPU every instance uses one mapping of the shared tensors; the CUDA provider copies
        # initializers to the device per session anyway, and reads them from the files itself.
        self.shared = shared_initializers(repo) if providers[0] == CPU_PROVIDER else {}
        self.sessions = tuple(
            new_session(
                repo.path(graph),
                providers,
                self.threads,
                graph.disabled_optimizers,
                serving=True,
                initializers=self.shared,
            )
            for _ in range(self.instances)
        )
        self.provider = self.sessions[0].get_providers()[0]
        self._free: queue.SimpleQueue[ort.InferenceSession | BoundSession] = queue.SimpleQueue()
        for session in self.sessions:
            self._free.put(
                BoundSession(session, repo.dimensions) if self.provider == CUDA_PROVIDER else session
            )
        if device == "cuda" and self.provider != CUDA_PROVIDER:
            raise ModelRepositoryError("--device cuda: the CUDA execution provider could not be loaded")
        if providers[0] == CUDA_PROVIDER and self.provider != CUDA_PROVIDER:
            log.warning("a GPU is present but CUDA could not be loaded: falling back to %s", self.provider)
        self.precision: str = graph.precision
        self.graph_sha256: str = graph.sha256
        self.load_seconds = time.perf_counter() - started
        log.info(
            "model on %s (%s, %s): %d instance(s) x %d thread(s), loaded in %.2fs",
            self.provider,
            graph.file,
            self.precision,
            self.instances,
            self.threads,
            self.load_seconds,
        )

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self.instance() as run:  # the next free one: never waits when at most `instances` call
            return run(ids, lengths)

    @contextlib.contextmanager
    def instance(self) -> Iterator[Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]:
        """One instance, held for the block: its runs go to it alone. The warm-up runs every shape on
        each instance this way; taking the next free one per run, a fast instance freed first is
        taken again and the other's shapes can stay cold (most likely why 2 instances on an H100 ran
        their first served level at 33 ms a batch against one instance's 4.3, p99 0.4 s)."""
        session = self._free.get()
        try:
            yield functools.partial(_run_on, session)
        finally:
            self._free.put(session)


def _run_on(
    session: ort.InferenceSession | BoundSession, ids: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    assert ids.dtype == np.int64 and lengths.dtype == np.int64 and ids.shape[0] == lengths.shape[0]
    if isinstance(session, BoundSession):
        return session.run(ids, lengths)
    return run_graph(session, ids, lengths)


# Token positions a CUDA batch is padded up to, and its rows up to the next power of two up to
# ROW_STEP, then to the next multiple of ROW_STEP: ORT then sees at most 7 x 22 shapes (rows
# 1..1,024), each with device buffers made once and reused. GPU memory stayed at 5,092 MiB over
# 10,000 random batches on an H200 (docs/gpu.md). Padded positions and rows (length 0) are masked
# in the graph and cost attention only, which was 69-82% of the H100's time: served batches of
# ~450-520 rows ran as 512 or 1,024 rows when rows went to the next power of two throughout
# (ROW_STEP 0, as until 2026-11-27); at 64, 523 rows run as 576. Not yet measured on a GPU
# (bench_gpu.py's `buckets` part compares the two).
SEQUENCE_BUCKETS = (16, 32, 64, 96, 128, 192, 256)
ROW_STEP = 64


def bucket(
    rows: int, positions: int, row_step: int = ROW_STEP, position_buckets: tuple[int, ...] = SEQUENCE_BUCKETS
) -> tuple[int, int]:
    """The (rows, positions) shape a (rows, positions) batch is run at on CUDA."""
    if row_step == 0 or rows <= row_step:
        padded_rows = 1 << max(0, rows - 1).bit_length()
    else:
        padded_rows = -(-rows // row_step) * row_step
    padded = next((b for b in position_buckets if b >= positions), positions)
    return padded_rows, padded


def bucket_warm_shapes(max_rows: int, max_tokens: int, longest: int) -> list[tuple[int, int]]:
    """For every bucket a batch within the limits can land in (at most `max_rows` rows, rows x
    longest row at most `max_tokens`, rows at most `longest` long), the (rows, length) batch of that
    bucket with the most tokens: what warms the CUDA path's shapes and memory arena to its
    high-water mark. On an H100, random batches alone stepped the fp16 graph's memory up 114 MiB at
    the 6,750th; after every bucket had run at its largest shape, 7,750 random batches moved it
    2 MiB.

    Largest first: with the arena growing by what a run asks for, each smaller batch then runs in
    memory the larger ones freed. Smallest first (until 2026-11-29), each larger batch asked for
    more and the fragments of the earlier ones stayed unused: on an H200, at the auto limits of
    1,024 rows and 131,072 tokens, the warm-up overran the 4 GiB arena at 832 rows x 128 positions
    and the engine never started."""
    most: dict[tuple[int, int], tuple[int, int]] = {}
    for rows in range(1, max_rows + 1):
        # For this row count, each bucket's longest rows the limits allow (a bucket's end, or less).
        for length in {min(end, longest, max_tokens // rows) for end in (*SEQUENCE_BUCKETS, longest)}:
            if length >= 1:
                key = bucket(rows, length)
                best_rows, best_length = most.get(key, (0, 0))
                if rows * length >= best_rows * best_length:  # ties: the more rows
                    most[key] = (rows, length)
    # By tokens, then length, then rows, each descending.
    return sorted(most.values(), key=lambda s: (s[0] * s[1], s[1], s[0]), reverse=True)


class BoundShape:
    """One bucket's I/O binding: device buffers for both inputs and both outputs, host staging arrays."""

    def __init__(
        self, session: ort.InferenceSession, rows: int, positions: int, dims: int, device: str = "cuda"
    ) -> None:
        self.session = session
        self.ids = np.zeros((rows, positions), np.int64)
        self.lengths = np.zeros(rows, np.int64)
        new = ort.OrtValue.ortvalue_from_shape_and_type
        self.device_ids = new((rows, positions), np.int64, device, 0)
        self.device_lengths = new((rows,), np.int64, device, 0)
        self.embeddings = new((rows, dims), np.float32, device, 0)
        self.pooled = new((rows, dims), np.float32, device, 0)
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input(INPUT_IDS, self.device_ids)
        self.binding.bind_ortvalue_input(LENGTHS, self.device_lengths)
        self.binding.bind_ortvalue_output(EMBEDDINGS, self.embeddings)
        self.binding.bind_ortvalue_output(POOLED, self.pooled)

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows, positions = ids.shape
        self.ids[:rows, :positions] = ids
        self.ids[:rows, positions:] = 0
        self.ids[rows:] = 0
        self.lengths[:rows] = lengths
        self.lengths[rows:] = 0
        self.device_ids.update_inplace(self.ids)  # one copy to the device per input per batch
        self.device_lengths.update_inplace(self.lengths)
        self.session.run_with_iobinding(self.binding)
        return self.embeddings.numpy()[:rows], self.pooled.numpy()[:rows]  # one copy back per output


class BoundSession:
    """A CUDA session run through I/O binding, with one `BoundShape` per bucket met so far (`device`
    "cpu" runs the same code on a CPU session, for the tests of machines without a GPU)."""

    def __init__(
        self,
        session: ort.InferenceSession,
        dims: int,
        device: str = "cuda",
        row_step: int = ROW_STEP,
        position_buckets: tuple[int, ...] = SEQUENCE_BUCKETS,
    ) -> None:
        self.session = session
        self.dims = dims
        self.device = device
        # bucket()'s settings; other than the defaults only to compare them (bench_gpu.py)
        self.row_step, self.position_buckets = row_step, position_buckets
        self.shapes: dict[tuple[int, int], BoundShape] = {}

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows, positions = ids.shape
        key = bucket(rows, positions, self.row_step, self.position_buckets)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = BoundShape(self.session, *key, self.dims, self.device)
        return shape.run(ids, lengths)
