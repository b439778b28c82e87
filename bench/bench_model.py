"""Throughput of the exported model on ONNX Runtime (CPU) against sentence-transformers, in one run.

    python bench/bench_model.py --model-dir build/model [--data-dir ../shared/data] [--out FILE.json]

Every setup embeds the same sentences (STS-B dev, else the project's parity sentences repeated), texts in
and vectors out, tokenization included, with the same thread count:
- sentence-transformers on torch (device cpu; it sorts inputs by length itself), batch 32 and 128, and
  in bfloat16 at batch 32 (`model.to(torch.bfloat16)`, what a torch user gets in one line) where
  torch has a native bf16 kernel on this CPU (AVX-512 BF16 or AMX; measured, else left out);
- the model repository's session as the server builds it (export.optimize.cpu_session), batches of
  length-sorted or unsorted (file order) sentences, batch 32 and 128;
- the same session with ORT's SkipLayerNormFusion switched back on, batch 32 sorted;
- the int8 graph, where the repository ships one, batch 32 sorted and unsorted;
- fp32 and int8 in the server's layout: two callers, each on a one-thread session, batch 32 sorted;
- with --baseline-model-dir, another repository's graph (e.g. one built at an earlier commit), batch
  32 sorted and unsorted: a graph change measured against its predecessor in the same run.
Each setup runs --repeats times after a warm-up; the fastest run is reported (the machine is shared).
"vs fp32" is over the fp32 graph in the same layout and order. A matmul microbenchmark (torch fp32 and
bf16, ONNX Runtime's MatMulIntegerToFloat, the int8 graph's kernel) gives this machine's peaks, and
the table's last column is the share of the peak of the row's precision that the whole model reaches
(FLOP per token counted from the model's shapes).
Where the repository ships an int8 graph, the two graphs again in the server's layout, interleaved:
in each of --interleaved-rounds rounds, both callers run 8 batches of one graph, then the same 8 of
the other, chunk by chunk through the sentences (tokenized beforehand), which graph goes first
alternating by round; the first round is a warm-up. Each graph's rate is its tokens over its wall
time, and the round-by-round ratios give the spread. On a machine whose speed drifts (a shared
VM's), this ratio is the one to read: a best-of-N of whole passes catches each graph at a different
moment (on one Xeon the int8 pass ranged 14,163-21,310 tok/s over six, fp32 7,026-8,990).
With --profile, ORT's profile of each graph (fp32, int8) on one thread: where the node time goes, by
op type (what a faster matmul kernel, AMX's say, leaves).
Writes a markdown table to stdout and JSON to --out (default build/bench/model.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.export.optimize import (
    CPU_DISABLED_OPTIMIZERS,
    WEIGHT_MAX,
    cpu_session,
    int8_matmul_model,
    runtime_op_types,
)
from minilm_embed.export.parity import CARRIED_SENTENCES, onnx_embedder
from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.data import read_sts, sts_path
from minilm_embed.model.evaluate import length_sorted
from minilm_embed.model.repository import CPU_PROVIDER, FP32_FILE, INT8_FILE, TOKENIZER_FILE, read_manifest
from minilm_embed.model.runtime import run_graph, session_options
from minilm_embed.model.tokenizer import Tokenizer, pad_batch

BATCHES = (32, 128)
EmbedTexts = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True)
class Workload:
    texts: list[str]
    lengths: list[int]  # real tokens per text, after truncation
    repeats: int


@dataclass
class Result:
    engine: str
    order: str
    batch: int
    seconds: float  # fastest of the repeats
    all_seconds: list[float]
    sentences_per_s: float
    tokens_per_s: float
    padding_fraction: float  # padded positions / all positions fed to the model
    precision: str = "fp32"
    ratio_vs_st: float = 0.0  # sentences/s over sentence-transformers' at the same batch size
    ratio_vs_fp32: float = 0.0  # over the fp32 graph in the same layout, order and batch (onnx rows)
    peak_share: float = 0.0  # model FLOP/s over the measured matmul peak of this precision
    max_abs_diff_vs_st: float = 0.0  # against sentence-transformers' vectors at batch 32
    min_cosine_vs_st: float = 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"), help="model repository")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("EMBED_DATA_DIR") or None,
        help="directory holding stsbenchmark/ [env EMBED_DATA_DIR]; without it, the carried sentences",
    )
    p.add_argument(
        "--baseline-model-dir", type=Path, default=None, help="another model repository to measure alongside"
    )
    p.add_argument("--out", type=Path, default=Path("build/bench/model.json"))
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interleaved-rounds", type=int, default=6, help="rounds of fp32 and int8 interleaved")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also ORT's profile of each graph (fp32, int8), one thread: node time by op type",
    )
    return p.parse_args()


def sentences(data_dir: Path | None, n: int) -> tuple[list[str], str]:
    """The first n distinct STS-B dev sentences in file order, or the carried ones repeated."""
    if data_dir is not None:
        pairs = read_sts(sts_path(data_dir, "dev"))
        texts = list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))
        return texts[:n], "sts-b dev"
    carried = CARRIED_SENTENCES.read_text(encoding="utf-8").splitlines()
    return (carried * (n // len(carried) + 1))[:n], "export/parity_sentences.txt repeated"


def op_time(path: Path, tokenizer: Tokenizer, texts: list[str], batch: int = 32) -> dict[str, float]:
    """Seconds of node time by op type, from ORT's profile of one pass over `texts` (length-sorted
    batches) on a one-thread session with the server's graph settings, after a pass to warm up."""
    rows = sorted(tokenizer.encode(texts).ids, key=len)
    batches = [pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)]
    with tempfile.TemporaryDirectory() as tmp:
        options = session_options(1, serving=False)
        session = ort.InferenceSession(
            str(path), options, providers=[CPU_PROVIDER], disabled_optimizers=list(CPU_DISABLED_OPTIMIZERS)
        )
        for ids, lengths in batches:
            run_graph(session, ids, lengths)
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(
            str(path), options, providers=[CPU_PROVIDER], disabled_optimizers=list(CPU_DISABLED_OPTIMIZERS)
        )
        for ids, lengths in batches:
            run_graph(session, ids, lengths)
        events = json.loads(Path(session.end_profiling()).read_text(encoding="utf-8"))
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e6
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def op_time_table(profiles: dict[str, dict[str, float]], top: int = 12) -> str:
    """Each graph's node time and its largest op types' shares."""
    lines = []
    for graph, by_op in profiles.items():
        total = sum(by_op.values())
        shares = ", ".join(f"{op} {t / total:.0%}" for op, t in list(by_op.items())[:top])
        lines.append(f"- {graph}: {total:.2f} s of node time; {shares}")
    return "\n".join(lines)


