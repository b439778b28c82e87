"""The encoder's hyper-parameters: one frozen dataclass passed whole to every module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

PositionKind = Literal["learned", "sinusoidal"]
PoolingKind = Literal["mean", "cls"]


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512  # rows of the learned position table
    max_seq_length: int = 256  # longest input served; <= max_position_embeddings
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1  # used only in training; inference is eval() and deterministic
    position: PositionKind = "learned"
    pooling: PoolingKind = "mean"
    normalize: bool = True
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.max_seq_length > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_length {self.max_seq_length} exceeds "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        if self.position not in ("learned", "sinusoidal"):
            raise ValueError(f"position must be 'learned' or 'sinusoidal', not {self.position!r}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', not {self.pooling!r}")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EncoderConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown EncoderConfig fields: {', '.join(unknown)}")
        return cls(**d)
