"""Throughput and latency of the gRPC server on STS-B sentences, against baselines from the same run,
and of its HTTP API beside gRPC on the same server.

    python bench/bench_server.py --model-dir build/model [--data-dir ../shared/data] [--seconds 6]
    python bench/bench_server.py --model-dir build/model --data-dir ../shared/data --http-only

Baselines, measured in the same run on the same machine:
- ceiling: in-process ONNX Runtime on length-sorted batches of 32 (its best batch here), no gRPC,
  in each of two layouts: one session on all cores, and one one-thread caller per core, each with
  a session of its own (the server's default layout); the faster of the two is the ceiling;
- unbatched: the same server started with --max-batch-size 1.
Each figure is the best of --repeats runs (the ceiling's too); the table shows the range.
HTTP beside gRPC: at concurrency 1 and 64 with 1 and 32 inputs per request, each level run over
gRPC (float32 bytes) then over HTTP (POST /v1/embeddings, base64 as OpenAI's client asks by default,
and float JSON at 32 inputs) on the same server, from one aiohttp session keeping a connection per
caller alive; --http-only runs just this comparison.
Low precision (--low-precision, only this): the int8 graph served (--precision int8) beside fp32
served, at 64 callers x 1 and x 32 sentences, against each graph's in-process ceiling and
sentence-transformers in process (the first 1,000 distinct sentences, batch 32, every core; fp32,
and bf16 where torch has a native bf16 kernel: AVX-512 BF16 or AMX; its best pass of --repeats
at the start and one after each server series), written to
build/bench/server_low_precision.json.

    python bench/bench_server.py --model-dir build/model --data-dir ../shared/data --low-precision
The load generator is one asyncio process (several with bench_front.py's --load-processes) sharing
the machine's cores with the server.
Writes markdown tables to stdout and JSON to build/bench/server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
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
from minilm_embed.model.host import usable_cores
from minilm_embed.model.repository import FP32_FILE, INT8_FILE, TOKENIZER_FILE, read_manifest
from minilm_embed.model.runtime import run_graph
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from tests.server_process import start_server

CONCURRENCY = (1, 16, 64, 256)
# Callers per connection. Each client keeps a connection of its own (gRPC channels share one by
# default), so that the kernel can spread connections over several front processes.
CALLS_PER_CHANNEL = 8
# HTTP beside gRPC: (concurrency, inputs per request), and the response formats measured at each.
HTTP_PLAN = ((1, 1), (64, 1), (1, 32), (64, 32))
HTTP_FORMATS = {1: ("base64",), 32: ("base64", "float")}
ST_SETUP = "sentence-transformers {}, in process"


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
    client_cpu_s: float = 0.0  # the load generator's own CPU time while it ran (every process)
    start_spread_s: float = 0.0  # between the first and the last load process starting their callers
    span_s: float = 0.0  # the rates' window: from the first caller's start to the last one's end


def sentences(data_dir: Path | None) -> list[str]:
    if data_dir is not None:
        pairs = read_sts(sts_path(data_dir, "dev"))
        return [s for p in pairs for s in (p.first, p.second)]
    return CARRIED_SENTENCES.read_text(encoding="utf-8").splitlines() * 50


def ceiling(
    model_dir: Path, texts: list[str], repeats: int, batch: int = 32, graph: str = FP32_FILE
) -> list[Row]:
    """In-process ORT on length-sorted batches, in both layouts; best of `repeats` passes each."""
    tokenizer = Tokenizer(model_dir / TOKENIZER_FILE, 256)
    rows = sorted(tokenizer.encode(texts).ids, key=len)
    batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    tokens = sum(len(r) for r in rows)
    cores = usable_cores()

    def run_all(sessions: list[ort.InferenceSession]) -> float:
        def work(session: ort.InferenceSession, part: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for ids, lengths in part:
                run_graph(session, ids, lengths)

        n = len(sessions)
        threads = [threading.Thread(target=work, args=(s, batches[i::n])) for i, s in enumerate(sessions)]
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
        sessions = [cpu_session(model_dir / graph, threads) for _ in range(callers)]  # one each, as served
        run_all(sessions)  # warm
        runs = [tokens / run_all(sessions) for _ in range(repeats)]
        best = max(runs)
        result.append(Row(setup, 0, batch, len(batches), 0, best * len(rows) / tokens, best, 0, 0, runs=runs))
    return result


def measured_row(
    concurrency: int,
    per_request: int,
    latencies: list[float],
    totals: dict[str, float],
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
        client_cpu_s=totals.get("cpu_s", 0.0), span_s=elapsed,
    )  # fmt: skip


async def load(address: str, texts: list[str], concurrency: int, per_request: int, seconds: float) -> Row:
    return measured_row(
        concurrency, per_request, *await _tally(address, texts, concurrency, per_request, seconds)
    )


Tally = tuple[list[float], dict[str, float], Counter[str], float]  # latencies, totals, error codes, elapsed


async def _tally(
    address: str,
    texts: list[str],
    concurrency: int,
    per_request: int,
    seconds: float,
    seed: int = 0,
) -> Tally:
    """`concurrency` callers for `seconds`; in a load process, from when every process is ready."""
    rng = random.Random(concurrency * 1000 + per_request + seed * 1_000_003)
    latencies: list[float] = []
    totals = {"inputs": 0, "tokens": 0, "errors": 0, "cpu_s": 0.0}
    codes: Counter[str] = Counter()

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
    if _TOGETHER is not None:
        await asyncio.to_thread(_wait_for_the_others, _TOGETHER)
    started, cpu_started, totals["start"] = time.perf_counter(), time.process_time(), time.time()
    stop_at = started + seconds
    await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    totals["cpu_s"], totals["end"] = time.process_time() - cpu_started, time.time()
    for client in clients:
        await client.close()
    return latencies, totals, codes, elapsed


# In a load process: the barrier every load process waits at, connected, before its callers start.
_TOGETHER: Any = None


def _join(together: Any) -> None:
    global _TOGETHER
    _TOGETHER = together


def _wait_for_the_others(together: Any) -> None:
    # One that never comes breaks the barrier after 120 s: start anyway; start_spread_s shows it.
    with contextlib.suppress(threading.BrokenBarrierError):
        together.wait(120)


def _tally_in_process(args: tuple[str, list[str], int, int, float, int]) -> Tally:
    return asyncio.run(_tally(*args))


def load_row(
    address: str, texts: list[str], concurrency: int, per_request: int, seconds: float, processes: int = 1
) -> Row:
    """`load`, its callers split over `processes` client processes that start together: on a many-core
    host one asyncio client process is slower than several server fronts."""
    processes = min(processes, concurrency)
    if processes == 1:
        return asyncio.run(load(address, texts, concurrency, per_request, seconds))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    jobs = [(address, texts, n, per_request, seconds, i) for i, n in enumerate(shares)]
    context = multiprocessing.get_context("spawn")
    # Started together at a barrier, once all have imported and connected. With a fixed head start
    # of 5 s (bench_gpu's children import torch, through bench_model) the windows lay staggered while
    # their tokens were divided by one window: one CUDA model instance "computed" 4.35 s of batches
    # in a 3 s level on an H100.
    together = context.Barrier(processes)
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_join, initargs=(together,)) as pool:
        parts = list(pool.map(_tally_in_process, jobs))
    starts = [part[1].pop("start") for part in parts]
    ends = [part[1].pop("end") for part in parts]
    latencies = [x for part in parts for x in part[0]]
    totals = {key: sum(part[1][key] for part in parts) for key in parts[0][1]}
    codes = sum((part[2] for part in parts), Counter[str]())
    # Over the span from the first start to the last end: exact when they ran together, and never
    # more than what was served in that span when they did not.
    row = measured_row(concurrency, per_request, latencies, totals, codes, max(ends) - min(starts))
    return dataclasses.replace(row, start_spread_s=max(starts) - min(starts))


async def load_http(
    url: str, texts: list[str], concurrency: int, per_request: int, seconds: float, fmt: str
) -> Row:
    """As `load`, over HTTP: each caller keeps one connection alive (HTTP/1.1 has one call at a time).
    aiohttp, not httpx: at 64 callers httpx's own CPU (2.3 s per 4 s) held the load to a third."""
    rng = random.Random(concurrency * 1000 + per_request)
    latencies: list[float] = []
    totals = {"inputs": 0, "tokens": 0, "errors": 0, "cpu_s": 0.0}
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
    setup: str,
    flags: list[str],
    texts: list[str],
    plan: list[tuple[int, int]],
    seconds: float,
    load_processes: int = 1,
) -> list[Row]:
    server = start_server(*flags, metrics=False).wait_serving()
    try:
        rows = []
        for concurrency, per_request in plan:
            row = load_row(server.address, texts, concurrency, per_request, seconds, load_processes)
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
    p.add_argument(
        "--low-precision",
        action="store_true",
        help="only the int8 graph served beside fp32 served and sentence-transformers fp32 and bf16",
    )
    args = p.parse_args()
    texts = sentences(args.data_dir)
    if args.low_precision:
        rows, markdown = low_precision(args.model_dir, texts, args.seconds, args.repeats)
        print(markdown)
        write_report(args.out.with_name("server_low_precision.json"), {"rows": [asdict(r) for r in rows]})
        return
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


