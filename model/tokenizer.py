"""Tokenization with the `tokenizers` library from a checkpoint's tokenizer.json.

The packaged all-MiniLM-L6-v2 tokenizer.json pads every row to 128 and truncates at 128; counting
those pad ids as real tokens cost 12.6 points of STS-B Spearman. So padding is switched off here
(the batcher pads, and the mask comes from lengths) and truncation is set to the model's limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

# A text longer than this is tokenized from its prefix when that provably gives the same ids: the
# tokenizer's work and memory grow with the text (100 kB took ~0.1 s and ~2.5 MB), the model keeps
# 256 tokens (~1,200 characters of English).
PREFIX_CHARS = 4096


# What BERT's uncased normaliser (clean text, then lowercase and strip accents) does to an ASCII text:
# control characters are dropped, except tab, newline and carriage return, which become spaces, and
# letters are lowercased (ASCII has nothing to decompose, no accents to strip, no CJK to space out).
# Done here with str methods it skips the normaliser's per-character Unicode work and alignment
# bookkeeping, ~40% of tokenizing (tests/test_tokenizer.py holds it to the library's normaliser).
_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ASCII_CLEAN = {c: None for c in (*range(0x20), 0x7F)} | {ord("\t"): " ", ord("\n"): " ", ord("\r"): " "}


def _normalize_ascii(text: str) -> str:
    lowered = text.lower()
    return lowered.translate(_ASCII_CLEAN) if _ASCII_CONTROL.search(lowered) else lowered


def _is_bert_uncased(tokenizer: HFTokenizer) -> bool:
    """True when the tokenizer's normaliser is BERT's, cleaning and lowercasing (so, for ASCII text,
    exactly _normalize_ascii)."""
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    return (
        normalizer.get("type") == "BertNormalizer"
        and normalizer.get("clean_text") is True
        and normalizer.get("lowercase") is True
        and normalizer.get("strip_accents") in (None, True)
    )


@dataclass(frozen=True)
class Tokenized:
    """One row per input text. ``original_lengths[i] > lengths[i]`` exactly when truncated.

    ``lower_bound[i]``: the text was tokenized from a prefix only, so ``original_lengths[i]`` counts
    the prefix's tokens (at least that many; the ids are exact).
    """

    ids: list[list[int]]
    truncated: list[bool]
    original_lengths: list[int]
    lower_bound: list[bool]

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.ids]


class Tokenizer:
    def __init__(self, path: Path, max_length: int) -> None:
        self.max_length = max_length
        self._truncating = HFTokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_length)
        # ASCII texts skip the normaliser (done by _normalize_ascii instead) when it is BERT's uncased one.
        self._ascii: HFTokenizer | None = None
        if _is_bert_uncased(self._truncating):
            self._ascii = HFTokenizer.from_file(str(path))
            self._ascii.normalizer = None
            self._ascii.no_padding()
            self._ascii.enable_truncation(max_length)
        # Special tokens the library finds in the raw text, before its normaliser (BERT's "[SEP]",
        # "[MASK]", ...: a user's text may hold them). Lowercasing first would hide them, so a text
        # holding one takes the library's own path.
        raw = [t.content for t in self._truncating.get_added_tokens_decoder().values() if not t.normalized]
        self._raw_specials = re.compile("|".join(map(re.escape, raw))) if raw else None
        self._longest_special = max(map(len, raw), default=0)
        # Only asked for the full length of inputs that were cut, to report it.
        self._full = HFTokenizer.from_file(str(path))
        self._full.no_padding()
        self._full.no_truncation()

    @property
    def frame(self) -> tuple[int, int] | None:
        """The special tokens the tokenizer starts and ends every sequence with ([CLS], [SEP] for
        BERT), or None for a tokenizer that adds no such pair."""
        ids = self._full.encode("").ids  # the specials alone: [CLS] [SEP]
        return (int(ids[0]), int(ids[-1])) if len(ids) == 2 else None

    def token(self, token_id: int) -> str:
        return self._full.id_to_token(token_id) or str(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._truncating.get_vocab_size(with_added_tokens=True))

    def encode_full(self, text: str) -> list[int]:
        """All of a text's ids, however long (for reporting, never for the model)."""
        return list(self._whole(text).ids)

    def _whole(self, text: str) -> Encoding:
        # The batch call: it releases the GIL while it works, a single encode() does not.
        return self._full.encode_batch([text])[0]

    def encode(self, texts: list[str]) -> Tokenized:
        long = [i for i, text in enumerate(texts) if len(text) > PREFIX_CHARS]
        if len(long) == len(texts):  # e.g. a flood of 100 kB texts: no empty batch call
            ids: list[list[int]] = []
            truncated: list[bool] = []
            original: list[int] = []
        else:
            short = [text for text in texts if len(text) <= PREFIX_CHARS] if long else texts
            encodings = self._encode_short(short)
            ids = [e.ids for e in encodings]
            truncated = [bool(e.overflowing) for e in encodings]
            original = [
                len(row) if not cut else len(self.encode_full(text))
                for row, cut, text in zip(ids, truncated, short, strict=True)
            ]
        lower_bound = [False] * len(ids)
        if long:  # slotted back in place: one batch of prefixes, each tokenized once
            prefixes = self._full.encode_batch([texts[i][: self._prefix_end(texts[i])] for i in long])
            for i, prefix in zip(long, prefixes, strict=True):
                row, count, bound = self._from_prefix(texts[i], prefix)
                ids.insert(i, row)
                original.insert(i, count)
                lower_bound.insert(i, bound)
                truncated.insert(i, count > len(row))
        return Tokenized(ids, truncated, original, lower_bound)

    def _encode_short(self, texts: list[str]) -> list[Encoding]:
        """Texts of at most PREFIX_CHARS, truncated to the model's limit, no offsets; ASCII ones
        without the library's normaliser, in one batch call, the others in another."""
        if self._ascii is None:
            return self._truncating.encode_batch_fast(texts)
        fast = [self._plain_ascii(text) for text in texts]
        if all(fast):
            return self._ascii.encode_batch_fast([_normalize_ascii(t) for t in texts])
        plain = [i for i, ok in enumerate(fast) if ok]
        rest = [i for i, ok in enumerate(fast) if not ok]
        cleaned = self._ascii.encode_batch_fast([_normalize_ascii(texts[i]) for i in plain])
        done = dict(zip(plain, cleaned, strict=True))
        done.update(zip(rest, self._truncating.encode_batch_fast([texts[i] for i in rest]), strict=True))
        return [done[i] for i in range(len(texts))]

    def _prefix_end(self, text: str) -> int:
        """PREFIX_CHARS, or where a special token's text that runs across it begins: cut inside,
        "[SEP]" would read as "[" and "se", and "[" stays in the ids (the cut drops only the last word)."""
        if self._raw_specials is not None:
            reach = self._longest_special
            for match in self._raw_specials.finditer(
                text, max(0, PREFIX_CHARS - reach), PREFIX_CHARS + reach
            ):
                if match.start() < PREFIX_CHARS < match.end():
                    return match.start()
        return PREFIX_CHARS

    def _plain_ascii(self, text: str) -> bool:
        """ASCII (O(1) per text in CPython) and holding no special token's text."""
        return text.isascii() and (self._raw_specials is None or self._raw_specials.search(text) is None)

    def _from_prefix(self, text: str, prefix: Encoding) -> tuple[list[int], int, bool]:
        """(ids as if the whole text were tokenized and truncated, original tokens, lower bound?).

        Splitting into words depends only on the characters themselves (whitespace, punctuation,
        CJK), so every word that ends inside the prefix tokenizes as in the whole text; only the
        word the cut runs through may differ. When the words before it give the model's tokens, the
        prefix's ids are exact. Otherwise (e.g. one 50,000-character "word", a single [UNK]), the
        whole text is tokenized: exact, and bounded by max_text_chars.
        """
        words = prefix.word_ids
        cut_word = next((w for w in reversed(words) if w is not None), None)
        whole = [token for token, w in zip(prefix.ids, words, strict=True) if w is not None and w != cut_word]
        keep = self.max_length - 2  # [CLS] ... [SEP]
        if len(whole) >= keep:
            return [prefix.ids[0], *whole[:keep], prefix.ids[-1]], len(prefix.ids), True
        full = self._whole(text).ids
        if len(full) <= self.max_length:  # a long text of few tokens (a URL, a blob, spaces): not cut
            return list(full), len(full), False
        return [*full[: self.max_length - 1], full[-1]], len(full), False


def pad_batch(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows -> ((B, T) int64 ids padded to the longest row, (B,) int64 lengths)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.full((len(rows), int(lengths.max(initial=1))), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths
