"""Which graph, and which ONNX Runtime settings, run fastest per execution provider.

Measured on the 2-core CI machine (ORT 1.31.1, 2 threads, STS-B dev sorted by length): the plain
TorchScript-exported graph and the graph fused offline by onnxruntime.transformers' optimizer ran
within noise of each other (about 430-455 sentences/s at batch 16-32, `make bench-model`), and the
issue's earlier measurement found ORT's SkipLayerNormalization CPU kernel 3-6x slower than
Add + Add + LayerNormalization. So the CPU provider gets the plain graph with that one runtime fusion
switched off; every other ORT graph optimisation stays on.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

# Runtime fusions that make this model slower on the CPU provider (see the module docstring).
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def graph_plan() -> list[dict[str, object]]:
    """What the model repository ships for each provider, recorded in manifest.json."""
    return [
        {
            "provider": CPU_PROVIDER,
            "file": "model.onnx",
            "precision": "fp32",
            "graph": "plain TorchScript export; ORT runtime optimisations at load",
            "disabled_optimizers": list(CPU_DISABLED_OPTIMIZERS),
        },
    ]


def cpu_session(path: Path, threads: int = 0) -> ort.InferenceSession:
    """An ONNX Runtime CPU session with the settings the server uses (threads=0: ORT's default)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(
        str(path),
        options,
        providers=[CPU_PROVIDER],
        disabled_optimizers=list(CPU_DISABLED_OPTIMIZERS),
    )
