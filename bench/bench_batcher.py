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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.model.repository import CPU_PROVIDER
from minilm_embed.server.batcher import Batcher, BatchLimits, Rows
from minilm_embed.server.config import ServerConfig, batch_limits_for
from minilm_embed.server.metrics import Metrics

DIMENSIONS = 384


def instant(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vectors = np.zeros((ids.shape[0], DIMENSIONS), dtype=np.float32)
    vectors[:, 0] = 1.0
    return vectors, vectors


async def measure(
    per_request: int, inputs: int, callers: int, config: ServerConfig | None = None
) -> dict[str, float]:
    c = batch_limits_for(config or ServerConfig(), CPU_PROVIDER)
    limits = BatchLimits(
        c.max_batch_tokens, c.max_batch_size, c.max_queue_delay_ms / 1000, 1 << 20, c.max_padding
    )
    batcher = Batcher(instant, limits, Metrics(), workers=2)
    batcher.start()
    rng = random.Random(per_request)
    requests = []
    for _ in range(inputs // per_request):
        lengths = np.array([rng.randint(8, 30) for _ in range(per_request)], dtype=np.int32)
        requests.append(Rows(lengths, np.ones(int(lengths.sum()), dtype=np.int32)))
    todo = iter(requests)

    async def caller() -> None:
        for rows in todo:
            await batcher.submit(rows)

    cpu, loop_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
