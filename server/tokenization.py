"""Request inputs -> validated token-id arrays, with what each input cost (its usage).

Texts are tokenized with the model's own tokenizer.json (the `tokenizers` library); token-id inputs
are checked against the vocabulary. Every refusal names the input, the limit and the value. The
result is arrays (lengths, ids one after another), what the engine takes: no per-input objects.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minilm_embed.model.tokenizer import PREFIX_CHARS, Tokenizer
from minilm_embed.server.errors import InvalidInput

# One input's token ids: a list or protobuf's repeated field, or an int64 array (HTTP's, checked).
TokenRow = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Prepared:
    lengths: np.ndarray  # (n,) int32 tokens each input runs with
    ids: np.ndarray  # (sum(lengths),) int32
    truncated: np.ndarray  # (n,) bool
    original: np.ndarray  # (n,) int64 tokens before truncation
    lower_bound: np.ndarray  # (n,) bool: `original` counts a prefix's tokens only

    def __len__(self) -> int:
        return int(self.lengths.size)

    def rows(self) -> list[np.ndarray]:
        """Each input's ids (views into `ids`), in order."""
        return np.split(self.ids, np.cumsum(self.lengths)[:-1])


@dataclass(frozen=True)
class InputLimits:
    max_inputs_per_request: int
    max_input_tokens: int
    max_text_chars: int


def _flatten(rows: Sequence[Sequence[int]], lengths: np.ndarray) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))


