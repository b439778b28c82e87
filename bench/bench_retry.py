"""OpenAI's client against a full queue: what the server's retry hint is worth.

    python bench/bench_retry.py [--model-dir build/model] [--data-dir ../shared/data]
                                [--callers 32] [--batch 8] [--queue-limit 64] [--seconds 15] [--rounds 2]

AsyncOpenAI calls of --batch STS-B sentences each (max_retries high, as a job that must finish sets
it), over HTTP to one real server whose queue holds --queue-limit inputs: more is offered than the
queue holds, so calls are refused (429) and the client retries each after the wait it reads from the
answer (retry-after-ms, else Retry-After). Two workloads:

    burst   --callers calls sent at once (a job gathering its chunks), then the next burst once all
            are answered, for --seconds: how long a burst takes to be served
    steady  --callers callers each sending its next call as soon as one is answered, for --seconds

and two modes, taking turns on the same server:

    hint    the answers as the server sends them: the queue's compute time at the recent pace
    1 s     the same answers with the wait rewritten to 1 s, what the server said before 2026-11-29

Reported per workload, mode and round: sentences served a second, the calls' p50 and p99 (their
retries included), 429s per call served, the server's CPU per sentence (every server process, from
/proc), and the inputs per batch the engine ran.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_priority import sentences
from tests.proc_tree import tree_cpu_seconds
from tests.server_process import ServerProcess, serving
from tests.test_server import metric

MODES = ("hint", "1 s")
WORKLOADS = ("burst", "steady")


async def load(
    server: ServerProcess, texts: list[str], workload: str, mode: str, args: argparse.Namespace
) -> dict:
    refusals = 0

    async def seen(response: httpx.Response) -> None:
        nonlocal refusals
        if response.status_code == 429:
            refusals += 1
            if mode == "1 s":
                response.headers["retry-after-ms"] = "1000"
                response.headers["retry-after"] = "1"

    latencies: list[float] = []
    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]}, limits=httpx.Limits())
    url = server.http_url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=1_000, http_client=http) as c:
        await c.embeddings.create(model="m", input=texts[:8])  # the connection made, a pace measured
        end = time.monotonic() + args.seconds

        async def call(i: int) -> None:
            chunk = [texts[(i + j) % len(texts)] for j in range(args.batch)]
            started = time.perf_counter()
            await c.embeddings.create(model="m", input=chunk)
            latencies.append(time.perf_counter() - started)

        async def caller(k: int) -> None:
            i = k * args.batch
            while time.monotonic() < end:
                await call(i)
                i += args.callers * args.batch

        async def bursts() -> None:
            i = 0
            while time.monotonic() < end:
                await asyncio.gather(*(call(i + k * args.batch) for k in range(args.callers)))
                i += args.callers * args.batch

        cpu = tree_cpu_seconds(server.proc.pid)
        batches = metric(server, "embed_batch_size_count")
        started = time.perf_counter()
        if workload == "burst":
            await bursts()
        else:
            await asyncio.gather(*(caller(k) for k in range(args.callers)))
        wall = time.perf_counter() - started
        cpu = tree_cpu_seconds(server.proc.pid) - cpu
        batches = metric(server, "embed_batch_size_count") - batches
    served = len(latencies) * args.batch
    q = statistics.quantiles(latencies, n=100)
    return {
        "sentences_s": served / wall,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
        "refusals_per_call": refusals / len(latencies),
        "cpu_ms_per_sentence": cpu / served * 1000,
        "inputs_per_batch": served / batches,
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model-dir", type=Path, default=Path("build/model"))
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--queue-limit", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    texts = sentences(args.data_dir)
    flags = ("--model-dir", str(args.model_dir), "--queue-limit", str(args.queue_limit))
    print("| workload | round | retry wait | sentences/s | p50 ms | p99 ms | 429s/call |", end="")
    print(" server CPU ms/sentence | inputs/batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    with serving(*flags) as server:
        for workload in WORKLOADS:
            for round_ in range(1, args.rounds + 1):
                for mode in MODES:
                    r = asyncio.run(load(server, texts, workload, mode, args))
                    print(
                        f"| {workload} | {round_} | {mode} | {r['sentences_s']:,.0f} | {r['p50_ms']:,.0f} "
                        f"| {r['p99_ms']:,.0f} | {r['refusals_per_call']:.2f} "
                        f"| {r['cpu_ms_per_sentence']:.2f} | {r['inputs_per_batch']:.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
