"""The model run: an ONNX Runtime session that sees only ready batches (ids + lengths).

CUDA execution provider first where a GPU is usable, CPU fallback. The provider really in use comes
from `session.get_providers()`: onnxruntime-gpu lists CUDA as *available* even where its libraries
cannot load, and then silently runs on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from model.checksum import sha256_file
from server.config import Device

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


class ModelRepositoryError(Exception):
    """The model directory is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class ModelRepository:
    directory: Path
    manifest: dict[str, Any]

    @property
    def max_input_tokens(self) -> int:
        return int(self.manifest["max_input_tokens"])

    @property
    def dimensions(self) -> int:
        return int(self.manifest["dimensions"])

    def graph_for(self, provider: str, precision: str) -> dict[str, Any]:
        """The graph shipped for this provider: the asked precision, else the first listed for it."""
        graphs = [g for g in self.manifest["graphs"] if g["provider"] == provider] or [
            g for g in self.manifest["graphs"] if g["provider"] == CPU
        ]
        if precision == "auto":
            return dict(graphs[0])
        for g in graphs:
            if g["precision"] == precision:
                return dict(g)
        shipped = ", ".join(sorted({g["precision"] for g in graphs}))
        raise ModelRepositoryError(
            f"{self.directory}: no {precision} graph for {provider} (shipped: {shipped}); "
            "int8 is built by `python -m export --data-dir ...`"
        )


def open_repository(directory: Path) -> ModelRepository:
    """Read manifest.json and verify every graph's checksum against it."""
    path = directory / "manifest.json"
    if not path.is_file():
        raise ModelRepositoryError(f"{path}: missing; build the model repository with `make model`")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for graph in manifest["graphs"]:
        file = directory / graph["file"]
        if not file.is_file():
            raise ModelRepositoryError(f"{file}: missing")
        _verify_checksum(file, graph["sha256"])
    return ModelRepository(directory, manifest)


def _verify_checksum(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ModelRepositoryError(f"{path}: sha256 {actual} does not match manifest {expected}")


def gpu_present() -> bool:
    """An NVIDIA driver is loaded. onnxruntime-gpu lists CUDA as available on any machine."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def wanted_providers(device: Device) -> list[str]:
    if device == "cpu":
        return [CPU]
    if device == "cuda" or (CUDA in ort.get_available_providers() and gpu_present()):
        return [CUDA, CPU]
    return [CPU]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_instances(provider: str, instances: int, threads: int, cores: int) -> tuple[int, int]:
    """(model instances, intra-op threads each); 0 means auto for either.

    Auto on the CPU provider: two instances splitting the cores (on 2 cores, one thread each ran
    6-40% faster than one instance with two threads, and is not stalled when the event loop takes
    a core), or as many as fit the cores at the threads asked for. On CUDA: one instance; the GPU
    runs one batch at a time anyway.
    """
    if instances < 0 or threads < 0:
        raise ValueError(f"instances and threads must be 0 (auto) or more, not {instances} and {threads}")
    if instances == 0:
        fit = cores if threads == 0 else max(1, cores // threads)
        instances = 1 if provider == CUDA else min(2, fit)
    threads = threads or max(1, cores // instances)
    return instances, threads


def _session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle ORT threads spin by default, taking the cores the event loop and tokenizer need.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OnnxBackend:
    """`run(ids, lengths) -> (normalised, pooled)`, safe to call from `instances` threads at once.

    Each call takes a free instance. Instances of one thread share one session (ORT runs concurrent
    calls on a session; with one thread there is no intra-op pool for them to contend for); instances
    of several threads get a session each, so each keeps its own thread pool.
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
        providers = wanted_providers(device)
        graph = repo.graph_for(providers[0], precision)
        self.instances, self.threads = plan_instances(providers[0], instances, threads, usable_cores())

        def new_session() -> ort.InferenceSession:
            return ort.InferenceSession(
                str(repo.directory / graph["file"]),
                _session_options(self.threads),
                providers=providers,
                disabled_optimizers=list(graph.get("disabled_optimizers", [])),
            )

        first = new_session()
        self.sessions = (first,) * self.instances
        if self.threads > 1:
            self.sessions = (first, *(new_session() for _ in range(self.instances - 1)))
        self._free: queue.SimpleQueue[ort.InferenceSession] = queue.SimpleQueue()
        for session in self.sessions:
            self._free.put(session)
        self.provider = first.get_providers()[0]
        if device == "cuda" and self.provider != CUDA:
            raise ModelRepositoryError("--device cuda: the CUDA execution provider could not be loaded")
        if providers[0] == CUDA and self.provider != CUDA:
            log.warning("a GPU is present but CUDA could not be loaded: falling back to %s", self.provider)
        self.precision = str(graph.get("precision", "fp32"))
        self.load_seconds = time.perf_counter() - started
        log.info(
            "model on %s (%s, %s): %d instance(s) x %d thread(s), loaded in %.2fs",
            self.provider,
            graph["file"],
            self.precision,
            self.instances,
            self.threads,
            self.load_seconds,
        )

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert ids.dtype == np.int64 and lengths.dtype == np.int64 and ids.shape[0] == lengths.shape[0]
        session = self._free.get()  # never waits when at most `instances` threads call
        try:
            if self.provider == CUDA:
                return _run_bound(session, ids, lengths)
            normalised, pooled = session.run(None, {"input_ids": ids, "lengths": lengths})
            return np.asarray(normalised), np.asarray(pooled)
        finally:
            self._free.put(session)


def _run_bound(
    session: ort.InferenceSession, ids: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """I/O binding: inputs copied to the GPU once, outputs left there and fetched together."""
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("lengths", lengths)
    binding.bind_output("embeddings", "cuda")
    binding.bind_output("pooled", "cuda")
    session.run_with_iobinding(binding)
    normalised, pooled = binding.copy_outputs_to_cpu()
    return np.asarray(normalised), np.asarray(pooled)