def skip_layer_norm_nodes(path: Path, disabled: list[str]) -> int:
    """SkipLayerNormalization nodes in the graph ORT actually runs, with these optimizers disabled:
    shows whether the fusion the server switches off fires on this model at all."""
    return runtime_op_types(path, disabled).count("SkipLayerNormalization")


def onnx_texts(session: ort.InferenceSession, tokenizer: Tokenizer, batch: int, sort: bool) -> EmbedTexts:
    embed = onnx_embedder(session, batch)
    run = length_sorted(embed) if sort else embed
    return lambda texts: run(tokenizer.encode(texts).ids)


def on_two_callers(work: Callable[[int], object]) -> None:
    """work(0) and work(1) at once, each on a thread: the server's two instances."""
    callers = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()


def two_callers(path: Path, tokenizer: Tokenizer, batch: int) -> EmbedTexts:
    """The server's CPU layout: two callers, each running every other length-sorted batch on a
    one-thread session of its own, as each of the server's instances has."""
    embedders = [onnx_embedder(cpu_session(path, 1), batch) for _ in range(2)]

    def run(rows: list[list[int]]) -> np.ndarray:
        batches = [rows[i : i + batch] for i in range(0, len(rows), batch)]
        parts: list[list[np.ndarray]] = [[], []]
        on_two_callers(lambda k: parts[k].extend(embedders[k](b) for b in batches[k::2]))
        out = [parts[i % 2][i // 2] for i in range(len(batches))]
        return np.concatenate(out)

    sorted_run = length_sorted(run)
    return lambda texts: sorted_run(tokenizer.encode(texts).ids)


@dataclass
class Interleaved:
    graph: str
    tokens_per_s: float
    ratio_vs_fp32: float
    round_ratios: list[float]  # this graph's rate over fp32's, round by round (after the warm-up)


def interleaved(
    graphs: dict[str, Path], rows: list[list[int]], rounds: int, chunk: int = 8
) -> list[Interleaved]:
    """The graphs in the server's layout (two callers, each on a one-thread session of its own), in
    chunks of `chunk` length-sorted batches of 32: every graph runs a chunk, then the next chunk;
    which goes first alternates by round. Round 0 warms up and is not counted. The first graph is
    the baseline."""
    order = sorted(rows, key=len)
    batches = [pad_batch(order[i : i + 32]) for i in range(0, len(order), 32)]
    sessions = {name: [cpu_session(path, 1) for _ in range(2)] for name, path in graphs.items()}
    seconds = {name: np.zeros(rounds) for name in graphs}
    tokens = sum(len(r) for r in rows)

    def caller(k: int, name: str, part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for ids, lengths in part[k::2]:
            run_graph(sessions[name][k], ids, lengths)

    for r in range(rounds + 1):
        names = list(graphs) if r % 2 == 0 else list(graphs)[::-1]
        for start in range(0, len(batches), chunk):
            part = batches[start : start + chunk]
            for name in names:
                began = time.perf_counter()
                on_two_callers(lambda k, name=name, part=part: caller(k, name, part))
                if r > 0:
                    seconds[name][r - 1] += time.perf_counter() - began
    base = next(iter(graphs))
    return [
        Interleaved(
            graph=name,
            tokens_per_s=tokens * rounds / float(seconds[name].sum()),
            ratio_vs_fp32=float(seconds[base].sum() / seconds[name].sum()),
            round_ratios=[float(b / t) for b, t in zip(seconds[base], seconds[name], strict=True)],
        )
        for name in graphs
    ]


def st_weights(recorded: Path) -> Path:
    """sentence-transformers' weights: BENCH_ST_WEIGHTS where set (a host the model repository was
    copied to, such as the GPU host, where the recorded path does not exist), else `recorded`."""
    return Path(os.environ.get("BENCH_ST_WEIGHTS") or recorded)


def st_texts(
    weights_dir: Path, max_length: int, dtype: torch.dtype = torch.float32
) -> Callable[[int], EmbedTexts]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(weights_dir), device="cpu", local_files_only=True)
    model.max_seq_length = max_length
    model.to(dtype)

    def at_batch(batch: int) -> EmbedTexts:
        return lambda texts: np.asarray(model.encode(texts, batch_size=batch, convert_to_numpy=True))

    return at_batch


def batch_order(work: Workload, order: str) -> list[int]:
    """The order rows reach the model: ST sorts by text length (longest first), we by token count."""
    n = len(work.texts)
    if order == "sorted by ST":
        return sorted(range(n), key=lambda i: -len(work.texts[i]))
    if order == "length-sorted":
        return sorted(range(n), key=lambda i: work.lengths[i])
    return list(range(n))


def padding_fraction(work: Workload, order: str, batch: int) -> float:
    """Share of the positions the model computes that are padding, for this batching."""
    ordered = [work.lengths[i] for i in batch_order(work, order)]
    chunks = [ordered[i : i + batch] for i in range(0, len(ordered), batch)]
    return 1.0 - sum(ordered) / sum(len(c) * max(c) for c in chunks)


@dataclass(frozen=True)
class Setup:
    engine: str
    order: str
    batch: int
    embed: EmbedTexts
    precision: str = "fp32"
    layout: str = "2 threads"  # or "2 x 1 thread": the fp32 row a lower precision is compared with


def setups(args: argparse.Namespace, tokenizer: Tokenizer, weights_dir: Path, bf16: bool) -> list[Setup]:
    """Every setup measured, sentence-transformers first (its batch-32 vectors are the reference)."""
    st = st_texts(weights_dir, tokenizer.max_length)
    found = [Setup("sentence-transformers (torch)", "sorted by ST", batch, st(batch)) for batch in BATCHES]
    if bf16:
        st_bf16 = st_texts(weights_dir, tokenizer.max_length, torch.bfloat16)(32)
        found.append(Setup("sentence-transformers bf16 (torch)", "sorted by ST", 32, st_bf16, "bf16"))
    model = args.model_dir / FP32_FILE
    session = cpu_session(model, args.threads)
    for batch in BATCHES:
        for sort in (True, False):
            order = "length-sorted" if sort else "unsorted"
            found.append(
                Setup("onnx (server settings)", order, batch, onnx_texts(session, tokenizer, batch, sort))
            )
    fused = onnx_texts(cpu_session(model, args.threads, disabled_optimizers=()), tokenizer, 32, sort=True)
    found.append(Setup("onnx + SkipLayerNormFusion", "length-sorted", 32, fused))
    others = [("onnx int8", args.model_dir / INT8_FILE, "int8")]
    if args.baseline_model_dir is not None:
        others.append((f"onnx, baseline {args.baseline_model_dir}", args.baseline_model_dir / FP32_FILE, ""))
    for engine, path, precision in others:
        if not path.is_file():
            continue
        other = cpu_session(path, args.threads)
        for sort in (True, False):
            order = "length-sorted" if sort else "unsorted"
            found.append(Setup(engine, order, 32, onnx_texts(other, tokenizer, 32, sort), precision))
    for engine, path, precision in [("onnx (server settings)", model, "fp32"), *others[:1]]:
        if path.is_file():
            embed = two_callers(path, tokenizer, 32)
            found.append(
                Setup(f"{engine}, 2 x 1 thread", "length-sorted", 32, embed, precision, "2 x 1 thread")
            )
    return found


def timings(found: list[Setup], work: Workload) -> tuple[list[list[float]], list[np.ndarray]]:
    """Seconds per repeat and the vectors of each setup. The repeats go round the setups in turn, so a
    change in the machine's load (it is shared) hits every setup alike rather than the last ones."""
    for setup in found:
        setup.embed(work.texts[:64])  # warm-up: first-run allocations and kernel selection
    times: list[list[float]] = [[] for _ in found]
    vectors: list[np.ndarray] = [np.empty(0) for _ in found]
    for _ in range(work.repeats):
        for i, setup in enumerate(found):
            start = time.perf_counter()
            vectors[i] = setup.embed(work.texts)
            times[i].append(time.perf_counter() - start)
    return times, vectors


def result(setup: Setup, times: list[float], work: Workload) -> Result:
    best = min(times)
    return Result(
        engine=setup.engine,
        order=setup.order,
        batch=setup.batch,
        seconds=best,
        all_seconds=[round(t, 4) for t in times],
        sentences_per_s=len(work.texts) / best,
        tokens_per_s=sum(work.lengths) / best,
        padding_fraction=padding_fraction(work, setup.order, setup.batch),
        precision=setup.precision,
    )


def run_all(
    found: list[Setup], work: Workload, flop_per_token: float, peaks: dict[str, float]
) -> list[Result]:
    times, vectors = timings(found, work)
    results = [result(setup, t, work) for setup, t in zip(found, times, strict=True)]
    st = {r.batch: r.sentences_per_s for r in results if r.engine == "sentence-transformers (torch)"}
    fp32 = {
        (s.layout, r.order, r.batch): r.tokens_per_s
        for s, r in zip(found, results, strict=True)
        if s.engine.startswith("onnx (server settings)")
    }
    for s, r, v in zip(found, results, vectors, strict=True):
        r.ratio_vs_st = r.sentences_per_s / st[r.batch]
        if s.engine.startswith("onnx") and (s.layout, r.order, r.batch) in fp32:
            r.ratio_vs_fp32 = r.tokens_per_s / fp32[(s.layout, r.order, r.batch)]
        r.peak_share = r.tokens_per_s * flop_per_token / (peaks.get(r.precision, 0.0) * 1e9 or float("inf"))
        r.max_abs_diff_vs_st = float(np.abs(v - vectors[0]).max())
        r.min_cosine_vs_st = float(((v * vectors[0]).sum(1) / np.linalg.norm(v, axis=1)).min())
    return results


def flop_per_token(config: EncoderConfig) -> float:
    """Linear layers' FLOP per real token (attention's score and mix work, ~1.5 kFLOP x T, left out)."""
    c, f = config.hidden_size, config.intermediate_size
    return 2.0 * config.num_layers * (4 * c * c + 2 * c * f)


def bf16_is_native(m: int = 256, k: int = 384, n: int = 1536) -> tuple[bool, str]:
    """Whether torch has a bf16 matmul kernel on this CPU, measured at the FFN's shape: without
    AVX-512 BF16 or AMX its fallback runs ~100x slower than fp32 (1.3 vs 124 GFLOP/s on a Zen 3), and
    the bf16 rows would take hours."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a16, b16 = a.bfloat16(), b.bfloat16()
    fp32, bf16 = _rate(lambda: a @ b, m, k, n, calls=3), _rate(lambda: a16 @ b16, m, k, n, calls=3)
    return bf16 >= fp32 / 2, f"torch bf16 {bf16:,.1f} vs fp32 {fp32:,.1f} GFLOP/s at {m}x{k}x{n}"


def matmul_peaks(threads: int, bf16: bool, m: int = 2048, k: int = 2048, n: int = 2048) -> dict[str, float]:
    """GFLOP/s (GOP/s for int8) of one big matmul: torch fp32 and bf16, and ORT's int8 kernel."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    peaks = {"fp32": _rate(lambda: a @ b, m, k, n)}
    if bf16:
        a16, b16 = a.bfloat16(), b.bfloat16()
        peaks["bf16"] = _rate(lambda: a16 @ b16, m, k, n)
    session, feed = _ort_int8_matmul(threads, m, k, n)
    peaks["int8"] = _rate(lambda: session.run(None, feed), m, k, n)
    return peaks


def _rate(run: Callable[[], object], m: int, k: int, n: int, calls: int = 10) -> float:
    run()
    best = min(_seconds(run, calls) for _ in range(3))
    return 2.0 * m * k * n / best / 1e9


def _seconds(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def _ort_int8_matmul(
    threads: int, m: int, k: int, n: int
) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """MatMulIntegerToFloat (uint8 x int8, per-row A scale), as the int8 graph runs it."""
    rng = np.random.default_rng(0)
    w = rng.integers(-WEIGHT_MAX, WEIGHT_MAX + 1, (k, n)).astype(np.int8)
    model = int8_matmul_model(w, np.full(n, 0.01, np.float32))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[CPU_PROVIDER])
    feed = {"x": rng.integers(0, 256, (m, k)).astype(np.uint8), "x_scale": np.ones((m, 1), np.float32)}
    return session, feed


def table(results: list[Result]) -> str:
    lines = [
        "| engine | order | batch | sentences/s | real tokens/s | vs ST | vs fp32 | padding "
        "| min cosine vs ST | share of peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        vs_fp32 = f"{r.ratio_vs_fp32:.2f}x" if r.ratio_vs_fp32 else "-"
        lines.append(
            f"| {r.engine} | {r.order} | {r.batch} | {r.sentences_per_s:.0f} | {r.tokens_per_s:.0f} "
            f"| {r.ratio_vs_st:.2f}x | {vs_fp32} | {r.padding_fraction:.0%} | {r.min_cosine_vs_st:.5f} "
            f"| {r.peak_share:.0%} {r.precision} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    manifest = read_manifest(args.model_dir)
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE, manifest.config.max_seq_length)
    texts, source = sentences(args.data_dir, args.sentences)
    work = Workload(texts, tokenizer.encode(texts).lengths, args.repeats)
    load_before = os.getloadavg()[0]
    bf16, bf16_probe = bf16_is_native()
    peaks = matmul_peaks(args.threads, bf16)
    per_token = flop_per_token(manifest.config)
    found = setups(args, tokenizer, st_weights(Path(manifest.source)), bf16)
    results = run_all(found, work, per_token, peaks)
    load = (load_before, os.getloadavg()[0])
    print(
        f"{len(texts)} sentences ({source}), {sum(work.lengths)} real tokens, {args.threads} threads, "
        f"best of {args.repeats}; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after\n"
    )
    print(table(results))
    print(
        f"\nmatmul peaks ({args.threads} threads, 2048^3): "
        + ", ".join(f"{k} {v:,.0f} GFLOP/s" for k, v in peaks.items())
        + f"; the model's linear layers: {per_token / 1e6:.1f} MFLOP per real token"
    )
    if not bf16:
        print(f"no native bf16 matmul on this CPU ({bf16_probe}): the bf16 rows are left out")
    model = args.model_dir / FP32_FILE
    fusion = {
        "server_settings": skip_layer_norm_nodes(model, list(CPU_DISABLED_OPTIMIZERS)),
        "all_optimizers": skip_layer_norm_nodes(model, []),
    }
    print(
        f"\nSkipLayerNormalization nodes after ORT's optimisation: {fusion['server_settings']} with the "
        f"server's settings, {fusion['all_optimizers']} with SkipLayerNormFusion on"
    )
    mixed: list[Interleaved] = []
    if (args.model_dir / INT8_FILE).is_file() and args.interleaved_rounds > 0:
        graphs = {"fp32": model, "int8": args.model_dir / INT8_FILE}
        mixed = interleaved(graphs, tokenizer.encode(texts).ids, args.interleaved_rounds)
        print(
            f"\nfp32 and int8 interleaved in the server's layout (2 x 1-thread sessions, chunks of 8 "
            f"length-sorted batches of 32, {args.interleaved_rounds} rounds after a warm-up):"
        )
        for m in mixed:
            spread = f"{min(m.round_ratios):.2f}-{max(m.round_ratios):.2f}x"
            print(f"- {m.graph}: {m.tokens_per_s:,.0f} tok/s, {m.ratio_vs_fp32:.2f}x fp32 (rounds {spread})")
    profiles = {}
    if args.profile:
        graphs = {"fp32": model, "int8": args.model_dir / INT8_FILE}
        profiles = {name: op_time(path, tokenizer, texts) for name, path in graphs.items() if path.is_file()}
        print("\nORT's profile, one thread, length-sorted batches of 32, node time by op type:")
        print(op_time_table(profiles))
    report = {
        "model_dir": str(args.model_dir),
        "onnx_sha256": manifest.onnx_sha256,
        "sentences": len(texts),
        "source": source,
        "real_tokens": sum(work.lengths),
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_average": load},
        "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__},
        "skip_layer_norm_nodes": fusion,
        "matmul_peaks_gflops": peaks,
        "bf16_probe": {"native": bf16, "figures": bf16_probe},
        "flop_per_token": per_token,
        "results": [asdict(r) for r in results],
        "op_time_s": profiles,
        "interleaved": [asdict(m) for m in mixed],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
