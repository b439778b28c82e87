"""ONNX Runtime's MatMulNBits against the shipped int8 graph: is ORT's fused int8 path faster?

    python bench/bench_nbits.py --model-dir build/model --data-dir ../shared/data

`MatMulNBits` (com.microsoft) with `accuracy_level=4` quantises each activation row per block of K
inside one kernel, against weights quantised per block too: none of the shipped int8 graph's Abs,
ReduceMax and QuantizeLinear nodes. This builds, from the repository's fp32 graph, one graph per
variant (8-bit weights in blocks of 32 and 128, 4-bit in blocks of 32), each Gemm replaced by the
shipped graph's SmoothQuant Mul (calibrated on STS-B train, as `export.optimize.quantize_int8` does)
and a `MatMulNBits`, attention fused as shipped. Then, against the shipped fp32 and int8 graphs: one
thread's CPU time on the first 1,000 distinct STS-B dev sentences in length-sorted batches of 32, the
graphs interleaved batch by batch (best of --repeats per batch: the machine is shared), the min
cosine of every dev sentence's vector against fp32's, STS-B dev Spearman, and batch invariance (the
parity gate's check, 300 inputs). An experiment kept for its answer (docs/benchmarks.md, "Zen 4 again"): the
shipped graph is kept.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minilm_embed.export.optimize import MS_DOMAIN, _input_absmax, cpu_session, fuse_attention, smoothing
from minilm_embed.export.parity import batch_invariance, onnx_embedder
from minilm_embed.model.data import read_sts, sts_path
from minilm_embed.model.repository import EMBEDDINGS, FP32_FILE, INPUT_IDS, INT8_FILE, LENGTHS, TOKENIZER_FILE
from minilm_embed.model.tokenizer import Tokenizer, pad_batch

VARIANTS = ((8, 32), (8, 128), (4, 32))  # (bits, block size)
CALIBRATION_SENTENCES = 800  # as export/__main__.py


def nbits_graph(fp32: Path, out: Path, rows: list[list[int]], bits: int, block: int, heads: int) -> None:
    model = onnx.load(str(fp32))
    fuse_attention(model, heads)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    gemms = {n.name: n for n in graph.node if n.op_type == "Gemm" and n.input[1] in weights}
    absmax = _input_absmax(model, [n.input[0] for n in gemms.values()], rows, 32)
    nodes = []
    for node in graph.node:
        if node.name not in gemms:
            nodes.append(node)
            continue
        nodes += _nbits_nodes(node, numpy_helper.to_array(weights[node.input[1]]), absmax, bits, block, graph)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    out.write_bytes(model.SerializeToString())


def _nbits_nodes(
    node: onnx.NodeProto,
    w: np.ndarray,
    absmax: dict[str, np.ndarray],
    bits: int,
    block: int,
    graph: onnx.GraphProto,
) -> list[onnx.NodeProto]:
    """Gemm (x @ W.T + b, W (N, K)) -> x * (1/smooth) -> MatMulNBits(W * smooth, b)."""
    n, k = w.shape
    p, x = node.name, node.input[0]
    smooth = smoothing(w.T, absmax[x])  # as the shipped int8 graph smooths
    blocks = (w * smooth[None, :]).reshape(n, k // block, block)  # (N, K / block, block)
    top = 2 ** (bits - 1) - 1
    scale = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / top  # (N, K / block)
    q = (np.clip(np.round(blocks / scale[:, :, None]), -top, top) + 2 ** (bits - 1)).astype(np.uint8)
    packed = q if bits == 8 else q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # 4-bit: low nibble first
    graph.initializer.extend([
        numpy_helper.from_array((1 / smooth).astype(np.float32), p + "/inv_smooth"),
        numpy_helper.from_array(packed, p + "/q"),
        numpy_helper.from_array(scale.astype(np.float32).reshape(-1), p + "/scales"),
    ])  # fmt: skip
    return [
        helper.make_node("Mul", [x, p + "/inv_smooth"], [p + "/x"]),
        helper.make_node(
            "MatMulNBits",
            [p + "/x", p + "/q", p + "/scales", "", "", node.input[2]],  # no zero points: 2^(bits-1)
            list(node.output),
            domain=MS_DOMAIN,
            K=k,
            N=n,
            bits=bits,
            block_size=block,
            accuracy_level=4,
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--data-dir", type=Path, required=True, help="STS-B: train calibrates, dev measures")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE, 256)
    train = read_sts(sts_path(args.data_dir, "train"))
    calibration = list(dict.fromkeys(s for q in train for s in (q.first, q.second)))[:CALIBRATION_SENTENCES]
    pairs = read_sts(sts_path(args.data_dir, "dev"))
    sentences = list(dict.fromkeys(s for q in pairs for s in (q.first, q.second)))
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {"fp32 (shipped)": args.model_dir / FP32_FILE, "int8 (shipped)": args.model_dir / INT8_FILE}
        for bits, block in VARIANTS:
            path = Path(tmp) / f"nbits{bits}_{block}.onnx"
            nbits_graph(args.model_dir / FP32_FILE, path, tokenizer.encode(calibration).ids, bits, block, 12)
            graphs[f"MatMulNBits {bits}-bit, blocks of {block}"] = path
        sessions = {name: cpu_session(path, threads=1) for name, path in graphs.items()}
        rates = speeds(sessions, tokenizer.encode(sentences[:1000]).ids, args.repeats)
        rows = tokenizer.encode(sentences).ids
        index = {s: i for i, s in enumerate(sentences)}
        reference = None
        print("| graph | tok/s | / fp32 | min cosine vs fp32 | STS-B dev Spearman | batch invariance |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, session in sessions.items():
            embed = onnx_embedder(session)
            vectors = embed(rows)
            reference = vectors if reference is None else reference
            scores = [float(vectors[index[q.first]] @ vectors[index[q.second]]) for q in pairs]
            rho = spearmanr(scores, [q.score for q in pairs]).statistic * 100
            invariance = batch_invariance(embed, rows, sample=300).figures["min_cosine"]
            cosine = float((vectors * reference).sum(axis=1).min())
            ratio = rates[name] / rates["fp32 (shipped)"]
            figures = f"{rates[name]:,.0f} | {ratio:.2f}x | {cosine:.4f} | {rho:.3f} | {invariance:.7f}"
            print(f"| {name} | {figures} |")


def speeds(sessions: dict, rows: list[list[int]], repeats: int) -> dict[str, float]:
    """Real tokens per second of one thread's CPU time; the graphs take turns batch by batch."""
    order = sorted(rows, key=len)
    batches = [pad_batch(order[i : i + 32]) for i in range(0, len(order), 32)]
    best = {name: np.full(len(batches), np.inf) for name in sessions}
    for _ in range(repeats):
        for b, (ids, lengths) in enumerate(batches):
            for name, session in sessions.items():
                started = time.thread_time()
                session.run([EMBEDDINGS], {INPUT_IDS: ids, LENGTHS: lengths})
                best[name][b] = min(best[name][b], time.thread_time() - started)
    tokens = sum(len(r) for r in rows)
    return {name: tokens / float(times.sum()) for name, times in best.items()}


if __name__ == "__main__":
    main()
