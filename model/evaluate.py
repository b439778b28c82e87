"""Evaluation helpers shared by the parity gate and training: batched embedding, STS Spearman."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from minilm_embed.model.data import ScoredPair, read_sts, sts_path
from minilm_embed.model.encoder import Encoder
from minilm_embed.model.tokenizer import Tokenizer, pad_batch

BATCH = 64

Embedder = Callable[[list[list[int]]], np.ndarray]


def batched(
    rows: Sequence[list[int]], run: Callable[[np.ndarray, np.ndarray], np.ndarray], batch: int
) -> np.ndarray:
    """Run rows in batches in the order given; (N, D) out."""
    return np.concatenate([run(*pad_batch(list(rows[i : i + batch]))) for i in range(0, len(rows), batch)])


def length_sorted(embed: Embedder) -> Embedder:
    """Batch rows of similar length together (little padding), return them in the caller's order."""

    def run(rows: list[list[int]]) -> np.ndarray:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        ordered = embed([rows[i] for i in order])
        out = np.empty_like(ordered)
        out[order] = ordered
        return out

    return run


def torch_embedder(encoder: Encoder, batch: int = BATCH, pooled: bool = False) -> Embedder:
    """The encoder's vectors as the service returns them, or (`pooled`) before normalisation."""
    assert not encoder.training, "evaluation needs the encoder in eval mode (dropout off)"
    forward = encoder if pooled else encoder.embed

    def run(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return forward(torch.from_numpy(ids), torch.from_numpy(lengths)).numpy()

    return lambda rows: batched(rows, run, batch)


def spearman_x100(vectors: dict[str, np.ndarray], pairs: list[ScoredPair]) -> float:
    a = np.stack([vectors[p.first] for p in pairs])
    b = np.stack([vectors[p.second] for p in pairs])
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(spearmanr(cosine, [p.score for p in pairs]).statistic * 100)


@dataclass(frozen=True)
class DevSet:
    """STS-B dev, tokenized once, to score a model during training."""

    pairs: list[ScoredPair]
    texts: list[str]
    rows: list[list[int]]

    @classmethod
    def load(cls, data_dir: Path, tokenizer: Tokenizer) -> DevSet:
        pairs = read_sts(sts_path(data_dir, "dev"))
        texts = list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))
        return cls(pairs, texts, tokenizer.encode(texts).ids)

    def spearman(self, model: Encoder) -> float:
        """STS-B dev Spearman x100 of cos(u, v), with dropout off."""
        model.eval()
        vectors = length_sorted(torch_embedder(model))(self.rows)
        model.train()
        return spearman_x100(dict(zip(self.texts, vectors, strict=True)), self.pairs)
