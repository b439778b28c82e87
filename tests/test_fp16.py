"""The fp16 graph for CUDA (export/fp16.py), checked where no GPU is: its structure (what stays fp32),
its vectors on ONNX Runtime's CPU provider, its gate's refusal, and the repository it is added to.
The gate itself runs on a GPU (tests/test_gpu.py); here `cuda_session` is replaced by CPU sessions."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from minilm_embed.export import fp16
from minilm_embed.export.optimize import cpu_session
from minilm_embed.export.parity import FP16_MIN_COSINE_VS_FP32
from minilm_embed.model.host import gpu_present
from minilm_embed.model.repository import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    FP16_FILE,
    FP32_FILE,
    MANIFEST_FILE,
    open_repository,
    read_manifest,
)
from minilm_embed.model.runtime import run_graph
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from tests.server_process import ROOT

TEXTS = [
    "A man is playing a guitar.",
    "a",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Half precision keeps the weights in 16 bits. " * 12,
]


@pytest.fixture(scope="module")
def conversion(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """The built repository's fp32 graph converted once (2 CPU-s): the file, and convert_fp16's figures."""
    out = tmp_path_factory.mktemp("fp16") / FP16_FILE
    figures = fp16.convert_fp16(model_dir / FP32_FILE, out, read_manifest(model_dir).config.num_heads)
    return out, figures


@pytest.fixture(scope="module")
def converted(conversion: tuple[Path, dict[str, int]]) -> Path:
    return conversion[0]


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


def test_layernorm_and_pooling_compute_in_fp32_and_the_rest_in_fp16(converted, model_dir):
    model = onnx.load(str(converted))
    types = value_types(model)
    by_name = {n.name: n for n in model.graph.node}
    pooling = fp16.pooling_nodes(onnx.load(str(model_dir / FP32_FILE), load_external_data=False))
    checked = 0
    for node in model.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "ReduceSum", "ReduceL2") or node.name in pooling:
            floats = [
                types[i] for i in node.input if i and types.get(i) in (TensorProto.FLOAT, TensorProto.FLOAT16)
            ]
            assert all(t == TensorProto.FLOAT for t in floats), (node.name, node.op_type, floats)
            checked += 1
    assert checked >= 13 + 2  # every LayerNorm, and the pooling's sum and norm at least
    # Each layer's attention is one MultiHeadAttention on fp16 queries, keys and values, its keys
    # masked by the lengths in int32 (export.optimize.fuse_attention).
    attention = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(attention) == 6 and not any(n.op_type == "Softmax" for n in model.graph.node)
    for node in attention:
        assert [types[i] for i in node.input[:3]] == [TensorProto.FLOAT16] * 3, node.name
        assert types[node.input[4]] == TensorProto.INT32, node.name
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 24 and all(types[g.input[1]] == TensorProto.FLOAT16 for g in gemms)
    assert types["input_ids"] == types["lengths"] == TensorProto.INT64
    assert types["embeddings"] == types["pooled"] == TensorProto.FLOAT
    assert "/encoder/layers.5/ffn_norm/LayerNormalization" in by_name


def test_no_value_goes_fp32_to_fp16_to_fp32_between_blocked_nodes(converted):
    model = onnx.load(str(converted))
    producer = {out: n for n in model.graph.node for out in n.output}
    for node in model.graph.node:
        if node.op_type == "Cast" and node.attribute[0].i == TensorProto.FLOAT:
            before = producer.get(node.input[0])
            if (
                before is not None
                and before.op_type == "Cast"
                and before.attribute[0].i == TensorProto.FLOAT16
            ):
                source = producer.get(before.input[0])
                assert source is None or source.op_type not in fp16.BLOCKED_OPS, node.name


def test_the_converters_own_output_is_refused_without_the_cast_clean_up(model_dir, monkeypatch, tmp_path):
    """Why drop_cast_round_trips exists: the converter names two Casts of one value alike."""
    monkeypatch.setattr(fp16, "drop_cast_round_trips", lambda model, blocked: 0)
    with pytest.raises(onnx.checker.ValidationError):
        fp16.convert_fp16(
            model_dir / FP32_FILE, tmp_path / FP16_FILE, read_manifest(model_dir).config.num_heads
        )


def test_fp16_vectors_on_the_cpu_provider_agree_with_fp32(converted, model_dir):
    tokenizer = Tokenizer(model_dir / "tokenizer.json", 256)
    ids, lengths = pad_batch(tokenizer.encode(TEXTS).ids)
    want, want_pooled = run_graph(cpu_session(model_dir / FP32_FILE), ids, lengths)
    got, got_pooled = run_graph(cpu_session(converted), ids, lengths)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert float(np.min(np.sum(got * want, axis=1))) >= FP16_MIN_COSINE_VS_FP32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got_pooled, want_pooled, rtol=0.02, atol=0.02)


@pytest.fixture
def repo_copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / FP16_FILE).unlink(missing_ok=True)
    return copy


@pytest.fixture
def converted_once(conversion, repo_copy, model_dir, monkeypatch) -> None:
    """add_fp16 on `repo_copy` converts its fp32 graph, a copy of the one `conversion` converted: that
    conversion's file is copied into place instead of converting again (convert_fp16 is deterministic:
    the same bytes). Its arguments are checked as convert_fp16 would be called."""
    path, figures = conversion

    def convert(fp32: Path, out: Path, num_heads: int, key_mask: object = "lengths") -> dict[str, int]:
        assert (fp32, out, key_mask) == (repo_copy / FP32_FILE, repo_copy / FP16_FILE, "lengths")
        assert num_heads == read_manifest(model_dir).config.num_heads
        assert fp32.read_bytes() == (model_dir / FP32_FILE).read_bytes()
        shutil.copyfile(path, out)
        return dict(figures)

    monkeypatch.setattr(fp16, "convert_fp16", convert)


def test_add_fp16_lists_the_gated_graph_first_for_cuda_and_leaves_the_cpu_graphs(
    repo_copy, converted_once, monkeypatch
):
    monkeypatch.setattr(fp16, "cuda_session", lambda path: cpu_session(path))
    before = read_manifest(repo_copy)
    fp16.add_fp16(repo_copy, data_dir=None)
    repo = open_repository(repo_copy)  # every checksum, the new graph's too
    assert repo.graph_for(CUDA_PROVIDER, "auto").file == FP16_FILE
    assert repo.graph_for(CUDA_PROVIDER, "fp32").file == FP32_FILE
    assert repo.graph_for(CPU_PROVIDER, "auto") == before.graphs[0]
    cpu_graphs = [g for g in before.graphs if g.provider == CPU_PROVIDER]
    assert [g for g in repo.manifest.graphs if g.provider == CPU_PROVIDER] == cpu_graphs
    checks = {c["name"]: c for c in repo.manifest.parity_fp16["checks"]}
    assert checks["fp16 vs fp32"]["passed"] and checks["fp16 batch invariance"]["passed"]
    assert repo.manifest.parity_fp16["provider"] == CUDA_PROVIDER


def test_a_failed_gate_refuses_the_graph_in_one_line_and_leaves_the_repository_as_it_was(
    repo_copy, converted_once, monkeypatch
):
    class Skewed:
        """The fp16 graph, answering vectors rotated off fp32's."""

        def __init__(self, path: Path) -> None:
            self.session = cpu_session(path)

        def run(self, names, feeds):
            outputs = self.session.run(names, feeds)
            return [np.roll(o, 1, axis=1) for o in outputs]

    monkeypatch.setattr(
        fp16, "cuda_session", lambda path: Skewed(path) if path.name == FP16_FILE else cpu_session(path)
    )
    manifest = (repo_copy / MANIFEST_FILE).read_text()
    with pytest.raises(fp16.Fp16Error) as refused:
        fp16.add_fp16(repo_copy, data_dir=None)
    line = str(refused.value)
    assert line.startswith("fp16 graph refused, its gate failed: ") and "\n" not in line
    assert "fp16 vs fp32: min_cosine" in line and "fp16 batch invariance" not in line
    assert not (repo_copy / FP16_FILE).exists()
    assert (repo_copy / MANIFEST_FILE).read_text() == manifest


@pytest.mark.skipif(gpu_present(), reason="this host has a GPU (tests/test_gpu.py runs the gate)")
def test_without_a_gpu_the_fp16_command_exits_2_with_one_line(repo_copy):
    proc = subprocess.run(
        [sys.executable, "-m", "minilm_embed.export.fp16", "--model-dir", str(repo_copy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "export.fp16: error: the fp16 graph is gated on a GPU: the CUDA execution provider could not be "
        "loaded here"
    )
    assert not (repo_copy / FP16_FILE).exists()
