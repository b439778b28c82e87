"""Vectors computed in the test process, to hold a server's answers to.

Tokenized by the `tokenizers` library itself (what sentence-transformers calls), not by the product's
Tokenizer and its shortcuts (the ASCII path, the long-text prefix): a bug there must show up as a
server answer that differs from this, not on both sides of the comparison."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as LibraryTokenizer

from minilm_embed.export.optimize import cpu_session
from minilm_embed.model.tokenizer import pad_batch

MAX_TOKENS = 256


def library_tokenizer(model_dir: Path) -> LibraryTokenizer:
    """The model's tokenizer.json as the library reads it, cut at MAX_TOKENS as sentence-transformers cuts."""
    tokenizer = LibraryTokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(MAX_TOKENS)
    return tokenizer


class Reference:
    """The same model file in this process: ONNX Runtime on the CPU, one text at a time."""

    def __init__(self, model_dir: Path) -> None:
        self.session = cpu_session(model_dir / "model.onnx")
        self.tokenizer = library_tokenizer(model_dir)
        self._cache: dict[tuple[str, bool], np.ndarray] = {}

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids as the library gives them, cut at MAX_TOKENS."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def whole_ids(self, text: str) -> list[int]:
        """All of a text's ids, uncut."""
        whole = LibraryTokenizer.from_str(self.tokenizer.to_str())
        whole.no_truncation()
        return whole.encode(text).ids

    def embed(self, texts: Sequence[str], normalize: bool = True) -> np.ndarray:
        return np.stack([self._one(t, normalize) for t in texts])

    def _one(self, text: str, normalize: bool) -> np.ndarray:
        if (text, normalize) not in self._cache:
            ids, lengths = pad_batch([self.tokenizer.encode(text).ids])
            normalised, pooled = self.session.run(None, {"input_ids": ids, "lengths": lengths})
            self._cache[text, normalize] = (normalised if normalize else pooled)[0]
        return self._cache[text, normalize]
