"""Valid but hostile input: the largest requests the limits allow, from 16 callers at once.

    python bench/bench_hostile.py [--model-dir build/model]
    python bench/bench_hostile.py --many-callers 1200 [--server-flag=--max-concurrent-calls=64]

With --many-callers N: instead, N callers over 16 connections each repeat one Embed padded to 2 MiB
(an unknown field: cheap to tokenize, all bytes to read) for 20 s against a server with default
flags (and any --server-flag), and the peak resident memory of each server process is printed
(docs/benchmarks.md, "Hostile input": what --max-concurrent-calls bounds).

For each kind of flood (Embed of as many 100 kB texts as the default message limit allows,
Tokenize of the same, EmbedStream items of 8 such texts, Embed of 256 inputs of 256 token ids):
the answers' status codes, the server's resident memory (all its processes) idle, at peak and 10 s
after the load (in all and per process), and the latency of a short Tokenize probe sent every
100 ms from a process of its own (tests/reliability/hostile.py). Issue 14's targets: only OK or
RESOURCE_EXHAUSTED, peak < 2x idle, after < 1.1x idle, probe p99 < 100 ms (docs/benchmarks.md, "Hostile
input"; tests/reliability/test_hostile.py asserts all but the probe's latency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from tests.reliability.hostile import FLAGS, KINDS, one_flood
from tests.reliability.probes import rss_by_process
from tests.server_process import ServerProcess, serving

EMBED_METHOD = "/embedding.v1.EmbeddingService/Embed"
PADDED_MIB = 2.0
MANY_SECONDS = 20.0


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def padded_embed(mib: float) -> bytes:
    """A valid EmbedRequest of one short text, padded to `mib` MiB by an unknown field (number 1000)."""
    base = pb.EmbedRequest(texts=["a short sentence"]).SerializeToString()
    pad = int(mib * 2**20) - len(base) - 16
    return base + varint((1000 << 3) | 2) + varint(pad) + b"x" * pad


def many_callers(server: ServerProcess, callers: int) -> dict[str, object]:
    """`callers` callers repeating one padded Embed for MANY_SECONDS: answers and peak MiB by process."""
    payload = padded_embed(PADDED_MIB)
    peak: dict[str, int] = {}
    codes: Counter[str] = Counter()

    async def scenario() -> None:
        stop = time.monotonic() + MANY_SECONDS
        options = [("grpc.max_send_message_length", 16 << 20)]
        channels = [grpc.aio.insecure_channel(server.address, options=options) for _ in range(16)]
        calls = [
            c.unary_unary(
                "/embedding.v1.EmbeddingService/Embed", response_deserializer=pb.EmbedResponse.FromString
            )
            for c in channels
        ]

        async def caller(i: int) -> None:
            while time.monotonic() < stop:
                try:
                    await calls[i % 16](payload, timeout=60)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1

        async def sample() -> None:
            while True:
                for name, value in rss_by_process(server.proc.pid).items():
                    peak[name] = max(peak.get(name, 0), value)
                await asyncio.sleep(0.25)

        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(caller(i) for i in range(callers)))
        sampler.cancel()
        for channel in channels:
            await channel.close()

    asyncio.run(scenario())
    return {"callers": callers, "calls": dict(codes), "peak_mib": {k: v >> 20 for k, v in peak.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--out", type=Path, default=Path("build/bench/hostile.json"))
    p.add_argument("--many-callers", type=int, default=0, help="N callers of 2 MiB padded Embeds instead")
    p.add_argument(
        "--server-flag", action="append", default=[], help="a server flag, e.g. --server-flag=--x=1"
    )
    args = p.parse_args()
    if args.many_callers:
        with serving(*args.server_flag, "--model-dir", str(args.model_dir)) as server:
            result = many_callers(server, args.many_callers)
        print(json.dumps(result, indent=2))
        return
    rows = []
    with serving(*FLAGS, "--model-dir", str(args.model_dir)) as server:
        for kind, call, seconds in KINDS:
            rows.append(one_flood(server, kind, call, seconds))
            print(rows[-1], file=sys.stderr)
    print("| flood | calls | idle MiB | peak MiB | after MiB | probe p50 ms | probe p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        calls = ", ".join(f"{k} {v}" for k, v in r["calls"].items())
        print(
            f"| {r['kind']} | {calls} | {r['idle_mib']} | {r['peak_mib']} | {r['after_mib']} | "
            f"{r['probe_p50_ms']} | {r['probe_p99_ms']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
