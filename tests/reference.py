"""Vectors computed in the test process, to hold a server's answers to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minilm_embed.export.optimize import cpu_session
from minilm_embed.model.tokenizer import Tokenizer, pad_batch

MAX_TOKENS = 256


class Reference:
    """The same model file in this process: ONNX Runtime on the CPU, one text at a time."""

    def __init__(self, model_dir: Path) -> None:
        self.session = cpu_session(model_dir / "model.onnx")
        self.tokenizer = Tokenizer(model_dir / "tokenizer.json", MAX_TOKENS)
        self._cache: dict[tuple[str, bool], np.ndarray] = {}

    def embed(self, texts: Sequence[str], normalize: bool = True) -> np.ndarray:
        return np.stack([self._one(t, normalize) for t in texts])

    def _one(self, text: str, normalize: bool) -> np.ndarray:
        if (text, normalize) not in self._cache:
            ids, lengths = pad_batch(self.tokenizer.encode([text]).ids)
            normalised, pooled = self.session.run(None, {"input_ids": ids, "lengths": lengths})
            self._cache[text, normalize] = (normalised if normalize else pooled)[0]
        return self._cache[text, normalize]