class SentenceTransformers:
    """sentence-transformers in process on every core, batch 32, fp32 and (where torch has a native
    kernel) bf16: what a user gets without this service. Its passes can be spread over a run (`passes`
    each time), and each row is its best pass: on a VM whose speed drifts (torch bf16 on one Xeon
    ranged 5,537-13,729 tok/s over a morning's passes), the baseline then gets its best moment, not
    just the run's first minute."""

    def __init__(self, model_dir: Path, texts: list[str]) -> None:
        import torch
        from bench_model import bf16_is_native, st_texts, st_weights

        torch.set_num_threads(usable_cores())
        self.texts = texts
        self.tokens = sum(Tokenizer(model_dir / TOKENIZER_FILE, 256).encode(texts).lengths)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        if not bf16_is_native()[0]:
            del dtypes["bf16"]
        weights = st_weights(Path(read_manifest(model_dir).source))
        self.embed = {name: st_texts(weights, 256, dtype)(32) for name, dtype in dtypes.items()}
        self.runs: dict[str, list[float]] = {name: [] for name in dtypes}
        for embed in self.embed.values():
            embed(texts[:64])  # warm

    def passes(self, n: int) -> None:
        for _ in range(n):
            for name, embed in self.embed.items():
                self.runs[name].append(self.tokens / _timed(embed, self.texts))

    def rows(self) -> list[Row]:
        found = []
        for name, runs in self.runs.items():
            best = max(runs)
            sentences_per_s = best * len(self.texts) / self.tokens
            found.append(Row(ST_SETUP.format(name), 0, 32, 0, 0, sentences_per_s, best, 0, 0, runs=runs))
        return found


def _timed(embed: Any, texts: list[str]) -> float:
    started = time.perf_counter()
    embed(texts)
    return time.perf_counter() - started


def low_precision(model_dir: Path, texts: list[str], seconds: float, repeats: int) -> tuple[list[Row], str]:
    """The int8 graph served (--precision int8) beside fp32 served, at 64 callers with 1 and 32
    sentences per request, against sentence-transformers in process and each graph's in-process
    ceiling, all in this run. Server series alternate, so a slow spell of the machine favours neither."""
    distinct = list(dict.fromkeys(texts))[:1000]
    st = SentenceTransformers(model_dir, distinct)
    st.passes(repeats)
    ceilings = []
    for graph, name in ((FP32_FILE, "fp32"), (INT8_FILE, "int8")):
        for row in ceiling(model_dir, texts, repeats, graph=graph):
            row.setup = f"{row.setup}, {name}"
            ceilings.append(row)
    plan = [(64, 1), (64, 32)]
    # On the CPU even where a GPU is usable (the GPU host's Xeon, scripts/cpu-low-precision-check.sh):
    # auto would serve fp32 on CUDA and refuse int8 there.
    base = ["--queue-limit", "16384", "--model-dir", str(model_dir), "--device", "cpu"]
    series: dict[str, list[list[Row]]] = {"fp32": [], "int8": []}
    for i in range(repeats):
        for precision in sorted(series, reverse=bool(i % 2)):
            flags = [*base, "--precision", precision]
            series[precision].append(run_server_levels(f"server, {precision}", flags, texts, plan, seconds))
            st.passes(1)  # between the server series too: the baseline's best over the whole run
    baselines = st.rows() + ceilings
    served = [row for runs in series.values() for row in best_of(runs)]
    return baselines + served, low_precision_table(baselines, served)


def low_precision_table(baselines: list[Row], served: list[Row]) -> str:
    """Each row's real tokens/s against sentence-transformers' (fp32 and bf16) and fp32 served."""
    rates = {r.setup: r.tokens_per_s for r in baselines}
    st = [rates.get(ST_SETUP.format("fp32")), rates.get(ST_SETUP.format("bf16"))]
    fp32 = {r.inputs_per_request: r.tokens_per_s for r in served if r.setup == "server, fp32"}
    lines = [
        "| setup | conc. | inputs/req | sentences/s | real tokens/s | range | x fp32 served | x ST fp32 "
        "| x ST bf16 | p50 ms | p99 ms | errors |",
        "|" + "---|" * 12,
    ]
    for r in [*baselines, *served]:
        ratios = [fp32.get(r.inputs_per_request) if r.concurrency else None, *st]
        cells = " | ".join(f"{r.tokens_per_s / x:.2f}" if x else "-" for x in ratios)
        lines.append(
            f"| {r.setup} | {r.concurrency or '-'} | {r.inputs_per_request} | {r.sentences_per_s:,.0f} | "
            f"{r.tokens_per_s:,.0f} | {min(r.runs or [0]):,.0f}-{max(r.runs or [0]):,.0f} | {cells} | "
            + (
                f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.error_codes or 0} |"
                if r.concurrency
                else "- | - | - |"
            )
        )
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
