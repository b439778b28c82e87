"""An interactive caller beside a bulk job: its latency when the job's requests are sent as bulk
(EmbedRequest.priority, what `minilm-embed embed-file` sends) against sent as interactive (as every
request was before priorities), on one server, taking turns.

    python bench/bench_priority.py [--model-dir build/model] [--data-dir ../shared/data]

The job: --callers callers (16, as embed-file's --concurrency), in a process of their own, each
sending --batch-size (32) STS-B sentences a request, back to back. The probe: one
sentence, interactive, every 100 ms from this process, on its own connection. Reported per round:
the probe's p50, p99 and max, and the job's sentences a second (what priority costs the job).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.client import AsyncEmbeddingClient, EmbeddingClient, Overloaded
from minilm_embed.model.data import read_sts, sts_path
from tests.server_process import serving

PROBE_EVERY_S = 0.1
CARRIED = Path(__file__).resolve().parents[1] / "export" / "parity_sentences.txt"
QUERY = "how do I reset my password"


def sentences(data_dir: Path | None) -> list[str]:
    """STS-B dev's distinct sentences, or the sentences the repository carries."""
    if data_dir is None:
        return CARRIED.read_text(encoding="utf-8").splitlines()
    pairs = read_sts(sts_path(data_dir, "dev"))
    return list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))


def job(address: str, texts: list[str], callers: int, batch: int, seconds: float, priority: str, out) -> None:
    """The bulk job: `callers` requests of `batch` texts in flight for `seconds`; sentences done."""

    async def main() -> int:
        done, refused = 0, 0
        end = time.monotonic() + seconds
        async with AsyncEmbeddingClient(address, timeout=120) as client:

            async def caller(k: int) -> None:
                nonlocal done, refused
                i = k * batch
                while time.monotonic() < end:
                    chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
                    i += callers * batch
                    try:
                        await client.embed(chunk, priority=priority)
                        done += batch
                    except Overloaded:
                        refused += 1
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(caller(k) for k in range(callers)))
        out.put((done, refused))
        return done

    asyncio.run(main())


def probe(address: str, seconds: float) -> list[float]:
    latencies = []
    with EmbeddingClient(address, timeout=60) as client:
        client.embed([QUERY])  # the connection made
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            client.embed([QUERY])
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(max(0.0, PROBE_EVERY_S - (time.perf_counter() - started)))
    return latencies


def one_round(address: str, texts: list[str], args: argparse.Namespace, priority: str) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    out = context.SimpleQueue()
    flood = context.Process(
        target=job, args=(address, texts, args.callers, args.batch_size, args.seconds, priority, out)
    )
    flood.start()
    time.sleep(args.settle)  # the job's requests queued
    latencies = probe(address, args.seconds - args.settle - 1.0)
    flood.join()
    done, refused = out.get()
    latencies.sort()
    return {
        "probe_p50_ms": statistics.median(latencies),
        "probe_p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "probe_max_ms": latencies[-1],
        "probes": len(latencies),
        "job_sentences_per_s": done / args.seconds,
        "job_refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("build/model"))
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    texts = sentences(args.data_dir)
    print(
        f"{len(texts)} sentences; the job: {args.callers} callers x {args.batch_size} a request",
        file=sys.stderr,
    )
    rows = []
    with serving("--model-dir", str(args.model_dir)) as server:
        for r in range(args.rounds):
            for priority in ("interactive", "bulk") if r % 2 == 0 else ("bulk", "interactive"):
                row = {
                    "round": r + 1,
                    "job_sent_as": priority,
                    **one_round(server.address, texts, args, priority),
                }
                print(row, file=sys.stderr)
                rows.append(row)
    print(
        "| round | job sent as | probe p50 ms | p99 ms | max ms | probes | job sentences/s | job refusals |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cells = [
            row["round"],
            row["job_sent_as"],
            f"{row['probe_p50_ms']:.1f}",
            f"{row['probe_p99_ms']:.1f}",
            f"{row['probe_max_ms']:.1f}",
            row["probes"],
            f"{row['job_sentences_per_s']:,.0f}",
            row["job_refused"],
        ]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
