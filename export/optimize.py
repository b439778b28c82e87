"""Which graph, and which ONNX Runtime settings, run fastest per execution provider.

Measured on the 2-core CI machine (ORT 1.31.1, 2 threads, STS-B dev sorted by length): the plain
TorchScript-exported graph and the graph fused offline by onnxruntime.transformers' optimizer ran
within noise of each other (about 430-455 sentences/s at batch 16-32), so the CPU provider gets the
plain graph with ORT's runtime optimisations. An earlier measurement found ORT's
SkipLayerNormalization CPU kernel 3-6x slower than Add + Add + LayerNormalization here, so that
runtime fusion is disabled. On this graph and ORT 1.31.1 it does not fire anyway (the optimised graph
is byte-identical with and without it): the setting is a guard against a future ORT that fuses it.

BiasGeluFusion is disabled too: on the int8 graph, whose Gemms' biases are separate Adds, it fuses
the FFN-up bias Add with Gelu, and ORT 1.31.1's BiasGelu CPU kernel took 0.157 s per pass where Add +
Gelu took 0.115 (profile, one thread, 1,000 STS-B dev sentences). Without it the int8 graph ran 2.4%
and 4.2% faster in two runs (one-thread CPU time, fp32 and int8 interleaved batch by batch, AMD EPYC
Zen 4), with vectors identical to the last bit on STS-B dev; the fp32 graph (bias inside its Gemms)
has no such pattern and does not change.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

from minilm_embed.export.onnx import IR_VERSION, OPSET
from minilm_embed.model.checksum import sha256_file
from minilm_embed.model.repository import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    FP16_FILE,
    FP32_FILE,
    INPUT_IDS,
    INT8_FILE,
    LENGTHS,
    Graph,
    Precision,
)
from minilm_embed.model.runtime import new_session
from minilm_embed.model.tokenizer import pad_batch

# Runtime fusions that make this model slower on the CPU provider (see the module docstring).
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion", "BiasGeluFusion")


# What the CPU provider runs: (file, precision, how the graph was made).
CPU_GRAPHS: tuple[tuple[str, Precision, str], ...] = (
    (FP32_FILE, "fp32", "plain TorchScript export; ORT runtime optimisations at load"),
    (
        INT8_FILE,
        "int8",
        "per-token int8 Gemms, 7-bit weights (exact sums on every x86 CPU), SmoothQuant smoothing "
        "calibrated on STS-B train, one MultiHeadAttention node per layer (opt-in)",
    ),
)


# What the CUDA provider runs, the first listed being `auto`'s: the fp16 graph where its gate passed
# on a GPU (export/fp16.py), else fp32. No runtime fusion is disabled on CUDA.
CUDA_GRAPHS: tuple[tuple[str, Precision, str], ...] = (
    (
        FP16_FILE,
        "fp16",
        "fp16 weights, matrix products and attention (one MultiHeadAttention node a layer); LayerNorm, "
        "pooling and normalisation in fp32; "
        "gated on a GPU",
    ),
    (FP32_FILE, "fp32", "plain TorchScript export; ORT runtime optimisations at load"),
)


def graph_plan(directory: Path, int8: bool, fp16: bool = False) -> tuple[Graph, ...]:
    """What the model repository in `directory` ships for each provider, recorded in manifest.json."""
    cpu = tuple(
        Graph(CPU_PROVIDER, file, precision, how, CPU_DISABLED_OPTIMIZERS, sha256_file(directory / file))
        for file, precision, how in CPU_GRAPHS
        if int8 or precision != "int8"
    )
    cuda = tuple(
        Graph(CUDA_PROVIDER, file, precision, how, (), sha256_file(directory / file))
        for file, precision, how in CUDA_GRAPHS
        if fp16 or precision != "fp16"
    )
    return cpu + cuda


MS_DOMAIN = "com.microsoft"
SMOOTH_ALPHA = 0.5
# Weights use 7 bits (-63..63). On x86 CPUs without VNNI (AVX2, or AVX-512 without VNNI: e.g. AMD
# Zen 3, Intel Skylake) MLAS's u8 x s8 kernel sums pairs of products into int16 (vpmaddubsw), which
# saturates once 255 x (|w1| + |w2|) passes 32,767: with 8-bit weights those CPUs computed other
# vectors (STS-B dev Spearman gap 0.31, min cosine vs fp32 0.983 on a Zen 3) than VNNI and AMX CPUs,
# which sum exactly. 255 x 2 x 63 = 32,130 cannot saturate, so every CPU computes the same integers.
WEIGHT_MAX = 63
# Activations are uint8 with zero point 128: symmetric int8 in the u8 x s8 layout VNNI computes.
_EPS, _INV127, _ZP, _AXIS1 = "int8/eps", "int8/inv127", "int8/zp128", "int8/axis1"
# QuantizeLinear's per-row zero points (128s), made once from the first quantised Gemm's row count:
# every linear layer runs on the same rows, the packed real tokens (model/encoder.py).
_ZERO_POINTS = "int8/zero_points"


def quantize_int8(
    fp32: Path, out: Path, calibration_rows: list[list[int]], num_heads: int, batch: int = 32
) -> None:
    """Per-token int8: every linear layer runs on MLAS's u8 x s8 kernels, batch-invariant; each
    layer's attention is one MultiHeadAttention node (`fuse_attention`).

    Each Gemm becomes: x * (1/smooth) -> int8 with one scale per row (token), computed in the graph
    -> MatMulIntegerToFloat against int8 weights with one scale per output channel -> + bias. A
    row's scale depends on that row alone, so a sentence gets the same vector alone or in any batch
    (dynamic quantisation with one scale per batch did not: min cosine 0.965). The weights are
    smoothed first (SmoothQuant, alpha 0.5): a few input channels reach 25-30 (GELU outputs, the
    LayerNorm outputs feeding the FFN) against a median of 1.3-1.9, so each channel is divided by
    sqrt(max|x| / max|w|), calibrated on these rows, and its weight row multiplied by the same.
    Weights have 7 bits (WEIGHT_MAX), so the integer sums are exact on every x86 CPU. Measured on
    STS-B dev (ORT 1.31): Spearman -0.03 vs fp32 (-0.14 unsmoothed), min cosine vs fp32 0.989, batch
    invariance 1.0000000 (AMD EPYC Zen 3; with 8-bit weights on a Zen 4, VNNI: -0.03 and 0.994).
    """
    model = onnx.load(str(fp32))
    fuse_attention(model, num_heads)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    gemms = {n.name: n for n in graph.node if n.op_type == "Gemm" and n.input[1] in weights}
    assert gemms, "no Gemm with constant weights: the export's linear layers changed"
    absmax = _input_absmax(model, [n.input[0] for n in gemms.values()], calibration_rows, batch)
    graph.initializer.extend(int8_shared_constants())
    nodes, first = [], True
    for node in graph.node:
        if node.name not in gemms:
            nodes.append(node)
            continue
        new_nodes, initializers = int8_gemm_nodes(node, weights[node.input[1]], absmax[node.input[0]], first)
        nodes.extend(new_nodes)
        graph.initializer.extend(initializers)
        first = False
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]  # the fp32 weights go
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.checker.check_model(model)
    out.write_bytes(model.SerializeToString())


# How MultiHeadAttention is told which keys are padding: the lengths, shape (B,), or the lengths with
# each row's query and key start in the padded (B, T) layout, shape (3B + 2,). ORT's CUDA kernel
# picks its attention kernel by this form: reading its source, the first rules out the
# memory-efficient (cutlass) kernel, which takes the second. ORT's CPU kernel reads only the lengths
# of either (tests/test_export.py checks both forms there, so the starts only on a GPU:
# bench_gpu.py's `attention` part compares the vectors, then the speed). Not yet run on a GPU.
KeyMask = Literal["lengths", "lengths-and-starts"]


def fuse_attention(model: onnx.ModelProto, num_heads: int, key_mask: KeyMask = "lengths") -> None:
    """Each layer's attention as one com.microsoft.MultiHeadAttention, its keys masked by the lengths.

    The export spells attention out (model/encoder.py's SelfAttention): from the packed qkv
    projection (N, 3C) to the packed context (N, C) that the output projection reads, about 70 nodes
    per layer in the file and 35 after ORT's runtime fusions, most of them shape arithmetic, masks
    and reshapes that cost the same per run whatever its size. Here they become 6: unpack (Gather to
    (B*T, 3C), Reshape to (B, T, 3C)), Split into q, k and v, MultiHeadAttention (the lengths as its
    key padding mask, scale 1/sqrt(head size)), Reshape, pack (Gather). With the shared zero points
    (int8_gemm_nodes), the int8 graph ORT runs went from 566 nodes to 343, and in the server's
    sessions (one thread, CPU time, old and new interleaved batch by batch, 1,000 STS-B dev
    sentences, AMD EPYC Zen 4) it ran one sentence per run 1.13-1.15x as fast, batches of 8
    1.03-1.04x, batches of 32 1.00-1.01x: the gain is in small batches, where a lone request's
    latency is; at 32 the attention kernel is no faster than the ops it replaces. The fp16 graph for
    CUDA is fused too (export/fp16.py); the fp32 graph, which CUDA can run as well, keeps the
    exported attention.
    """
    graph = model.graph
    produced_by = {out: n for n in graph.node for out in n.output}
    named = {n.name: n for n in graph.node}
    scopes = [
        n.name.removesuffix("/Gemm")
        for n in graph.node
        if re.fullmatch(r".*/layers\.\d+/attention/Gemm", n.name)
    ]
    assert scopes, "no attention qkv Gemm: the export's names changed"
    hidden = next(t.dims[1] for t in graph.initializer if t.name == named[scopes[0] + "/Gemm"].input[1])
    assert hidden % num_heads == 0, f"hidden size {hidden} is not a multiple of {num_heads} heads"
    constants = [
        numpy_helper.from_array(np.array([3 * hidden], np.int64), "mha/three_c"),
        numpy_helper.from_array(np.array([hidden] * 3, np.int64), "mha/split"),
        numpy_helper.from_array(np.array([-1, hidden], np.int64), "mha/rows_c"),
    ]
    make = onnx.helper.make_node
    head = [
        make("Shape", [INPUT_IDS], ["mha/batch_seq"]),  # (B, T): the padded layout attention needs
        make("Concat", ["mha/batch_seq", "mha/three_c"], ["mha/padded_qkv_shape"], axis=0),
        make("Cast", [LENGTHS], ["mha/lengths_int32"], to=TensorProto.INT32),  # the key padding mask
    ]
    mask = "mha/lengths_int32"
    if key_mask == "lengths-and-starts":
        mask = "mha/lengths_starts"
        constants += [
            numpy_helper.from_array(np.array(0, np.int64), "mha/zero"),
            numpy_helper.from_array(np.array(1, np.int64), "mha/one"),
        ]
        head += [  # each row's start in the padded layout, 0, T, 2T, ..., BT: for queries and for keys
            make("Gather", ["mha/batch_seq", "mha/zero"], ["mha/batch"], axis=0),
            make("Gather", ["mha/batch_seq", "mha/one"], ["mha/seq"], axis=0),
            make("Add", ["mha/batch", "mha/one"], ["mha/batch_plus_one"]),
            make("Range", ["mha/zero", "mha/batch_plus_one", "mha/one"], ["mha/rows"]),
            make("Mul", ["mha/rows", "mha/seq"], ["mha/starts"]),
            make("Cast", ["mha/starts"], ["mha/starts_int32"], to=TensorProto.INT32),
            make("Concat", ["mha/lengths_int32", "mha/starts_int32", "mha/starts_int32"], [mask], axis=0),
        ]
    replaced = {}
    for scope in scopes:
        qkv, out = named[scope + "/Gemm"].output[0], named[scope + "/out/Gemm"].input[0]
        (unpack,) = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == qkv]
        pack = produced_by[out]
        assert pack.op_type == "Gather", f"{scope}: the output projection reads {pack.op_type}, not a pack"
        p = scope + "/mha"
        replaced[pack.name] = [
            make("Gather", [qkv, unpack.input[1]], [p + "/padded"], axis=0),  # (B*T, 3C)
            make("Reshape", [p + "/padded", "mha/padded_qkv_shape"], [p + "/qkv"]),  # (B, T, 3C)
            make("Split", [p + "/qkv", "mha/split"], [p + "/q", p + "/k", p + "/v"], axis=2),  # 3 x (B, T, C)
            make(
                "MultiHeadAttention",
                [p + "/q", p + "/k", p + "/v", "", mask],
                [p + "/context"],
                domain=MS_DOMAIN,
                num_heads=num_heads,
            ),  # (B, T, C)
            make("Reshape", [p + "/context", "mha/rows_c"], [p + "/rows"]),  # (B*T, C)
            make("Gather", [p + "/rows", pack.input[1]], [out], axis=0),  # (N, C)
        ]
    nodes = head + [m for n in graph.node for m in replaced.get(n.name, [n])]
    del graph.node[:]
    graph.node.extend(_live(nodes, {o.name for o in graph.output}))
    assert not any(n.op_type == "Softmax" for n in graph.node), "an attention was left unfused"
    graph.initializer.extend(constants)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` less those whose outputs nothing reads, repeatedly; order kept."""
    while True:
        read = outputs | {name for n in nodes for name in n.input}
        live = [n for n in nodes if any(o in read for o in n.output)]
        if len(live) == len(nodes):
            return live
        nodes = live


def int8_shared_constants() -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(np.array(1e-12, np.float32), _EPS),
        numpy_helper.from_array(np.array(1 / 127, np.float32), _INV127),
        numpy_helper.from_array(np.array(128, np.uint8), _ZP),
        numpy_helper.from_array(np.array([1], np.int64), _AXIS1),
    ]


