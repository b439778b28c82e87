"""Training data: sentence pairs read, checked line by line, tokenized once, and cut into batches.

Two kinds, each batch drawn from one kind:
- pairs (JSONL ``{"anchor": ..., "positive": ...}``), for the contrastive loss;
- scored pairs (STS-B rows, score 0-5), for cosine regression.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from minilm_embed.model.data import DataError, ScoredPair, read_sts, sts_path, utf8_lines
from minilm_embed.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Batch:
    """Token-id rows of both sides of each pair; ``scores`` (0-1) only for scored pairs."""

    first: list[list[int]]
    second: list[list[int]]
    scores: list[float] | None


@dataclass(frozen=True)
class TrainingData:
    """Both kinds of pairs, tokenized once."""

    pairs: list[tuple[list[int], list[int]]]
    scored: list[tuple[list[int], list[int], float]]

    def batches(self, size: int, seed: int, epoch: int) -> list[Batch]:
        """One epoch: each kind shuffled and cut into batches, then the batches shuffled together."""
        rng = random.Random(seed * 100_003 + epoch)
        pairs, scored = rng.sample(self.pairs, len(self.pairs)), rng.sample(self.scored, len(self.scored))
        out = [Batch([a for a, _ in c], [b for _, b in c], None) for c in _chunks(pairs, size)]
        out += [
            Batch([a for a, _, _ in c], [b for _, b, _ in c], [s for *_, s in c])
            for c in _chunks(scored, size)
        ]
        rng.shuffle(out)
        return out


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _pair(path: Path, number: int, line: str) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: expected a JSON object with 'anchor' and 'positive'")
    for key in ("anchor", "positive"):
        if key not in row:
            raise DataError(f"{path}:{number}: missing field {key!r}")
        if not isinstance(row[key], str) or not row[key].strip():
            raise DataError(f"{path}:{number}: field {key!r} must be a non-empty string")
    return row["anchor"], row["positive"]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """JSONL anchor/positive pairs; blank lines are skipped, anything else malformed is a DataError."""
    pairs = [_pair(path, n, line) for n, line in utf8_lines(path) if line.strip()]
    if not pairs:
        raise DataError(f"{path}: no pairs (the file is empty)")
    return pairs


def read_scored(path: Path) -> list[ScoredPair]:
    """STS-B-format rows with their 0-5 scores checked."""
    pairs = read_sts(path)  # one pair per line: any other line is an error there
    for number, pair in enumerate(pairs, start=1):
        if not 0.0 <= pair.score <= 5.0:
            raise DataError(f"{path}:{number}: score {pair.score} is outside 0-5")
    return pairs


def read_training_data(
    pairs: Path | None, sts_train: Path | None, data_dir: Path | None
) -> tuple[list[tuple[str, str]], list[ScoredPair]]:
    """The pairs and scored pairs asked for; STS-B train from `data_dir` when nothing else is given."""
    if sts_train is None and pairs is None and data_dir is not None:
        sts_train = sts_path(data_dir, "train")
    if sts_train is None and pairs is None:
        raise DataError("no training data: give --pairs FILE.jsonl, --sts-train FILE or --data-dir DIR")
    return read_pairs(pairs) if pairs else [], read_scored(sts_train) if sts_train else []


def tokenize(tokenizer: Tokenizer, pairs: list[tuple[str, str]], scored: list[ScoredPair]) -> TrainingData:
    """Both kinds tokenized once; scores scaled to 0-1, the range of a cosine the loss compares them with."""
    a = tokenizer.encode([p[0] for p in pairs]).ids if pairs else []
    b = tokenizer.encode([p[1] for p in pairs]).ids if pairs else []
    sa = tokenizer.encode([p.first for p in scored]).ids if scored else []
    sb = tokenizer.encode([p.second for p in scored]).ids if scored else []
    scores = [p.score / 5.0 for p in scored]
    return TrainingData(list(zip(a, b, strict=True)), list(zip(sa, sb, scores, strict=True)))
