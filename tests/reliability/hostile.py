"""Valid but hostile input: the largest requests the limits allow, from 16 callers at once, with a
short Tokenize probe every 100 ms from a process of its own, and the server's memory sampled per
process. Used by bench/bench_hostile.py (the figures) and tests/reliability/test_hostile.py (what
must hold: the answers and the memory bounds).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server.config import ServerConfig
from tests.reliability.probes import rss_by_process, rss_bytes
from tests.server_process import ServerProcess

CALLERS = 16
MAX_TEXT = 100_000
# As many 100 kB texts as the server's default message limit allows (20 within 2 MiB).
TEXTS_PER_CALL = (ServerConfig().max_message_bytes - 4096) // (MAX_TEXT + 8)
SECONDS = 30.0
# A short queue: the model's backlog (and so the test's length) stays seconds, and excess work is
# refused at once as it would be in production under such a flood.
FLAGS = ("--queue-limit", "320")
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "tempor"]


def long_text(seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=MAX_TEXT // 5))[:MAX_TEXT]


TEXTS = [long_text(i) for i in range(max(TEXTS_PER_CALL, 64))]  # made once: the load generator must not stall


Call = Callable[[Any], Awaitable[Any]]


EMBED = pb.EmbedRequest(texts=TEXTS[:TEXTS_PER_CALL])
TOKENIZE = pb.TokenizeRequest(texts=TEXTS[:TEXTS_PER_CALL])
STREAM = [
    pb.EmbedStreamRequest(id=str(i), request=pb.EmbedRequest(texts=TEXTS[8 * i : 8 * i + 8]))
    for i in range(8)
]
# 256 inputs of token ids in the largest message: rows of one-byte ids (below 128) filling the 2 MiB
# limit, each cut to 256 (until 2026-11-29 rows of 256 ids, 130 kB a message). Parsed, 2M ids are
# ~27 MB of protobuf: while the front kept a refused or waiting request's parsed message, 32 callers
# of these took it past 2 GB.
IDS_PER_ROW = (ServerConfig().max_message_bytes - 4096) // 256 - 8
IDS = pb.EmbedRequest(
    token_ids=[
        pb.TokenIds(ids=[101, *np.random.default_rng(i).integers(1, 128, IDS_PER_ROW - 2).tolist(), 102])
        for i in range(256)
    ]
)


def embed_texts(stub: Any) -> Awaitable[Any]:
    return stub.Embed(EMBED, timeout=120)


def tokenize_texts(stub: Any) -> Awaitable[Any]:
    return stub.Tokenize(TOKENIZE, timeout=120)


async def stream_texts(stub: Any) -> Any:
    answers = [a async for a in stub.EmbedStream(iter(STREAM), timeout=120)]
    codes = {a.error.code for a in answers if a.WhichOneof("result") == "error"}
    if codes - {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}:
        raise AssertionError(f"a stream item failed otherwise than RESOURCE_EXHAUSTED: {codes}")
    return answers


def embed_ids(stub: Any) -> Awaitable[Any]:
    return stub.Embed(IDS, timeout=120)


async def flood(address: str, call: Call, seconds: float) -> tuple[Counter[str], list[float]]:
    """CALLERS callers repeating `call` for `seconds`, and a Tokenize probe every 100 ms meanwhile."""
    codes: Counter[str] = Counter()
    options = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    context = multiprocessing.get_context("spawn")
    orders, results = context.SimpleQueue(), context.SimpleQueue()
    prober = context.Process(target=probe, args=(address, orders, results), daemon=True)
    prober.start()
    assert await asyncio.to_thread(results.get) == "ready"  # started and connected before the flood
    stop_at = time.monotonic() + seconds
    orders.put(stop_at)

    async def caller(channel: Any) -> None:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        while time.monotonic() < stop_at:
            try:
                await call(stub)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(4)]
    try:
        await asyncio.gather(*(caller(channels[i % 4]) for i in range(CALLERS)))
    finally:
        for channel in channels:
            await channel.close()
    probe_codes, probes = await asyncio.to_thread(results.get)
    prober.join()
    codes.update(probe_codes)
    return codes, probes


def probe(address: str, orders: Any, results: Any) -> None:
    """A process of its own: sharing the flood's interpreter (its GIL), a probe thread measured the
    load generator's serialising of 2 MB requests as much as the server. Says "ready" once
    connected, then probes until the time it is given."""
    codes: Counter[str] = Counter()
    latencies: list[float] = []
    request = pb.TokenizeRequest(texts=["a short probe sentence"])
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        stub.Tokenize(request, timeout=30, wait_for_ready=True)
        results.put("ready")
        stop_at = orders.get()
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                stub.Tokenize(request, timeout=10)
                codes["probe OK"] += 1
            except grpc.RpcError as e:  # refused at once is an answer too
                codes[f"probe {e.code().name}"] += 1
            latencies.append(time.monotonic() - started)
            time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))
    results.put((codes, latencies))


def settled_rss(process: ServerProcess, seconds: float = 10.0) -> tuple[float, dict[str, int]]:
    """The median of the server's resident memory over a few quiet seconds, in all and by process
    (MiB; by name and pid: embed-engine:PID, embed-front-N:PID, and the supervisor's PID)."""
    samples: list[dict[str, int]] = []
    for _ in range(int(seconds / 0.5)):
        samples.append(rss_by_process(process.proc.pid))
        time.sleep(0.5)
    names = {name for each in samples for name in each}
    each = {
        name.removeprefix("python:"): round(float(np.median([s[name] for s in samples if name in s])) / 2**20)
        for name in sorted(names)
    }
    return float(np.median([sum(s.values()) for s in samples])), each


KINDS = [
    (f"Embed, {TEXTS_PER_CALL} texts of 100 kB", embed_texts, SECONDS),
    (f"Tokenize, {TEXTS_PER_CALL} texts of 100 kB", tokenize_texts, SECONDS / 3),
    ("EmbedStream, 8 items of 8 texts of 100 kB", stream_texts, SECONDS / 3),
    (f"Embed, 256 inputs of {IDS_PER_ROW} one-byte token ids", embed_ids, SECONDS / 3),
]


def one_flood(
    server: ServerProcess, kind: str, call: Call, seconds: float, settle_s: float = 10.0
) -> dict[str, Any]:
    """One flood's figures: its answers, memory idle (3 s before), at peak and `settle_s` after, and
    the probe's latency."""
    idle, idle_each = settled_rss(server, 3.0)
    peak = [idle]

    async def scenario() -> tuple[Counter[str], list[float]]:
        async def sample() -> None:
            while True:
                peak.append(float(rss_bytes(server.proc.pid)))
                await asyncio.sleep(0.25)

        sampler = asyncio.ensure_future(sample())
        try:
            return await flood(server.address, call, seconds)
        finally:
            sampler.cancel()

    codes, probes = asyncio.run(scenario())
    after, after_each = settled_rss(server, settle_s)
    return {
        "kind": kind,
        "calls": dict(codes),
        "idle_mib": round(idle / 2**20),
        "peak_mib": round(max(peak) / 2**20),
        "after_mib": round(after / 2**20),
        "idle_by_process_mib": idle_each,
        "after_by_process_mib": after_each,
        "probe_p50_ms": round(float(np.median(probes)) * 1000, 1),
        "probe_p99_ms": round(float(np.percentile(probes, 99)) * 1000, 1),
    }