class RequestTokenizer:
    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        assert tokenizer.max_length == limits.max_input_tokens
        self.tokenizer = tokenizer
        self.limits = limits
        self.python_path = tokenizer.python_path
        self.vocab_size = tokenizer.vocab_size
        self.frame = tokenizer.frame
        self.frame_text = ""
        if self.frame is not None:
            (start, end), token = self.frame, tokenizer.token
            self.frame_text = f"{token(start)} ({start}) and end with {token(end)} ({end})"

    def check_count(
        self,
        count: int,
        wanted: str = "`texts` or `token_ids` with at least one input",
        field: str = "texts",
    ) -> None:
        """`wanted`: what an empty request is told to set (Tokenize has no `token_ids`); `field`: the
        request field holding the inputs."""
        if count == 0:
            raise InvalidInput(f"no inputs: set {wanted}", "NO_INPUTS", field)
        if count > (limit := self.limits.max_inputs_per_request):
            raise InvalidInput(
                f"{count} inputs in one request, over the limit max_inputs_per_request={limit}; "
                "split the request",
                "TOO_MANY_INPUTS",
                field,
                setting="max_inputs_per_request",
                limit=limit,
                value=count,
            )

    def check_texts(self, texts: Sequence[str]) -> None:
        """Refusals that cost no tokenizing (call before from_texts): an empty text, a text over
        max_text_chars."""
        self.check_count(len(texts))
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"input {i} is an empty string", "EMPTY_INPUT", f"texts[{i}]", input=i)
            if len(text) > (limit := self.limits.max_text_chars):
                raise InvalidInput(
                    f"input {i} has {len(text)} characters, over the limit max_text_chars={limit}",
                    "TEXT_TOO_LONG",
                    f"texts[{i}]",
                    input=i,
                    setting="max_text_chars",
                    limit=limit,
                    value=len(text),
                )

    def from_texts(self, texts: Sequence[str], truncate: bool) -> Prepared:
        encoded = self.tokenizer.encode(list(texts))
        lengths = np.fromiter(map(len, encoded.ids), dtype=np.int32, count=len(texts))
        prepared = Prepared(
            lengths,
            _flatten(encoded.ids, lengths),
            np.array(encoded.truncated, dtype=bool),
            np.array(encoded.original_lengths, dtype=np.int64),
            np.array(encoded.lower_bound, dtype=bool),
        )
        if not truncate:
            self._refuse_long(prepared, "texts[{}]")
        return prepared

    def from_texts_whole(self, texts: Sequence[str], truncate: bool = False) -> Prepared:
        """Tokenize's truncate=false: every id of every text, however long (never for the model)."""
        rows = [self.tokenizer.encode_full(t) for t in texts]
        lengths = np.fromiter(map(len, rows), dtype=np.int32, count=len(rows))
        exact = np.zeros(len(rows), dtype=bool)
        return Prepared(lengths, _flatten(rows, lengths), exact, lengths.astype(np.int64), exact)

    def from_ids(self, sequences: Sequence[TokenRow], truncate: bool) -> Prepared:
        self.check_count(len(sequences), field="token_ids")
        prepared = self._ids_checked_at_once(sequences) or self._ids_checked_row_by_row(sequences)
        if not truncate:
            self._refuse_long(prepared, "token_ids[{}].ids")
        return prepared

    def _ids_checked_at_once(self, sequences: Sequence[TokenRow]) -> Prepared | None:
        """Every row's ids in one array, checked and cut with a few array operations whatever the rows
        (row by row, 32 rows of 32 ids took 0.4-0.6 ms of the event loop); None when any row breaks
        a rule, which the row-by-row check then names."""
        limit = self.limits.max_input_tokens
        original = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        if not original.all():
            return None
        ids = np.concatenate([np.asarray(row, dtype=np.int64) for row in sequences])
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            return None
        ends = np.cumsum(original)
        starts = ends - original
        if self.frame is not None and not (
            (ids[starts] == self.frame[0]).all() and (ids[ends - 1] == self.frame[1]).all()
        ):
            return None
        truncated = original > limit
        if truncated.any():  # as _cut cuts: the first limit - 1 ids and the last, or the first limit
            position = np.arange(ids.size) - np.repeat(starts, original)
            keep = position < (limit - 1 if self.frame is not None else limit)
            if self.frame is not None:
                keep |= position == np.repeat(original - 1, original)
            ids = ids[keep]
        lengths = np.minimum(original, limit).astype(np.int32)
        exact = np.zeros(len(sequences), dtype=bool)
        return Prepared(lengths, ids.astype(np.int32), truncated, original, exact)

    def _ids_checked_row_by_row(self, sequences: Sequence[TokenRow]) -> Prepared:
        limit = self.limits.max_input_tokens
        rows = []
        for i, ids in enumerate(sequences):
            if not len(ids):
                raise InvalidInput(
                    f"input {i} is an empty token-id sequence", "EMPTY_INPUT", f"token_ids[{i}].ids", input=i
                )
            row = np.asarray(ids, dtype=np.int64)
            # The frame first: another tokenizer's ids (tiktoken's run to 100,256) are named as
            # such even where one of them is also outside this vocabulary.
            self._check_frame(row, i)
            bad = np.flatnonzero((row < 0) | (row >= self.vocab_size))
            if bad.size:
                j = int(bad[0])
                raise InvalidInput(
                    f"input {i}: token id {ids[j]} at position {j} is outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    "TOKEN_ID_OUT_OF_RANGE",
                    f"token_ids[{i}].ids[{j}]",
                    input=i,
                    position=j,
                    value=ids[j],
                    vocabularySize=self.vocab_size,
                )
            rows.append(self._cut(row, limit))
        original = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        lengths = np.minimum(original, limit).astype(np.int32)
        exact = np.zeros(len(sequences), dtype=bool)
        return Prepared(lengths, np.concatenate(rows).astype(np.int32), original > limit, original, exact)

    def _check_frame(self, row: np.ndarray, i: int) -> None:
        """Ids are taken as Tokenize gives them, [CLS] ... [SEP]. Ids without that frame are another
        tokenizer's (LangChain's OpenAIEmbeddings sends tiktoken's by default) or a text's without
        its specials, and would be embedded as valid ids of this vocabulary: silently wrong vectors
        (cosine 0.13 against the text for tiktoken's "hello world", 0.53 for the text's own ids
        without [CLS] and [SEP])."""
        if self.frame is None or (row[0], row[-1]) == self.frame:
            return
        end = self.frame[1]
        padded = (
            f" Ids after {self.tokenizer.token(end)} are taken for padding: send each input's ids "
            "unpadded (the library's tokenizer.no_padding())."
            if row[0] == self.frame[0] and end in row[1:-1]
            else ""
        )
        raise InvalidInput(
            f"input {i}: token ids must start with {self.frame_text}, as the model's tokenizer makes "
            f"them (gRPC's Tokenize returns them); these start with {row[0]} and end with "
            f"{row[-1]}.{padded} Ids of another tokenizer give wrong vectors: send texts (for "
            "LangChain's OpenAIEmbeddings, check_embedding_ctx_length=False)",
            "TOKEN_IDS_NOT_FRAMED",
            f"token_ids[{i}].ids",
            input=i,
            firstId=row[0],
            lastId=row[-1],
            expectedFirstId=self.frame[0],
            expectedLastId=self.frame[1],
        )

    def _cut(self, row: np.ndarray, limit: int) -> np.ndarray:
        """The first `limit` - 1 ids and the last ([SEP]), as a text cut by the tokenizer is cut."""
        if row.size <= limit or self.frame is None:
            return row[:limit]
        return np.concatenate([row[: limit - 1], row[-1:]])

    def _refuse_long(self, prepared: Prepared, field: str) -> None:
        """`field`: the inputs' field path, `{}` for the index."""
        for i in np.flatnonzero(prepared.truncated)[:1]:
            at_least = "at least " if prepared.lower_bound[i] else ""
            raise InvalidInput(
                f"input {i} has {at_least}{prepared.original[i]} tokens, over the limit max_input_tokens="
                f"{self.limits.max_input_tokens}; send truncate=true to cut it",
                "TOO_MANY_TOKENS",
                field.format(i),
                input=i,
                setting="max_input_tokens",
                limit=self.limits.max_input_tokens,
                value=prepared.original[i],
                valueIsLowerBound=str(bool(prepared.lower_bound[i])).lower(),
            )


def inputs_field(texts: Sequence[object], token_ids: Sequence[object]) -> str:
    """The request field whose inputs are counted (`texts` unless only `token_ids` is set)."""
    return "texts" if texts or not token_ids else "token_ids"


def tokenizing_cost(texts: Sequence[str], whole: bool = False) -> int:
    """Characters the tokenizer reads for these texts: a long text's prefix, unless `whole`."""
    return sum(len(t) if whole else min(len(t), PREFIX_CHARS) for t in texts)
