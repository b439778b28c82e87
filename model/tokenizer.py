"""Tokenization with the `tokenizers` library from a checkpoint's tokenizer.json.

The packaged all-MiniLM-L6-v2 tokenizer.json pads every row to 128 and truncates at 128; counting
those pad ids as real tokens cost 12.6 points of STS-B Spearman. So padding is switched off here
(the batcher pads, and the mask comes from lengths) and truncation is set to the model's limit,
and a model repository's copy is written so (`save_unpadded`).
"""

from __future__ import annotations

import functools
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


# BERT's pre-tokenizer on normalised ASCII: runs of letters and digits are words, and every other
# printable character but the space is punctuation, a word of its own (Rust's is_ascii_punctuation).
_ASCII_WORD = re.compile(r"[a-z0-9]+|[^ a-z0-9]")

# Word-piece splits of words that are not whole vocabulary entries, kept per tokenizer (a front's
# memory: at most ~6 MB, the words being at most max_input_chars_per_word long).
SPLIT_WORDS_KEPT = 16_384

# Whitespace BERT's pre-tokenizer splits at, after its normaliser too (not str.isspace(): that also
# takes \x1c-\x1f and \x85, control characters the normaliser drops, joining their neighbours).
_WORD_ENDS = " \t\n\r"


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


