"""Test and benchmark entry points: the real server (supervisor, fronts, engine, batcher) over a model
run that is not the production one. Nothing in `minilm-embed-serve` can start these.

    python -m tests.stand_in_server instant <server flags>      # an instant stand-in model (bench/)
    python -m tests.stand_in_server fault TEXT <server flags>   # the real model; a batch holding TEXT fails
    python -m tests.stand_in_server slow-start S <server flags> # the real model, loaded S seconds late
    python -m tests.stand_in_server warm-oom <server flags>     # the real model; its warm-up runs out
                                                                # of memory as ORT's CUDA arena does

The fault server also holds (sleeps HOLD_S in) any batch holding HOLD_TEXT: a test that needs inputs
to wait in the queue first keeps a model instance busy with it (an idle server runs a lone input at
once, without waiting for company).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import numpy as np

from minilm_embed.model.tokenizer import Tokenizer
from minilm_embed.server.__main__ import main
from minilm_embed.server.backend import ModelRepository
from minilm_embed.server.batcher import RunFn
from minilm_embed.server.config import ServerConfig
from minilm_embed.server.engine import Backend, onnx_backend


class InstantBackend:
    """Answers every batch at once with unit vectors: what is left of the server's cost when the
    model costs nothing (a fast GPU comes close). Measures the front end's capacity, nothing else."""

    provider = "CPUExecutionProvider"
    precision = "fp32"
    graph_sha256 = ""  # runs no graph
    threads = 1

    def __init__(self, config: ServerConfig, repo: ModelRepository) -> None:
        self.dimensions = repo.dimensions
        self.instances = config.model_instances or 1
        started = time.perf_counter()
        self.load_seconds = time.perf_counter() - started

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        vectors = np.zeros((ids.shape[0], self.dimensions), dtype=np.float32)
        vectors[:, 0] = 1.0
        return vectors, vectors

    @contextlib.contextmanager
    def instance(self) -> Iterator[RunFn]:
        yield self.run


HOLD_TEXT = "this exact text holds its batch for a few seconds"
HOLD_S = 4.0


def _holds(ids: np.ndarray, lengths: np.ndarray, wanted: list[int]) -> bool:
    n = len(wanted)
    return any(length == n and row[:n].tolist() == wanted for row, length in zip(ids, lengths, strict=True))


class FaultyBackend:
    """The real backend, except that a batch holding the fault input's exact ids fails, and one
    holding the hold input's ids first sleeps HOLD_S."""

    def __init__(self, real: Backend, fault_ids: list[int], hold_ids: list[int]) -> None:
        self.real = real
        self.fault_ids = fault_ids
        self.hold_ids = hold_ids
        self.provider, self.precision, self.graph_sha256 = real.provider, real.precision, real.graph_sha256
        self.instances, self.threads, self.load_seconds = real.instances, real.threads, real.load_seconds

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if _holds(ids, lengths, self.fault_ids):
            raise RuntimeError("injected backend fault")
        if _holds(ids, lengths, self.hold_ids):
            time.sleep(HOLD_S)
        return self.real.run(ids, lengths)

    def instance(self) -> AbstractContextManager[RunFn]:
        return self.real.instance()  # the warm-up: no faults to inject there


def faulty_backend(fault_text: str, config: ServerConfig, repo: ModelRepository) -> Backend:
    tokenizer = Tokenizer(repo.tokenizer_file, repo.max_input_tokens)
    fault, hold = tokenizer.encode([fault_text, HOLD_TEXT]).ids
    return FaultyBackend(onnx_backend(config, repo), fault, hold)


def slow_backend(seconds: float, config: ServerConfig, repo: ModelRepository) -> Backend:
    """The real backend after `seconds`: a GPU engine loading its graphs and CUDA for that long."""
    time.sleep(seconds)
    return onnx_backend(config, repo)


# ORT's error when a run asks its bounded CUDA arena for more than is left (an H200, 2026-11-29).
ARENA_FULL = (
    "Error in execution: Non-zero status code returned while running Gemm node. "
    "Name:'/encoder/layers.0/ffn/up/Gemm' Status Message: /onnxruntime_src/onnxruntime/core/framework/"
    "bfc_arena.cc:360 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) "
    "Available memory of 311442688 is smaller than requested bytes of 327155712"
)


class ArenaFullBackend(FaultyBackend):
    """The real backend whose warm-up's first batch fails as ORT's full CUDA arena does."""

    @contextlib.contextmanager
    def instance(self) -> Iterator[RunFn]:
        def run(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            raise RuntimeError(ARENA_FULL)

        yield run


def arena_full_backend(config: ServerConfig, repo: ModelRepository) -> Backend:
    return ArenaFullBackend(onnx_backend(config, repo), [], [])


if __name__ == "__main__":
    kind, rest = sys.argv[1], sys.argv[2:]
    if kind == "instant":
        sys.exit(main(rest, InstantBackend))
    if kind == "fault":
        sys.exit(main(rest[1:], functools.partial(faulty_backend, rest[0])))
    if kind == "slow-start":
        sys.exit(main(rest[1:], functools.partial(slow_backend, float(rest[0]))))
    if kind == "warm-oom":
        sys.exit(main(rest, arena_full_backend))
    sys.exit(f"usage: {__doc__}")
