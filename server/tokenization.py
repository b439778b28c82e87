"""Request inputs -> validated token-id rows, with what each input cost (its usage).

Texts are tokenized with the model's own tokenizer.json (the `tokenizers` library); token-id inputs
are checked against the vocabulary. Every refusal names the input, the limit and the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.tokenizer import Tokenizer
from server.errors import InvalidInput


@dataclass(frozen=True)
class Usage:
    tokens: int
    truncated: bool
    original_tokens: int


@dataclass(frozen=True)
class Prepared:
    rows: list[list[int]]
    usage: list[Usage]


@dataclass(frozen=True)
class InputLimits:
    max_inputs_per_request: int
    max_input_tokens: int
    max_text_chars: int


class RequestTokenizer:
    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        assert tokenizer.max_length == limits.max_input_tokens
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = tokenizer.vocab_size

    def check_count(self, count: int) -> None:
        if count == 0:
            raise InvalidInput("no inputs: set `texts` or `token_ids` with at least one input")
        if count > self.limits.max_inputs_per_request:
            raise InvalidInput(
                f"{count} inputs in one request, over the limit max_inputs_per_request="
                f"{self.limits.max_inputs_per_request}; split the request"
            )

    def from_texts(self, texts: Sequence[str], truncate: bool) -> Prepared:
        self.check_count(len(texts))
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"input {i} is an empty string")
            if len(text) > self.limits.max_text_chars:
                raise InvalidInput(
                    f"input {i} has {len(text)} characters, over the limit max_text_chars="
                    f"{self.limits.max_text_chars}"
                )
        encoded = self.tokenizer.encode(list(texts))
        usage = [
            Usage(len(row), cut, original)
            for row, cut, original in zip(
                encoded.ids, encoded.truncated, encoded.original_lengths, strict=True
            )
        ]
        if not truncate:
            self._refuse_long(usage)
        return Prepared(encoded.ids, usage)

    def from_ids(self, sequences: Sequence[Sequence[int]], truncate: bool) -> Prepared:
        self.check_count(len(sequences))
        rows, usage = [], []
        limit = self.limits.max_input_tokens
        for i, ids in enumerate(sequences):
            if not ids:
                raise InvalidInput(f"input {i} is an empty token-id sequence")
            bad = next((j for j, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidInput(
                    f"input {i}: token id {ids[bad]} at position {bad} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
            rows.append(list(ids[:limit]))
            usage.append(Usage(min(len(ids), limit), len(ids) > limit, len(ids)))
        if not truncate:
            self._refuse_long(usage)
        return Prepared(rows, usage)

    def _refuse_long(self, usage: list[Usage]) -> None:
        for i, u in enumerate(usage):
            if u.truncated:
                raise InvalidInput(
                    f"input {i} has {u.original_tokens} tokens, over the limit max_input_tokens="
                    f"{self.limits.max_input_tokens}; send truncate=true to cut it"
                )