def _input_absmax(
    model: onnx.ModelProto, names: list[str], rows: list[list[int]], batch: int
) -> dict[str, np.ndarray]:
    """Per channel, the largest |x| each named tensor takes over the calibration rows."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = list(dict.fromkeys(names))
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=[CPU_PROVIDER])
    ordered = sorted(rows, key=len)
    found: dict[str, np.ndarray] = {}
    for i in range(0, len(ordered), batch):
        ids, lengths = pad_batch(ordered[i : i + batch])
        outputs = session.run(names, {INPUT_IDS: ids, LENGTHS: lengths})
        for name, x in zip(names, outputs, strict=True):  # (N, K): packed real tokens
            top = np.abs(x).max(axis=0)
            found[name] = np.maximum(found[name], top) if name in found else top
    return found


def int8_gemm_nodes(
    node: onnx.NodeProto, weight: onnx.TensorProto, absmax: np.ndarray, first: bool = True
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """One Gemm (x @ W.T + b) as smoothed, per-row int8 nodes; the `first` also makes the zero
    points that the others, whose inputs have as many rows, read."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs.get("transB") == 1 and not attrs.get("transA"), f"{node.name}: unexpected Gemm layout"
    assert attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0, f"{node.name}: scaled Gemm"
    w = numpy_helper.to_array(weight).T  # (K, N)
    smooth = smoothing(w, absmax)
    w = w * smooth[:, None]
    col_scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / WEIGHT_MAX  # (N,)
    w_int8 = np.clip(np.round(w / col_scale), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8)
    p = node.name
    initializers = [
        numpy_helper.from_array((1 / smooth).astype(np.float32), p + "/inv_smooth"),
        numpy_helper.from_array(w_int8, p + "/w_int8"),
        numpy_helper.from_array(col_scale.astype(np.float32), p + "/w_scale"),
    ]
    make = onnx.helper.make_node
    nodes = [
        make("Mul", [node.input[0], p + "/inv_smooth"], [p + "/x"]),  # (M, K)
        make("Abs", [p + "/x"], [p + "/abs"]),
        make("ReduceMax", [p + "/abs"], [p + "/absmax"], axes=[1], keepdims=0),  # (M,)
        make("Max", [p + "/absmax", _EPS], [p + "/absmax_eps"]),
        make("Mul", [p + "/absmax_eps", _INV127], [p + "/row_scale"]),  # (M,)
        *(_zero_point_nodes(p + "/row_scale") if first else []),
        make("QuantizeLinear", [p + "/x", p + "/row_scale", _ZERO_POINTS], [p + "/x_uint8"], axis=0),
        make("Unsqueeze", [p + "/row_scale", _AXIS1], [p + "/row_scale_2d"]),  # (M, 1)
        # The bias is added apart: ORT 1.31's MatMulIntegerToFloat multiplies its bias input by a
        # per-row A scale too ((acc * b_scale + bias) * a_scale), which is not the op's contract.
        make(
            "MatMulIntegerToFloat",
            [p + "/x_uint8", p + "/w_int8", p + "/row_scale_2d", p + "/w_scale", _ZP],
            [p + "/y"],
            domain=MS_DOMAIN,
        ),
        make("Add", [p + "/y", node.input[2]], list(node.output)),
    ]
    return nodes, initializers


