"""Throughput and latency of the gRPC server on STS-B sentences, against baselines from the same run,
and of its HTTP API beside gRPC on the same server.

    python bench/bench_server.py --model-dir build/model [--data-dir ../shared/data] [--seconds 6]
    python bench/bench_server.py --model-dir build/model --data-dir ../shared/data --http-only

Baselines, measured in the same run on the same machine:
- ceiling: in-process ONNX Runtime on length-sorted batches of 32 (its best batch here), no gRPC,
  in each of two layouts: one session on all cores, and one one-thread caller per core (the
  server's default layout); the faster of the two is the ceiling;
- unbatched: the same server started with --max-batch-size 1.
Each figure is the best of --repeats runs (the ceiling's too); the table shows the range.
HTTP beside gRPC: at concurrency 1 and 64 with 1 and 32 inputs per request, each level run over
gRPC (float32 bytes) then over HTTP (POST /v1/embeddings, base64 as OpenAI's client asks by default,
and float JSON at 32 inputs) on the same server, from one aiohttp session keeping a connection per
caller alive; --http-only runs just this comparison.
The load generator is one asyncio process sharing the machine's cores with the server.
Writes markdown tables to stdout and JSON to build/bench/server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.client.client import AsyncEmbeddingClient, Security, embed_request
from minilm_embed.export.optimize import cpu_session
from minilm_embed.export.parity import CARRIED_SENTENCES
from minilm_embed.model.data import read_sts, sts_path
from minilm_embed.model.repository import FP32_FILE, TOKENIZER_FILE
from minilm_embed.model.runtime import run_graph
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from minilm_embed.server.backend import usable_cores
from tests.server_process import start_server

CONCURRENCY = (1, 16, 64, 256)
# Callers per connection. Each client keeps a connection of its own (gRPC channels share one by
# default), so that the kernel can spread connections over several front processes.
CALLS_PER_CHANNEL = 8
# HTTP beside gRPC: (concurrency, inputs per request), and the response formats measured at each.
HTTP_PLAN = ((1, 1), (64, 1), (1, 32), (64, 32))
HTTP_FORMATS = {1: ("base64",), 32: ("base64", "float")}


@dataclass(frozen=True)
class OwnConnection(Security):
    def options(self) -> list[tuple[str, Any]]:
        return [*super().options(), ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Row:
    setup: str
    concurrency: int
    inputs_per_request: int
    requests: int
    errors: int
    sentences_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    error_codes: str = ""
    runs: list[float] | None = None  # tokens/s of every repeat; the row is the best one


def sentences(data_dir: Path | None) -> list[str]:
    if data_dir is not None:
        pairs = read_sts(sts_path(data_dir, "dev"))
        return [s for p in pairs for s in (p.first, p.second)]
    return CARRIED_SENTENCES.read_text(encoding="utf-8").splitlines() * 50


def ceiling(model_dir: Path, texts: list[str], repeats: int, batch: int = 32) -> list[Row]:
    """In-process ORT on length-sorted batches, in both layouts; best of `repeats` passes each."""
    tokenizer = Tokenizer(model_dir / TOKENIZER_FILE, 256)
    rows = sorted(tokenizer.encode(texts).ids, key=len)
    batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    tokens = sum(len(r) for r in rows)
    cores = usable_cores()

    def run_all(session: ort.InferenceSession, callers: int) -> float:
        def work(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for ids, lengths in part:
                run_graph(session, ids, lengths)

        threads = [threading.Thread(target=work, args=(batches[i::callers],)) for i in range(callers)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - started

    result = []
    for setup, threads, callers in (
        (f"in-process ORT, 1 session x {cores} threads", cores, 1),
        (f"in-process ORT, {cores} callers x 1 thread", 1, cores),
    ):
        session = cpu_session(model_dir / FP32_FILE, threads)
        run_all(session, callers)  # warm
        runs = [tokens / run_all(session, callers) for _ in range(repeats)]
        best = max(runs)
        result.append(Row(setup, 0, batch, len(batches), 0, best * len(rows) / tokens, best, 0, 0, runs=runs))
    return result


def measured_row(
    concurrency: int,
    per_request: int,
    latencies: list[float],
    totals: dict[str, int],
    codes: Counter[str],
    elapsed: float,
) -> Row:
    """One load level's row: rates over the elapsed time, latency percentiles in ms."""
    lat = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    return Row(
        "", concurrency, per_request, len(latencies), totals["errors"],
        totals["inputs"] / elapsed, totals["tokens"] / elapsed,
        float(np.percentile(lat, 50)), float(np.percentile(lat, 99)),
        ", ".join(f"{k} {v}" for k, v in codes.most_common()),
    )  # fmt: skip


