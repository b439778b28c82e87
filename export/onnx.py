"""PyTorch encoder -> ONNX graph: int64 ids (B, T) and lengths (B,) in, embeddings (B, D) out."""

from __future__ import annotations

import io
from pathlib import Path

import onnx
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minilm_embed.model.encoder import Encoder
from minilm_embed.model.repository import EMBEDDINGS, INPUT_IDS, INPUTS, LENGTHS, OUTPUTS, POOLED

OPSET = 17
# onnx 1.23 stamps IR version 14 on new models, which onnxruntime 1.31 refuses (it reads <= 13).
IR_VERSION = 8


class ExportedEncoder(nn.Module):
    """The graph's contract: normalised embeddings for the default path, raw pooled for normalize=false."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        pooled = self.encoder(input_ids, lengths)  # (B, D)
        return F.normalize(pooled, p=2.0, dim=-1), pooled


def export_onnx(encoder: Encoder) -> onnx.ModelProto:
    """Trace the encoder with dynamic batch and sequence axes; the ONNX checker must pass."""
    encoder.eval()
    ids = torch.full((2, 8), 101, dtype=torch.int64)
    lengths = torch.tensor([8, 3], dtype=torch.int64)
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(
            ExportedEncoder(encoder).eval(),
            (ids, lengths),
            buffer,  # type: ignore[arg-type]
            dynamo=False,
            opset_version=OPSET,
            input_names=list(INPUTS),
            output_names=list(OUTPUTS),
            dynamic_axes={
                INPUT_IDS: {0: "batch", 1: "sequence"},
                LENGTHS: {0: "batch"},
                EMBEDDINGS: {0: "batch"},
                POOLED: {0: "batch"},
            },
            do_constant_folding=True,
        )
    model = onnx.load_from_string(buffer.getvalue())
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def save(model: onnx.ModelProto, path: Path) -> None:
    assert model.ir_version <= IR_VERSION, "onnxruntime 1.31 refuses IR versions above 13"
    path.write_bytes(model.SerializeToString())
