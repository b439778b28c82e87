"""PyTorch encoder -> ONNX graph: int64 ids (B, T) and lengths (B,) in, embeddings (B, D) out."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import external_data_helper, numpy_helper
from torch import Tensor, nn

from minilm_embed.model.checksum import sha256_file
from minilm_embed.model.encoder import Encoder
from minilm_embed.model.repository import (
    EMBEDDINGS,
    INPUT_IDS,
    INPUTS,
    LENGTHS,
    OUTPUTS,
    POOLED,
    WORD_EMBEDDINGS_FILE,
    SharedTensor,
)

OPSET = 17
# The word-embedding table (30,522 x 384 float32, 47 MB): the graphs' largest initializer, and the
# one every graph shares unchanged (int8 quantises the linear layers only).
WORD_EMBEDDINGS = "encoder.embeddings.word.weight"
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


def share_tensor(
    graph_file: Path, name: str = WORD_EMBEDDINGS, file: str = WORD_EMBEDDINGS_FILE
) -> SharedTensor:
    """Move initializer `name` out of the graph into `file` beside it, which the graph then
    references as ONNX external data; a second graph holding the same values references the same
    file (written once, and refused if its values differ).

    The server gives every model instance that one copy (runtime.shared_initializers): with the
    table inside the graph, each instance held its own.
    """
    model = onnx.load(str(graph_file))
    tensor = next((t for t in model.graph.initializer if t.name == name), None)
    if tensor is None:
        raise ValueError(f"{graph_file}: no initializer {name!r} to share")
    values = numpy_helper.to_array(tensor)
    if values.dtype != np.float32:
        raise ValueError(f"{graph_file}: {name} is {values.dtype}; shared tensors are float32")
    data = values.astype("<f4").tobytes()
    path = graph_file.parent / file
    if not path.exists():
        path.write_bytes(data)
    elif path.read_bytes() != data:
        raise ValueError(f"{graph_file}: {name} differs from the {file} another graph shares")
    tensor.ClearField("float_data")
    tensor.raw_data = data  # set_external_data wants it there, then the graph keeps only the reference
    external_data_helper.set_external_data(tensor, location=file, offset=0, length=len(data))
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    save(model, graph_file)
    onnx.checker.check_model(str(graph_file))
    return SharedTensor(name, file, tuple(values.shape), sha256_file(path))
