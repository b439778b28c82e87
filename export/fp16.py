"""The fp16 graph for the CUDA execution provider, converted from the verified fp32 graph.

Each layer's attention is first made one com.microsoft.MultiHeadAttention node, its keys masked by
the lengths (export.optimize.fuse_attention). With the exported attention, half the node time on an
H200 went to Softmax and the mask's Add, one node each per layer over batch x 12 x T x T tensors; on
an H100 the fused graph ran 110-150-token passages 1.28-1.40x as fast (docs/gpu.md).

ONNX Runtime's converter (`onnxruntime.transformers.float16`) then turns every float tensor to fp16
except what is blocked, which runs in fp32 between Casts:
- every LayerNormalization (its sums of squares lose digits in fp16), and Softmax where one is left,
- the pooling and the normalisation: every node downstream of the last encoder layer's LayerNorm
  (sum over up to 256 token states, division by the lengths, L2 norm).
The weights, the matrix products, attention, GELU and the residual adds run in fp16 (tensor cores).

The converter wraps each blocked node in its own Casts, so a value passed from one blocked node to the
next went fp32 -> fp16 -> fp32 and lost its digits anyway (the pooled sum was rounded to fp16); and it
named the two Casts it put on one value consumed twice alike, an invalid graph. `drop_cast_round_trips`
feeds each such consumer the fp32 value itself, which removes both problems.

The graph's inputs and outputs keep their types (int64 ids and lengths in, float32 vectors out), so
the server feeds and reads both graphs alike. The word-embedding table is stored in the graph, in
fp16 (the shared table file is float32 and belongs to the CPU graphs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from onnx import TensorProto

from minilm_embed.export.onnx import save
from minilm_embed.export.optimize import KeyMask, fuse_attention, graph_plan
from minilm_embed.export.parity import ParityReport, run_fp16_gate
from minilm_embed.model.data import DataError
from minilm_embed.model.repository import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    FP16_FILE,
    FP32_FILE,
    MANIFEST_FILE,
    Manifest,
    ModelRepositoryError,
    open_repository,
)
from minilm_embed.model.runtime import new_session
from minilm_embed.model.tokenizer import Tokenizer

BLOCKED_OPS = ("LayerNormalization", "Softmax")


def pooling_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes fed, directly or not, by the last LayerNormalization (pooling + norm)."""
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    if not norms:
        raise ValueError("the graph has no LayerNormalization: not this project's encoder")
    downstream = {norms[-1].output[0]}
    names = []
    for node in model.graph.node:  # ONNX graphs are topologically sorted
        if any(i in downstream for i in node.input):
            names.append(node.name)
            downstream.update(node.output)
    return names


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def drop_cast_round_trips(model: onnx.ModelProto, blocked: set[str]) -> int:
    """Turn every Cast(to fp32) of a Cast(to fp16) of a blocked node's output (an fp32 value) into
    an Identity of that value; drop the Casts left without consumers. Returns the round trips removed."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}

    def in_fp32(node: onnx.NodeProto | None) -> bool:
        return node is not None and (node.name in blocked or node.op_type in BLOCKED_OPS)

    dropped = 0
    for node in graph.node:
        if node.op_type != "Cast" or _cast_to(node) != TensorProto.FLOAT:
            continue
        before = producer.get(node.input[0])
        if before is None or before.op_type != "Cast" or _cast_to(before) != TensorProto.FLOAT16:
            continue
        if in_fp32(producer.get(before.input[0])):
            # An Identity of the fp32 value (ORT removes it at load), which also serves a graph output.
            node.op_type, node.input[0] = "Identity", before.input[0]
            del node.attribute[:]
            dropped += 1
    # The converter's two Casts of one value read twice write one name twice: keep the first.
    seen: set[str] = set()
    for node in list(graph.node):
        if node.op_type == "Identity" and node.output[0] in seen:
            graph.node.remove(node)
        seen.update(node.output)
    outputs = {o.name for o in graph.output}
    while True:  # drop Casts nothing reads any more (a dropped fp32 Cast may orphan its fp16 one)
        used = {i for node in graph.node for i in node.input} | outputs
        dead = [n for n in graph.node if n.op_type == "Cast" and n.output[0] not in used]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    return dropped


def sort_nodes(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs, as ONNX requires."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending: list[onnx.NodeProto] = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        left: list[onnx.NodeProto] = []
        for node in pending:
            if all(i in ready for i in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                left.append(node)
        if len(left) == len(pending):
            raise ValueError(f"the graph has a cycle or a missing input at {left[0].name}")
        pending = left
    del graph.node[:]
    graph.node.extend(ordered)


def convert_fp16(
    fp32: Path, out: Path, num_heads: int, key_mask: KeyMask | None = "lengths"
) -> dict[str, int]:
    """Write the fp16 graph of the fp32 graph at `fp32` to `out` (one file, weights inside), each
    layer's attention one MultiHeadAttention node (`fuse_attention`, its keys masked by `key_mask`;
    None keeps the exported attention, for comparison)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(fp32))  # with the shared table, read from its file
    if key_mask is not None:
        fuse_attention(model, num_heads, key_mask)
    blocked = pooling_nodes(model)
    converted = convert_float_to_float16(
        model, keep_io_types=True, op_block_list=list(BLOCKED_OPS), node_block_list=blocked
    )
    dropped = drop_cast_round_trips(converted, set(blocked))
    sort_nodes(converted.graph)  # the converter appends its Casts at the end
    onnx.checker.check_model(converted)
    save(converted, out)
    return {"blocked_pooling_nodes": len(blocked), "cast_round_trips_dropped": dropped}