def smoothing(w: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-input-channel divisor (K,) for weights `w` (K, N) whose input reaches
    `absmax` (K,) per channel: sqrt(max|x| / max|w|) at alpha 0.5, scaled to a geometric mean of 1
    so that the scales stay near the original."""
    w_max = np.maximum(np.abs(w).max(axis=1), 1e-5)  # (K,)
    smooth = np.maximum(absmax, 1e-5) ** SMOOTH_ALPHA / w_max ** (1 - SMOOTH_ALPHA)
    return smooth / np.exp(np.log(smooth).mean())


def _zero_point_nodes(row_scale: str) -> list[onnx.NodeProto]:
    """(M,) uint8 128s, as many as `row_scale` has rows."""
    return [
        onnx.helper.make_node("Shape", [row_scale], [_ZERO_POINTS + "/rows"]),
        onnx.helper.make_node(
            "ConstantOfShape",
            [_ZERO_POINTS + "/rows"],
            [_ZERO_POINTS],
            value=numpy_helper.from_array(np.array([128], np.uint8)),
        ),
    ]


def int8_matmul_model(w_int8: np.ndarray, w_scale: np.ndarray) -> onnx.ModelProto:
    """One MatMulIntegerToFloat as the int8 graph runs it: x (M, K) uint8 with zero point 128 and one
    scale per row (input x_scale, (M, 1)) against int8 weights (K, N) with one scale per column."""
    helper = onnx.helper
    m, (k, n) = "rows", w_int8.shape
    weights = [
        numpy_helper.from_array(w_int8, "w"),
        numpy_helper.from_array(w_scale.astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "zp"),
    ]
    node = helper.make_node(
        "MatMulIntegerToFloat", ["x", "w", "x_scale", "w_scale", "zp"], ["y"], domain=MS_DOMAIN
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.UINT8, [m, k]),
        helper.make_tensor_value_info("x_scale", TensorProto.FLOAT, [m, 1]),
    ]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])
    graph = helper.make_graph([node], "int8_matmul", inputs, [output], weights)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def runtime_op_types(path: Path, disabled_optimizers: Sequence[str]) -> list[str]:
    """The node types of the graph ORT actually runs on the CPU provider, after its runtime
    optimisations with `disabled_optimizers` switched off: whether a fusion fires, or is really off
    (ORT ignores an optimizer name it does not know)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(
            str(path), options, providers=[CPU_PROVIDER], disabled_optimizers=list(disabled_optimizers)
        )
        # Node types only: the shared table stays where the graph points, beside the original.
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    return [node.op_type for node in graph.node]


def cpu_session(
    path: Path, threads: int = 0, disabled_optimizers: tuple[str, ...] = CPU_DISABLED_OPTIMIZERS
) -> ort.InferenceSession:
    """An ONNX Runtime CPU session with the server's graph settings (threads=0: ORT's default).

    Unlike the server's sessions, ORT's defaults: idle threads spin, a CPU memory arena (model/runtime.py).
    """
    return new_session(path, [CPU_PROVIDER], threads, disabled_optimizers, serving=False)
