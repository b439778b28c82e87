"""Tokenization with the `tokenizers` library from a checkpoint's tokenizer.json.

The packaged all-MiniLM-L6-v2 tokenizer.json pads every row to 128 and truncates at 128; counting
those pad ids as real tokens cost 12.6 points of STS-B Spearman. So padding is switched off here
(the batcher pads, and the mask comes from lengths) and truncation is set to the model's limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class Tokenized:
    """One row per input text. ``original_lengths[i] > lengths[i]`` exactly when truncated."""

    ids: list[list[int]]
    truncated: list[bool]
    original_lengths: list[int]

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.ids]


class Tokenizer:
    def __init__(self, path: Path, max_length: int) -> None:
        self.max_length = max_length
        self._truncating = HFTokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_length)
        # Only asked for the full length of inputs that were cut, to report it.
        self._full = HFTokenizer.from_file(str(path))
        self._full.no_padding()
        self._full.no_truncation()

    @property
    def vocab_size(self) -> int:
        return int(self._truncating.get_vocab_size(with_added_tokens=True))

    def encode_full(self, text: str) -> list[int]:
        """All of a text's ids, however long (for reporting, never for the model)."""
        return list(self._full.encode(text).ids)

    def encode(self, texts: list[str]) -> Tokenized:
        encodings = self._truncating.encode_batch(texts)
        ids = [e.ids for e in encodings]
        truncated = [bool(e.overflowing) for e in encodings]
        original = [
            len(self.encode_full(text)) if cut else len(row)
            for text, row, cut in zip(texts, ids, truncated, strict=True)
        ]
        return Tokenized(ids=ids, truncated=truncated, original_lengths=original)


def pad_batch(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows -> ((B, T) int64 ids padded to the longest row, (B,) int64 lengths)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.full((len(rows), int(lengths.max(initial=1))), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths
