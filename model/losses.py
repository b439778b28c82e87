"""The training losses, each on one batch of one kind of pair.

- pairs: contrastive loss with in-batch negatives (cross-entropy over the scaled cosine-similarity
  matrix; the positive is on the diagonal);
- scored pairs: MSE between cos(u, v) and score / 5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from minilm_embed.model.encoder import Encoder
from minilm_embed.model.pairs import Batch
from minilm_embed.model.tokenizer import pad_batch

CONTRASTIVE_SCALE = 20.0  # cosine similarities in [-1, 1] are too flat a softmax without it


def encode_pairs(model: Encoder, batch: Batch) -> tuple[Tensor, Tensor]:
    """Both sides in one forward pass: (B, C) and (B, C), L2-normalised."""
    ids, lengths = pad_batch(batch.first + batch.second)
    pooled = model(torch.from_numpy(ids), torch.from_numpy(lengths))  # (2B, C)
    u, v = F.normalize(pooled, dim=-1).split(len(batch.first))
    return u, v


def contrastive_loss(u: Tensor, v: Tensor) -> Tensor:
    """Multiple negatives ranking: row i's positive is v[i], every other v[j] is a negative."""
    logits = CONTRASTIVE_SCALE * u @ v.T  # (B, B)
    return F.cross_entropy(logits, torch.arange(len(u)))


def cosine_loss(u: Tensor, v: Tensor, scores: list[float]) -> Tensor:
    """Cosine regression: each pair's cos(u, v) against its score scaled to 0-1."""
    return F.mse_loss((u * v).sum(-1), torch.tensor(scores))


def batch_loss(model: Encoder, batch: Batch) -> Tensor:
    """The loss for the batch's kind: contrastive for pairs, cosine regression for scored pairs."""
    u, v = encode_pairs(model, batch)
    return contrastive_loss(u, v) if batch.scores is None else cosine_loss(u, v, batch.scores)