async def load(address: str, texts: list[str], concurrency: int, per_request: int, seconds: float) -> Row:
    rng = random.Random(concurrency * 1000 + per_request)
    latencies: list[float] = []
    totals = {"inputs": 0, "tokens": 0, "errors": 0}
    codes: Counter[str] = Counter()
    stop_at = time.perf_counter() + seconds

    async def worker(client: AsyncEmbeddingClient) -> None:
        while time.perf_counter() < stop_at:
            batch = rng.sample(texts, per_request)
            started = time.perf_counter()
            try:
                response = await client.embed_response(embed_request(batch))
            except grpc.RpcError as e:
                totals["errors"] += 1
                codes[f"{e.code().name}: {e.details()[:80]}"] += 1
                continue
            latencies.append(time.perf_counter() - started)
            totals["inputs"] += per_request
            totals["tokens"] += response.total_tokens

    # One connection per 8 callers, well under the server's concurrent calls per connection
    # (--max-concurrent-streams, 1024 by default), past which it refuses streams (REFUSED_STREAM).
    count = -(-concurrency // CALLS_PER_CHANNEL)
    clients = [AsyncEmbeddingClient(address, timeout=60, security=OwnConnection()) for _ in range(count)]
    for client in clients:
        await client.embed(texts[:4])  # connect
    started = time.perf_counter()
    await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.close()
    return measured_row(concurrency, per_request, latencies, totals, codes, elapsed)


async def load_http(
    url: str, texts: list[str], concurrency: int, per_request: int, seconds: float, fmt: str
) -> Row:
    """As `load`, over HTTP: each caller keeps one connection alive (HTTP/1.1 has one call at a time).
    aiohttp, not httpx: at 64 callers httpx's own CPU (2.3 s per 4 s) held the load to a third."""
    rng = random.Random(concurrency * 1000 + per_request)
    latencies: list[float] = []
    totals = {"inputs": 0, "tokens": 0, "errors": 0}
    codes: Counter[str] = Counter()
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def post(batch: list[str]) -> tuple[int, Any]:
            body = orjson.dumps({"input": batch, "model": "m", "encoding_format": fmt})
            async with session.post("/v1/embeddings", data=body, headers=headers) as response:
                return response.status, orjson.loads(await response.read())

        await asyncio.gather(*(post(texts[:4]) for _ in range(concurrency)))  # connect
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                batch = rng.sample(texts, per_request)
                started = time.perf_counter()
                status, answer = await post(batch)
                if status != 200:
                    totals["errors"] += 1
                    codes[f"{status}: {answer['error']['message'][:80]}"] += 1
                    continue
                latencies.append(time.perf_counter() - started)
                totals["inputs"] += per_request
                totals["tokens"] += answer["usage"]["total_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return measured_row(concurrency, per_request, latencies, totals, codes, elapsed)


def run_http_levels(flags: list[str], texts: list[str], seconds: float, http_first: bool) -> list[Row]:
    """Each level over gRPC and over HTTP in each format, on one server; rows in that order whichever
    ran first (repeats alternate it, so a slow spell of the shared machine favours neither)."""
    server = start_server(*flags, metrics=False).wait_serving()
    try:
        rows = []
        for concurrency, per_request in HTTP_PLAN:
            runs = [("gRPC", "")] + [(f"HTTP {fmt}", fmt) for fmt in HTTP_FORMATS[per_request]]
            level = []
            for setup, fmt in runs[::-1] if http_first else runs:
                url = server.http_url
                if fmt:
                    row = asyncio.run(load_http(url, texts, concurrency, per_request, seconds, fmt))
                else:
                    row = asyncio.run(load(server.address, texts, concurrency, per_request, seconds))
                level.append(_named(row, setup))
            rows += level[::-1] if http_first else level
        return rows
    finally:
        server.stop()


def _named(row: Row, setup: str) -> Row:
    row.setup = setup
    print(
        f"  {setup} c={row.concurrency} x{row.inputs_per_request}: {row.sentences_per_s:,.0f}/s",
        file=sys.stderr,
    )
    return row


def http_table(rows: list[Row]) -> str:
    """HTTP beside gRPC, level by level: sentences/s, its ratio to gRPC's, latency."""
    head = (
        "| protocol | conc. | inputs/req | sentences/s | tokens/s range | x gRPC | p50 ms | p99 ms | errors |"
    )
    lines = [head, "|" + "---|" * 9]
    grpc_rate = {}
    for r in rows:
        key = (r.concurrency, r.inputs_per_request)
        if r.setup == "gRPC":
            grpc_rate[key] = r.sentences_per_s
        spread = f"{min(r.runs):,.0f}-{max(r.runs):,.0f}" if r.runs else "-"
        lines.append(
            f"| {r.setup} | {r.concurrency} | {r.inputs_per_request} | {r.sentences_per_s:,.0f} | {spread} | "
            f"{r.sentences_per_s / grpc_rate[key]:.2f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
            f"{r.error_codes or 0} |"
        )
    return "\n".join(lines)


def best_of(series: list[list[Row]]) -> list[Row]:
    """Per level, the repeat with the most tokens/s, carrying every repeat's tokens/s."""
    best = []
    for repeats in zip(*series, strict=True):
        top = max(repeats, key=lambda r: r.tokens_per_s)
        top.runs = [r.tokens_per_s for r in repeats]
        best.append(top)
    return best


def run_server_levels(
    setup: str, flags: list[str], texts: list[str], plan: list[tuple[int, int]], seconds: float
) -> list[Row]:
    server = start_server(*flags, metrics=False).wait_serving()
    try:
        rows = []
        for concurrency, per_request in plan:
            row = asyncio.run(load(server.address, texts, concurrency, per_request, seconds))
            row.setup = setup
            rows.append(row)
            print(f"  {setup} c={concurrency} x{per_request}: {row.tokens_per_s:,.0f} tok/s", file=sys.stderr)
        return rows
    finally:
        server.stop()


def table(rows: list[Row], ceilings: list[Row], unbatched: dict[int, float]) -> str:
    ceil = max(ceilings, key=lambda r: r.tokens_per_s)
    head = (
        "| setup | conc. | inputs/req | sentences/s | real tokens/s | range | x ceiling | x unbatched "
        "| p50 ms | p99 ms | errors |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in [*ceilings, *rows]:
        spread = f"{min(r.runs):,.0f}-{max(r.runs):,.0f}" if r.runs else "-"
        vs_unbatched = (
            r.tokens_per_s / unbatched[r.concurrency]
            if r.inputs_per_request == 1 and r.concurrency in unbatched
            else None
        )
        lines.append(
            f"| {r.setup} | {r.concurrency or '-'} | {r.inputs_per_request} | {r.sentences_per_s:,.0f} | "
            f"{r.tokens_per_s:,.0f} | {spread} | {r.tokens_per_s / ceil.tokens_per_s:.2f} | "
            f"{f'{vs_unbatched:.1f}' if vs_unbatched else '-'} | "
            f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.error_codes or 0} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--seconds", type=float, default=6.0, help="load duration per level")
    p.add_argument("--repeats", type=int, default=2, help="runs of every level (and of the ceiling)")
    p.add_argument("--out", type=Path, default=Path("build/bench/server.json"))
    p.add_argument("--http-only", action="store_true", help="only HTTP beside gRPC (no baselines)")
    args = p.parse_args()
    texts = sentences(args.data_dir)
    big_queue = ["--queue-limit", "16384", "--model-dir", str(args.model_dir)]
    http = best_of([run_http_levels(big_queue, texts, args.seconds, i % 2 == 1) for i in range(args.repeats)])
    print(http_table(http))
    if args.http_only:
        write_report(args.out, {"http": [asdict(r) for r in http]})
        return
    ceilings = ceiling(args.model_dir, texts, args.repeats)
    single = [(c, 1) for c in CONCURRENCY]
    plan = single + [(c, 32) for c in CONCURRENCY]
    no_batching = [*big_queue, "--max-batch-size", "1"]
    batched_runs, unbatched_runs = [], []
    for _ in range(args.repeats):  # whole series in turn, so slow spells of the machine spread out
        batched_runs.append(run_server_levels("server", big_queue, texts, plan, args.seconds))
        unbatched = run_server_levels("server, max batch 1", no_batching, texts, single, args.seconds)
        unbatched_runs.append(unbatched)
    batched, unbatched_rows = best_of(batched_runs), best_of(unbatched_runs)
    by_concurrency = {r.concurrency: r.tokens_per_s for r in unbatched_rows}
    print(table(batched + unbatched_rows, ceilings, by_concurrency))
    rows = [asdict(r) for r in batched + unbatched_rows]
    report = {"ceilings": [asdict(c) for c in ceilings], "rows": rows, "http": [asdict(r) for r in http]}
    write_report(args.out, report)


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