def _whitespace_ends_words(tokenizer: HFTokenizer) -> bool:
    """True when an ASCII space, tab, newline or carriage return always ends a word: BERT's
    pre-tokenizer after no normaliser or BERT's (which keeps them, or makes them spaces), and no
    added token holding one."""
    config = json.loads(tokenizer.to_str())
    normalizer = config.get("normalizer")
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    return (
        (normalizer is None or normalizer.get("type") == "BertNormalizer")
        and (config.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
        and not any(c in _WORD_ENDS for content in added for c in content)
    )


def _is_bert_pipeline(tokenizer: HFTokenizer) -> bool:
    """True when, after the normaliser, the tokenizer is BERT's: its pre-tokenizer, WordPiece, and
    [CLS] text [SEP] for one sequence (so, for normalised ASCII, exactly _AsciiWordPiece)."""
    config = json.loads(tokenizer.to_str())
    single = (config.get("post_processor") or {}).get("single") or []
    return (
        (config.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
        and config["model"].get("type") == "WordPiece"
        and [next(iter(part)) for part in single] == ["SpecialToken", "Sequence", "SpecialToken"]
    )


class _AsciiWordPiece:
    """BERT's uncased pipeline for a plain ASCII text, in Python, word by word: a word that is a
    whole vocabulary entry is its id, any other is split by the library's own WordPiece model (and
    remembered). The library's batch call spends most of its time building per-token strings,
    offsets and Encoding objects a front throws away: this is ~5x less CPU per sentence, and the
    front's CPU per sentence is what bounds a served GPU (tests/test_tokenizer.py holds it to the
    library's ids)."""

    def __init__(self, library: HFTokenizer, max_length: int, frame: tuple[int, int]) -> None:
        assert max_length >= 2
        self._vocab = library.get_vocab(with_added_tokens=False)
        self._model = library.model
        self._longest_word = int(self._model.max_input_chars_per_word)
        self._unknown = (self._vocab[self._model.unk_token],)
        self._keep = max_length - 2  # tokens between [CLS] and [SEP]
        self._frame = frame
        self._split = functools.lru_cache(maxsize=SPLIT_WORDS_KEPT)(self._pieces)

    def _pieces(self, word: str) -> tuple[int, ...]:
        return tuple(token.id for token in self._model.tokenize(word))

    def encode(self, text: str) -> tuple[list[int], int]:
        """(the ids the model runs with, the text's whole count of tokens) for normalised ASCII."""
        ids: list[int] = []
        whole = self._vocab.get
        for word in _ASCII_WORD.findall(text):
            found = whole(word)
            if found is not None:
                ids.append(found)
            elif len(word) > self._longest_word:
                ids.extend(self._unknown)
            else:
                ids.extend(self._split(word))
        count = len(ids) + 2
        if len(ids) > self._keep:
            del ids[self._keep :]
        return [self._frame[0], *ids, self._frame[1]], count


@dataclass(frozen=True)
class Tokenized:
    """One row per input text. ``original_lengths[i] > lengths[i]`` exactly when truncated.

    ``lower_bound[i]``: the text was tokenized from a prefix only, so ``original_lengths[i]`` counts
    the tokens of the prefix's words that are whole in it, and the specials (the whole text has at
    least that many; the ids are exact).
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
        self._whitespace_ends_words = _whitespace_ends_words(self._full)  # for counting from a prefix
        # ... and, when the rest of the pipeline is BERT's too, skip the library for them.
        frame = self.frame
        self._words: _AsciiWordPiece | None = None
        if self._ascii is not None and frame is not None and _is_bert_pipeline(self._truncating):
            self._words = _AsciiWordPiece(self._truncating, max_length, frame)

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
            ids, original = self._encode_short(short)
            truncated = [count > len(row) for row, count in zip(ids, original, strict=True)]
        lower_bound = [False] * len(ids)
        if long:  # slotted back in place: one batch of prefixes, each tokenized once
            ends = [self._prefix_end(texts[i]) for i in long]
            prefixes = self._full.encode_batch([texts[i][:end] for i, end in zip(long, ends, strict=True)])
            for i, end, prefix in zip(long, ends, prefixes, strict=True):
                row, count, bound = self._from_prefix(texts[i], end, prefix)
                ids.insert(i, row)
                original.insert(i, count)
                lower_bound.insert(i, bound)
                truncated.insert(i, count > len(row))
        return Tokenized(ids, truncated, original, lower_bound)

    def _encode_short(self, texts: list[str]) -> tuple[list[list[int]], list[int]]:
        """Texts of at most PREFIX_CHARS: (ids truncated to the model's limit, whole token counts).
        Plain ASCII ones skip the library's normaliser, the others take the library's own path."""
        if self._ascii is None:
            return self._from_library(self._truncating, texts, texts)
        fast = [self._plain_ascii(text) for text in texts]
        if all(fast):
            return self._from_ascii(texts)
        plain = [i for i, ok in enumerate(fast) if ok]
        rest = [i for i, ok in enumerate(fast) if not ok]
        ids: list[list[int]] = [[] for _ in texts]
        counts = [0] * len(texts)
        others = [texts[i] for i in rest]
        parts = (
            (plain, self._from_ascii([texts[i] for i in plain])),
            (rest, self._from_library(self._truncating, others, others)),
        )
        for places, (rows, whole) in parts:
            for i, row, count in zip(places, rows, whole, strict=True):
                ids[i], counts[i] = row, count
        return ids, counts

    def _from_ascii(self, texts: list[str]) -> tuple[list[list[int]], list[int]]:
        cleaned = [_normalize_ascii(text) for text in texts]
        if self._words is None:
            assert self._ascii is not None
            return self._from_library(self._ascii, cleaned, texts)
        encoded = [self._words.encode(text) for text in cleaned]
        return [row for row, _ in encoded], [count for _, count in encoded]

    def _from_library(
        self, library: HFTokenizer, inputs: list[str], texts: list[str]
    ) -> tuple[list[list[int]], list[int]]:
        """One batch call, no offsets; the whole count of a cut text from the untruncated tokenizer."""
        if not inputs:
            return [], []
        encodings = library.encode_batch_fast(inputs)
        counts = [
            len(e.ids) if not e.overflowing else len(self.encode_full(text))
            for e, text in zip(encodings, texts, strict=True)
        ]
        return [e.ids for e in encodings], counts

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

    def python_path(self, text: str) -> bool:
        """Whether `text` is tokenized by this module's own WordPiece (plain ASCII, BERT's pipeline,
        up to PREFIX_CHARS), at ~0.08 us a character for known words, rather than by the library."""
        return self._words is not None and len(text) <= PREFIX_CHARS and self._plain_ascii(text)

    def _plain_ascii(self, text: str) -> bool:
        """ASCII (O(1) per text in CPython) and holding no special token's text."""
        return text.isascii() and (self._raw_specials is None or self._raw_specials.search(text) is None)

    def _last_word_ends(self, text: str, end: int) -> bool:
        """Whether the last word of text[:end] is whole there: whitespace ends the prefix or follows it."""
        return self._whitespace_ends_words and any(
            0 <= i < len(text) and text[i] in _WORD_ENDS for i in (end - 1, end)
        )

    def _from_prefix(self, text: str, end: int, prefix: Encoding) -> tuple[list[int], int, bool]:
        """(ids as if the whole text were tokenized and truncated, original tokens, lower bound?).

        `prefix` is text[:end] tokenized. Splitting into words depends only on the characters
        themselves (whitespace, punctuation, CJK), so every word that ends inside the prefix
        tokenizes as in the whole text; only the word the cut runs through may differ. When the
        words before it give the model's tokens, the prefix's ids are exact. Otherwise (e.g. one
        50,000-character "word", a single [UNK]), the whole text is tokenized: exact, and bounded
        by max_text_chars.

        From a prefix, the count is the specials' and those words' tokens, a lower bound; the cut
        word's count only when whitespace shows it whole. Its cut-off start can hold more tokens
        than the word: a word over 100 characters is one [UNK] in the whole text, its start up to
        ~100 word pieces ("hello " * 670 + "a" * 101 + " end" was counted 710, of 674 tokens), and
        "international" is one token, "internation" two.
        """
        words = prefix.word_ids
        cut_word = next((w for w in reversed(words) if w is not None), None)
        whole = [token for token, w in zip(prefix.ids, words, strict=True) if w is not None and w != cut_word]
        keep = self.max_length - 2  # [CLS] ... [SEP]
        if len(whole) >= keep:
            count = len(prefix.ids)  # the specials, the words before the last, the last word
            if not self._last_word_ends(text, end):
                count -= sum(1 for w in words if w == cut_word)
            return [prefix.ids[0], *whole[:keep], prefix.ids[-1]], count, True
        full = self._whole(text).ids
        if len(full) <= self.max_length:  # a long text of few tokens (a URL, a blob, spaces): not cut
            return list(full), len(full), False
        return [*full[: self.max_length - 1], full[-1]], len(full), False


def save_unpadded(source: Path, out: Path, max_length: int) -> None:
    """The tokenizer.json at `source`, written to `out` as the server tokenizes: no padding, cut at
    `max_length`. A caller who makes token ids with a repository's file then gets the server's own
    (the packaged file's ids, padded with 0s to 128, were refused; cut at 128, silently embedded short:
    cosine 0.983 against the text)."""
    tokenizer = HFTokenizer.from_file(str(source))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    tokenizer.save(str(out))


def pad_batch(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows -> ((B, T) int64 ids padded to the longest row, (B,) int64 lengths)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.full((len(rows), int(lengths.max(initial=1))), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths
