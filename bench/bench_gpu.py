"""The CUDA path on one NVIDIA GPU, against its peer and its ceiling, in one run (JSON + markdown).

    python bench/bench_gpu.py --model-dir build/model --data-dir ../shared/data [--out build/bench/gpu]

Needs a model repository holding the gated fp16 graph (`python -m minilm_embed.export.fp16` on the
same host) and a usable CUDA execution provider; refuses to run otherwise. In this order:
1. the ceiling: the server's own backend in process (OnnxBackend: I/O binding, shape buckets), fp32
   and fp16, over batch sizes 16..1024 on length-sorted inputs; plain `session.run` at the best one
   (what I/O binding saves); the fraction of the GPU's dense fp16 FLOP bound reached;
   the fp16 graph with each layer's attention fused (the repository's, export/fp16.py) against the
   same graph with the lengths and row starts as attention's key mask and with the exported
   attention, plain `session.run`, the three taking turns batch by batch;
2. the peer: sentence-transformers on the same GPU in fp16 (`model.half()`), at batch 32, 128, 512
   (after ONNX Runtime's figures, so those are taken before torch is loaded);
3. where the time goes: ORT's profile of the fp16 graph at its best batch (op types' share of the
   run, and the run's host time not inside any op);
4. GPU memory over 10,000 random batches (rows 1-128, lengths 1-256) through the fp16 backend:
   the process's GPU memory (nvidia-smi) after every shape bucket ran at its largest (as the
   engine's warm-up does) and 200 random batches, and after all;
5. the gRPC server on CUDA (--device cuda) at concurrency 1, 64 and 256, with 1 and 32 sentences per
   request, with --fronts front processes each (the last gets every level, the others the 256-caller
   levels): real tokens/s, sentences/s, p50/p99, the server's GPU memory, against the ceiling.
Two workloads: the distinct STS-B train and dev sentences (~14k, ~10 tokens each) and "passages" of
consecutive ones joined to 110-150 tokens (a RAG chunk's size); tokens/s count real (unpadded) tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import flop_per_token
from bench_server import load_row

from minilm_embed.export.fp16 import convert_fp16
from minilm_embed.export.parity import CARRIED_SENTENCES
from minilm_embed.model.data import read_sts, sts_path
from minilm_embed.model.repository import CUDA_PROVIDER, FP16_FILE, FP32_FILE, open_repository
from minilm_embed.model.runtime import new_session, run_graph
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from minilm_embed.server.backend import (
    ROW_STEP,
    SEQUENCE_BUCKETS,
    BoundSession,
    OnnxBackend,
    bucket,
    bucket_warm_shapes,
)
from tests.gpu_memory import gpu_memory_mib
from tests.proc_tree import tree_cpu_seconds
from tests.server_process import start_server

# Dense fp16 tensor-core FLOP/s (no sparsity) by device name, from NVIDIA's data sheets (SXM parts).
FP16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12}
BATCHES = (16, 32, 64, 128, 256, 512, 1024)
ATTENTION_BATCHES = (32, 128, 256, 1024)


@dataclass
class Rate:
    setup: str
    workload: str
    batch: int
    sentences_per_s: float
    tokens_per_s: float


def gpu_name() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def sentences(data_dir: Path | None) -> list[str]:
    """STS-B train and dev sentences, distinct (a benchmark's text: nothing is tuned on it); without
    a data directory, the sentences the project carries, repeated."""
    if data_dir is None:
        return CARRIED_SENTENCES.read_text(encoding="utf-8").splitlines() * 200
    pairs = [p for split in ("train", "dev") for p in read_sts(sts_path(data_dir, split))]
    return list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))


def workloads(texts: list[str], tokenizer: Tokenizer, passages: int = 2000) -> dict[str, list[str]]:
    """The sentences as they are, and passages of 110-150 tokens joined from consecutive ones."""
    joined, current, tokens = [], [], 0
    for text, row in zip(texts, tokenizer.encode(texts).ids, strict=True):
        current.append(text)
        tokens += len(row) - 2
        if tokens >= 110:
            joined.append(" ".join(current))
            current, tokens = [], 0
            if len(joined) == passages:
                break
    return {"sentences": texts, "passages": joined}


def timed(run: Any, repeats: int, least_s: float = 0.5) -> float:
    """Seconds one `run()` takes: the best of `repeats` measurements, each of enough calls to last
    `least_s` (one pass over a workload takes milliseconds on a GPU)."""
    calls = max(1, math.ceil(least_s / _seconds(run, 1)))  # warm: every bucket's buffers, plans
    return min(_seconds(run, calls) for _ in range(repeats)) / calls


def _seconds(run: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return time.perf_counter() - started


def cuda_backend(model_dir: Path, precision: str, instances: int = 1) -> OnnxBackend:
    backend = OnnxBackend(open_repository(model_dir), "cuda", precision=precision, instances=instances)
    assert backend.provider == CUDA_PROVIDER, backend.provider
    return backend


def concurrent_rate(
    backend: OnnxBackend, rows: list[list[int]], batch: int, workload: str, repeats: int
) -> Rate:
    """The server backend with every instance computing at once (one thread each, batches dealt
    round), as the engine runs them: whether two sessions get more from the GPU than one (the
    served figures could not tell, their load windows staggered; docs/gpu.md)."""
    batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    shares = [batches[k :: backend.instances] for k in range(backend.instances)]

    def share(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for ids, lengths in part:
            backend.run(ids, lengths)

    with ThreadPoolExecutor(backend.instances) as pool:

        def run() -> None:
            list(pool.map(share, shares))

        seconds = timed(run, repeats)
    tokens = sum(len(r) for r in rows)
    setup = f"ORT {backend.precision}, server backend, {backend.instances} instances at once"
    return Rate(setup, workload, batch, len(rows) / seconds, tokens / seconds)


def backend_rates(backend: OnnxBackend, work: dict[str, list[list[int]]], repeats: int) -> list[Rate]:
    precision = backend.precision
    rates = []
    for name, rows in work.items():
        tokens = sum(len(r) for r in rows)
        for batch in BATCHES:
            batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]

            def run(batches: list[tuple[np.ndarray, np.ndarray]] = batches) -> None:
                for ids, lengths in batches:
                    backend.run(ids, lengths)

            try:
                seconds = timed(run, repeats)
            except Exception as e:  # e.g. the arena's limit at the largest batches: recorded, not fatal
                print(f"  {precision} {name} batch {batch}: failed: {str(e)[:200]}", file=sys.stderr)
                continue
            rates.append(
                Rate(f"ORT {precision}, server backend", name, batch, len(rows) / seconds, tokens / seconds)
            )
            print(f"  {rates[-1]}", file=sys.stderr)
    return rates


def plain_run_rate(path: Path, rows: list[list[int]], batch: int, workload: str, repeats: int) -> Rate:
    """`session.run` with numpy in and out (no I/O binding, no buckets), for comparison."""
    session = new_session(path, [CUDA_PROVIDER], 0, (), serving=True)
    batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]

    def run() -> None:
        for ids, lengths in batches:
            run_graph(session, ids, lengths)

    seconds = timed(run, repeats)
    tokens = sum(len(r) for r in rows)
    return Rate(
        "ORT fp16, session.run (no I/O binding)", workload, batch, len(rows) / seconds, tokens / seconds
    )


# The bucket settings bench_gpu's `buckets` part compares: (label, row step, position buckets).
FINER_LENGTHS = (16, 24, 32, 48, 64, 96, 128, 192, 256)
BUCKET_SETUPS = (
    ("rows to powers of two (until 2026-11-27)", 0, SEQUENCE_BUCKETS),
    (f"rows to multiples of {ROW_STEP} past it (shipped)", ROW_STEP, SEQUENCE_BUCKETS),
    ("the same, positions also at 24 and 48", ROW_STEP, FINER_LENGTHS),
)


def bucket_rates(
    path: Path, dims: int, work: dict[str, list[list[int]]], repeats: int, device: str = "cuda"
) -> list[Rate]:
    """Served-like batches through the bound path at each of BUCKET_SETUPS, taking turns. A served
    batch is ~250-1,000 rows of similar lengths (chosen by length from the queue's window): here 24
    runs of length-sorted rows, 257-1,000 each, at random places. Every setup must give the first
    one's vectors."""
    provider = CUDA_PROVIDER if device == "cuda" else "CPUExecutionProvider"  # "cpu": a smoke test
    session = new_session(path, [provider], 0, (), serving=True)
    rng = np.random.default_rng(0)
    rates = []
    for name, rows in work.items():
        batches = []
        for size in rng.integers(257, 1001, 24).tolist():
            start = int(rng.integers(0, max(1, len(rows) - size)))
            batches.append(pad_batch(rows[start : start + size]))
        tokens = sum(int(lengths.sum()) for _, lengths in batches)
        count = sum(len(lengths) for _, lengths in batches)
        bound = [BoundSession(session, dims, device, step, buckets) for _, step, buckets in BUCKET_SETUPS]
        vectors = [[b.run(ids, lengths)[0].copy() for ids, lengths in batches] for b in bound]
        for label, got in zip([s[0] for s in BUCKET_SETUPS[1:]], vectors[1:], strict=True):
            least = min(float(np.min(np.sum(a * g, axis=1))) for a, g in zip(vectors[0], got, strict=True))
            assert least >= 0.9999, f"{label}: other vectors, min cosine {least}"
        best = [math.inf] * len(bound)
        for _ in range(2):  # taking turns
            for k, session_bound in enumerate(bound):

                def run(b: BoundSession = session_bound, todo: list[Any] = batches) -> None:
                    for ids, lengths in todo:
                        b.run(ids, lengths)

                best[k] = min(best[k], timed(run, repeats))
        for (label, _, _), seconds in zip(BUCKET_SETUPS, best, strict=True):
            rates.append(Rate(f"ORT fp16, bound path, {label}", name, 0, count / seconds, tokens / seconds))
            print(f"  {rates[-1]}", file=sys.stderr)
    return rates


def attention_rates(
    model_dir: Path, num_heads: int, work: dict[str, list[list[int]]], repeats: int
) -> tuple[list[Rate], dict[str, float]]:
    """The repository's fp16 graph (attention fused, the lengths its key mask) against fp16 graphs
    converted with the lengths and row starts as the key mask (export.optimize.KeyMask) and with the
    exported attention, all by plain `session.run`, taking turns at each batch size; and each
    graph's min cosine against the repository's on rows of every length padded together (the CPU
    kernel ignores the starts, so only a GPU checks them)."""
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {"fused": model_dir / FP16_FILE}
        for label, key_mask in (("fused, key starts", "lengths-and-starts"), ("exported", None)):
            graphs[label] = Path(tmp) / f"{len(graphs)}.onnx"
            convert_fp16(model_dir / FP32_FILE, graphs[label], num_heads, key_mask)
        sessions = {
            label: new_session(path, [CUDA_PROVIDER], 0, (), serving=True) for label, path in graphs.items()
        }
        every = [r for rows in work.values() for r in rows]
        mixed = pad_batch(every[:: max(1, len(every) // 64)])  # 64 rows, shortest to longest
        want = run_graph(sessions["fused"], *mixed)[0]
        agreement = {
            label: float(np.min(np.sum(run_graph(session, *mixed)[0] * want, axis=1)))
            for label, session in sessions.items()
        }
        print(f"  attention variants' min cosine vs fused: {agreement}", file=sys.stderr)
        for name, rows in work.items():
            tokens = sum(len(r) for r in rows)
            for batch in ATTENTION_BATCHES:
                batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
                for label, session in sessions.items():

                    def run(
                        session: ort.InferenceSession = session,
                        batches: list[tuple[np.ndarray, np.ndarray]] = batches,
                    ) -> None:
                        for ids, lengths in batches:
                            run_graph(session, ids, lengths)

                    try:
                        seconds = timed(run, repeats)
                    except Exception as e:  # the arena's limit at the largest batches: recorded
                        print(
                            f"  attention {label} {name} batch {batch}: failed: {str(e)[:200]}",
                            file=sys.stderr,
                        )
                        continue
                    setup = f"ORT fp16, session.run, attention {label}"
                    rates.append(Rate(setup, name, batch, len(rows) / seconds, tokens / seconds))
                    print(f"  {rates[-1]}", file=sys.stderr)
    return rates, agreement


def st_rates(texts: dict[str, list[str]], token_counts: dict[str, int], repeats: int) -> list[Rate]:
    import torch
    from sentence_transformers import SentenceTransformer

    from minilm_embed.model.weights import default_weights_dir

    weights = os.environ.get("BENCH_ST_WEIGHTS") or str(default_weights_dir())
    model = SentenceTransformer(weights, device="cuda", local_files_only=True).half()
    model.max_seq_length = 256
    rates = []
    for name, items in texts.items():
        for batch in (32, 128, 512):

            def run(batch: int = batch, items: list[str] = items) -> None:
                model.encode(items, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True)
                torch.cuda.synchronize()

            seconds = timed(run, repeats)
            rates.append(
                Rate(
                    "sentence-transformers fp16",
                    name,
                    batch,
                    len(items) / seconds,
                    token_counts[name] / seconds,
                )
            )
            print(f"  {rates[-1]}", file=sys.stderr)
    return rates


def profile(model_dir: Path, rows: list[list[int]], batch: int) -> dict[str, Any]:
    """ORT's profile of the fp16 graph over length-sorted batches: op types' share of node time, and
    node time against the runs' time."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / "ort_fp16_profile")
    session = ort.InferenceSession(str(model_dir / FP16_FILE), options, providers=[CUDA_PROVIDER])
    every = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    batches = every[:: max(1, len(every) // 20)]  # ~20 batches across the length range
    for ids, lengths in batches:
        run_graph(session, ids, lengths)
    trace = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = {}
    on_cpu: dict[str, int] = {}
    run_us = node_us = 0.0
    for event in trace:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            run_us += event["dur"]
        elif event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + event["dur"]
            node_us += event["dur"]
            if event.get("args", {}).get("provider") != CUDA_PROVIDER:  # placed on the CPU: copies
                on_cpu[op] = on_cpu.get(op, 0) + 1
    shares = (
        {op: us / node_us for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]} if node_us else {}
    )
    return {
        "runs": len(batches[:5]),
        "batch": batch,
        "run_us": run_us,
        "node_us": node_us,
        "op_share": shares,
        "ops_not_on_cuda": on_cpu,
    }


def memory_flat(
    backend: OnnxBackend, batches: int = 10_000, warm: int = 200, seed: int = 0
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    shapes = set()

    def one() -> None:
        rows = int(rng.integers(1, 129))
        lengths = rng.integers(1, 257, rows)
        ids = rng.integers(1000, 30000, (rows, int(lengths.max())))
        shapes.add(bucket(*ids.shape))
        backend.run(ids.astype(np.int64), lengths.astype(np.int64))

    # Every shape bucket at its largest first, as the engine's warm-up does on CUDA.
    for rows, length in bucket_warm_shapes(128, 128 * 256, 256):
        backend.run(np.full((rows, length), 1000, np.int64), np.full(rows, length, np.int64))
    for _ in range(warm):
        one()
    before = gpu_memory_mib(os.getpid())
    started = time.perf_counter()
    for _ in range(batches - warm):
        one()
    after = gpu_memory_mib(os.getpid())
    return {
        "batches": batches,
        "after_warm_mib": before,
        "after_all_mib": after,
        "seconds": time.perf_counter() - started,
        "buckets_met": len(shapes),
    }


ENGINE_SERIES = ("embed_batch_size_sum", "embed_batch_size_count", "embed_model_run_duration_seconds_sum")


def engine_counters(port: int | None) -> dict[str, float]:
    """The engine's batch counters from /metrics: rows and batches so far, seconds of model runs."""
    if port is None:
        return dict.fromkeys(ENGINE_SERIES, 0.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = dict.fromkeys(ENGINE_SERIES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def engine_figures(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Mean rows a batch, batches a second, and the share of the time a model run was computing."""
    rows, batches, run_s = (after[k] - before[k] for k in ENGINE_SERIES)
    return {
        "mean_batch_rows": rows / batches if batches else 0.0,
        "batches_per_s": batches / seconds,
        "model_busy": run_s / seconds,
    }


def served(
    model_dir: Path,
    texts: dict[str, list[str]],
    fronts: list[int],
    batch_flags: list[str],
    seconds: float,
    load_processes: int,
    variants: list[str],
    quick: bool = False,
) -> list[dict[str, Any]]:
    # Every level with the last front count; the others get the 256-caller levels on sentences (the
    # front's hardest case, ~13 tokens a sentence): the front scaling. `quick`: the 32-input levels
    # at 64 and 256 callers only. Each variant (more server flags) runs every front count.
    full = {
        "sentences": [(1, 1), (64, 1), (256, 1), (1, 32), (64, 32), (256, 32)],
        "passages": [(1, 1), (64, 32), (256, 32)],
    }
    scaling = {"sentences": [(256, 1), (256, 32)]}
    short = {"sentences": [(64, 32), (256, 32)], "passages": [(256, 32)]}
    results = []
    for variant, n in ((v, n) for v in variants for n in fronts):
        plans = short if quick else full if n == fronts[-1] else scaling
        flags = ["--model-dir", str(model_dir), "--device", "cuda", "--front-processes", str(n)]
        flags += ["--queue-limit", "65536", *batch_flags, *variant.split()]
        server = start_server(*flags).wait_serving()
        try:
            for name, plan in plans.items():
                items = texts[name]
                for concurrency, per_request in plan:
                    processes = 1 if concurrency == 1 else load_processes
                    cpu_before = tree_cpu_seconds(server.proc.pid)
                    counters = engine_counters(server.metrics_port)
                    row = load_row(server.address, items, concurrency, per_request, seconds, processes)
                    # Per second of the span the load ran (a level outlasts `seconds` by its last
                    # answers: on a loaded CPU by many seconds, which read as a model busy 558%).
                    span = row.span_s or seconds
                    engine = engine_figures(counters, engine_counters(server.metrics_port), span)
                    # Cores busy: the server's (fronts and engine; includes the load's connecting
                    # and the few idle seconds before it starts) and the load generator's.
                    server_cpu = tree_cpu_seconds(server.proc.pid) - cpu_before
                    entry = dict(
                        asdict(row), fronts=n, workload=name, gpu_mib=gpu_memory_mib(server.proc.pid),
                        server_cores=server_cpu / span, client_cores=row.client_cpu_s / span,
                        cores=os.cpu_count(), variant=variant, **engine,
                    )  # fmt: skip
                    results.append(entry)
                    print(
                        f"  {n} fronts {variant} {name} c={concurrency} x{per_request}: "
                        f"{row.tokens_per_s:,.0f} tok/s "
                        f"p50 {row.p50_ms:.1f} ms errors {row.errors}; cores busy: server "
                        f"{entry['server_cores']:.1f}, load {entry['client_cores']:.1f}; batches "
                        f"{engine['mean_batch_rows']:.0f} rows, {engine['batches_per_s']:.0f}/s, model busy "
                        f"{engine['model_busy']:.0%}; load started within {row.start_spread_s:.3f} s",
                        file=sys.stderr,
                    )
        finally:
            server.stop()
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = [f"GPU: {report['gpu']}; ORT {report['onnxruntime']}; command: {report['command']}", ""]
    lines += ["| setup | workload | batch | sentences/s | real tokens/s | x ST fp16 | of FLOP bound |"]
    lines += ["|---|---|---|---|---|---|---|"]
    st_best = {
        w: max(
            (
                r["tokens_per_s"]
                for r in report["rates"]
                if r["setup"].startswith("sentence") and r["workload"] == w
            ),
            default=0,
        )
        for w in report["workloads"]
    }
    bound = report["flop_bound_tokens_per_s"]
    for r in report["rates"]:
        vs = r["tokens_per_s"] / st_best[r["workload"]] if st_best.get(r["workload"]) else float("nan")
        lines.append(
            f"| {r['setup']} | {r['workload']} | {r['batch']} | {r['sentences_per_s']:,.0f} | "
            f"{r['tokens_per_s']:,.0f} | {vs:.2f} | {r['tokens_per_s'] / bound:.1%} |"
        )
    if report.get("attention_min_cosine"):
        agreement = ", ".join(f"{k} {v:.6f}" for k, v in report["attention_min_cosine"].items())
        lines += ["", f"Attention variants, min cosine against the repository's fp16 graph: {agreement}"]
    if report.get("served"):
        lines += [
            "",
            "| fronts | workload | conc. | inputs/req | sentences/s | real tokens/s | x ceiling "
            "| x 2 at once | p50 ms | p99 ms | GPU MiB | server cores | load cores | batch rows | model busy "
            "| errors |",
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in report["served"]:
            ceiling = report["ceiling"][s["workload"]]
            together = report.get("ceiling_instances_at_once", {}).get(s["workload"], math.nan)
            lines.append(
                f"| {s['fronts']} {s.get('variant', '')} | {s['workload']} | {s['concurrency']} | "
                f"{s['inputs_per_request']} | "
                f"{s['sentences_per_s']:,.0f} | {s['tokens_per_s']:,.0f} | "
                f"{s['tokens_per_s'] / ceiling:.2f} | {s['tokens_per_s'] / together:.2f} | "
                f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
                f"{s['gpu_mib']:.0f} | {s.get('server_cores', 0):.1f} | {s.get('client_cores', 0):.1f} | "
                f"{s.get('mean_batch_rows', 0):.0f} | {s.get('model_busy', 0):.0%} | "
                f"{s['errors']} {s['error_codes']} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("build/bench/gpu"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="load duration per served level")
    p.add_argument("--fronts", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--load-processes", type=int, default=4)
    p.add_argument(
        "--server-variants",
        default="",
        help="served: more server flags for each variant, ';'-separated: '--model-instances 2;'",
    )
    p.add_argument("--quick-served", action="store_true", help="served: the 32-input levels only")
    p.add_argument(
        "--skip",
        default="",
        help="parts to skip, comma-separated: fp32 buckets st attention profile memory served",
    )
    args = p.parse_args()
    skip = set(args.skip.split(","))
    if CUDA_PROVIDER not in ort.get_available_providers():
        print("bench_gpu: this onnxruntime has no CUDA execution provider", file=sys.stderr)
        return 2
    repo = open_repository(args.model_dir)
    if not any(g.file == FP16_FILE for g in repo.manifest.graphs):
        print("bench_gpu: no gated fp16 graph: run python -m minilm_embed.export.fp16 first", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(repo.tokenizer_file, repo.max_input_tokens)
    texts = workloads(sentences(args.data_dir), tokenizer)
    rows = {name: sorted(tokenizer.encode(items).ids, key=len) for name, items in texts.items()}
    token_counts = {name: sum(len(r) for r in rs) for name, rs in rows.items()}
    name = gpu_name()
    peak = next((v for k, v in FP16_PEAK.items() if k in name), FP16_PEAK["H100"])
    report: dict[str, Any] = {
        "gpu": name,
        "onnxruntime": ort.__version__,
        "command": " ".join(sys.argv),
        "workloads": {k: {"texts": len(v), "real_tokens": token_counts[k]} for k, v in texts.items()},
        "flop_per_token": flop_per_token(repo.manifest.config),
        "fp16_peak_flops": peak,
        "flop_bound_tokens_per_s": peak / flop_per_token(repo.manifest.config),
        "fp16_gate": dict(repo.manifest.parity_fp16),
        "rates": [],
    }

    def save() -> None:
        (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu.md").write_text(markdown(report) + "\n")

    rates: list[Rate] = []
    # ONNX Runtime first, in a process without torch: on the H100 the served 32-passage level beat
    # the in-process best, measured after the peer (torch) had run in this process (docs/gpu.md).
    fp32 = [] if "fp32" in skip else backend_rates(cuda_backend(args.model_dir, "fp32"), rows, args.repeats)
    backend16 = cuda_backend(args.model_dir, "fp16")
    fp16 = backend_rates(backend16, rows, args.repeats)
    rates += fp32 + fp16
    best = {w: max((r for r in fp16 if r.workload == w), key=lambda r: r.tokens_per_s) for w in rows}
    rates += [
        plain_run_rate(args.model_dir / FP16_FILE, rows[w], b.batch, w, args.repeats) for w, b in best.items()
    ]
    if "buckets" not in skip:
        rates += bucket_rates(args.model_dir / FP16_FILE, repo.dimensions, rows, args.repeats)
    pair = cuda_backend(args.model_dir, "fp16", instances=2)
    together = {w: concurrent_rate(pair, rows[w], b.batch, w, args.repeats) for w, b in best.items()}
    rates += together.values()
    del pair  # its GPU memory back
    if "attention" not in skip:
        variants, report["attention_min_cosine"] = attention_rates(
            args.model_dir, repo.manifest.config.num_heads, rows, args.repeats
        )
        rates += variants
    if "st" not in skip:
        rates = st_rates(texts, token_counts, args.repeats) + rates  # the peer's rows first, as before
        import torch

        torch.cuda.empty_cache()  # the peer's memory back
    report["rates"] = [asdict(r) for r in rates]
    report["ceiling"] = {w: b.tokens_per_s for w, b in best.items()}
    report["ceiling_instances_at_once"] = {w: r.tokens_per_s for w, r in together.items()}
    report["best_batch"] = {w: b.batch for w, b in best.items()}
    save()
    if "profile" not in skip:
        report["profile"] = profile(args.model_dir, rows["passages"], best["passages"].batch)
        save()
    if "memory" not in skip:
        report["memory"] = memory_flat(backend16)
        print(f"  memory: {report['memory']}", file=sys.stderr)
        save()
    del backend16
    if "served" not in skip:
        # The server's batch limits at the ceiling's best batch on passages (the larger token count).
        b = best["passages"].batch
        batch_flags = ["--max-batch-size", str(b), "--max-batch-tokens", str(max(256, b * 128))]
        report["served_flags"] = batch_flags
        report["served"] = served(
            args.model_dir, texts, args.fronts, batch_flags, args.seconds, args.load_processes,
            args.server_variants.split(";"), args.quick_served,
        )  # fmt: skip
        save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
