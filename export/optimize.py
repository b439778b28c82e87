"""Which graph, and which ONNX Runtime settings, run fastest per execution provider.

Measured on the 2-core CI machine (ORT 1.31.1, 2 threads, STS-B dev sorted by length): the plain
TorchScript-exported graph and the graph fused offline by onnxruntime.transformers' optimizer ran
within noise of each other (about 430-455 sentences/s at batch 16-32), so the CPU provider gets the
plain graph with ORT's runtime optimisations. An earlier measurement found ORT's
SkipLayerNormalization CPU kernel 3-6x slower than Add + Add + LayerNormalization here, so that
runtime fusion is disabled. On this graph and ORT 1.31.1 it does not fire anyway (the optimised graph
is byte-identical with and without it): the setting is a guard against a future ORT that fuses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)

from model.tokenizer import pad_batch

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

# Runtime fusions that make this model slower on the CPU provider (see the module docstring).
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"


def graph_plan(int8: bool) -> list[dict[str, object]]:
    """What the model repository ships for each provider, recorded in manifest.json."""
    plan: list[dict[str, object]] = [
        {
            "provider": CPU_PROVIDER,
            "file": FP32_FILE,
            "precision": "fp32",
            "graph": "plain TorchScript export; ORT runtime optimisations at load",
            "disabled_optimizers": list(CPU_DISABLED_OPTIMIZERS),
        },
    ]
    if int8:
        plan.append(
            {
                "provider": CPU_PROVIDER,
                "file": INT8_FILE,
                "precision": "int8",
                "graph": "static QDQ int8, FFN down projections fp32; calibrated on STS-B train (opt-in)",
                "disabled_optimizers": list(CPU_DISABLED_OPTIMIZERS),
            }
        )
    return plan


class _Batches(CalibrationDataReader):
    def __init__(self, rows: list[list[int]], batch: int) -> None:
        self._batches: Iterator[tuple[np.ndarray, np.ndarray]] = (
            pad_batch(rows[i : i + batch]) for i in range(0, len(rows), batch)
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        ids_lengths = next(self._batches, None)
        if ids_lengths is None:
            return None
        return {"input_ids": ids_lengths[0], "lengths": ids_lengths[1]}


def quantize_int8(fp32: Path, out: Path, calibration_rows: list[list[int]], batch: int = 32) -> None:
    """Static int8: per-channel int8 weights, uint8 activations with fixed calibrated scales.

    Dynamic quantisation measured 2.4x the fp32 speed but computes activation scales per batch,
    so a sentence's vector changed with its batch-mates (min cosine 0.965). Static scales are fixed
    at export, so each row's arithmetic is the same alone or in any batch.

    The FFN's down projections stay fp32: their input (the GELU output) has outliers that one
    uint8 scale cannot hold. Quantising them too cost 0.50 STS-B dev Spearman (gate: 0.5); without
    them 0.11, at 1.38x the fp32 speed (sorted batches of 32, 2 threads).
    """
    graph = onnx.load(str(fp32), load_external_data=False).graph
    keep_fp32 = [n.name for n in graph.node if n.op_type == "Gemm" and "/ffn/down/" in n.name]
    assert keep_fp32, "no FFN down projection found by name: the export's module names changed"
    quantize_static(
        str(fp32),
        str(out),
        _Batches(sorted(calibration_rows, key=len), batch),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["MatMul", "Gemm"],  # 2-D linear layers export as Gemm
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_exclude=keep_fp32,
    )


def cpu_session(
    path: Path, threads: int = 0, disabled_optimizers: tuple[str, ...] = CPU_DISABLED_OPTIMIZERS
) -> ort.InferenceSession:
    """An ONNX Runtime CPU session with the server's graph settings (threads=0: ORT's default).

    Unlike the server's sessions, idle threads keep ORT's default spinning: nothing else shares the
    cores in the gate or a benchmark.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(
        str(path),
        options,
        providers=[CPU_PROVIDER],
        disabled_optimizers=list(disabled_optimizers),
    )
