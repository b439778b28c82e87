"""The engine's batcher alone: how many inputs per second one engine process can batch when the model
costs nothing (what a fast GPU leaves of the engine's cost), and its CPU per input.

    python bench/bench_batcher.py [--inputs 64000] [--repeats 3]
        [--max-batch-size 32] [--max-batch-tokens 1024]

In process, no gRPC, no ZeroMQ: the real Batcher (server/batcher.py, server defaults unless the
flags say otherwise: 1,024 padded tokens and 32 rows per batch, max padding 0.5, 2 workers) over a
model run that answers at once with (B, 384) vectors; 64 callers keep the queue deep, as a GPU-bound
engine sees it. Requests of 32 and of 1 input, lengths drawn from 8-30 tokens. CPU is the process's
(all threads) and the event loop's thread alone. Prints a markdown table; writes JSON to
build/bench/batcher.json.

Then one GPU-like instance (CUDA's auto limits, 1,024 rows and 131,072 tokens, one instance): a model
run that holds the instance for --row-us microseconds a row, the GIL released as a GPU's run releases
it (10.6 by default: an H200 ran 557-row batches of sentences in 5.9 ms), with no batch prepared ahead
and with one (engine.BATCHES_AHEAD on CUDA), taking turns: inputs/s and the share of the time the
instance computed ("model busy"). 256 callers of 32 inputs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.model.repository import CPU_PROVIDER, CUDA_PROVIDER
from minilm_embed.server.batcher import Batcher, BatchLimits, Rows, RunFn
from minilm_embed.server.config import ServerConfig, batch_limits_for
from minilm_embed.server.engine import batch_limits
from minilm_embed.server.metrics import Metrics

DIMENSIONS = 384


def instant(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vectors = np.zeros((ids.shape[0], DIMENSIONS), dtype=np.float32)
    vectors[:, 0] = 1.0
    return vectors, vectors


class GpuLike:
    """One instance whose run sleeps `row_s` a row (the GIL released, as a GPU's run releases it)."""

    def __init__(self, row_s: float) -> None:
        self.row_s, self.busy_s = row_s, 0.0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def instance(self) -> Iterator[RunFn]:
        with self.lock:
            yield self.run

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        time.sleep(self.row_s * ids.shape[0])
        self.busy_s += time.perf_counter() - started
        return instant(ids, lengths)


def limits_for(config: ServerConfig, provider: str) -> BatchLimits:
    """The engine's limits on `provider` (auto resolved), a queue no load here fills."""
    return batch_limits(dataclasses.replace(batch_limits_for(config, provider), queue_limit=1 << 20))


def requests_of(per_request: int, inputs: int, seed: int) -> list[Rows]:
    rng = random.Random(seed)
    requests = []
    for _ in range(inputs // per_request):
        lengths = np.array([rng.randint(8, 30) for _ in range(per_request)], dtype=np.int32)
        requests.append(Rows(lengths, np.ones(int(lengths.sum()), dtype=np.int32)))
    return requests


async def drive(batcher: Batcher, requests: list[Rows], callers: int) -> None:
    """`callers` callers submitting `requests` one after another until none is left."""
    todo = iter(requests)

    async def caller() -> None:
        for rows in todo:
            await batcher.submit(rows)

    await asyncio.gather(*(caller() for _ in range(callers)))


async def measure_gpu_like(ahead: int, row_s: float, inputs: int, callers: int) -> dict[str, float]:
    model = GpuLike(row_s)
    limits = limits_for(ServerConfig(), CUDA_PROVIDER)
    batcher = Batcher(model.run, limits, Metrics(), workers=1, ahead=ahead, instance=model.instance)
    batcher.start()
    requests = requests_of(32, inputs, ahead)
    wall = time.perf_counter()
    await drive(batcher, requests, callers)
    wall = time.perf_counter() - wall
    await batcher.stop()
    return {
        "batches_ahead": ahead,
        "inputs_per_s": len(requests) * 32 / wall,
        "model_busy": model.busy_s / wall,
        "mean_batch_rows": sample(batcher, "embed_batch_size_sum")
        / sample(batcher, "embed_batch_size_count"),
    }


def sample(batcher: Batcher, name: str) -> float:
    return batcher.metrics.registry.get_sample_value(name) or 0.0


async def measure(
    per_request: int, inputs: int, callers: int, config: ServerConfig | None = None
) -> dict[str, float]:
    batcher = Batcher(instant, limits_for(config or ServerConfig(), CPU_PROVIDER), Metrics(), workers=2)
    batcher.start()
    requests = requests_of(per_request, inputs, per_request)
    cpu, loop_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
    await drive(batcher, requests, callers)
    cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
    wall = time.perf_counter() - wall
    await batcher.stop()
    n = len(requests) * per_request
    return {
        "inputs_per_request": per_request,
        "inputs_per_s": n / wall,
        "cpu_us_per_input": cpu / n * 1e6,
        "event_loop_cpu_us_per_input": loop_cpu / n * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, default=64000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--callers", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=0, help="0: the server's auto (the CPU's)")
    p.add_argument("--max-batch-tokens", type=int, default=0, help="0: the server's auto (the CPU's)")
    p.add_argument("--row-us", type=float, default=10.6, help="the GPU-like run's time a row")
    p.add_argument("--gpu-like-inputs", type=int, default=96000)
    p.add_argument("--out", type=Path, default=Path("build/bench/batcher.json"))
    args = p.parse_args()
    config = ServerConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens)
    runs = [
        asyncio.run(measure(per, args.inputs if per > 1 else args.inputs // 3, args.callers, config))
        for _ in range(args.repeats)
        for per in (32, 1)
    ]
    print("| inputs/request | inputs/s | CPU µs/input (all threads) | event loop µs/input |")
    print("|---|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['inputs_per_request']} | {r['inputs_per_s']:,.0f} | {r['cpu_us_per_input']:.1f} | "
            f"{r['event_loop_cpu_us_per_input']:.1f} |"
        )
    gpu_like = [
        asyncio.run(measure_gpu_like(ahead, args.row_us / 1e6, args.gpu_like_inputs, 256))
        for _ in range(args.repeats)
        for ahead in (0, 1)
    ]
    print(f"\nOne GPU-like instance, {args.row_us} µs a row, 256 callers x 32 inputs:\n")
    print("| batches prepared ahead | inputs/s | model busy | mean batch rows |")
    print("|---:|---:|---:|---:|")
    for r in gpu_like:
        print(
            f"| {r['batches_ahead']} | {r['inputs_per_s']:,.0f} | {r['model_busy']:.0%} | "
            f"{r['mean_batch_rows']:.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"instant": runs, "gpu_like": gpu_like}, indent=2) + "\n")


if __name__ == "__main__":
    main()