FP16_SKIPPED = "no GPU at export: add the gated fp16 graph on a GPU host, python -m minilm_embed.export.fp16"


class Fp16Error(Exception):
    """No fp16 graph: no usable GPU, or its gate failed; the message is the one line to show."""


def cuda_session(path: Path) -> ort.InferenceSession:
    """A CUDA session with the server's settings, refused unless CUDA really runs it."""
    session = new_session(path, [CUDA_PROVIDER, CPU_PROVIDER], 0, (), serving=False)
    if session.get_providers()[0] != CUDA_PROVIDER:
        raise Fp16Error(
            "the fp16 graph is gated on a GPU: the CUDA execution provider could not be loaded here"
        )
    return session


def gated_fp16(directory: Path, tokenizer: Tokenizer, data_dir: Path | None, num_heads: int) -> ParityReport:
    """Convert `directory`'s fp32 graph to `FP16_FILE` beside it and gate it against fp32 on the GPU.
    The file is removed again if the gate fails (Fp16Error names the failed checks)."""
    out = directory / FP16_FILE
    figures = convert_fp16(directory / FP32_FILE, out, num_heads)
    try:
        report = run_fp16_gate(cuda_session(directory / FP32_FILE), cuda_session(out), tokenizer, data_dir)
        print(report.table())
        if not report.passed:
            failed = "; ".join(c.reason() for c in report.checks if not c.passed)
            raise Fp16Error(f"fp16 graph refused, its gate failed: {failed}")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    print(f"fp16: {figures['blocked_pooling_nodes']} pooling nodes and every LayerNorm kept in fp32")
    return report


def add_fp16(directory: Path, data_dir: Path | None) -> Manifest:
    """Add the gated fp16 graph to an existing model repository (on a GPU host), rewriting its manifest."""
    repo = open_repository(directory)
    tokenizer = Tokenizer(repo.tokenizer_file, repo.max_input_tokens)
    report = gated_fp16(directory, tokenizer, data_dir, repo.manifest.config.num_heads)
    int8 = any(g.precision == "int8" for g in repo.manifest.graphs)
    manifest = dataclasses.replace(
        repo.manifest, graphs=graph_plan(directory, int8, fp16=True), parity_fp16=fp16_record(report)
    )
    staged = directory / f".{MANIFEST_FILE}.partial"
    staged.write_text(manifest.to_json(), encoding="utf-8")
    staged.replace(directory / MANIFEST_FILE)
    return manifest


def fp16_record(report: ParityReport) -> dict[str, Any]:
    """The gate's figures for the manifest, with the device it ran on."""
    return dict(report.to_dict(), provider=CUDA_PROVIDER, device=ort.get_device())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minilm_embed.export.fp16",
        description="add the fp16 graph, gated on this host's GPU, to a model repository",
    )
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("EMBED_DATA_DIR") or None,
        help="directory holding stsbenchmark/ (the gate's STS-B dev Spearman check) [env EMBED_DATA_DIR]",
    )
    args = p.parse_args(argv)
    try:
        add_fp16(args.model_dir, args.data_dir)
    except (Fp16Error, ModelRepositoryError, DataError, OSError) as e:
        print(f"export.fp16: error: {e}", file=sys.stderr)
        return 2
    print(f"export.fp16: added {FP16_FILE} to {args.model_dir} (gate passed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
