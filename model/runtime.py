"""ONNX Runtime sessions with the one set of options the server, the parity gate and benchmarks share.

Torch-free: the serving image imports it.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from minilm_embed.model.repository import (
    CUDA_PROVIDER,
    EMBEDDINGS,
    INPUT_IDS,
    LENGTHS,
    POOLED,
    ModelRepository,
)

# The CUDA provider's settings (ORT 1.31), for every CUDA session the project opens:
# - the arena grows by what a run asks for, not by doubling (`kSameAsRequested`), and never beyond
#   `gpu_mem_limit` (a run that needs more fails alone, with ORT's out-of-memory message): the served
#   shapes are few (backend.py pads them to buckets), so the arena stops growing once each was seen;
# - TF32 off: the fp32 graph computes in fp32 (ORT's default, TF32 on, rounds Gemm inputs to 10-bit
#   mantissas), the reference the fp16 graph's gate compares with; the fp16 graph is unaffected.
CUDA_MEMORY_LIMIT_BYTES = 4 << 30
CUDA_OPTIONS = {
    "arena_extend_strategy": "kSameAsRequested",
    "gpu_mem_limit": str(CUDA_MEMORY_LIMIT_BYTES),
    "use_tf32": "0",
    "do_copy_in_default_stream": "1",
}


def session_options(threads: int, serving: bool) -> ort.SessionOptions:
    """Sequential execution on `threads` intra-op threads (0: ORT's default), all graph optimisations.

    `serving=True` for the server: idle ORT threads do not spin (by default they take the cores the
    event loop and the tokenizer need). The gate and benchmarks keep ORT's defaults. The CPU memory
    arena stays on: it keeps the high-water mark of the shapes it met (+50 MB after a flood of
    256-token batches), but without it every op's output was a malloc (an mmap above 64 kB), and
    the served model ran at half the speed.

    The memory pattern is off when serving: ORT plans one block per input shape for all of a run's
    intermediate tensors, and the served shapes (rows x longest row) are many. Two instances' blocks
    of ever-new sizes fragmented the arena, whose resident size then rose in 5-20 MB steps at random
    moments of the first minute of the soak's load (270-310 MB engine). Without it the engine sat at
    240-250 MB, flat after 20 s, at the same CPU per token (243 vs 251 us, random batches of up to
    1,024 tokens, two instances, this 2-core EPYC).
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if serving:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_mem_pattern = False
    return options


def new_session(
    path: Path,
    providers: Sequence[str],
    threads: int,
    disabled_optimizers: Sequence[str],
    serving: bool,
    initializers: Mapping[str, ort.OrtValue] | None = None,
) -> ort.InferenceSession:
    """A session on the first of `providers` that loads, with `disabled_optimizers` switched off, and
    `initializers` used in place of the graph's own (ORT keeps a reference, never a copy)."""
    options = session_options(threads, serving)
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    with_options = [(p, dict(CUDA_OPTIONS)) if p == CUDA_PROVIDER else p for p in providers]
    return ort.InferenceSession(
        str(path), options, providers=with_options, disabled_optimizers=list(disabled_optimizers)
    )


def shared_initializers(repo: ModelRepository) -> dict[str, ort.OrtValue]:
    """The repository's shared tensors, each mapped read-only from its file, for `new_session`.

    Every CPU session given these uses the one mapping: two model instances held the 47 MB
    word-embedding table twice before. The pages are the file's (the page cache's, shared with any
    other process that maps the file). Keep the values for as long as the sessions live.
    """
    values = {}
    for tensor in repo.manifest.shared_tensors:
        with repo.path(tensor).open("rb") as file:
            # Every page read in now (MAP_POPULATE): touched on first use instead, the table's pages
            # showed up in the engine's resident memory as requests met new tokens (+25 MB at the
            # hostile test's first flood of 100 kB texts, +18 MB more at random token ids).
            mapped = mmap.mmap(
                file.fileno(), tensor.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        array = np.frombuffer(mapped, dtype="<f4").reshape(tensor.shape)
        values[tensor.name] = ort.OrtValue.ortvalue_from_numpy(array)
    return values


def run_graph(
    session: ort.InferenceSession, ids: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One batch through the exported graph: ((B, D) L2-normalised, (B, D) pooled)."""
    normalised, pooled = session.run([EMBEDDINGS, POOLED], {INPUT_IDS: ids, LENGTHS: lengths})
    return np.asarray(normalised), np.asarray(pooled)
