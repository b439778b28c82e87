"""Tokenization: no padding, truncation reported with the original length, any text tokenizes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from minilm_embed.model.data import read_sts, sts_path
from minilm_embed.model.tokenizer import PREFIX_CHARS, Tokenizer, pad_batch

CLS, SEP, UNK = 101, 102, 100


def test_rows_are_not_padded(tokenizer):
    out = tokenizer.encode(["a", "A man is playing a guitar.", "ok then"])
    assert out.lengths == [3, 9, 4]
    for row in out.ids:
        assert row[0] == CLS and row[-1] == SEP
        assert 0 not in row  # no [PAD]: the packaged tokenizer.json pads to 128 unless told not to
    assert out.truncated == [False, False, False]
    assert out.original_lengths == out.lengths


def test_truncation_at_max_length_reports_the_original_length(tokenizer):
    out = tokenizer.encode(["word " * 400, "word " * 254, "word " * 255])
    assert out.lengths == [256, 256, 256]
    assert out.truncated == [True, False, True]
    assert out.original_lengths == [402, 256, 257]
    assert out.ids[0][0] == CLS and out.ids[0][-1] == SEP  # cut inside the text, not the specials


def test_truncation_follows_the_given_max_length(encoder_and_checkpoint):
    _, checkpoint = encoder_and_checkpoint
    short = Tokenizer(checkpoint.directory / "tokenizer.json", max_length=8)
    out = short.encode(["one two three four five six seven eight nine", "one two"])
    assert out.lengths == [8, 4]
    assert out.truncated == [True, False]
    assert out.original_lengths == [11, 4]


def test_empty_string_is_cls_and_sep(tokenizer):
    out = tokenizer.encode([""])
    assert out.ids == [[CLS, SEP]]
    assert out.truncated == [False]


@pytest.mark.parametrize(
    ("text", "inner"),
    [
        ("hello 😀", 2),  # the emoji is [UNK]
        ("中文字", 3),  # one token per CJK character
        ("a\x00b", 1),  # NUL is dropped by BERT's text cleaning
        ("\x00", 0),
        ("\x07\x1b\t\n\r", 0),  # control characters and whitespace only
        ("café naïve", 2),  # accents stripped by the uncased normaliser
        ("\u200b\ufeff", 0),  # zero-width space and byte-order mark
    ],
)
def test_any_unicode_text_tokenizes(tokenizer, encoder_and_checkpoint, text, inner):
    out = tokenizer.encode([text])
    row = out.ids[0]
    assert row[0] == CLS and row[-1] == SEP
    assert len(row) == inner + 2
    assert all(0 <= i < tokenizer.vocab_size for i in row)
    library = library_tokenizer(encoder_and_checkpoint[1].directory / "tokenizer.json")
    assert row == library.encode(text).ids  # the counts above are the library's, not ours alone


def test_emoji_becomes_unknown_token(tokenizer):
    assert tokenizer.encode(["😀"]).ids == [[CLS, UNK, SEP]]


def test_batch_and_one_by_one_agree(tokenizer):
    texts = ["A man is playing a guitar.", "", "中文字 😀", "word " * 300]
    together = tokenizer.encode(texts)
    alone = [tokenizer.encode([t]) for t in texts]
    assert together.ids == [a.ids[0] for a in alone]
    assert together.original_lengths == [a.original_lengths[0] for a in alone]


def test_vocab_size_is_bert_uncased(tokenizer):
    assert tokenizer.vocab_size == 30522


def test_pad_batch_pads_to_longest_row():
    ids, lengths = pad_batch([[5, 6, 7], [8], [9, 10]])
    assert ids.dtype == np.int64 and lengths.dtype == np.int64
    assert ids.shape == (3, 3)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    np.testing.assert_array_equal(lengths, [3, 1, 2])


def test_pad_batch_uses_the_given_pad_id():
    ids, lengths = pad_batch([[1], [2, 3, 4, 5]], pad_id=-1)
    np.testing.assert_array_equal(ids, [[1, -1, -1, -1], [2, 3, 4, 5]])
    np.testing.assert_array_equal(lengths, [1, 4])


def test_pad_batch_of_tokenized_text(tokenizer):
    tokenized = tokenizer.encode(["a", "", "A man is playing a guitar."])
    ids, lengths = pad_batch(tokenized.ids)
    assert ids.shape == (3, max(tokenized.lengths))
    assert lengths.tolist() == tokenized.lengths
    for row, n, original in zip(ids, lengths, tokenized.ids, strict=True):
        assert row[:n].tolist() == original
        assert not row[n:].any()


# Long texts: a prefix is tokenized when that provably gives the same ids ----------------------------

LONG_CASES = {
    "prose": " ".join(["the quick brown fox jumps over the lazy dog"] * 2500),
    "one giant word, then words": "a" * 50_000 + " hello" * 8_000,
    "a giant word across the cut": "x" * 4_090 + " and then some words" * 500,
    "CJK": "日本語のテキスト" * 12_000,
    "punctuation": "word, " * 16_000,
    "accents, composed and not": "é" * 3_000 + "e\u0301" * 3_000 + " ok" * 1_000,
    "a short text over 256 tokens": " ".join(["token"] * 600),
    # Long in characters, few in tokens: nothing to cut (a second [SEP] was appended once).
    "one giant word alone": "x" * 5_000,
    "spaces, then two words": " " * 5_000 + "hello world",
    "a long URL": "https://example.com/" + "a1b2" * 1_200,
}


def across_the_cut(words: int, special: str, inside: int, tail: str) -> str:
    """`words` words, spaces, then `special` starting `inside` characters before PREFIX_CHARS."""
    head = " ".join(["hello"] * words)
    return head + " " * (PREFIX_CHARS - inside - len(head)) + special + tail


# A special token's text across the prefix's end: cut inside, "[SEP]" read as "[" and "se".
LONG_CASES |= {
    "[SEP] across the cut": across_the_cut(254, "[SEP]", 3, " world" * 10),
    "[MASK] across the cut, ending the text": across_the_cut(253, "[MASK]", 2, ""),
    "[CLS] across the cut": across_the_cut(253, "[CLS]", 4, " more words here"),
}


@pytest.mark.parametrize("name", LONG_CASES)
def test_long_texts_get_the_ids_of_the_whole_text_truncated(tokenizer, library, name):
    text = LONG_CASES[name]
    whole = tokenizer.encode_full(text)
    got = tokenizer.encode([text])
    assert got.ids[0] == library.encode(text).ids  # the library's own truncation: [CLS] ... [SEP]
    assert got.truncated[0] == (len(whole) > 256)
    if got.lower_bound[0]:  # only a prefix was read: the count is at most the whole's
        assert len(text) > PREFIX_CHARS and 256 < got.original_lengths[0] <= len(whole)
    else:
        assert got.original_lengths[0] == len(whole)


def test_a_long_prose_text_reads_only_its_prefix(tokenizer):
    got = tokenizer.encode([LONG_CASES["prose"]])
    assert got.lower_bound == [True]


def test_long_and_short_texts_mixed_keep_their_order(tokenizer):
    texts = ["short one", LONG_CASES["prose"], "another short", LONG_CASES["CJK"], LONG_CASES["punctuation"]]
    together = tokenizer.encode(texts)
    alone = [tokenizer.encode([t]) for t in texts]
    assert together.ids == [a.ids[0] for a in alone]
    assert together.original_lengths == [a.original_lengths[0] for a in alone]
    assert together.lower_bound == [a.lower_bound[0] for a in alone]
    assert together.truncated == [a.truncated[0] for a in alone]


def test_a_long_word_cut_by_the_prefix_is_not_counted_as_its_pieces(tokenizer):
    """The 101-character word is one [UNK] in the whole text (674 tokens); its first 95 characters,
    in the prefix, split into 38 word pieces, and the count was 710 "at least"."""
    text = "hello " * 670 + "a" * 101 + " end"
    whole = tokenizer.encode_full(text)
    assert len(text) == 4_125 and len(whole) == 674
    got = tokenizer.encode([text])
    assert got.ids[0] == [*whole[:255], whole[-1]]
    assert got.lower_bound == [True]
    assert got.original_lengths == [672]  # [CLS], 670 "hello", [SEP]: the cut word is not counted


def test_a_word_that_whitespace_shows_whole_at_the_cut_is_counted(tokenizer):
    """The count from a prefix loses no more than the word the cut runs through."""
    ends_the_prefix = "hello " * 682 + "word" + " more" * 50  # "word" ends at PREFIX_CHARS, a space next
    after_a_space = "hello " * 682 + "big " + "x" * 200  # the space is the prefix's last character
    inside = "hello " * 682 + "wordy more" * 50  # the cut runs through "wordy": not counted
    got = tokenizer.encode([ends_the_prefix, after_a_space, inside])
    assert got.lower_bound == [True, True, True]
    assert got.original_lengths == [2 + 683, 2 + 683, 2 + 682]
    for text, count in zip([ends_the_prefix, after_a_space, inside], got.original_lengths, strict=True):
        assert count <= len(tokenizer.encode_full(text))


def texts_cut_near_long_words(count: int, seed: int = 0) -> list[str]:
    """Words up to 300 characters long (over 100: one [UNK] whole) placed so that the prefix's cut
    falls inside them, at their ends, or next to whitespace, control characters (which the normaliser
    drops, joining their neighbours), accents and punctuation."""
    rng = random.Random(seed)
    common = ["hello", "the", "international", "unaffable", "x7q", "embeddings", ",", "é", "日本"]
    joins = [" ", "", "\t", "\n", "\r", "\x00", "\x1c", "\x85", "\u0301", ".", "\u00a0"]
    texts = []
    for _ in range(count):
        letters = rng.choice(["a", "ab", "xyzq", "international", "é", "9", "e\u0301"])
        word = (letters * 300)[: rng.randint(1, 300)]
        start = PREFIX_CHARS - rng.randint(-2, len(word) + 2)
        head = ""
        while len(head) < start:
            head += rng.choice(common) + rng.choice([" ", " ", " ", *joins])
        tail = rng.choice(["", " end", rng.choice(joins) + " more words" * rng.randint(1, 40), "b" * 150])
        texts.append(head[:start] + rng.choice(joins) + word + rng.choice(joins) + tail)
    return texts


def test_the_count_from_a_prefix_is_never_above_the_whole_texts(tokenizer, library):
    texts = [t for t in texts_cut_near_long_words(400) if len(t) > PREFIX_CHARS]
    assert len(texts) > 300
    got = tokenizer.encode(texts)
    assert got.ids == [e.ids for e in library.encode_batch(texts)]
    assert sum(got.lower_bound) > 200  # most were counted from their prefix
    for text, count, bound in zip(texts, got.original_lengths, got.lower_bound, strict=True):
        whole = len(tokenizer.encode_full(text))
        assert count <= whole if bound else count == whole, repr(text[PREFIX_CHARS - 20 : PREFIX_CHARS + 20])


# ASCII texts skip the library's normaliser: held to what that normaliser gives -------------------------


def library_tokenizer(path: Path, max_length: int = 256) -> HFTokenizer:
    """The library's tokenizer as tokenizer.json defines it (its own normaliser), unpadded, truncated."""
    library = HFTokenizer.from_file(str(path))
    library.no_padding()
    library.enable_truncation(max_length)
    return library


@pytest.fixture(scope="module")
def library(encoder_and_checkpoint) -> HFTokenizer:
    return library_tokenizer(encoder_and_checkpoint[1].directory / "tokenizer.json")


def ascii_texts(count: int, seed: int = 0) -> list[str]:
    """Every ASCII character alone and inside words, then random ASCII strings that lean on what the
    normaliser changes: capitals, control characters, tabs, newlines, carriage returns, punctuation."""
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(128)] + list("AZaz09 .,'-") * 4
    texts = [chr(c) for c in range(128)] + [f"Ab{chr(c)}Cd e{chr(c)}F" for c in range(128)]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 300))) for _ in range(count)]
    return texts


def test_ascii_texts_get_the_ids_of_the_librarys_own_normaliser(tokenizer, library):
    texts = ascii_texts(2000)
    got = tokenizer.encode(texts)
    expected = library.encode_batch(texts)
    assert got.ids == [e.ids for e in expected]
    assert got.truncated == [bool(e.overflowing) for e in expected]


def test_sts_b_sentences_get_the_ids_of_the_librarys_own_normaliser(tokenizer, library, data_dir):
    if data_dir is None:
        pytest.skip("no data directory (EMBED_DATA_DIR)")
    texts = [text for pair in read_sts(sts_path(data_dir, "train")) for text in (pair.first, pair.second)]
    assert len(texts) > 10_000 and sum(t.isascii() for t in texts) > 0.9 * len(texts)
    assert tokenizer.encode(texts).ids == [e.ids for e in library.encode_batch(texts)]


SPECIAL_TOKEN_TEXTS = [
    "hello [SEP] world",
    "Use [UNK] for unknown words",
    "[CLS] classification",
    "The [MASK] token is predicted",
    "[PAD][PAD]",
    "lower case [sep] and [cls] are words",  # not special: the specials match case-sensitively
    "half a [SEP",
    "héllo [SEP] wörld",
]


def test_special_tokens_written_in_a_text_are_found_as_the_library_finds_them(tokenizer, library):
    """The library finds them in the raw text, before its normaliser lowercases it: the ASCII
    shortcut, lowercasing first, made "[SEP]" ordinary word pieces (served cosine 0.6 vs
    sentence-transformers on "hello [SEP] world")."""
    got = tokenizer.encode(SPECIAL_TOKEN_TEXTS)
    assert got.ids == [e.ids for e in library.encode_batch(SPECIAL_TOKEN_TEXTS)]
    assert got.ids[0] == [CLS, 7592, SEP, 2088, SEP]
    assert got.ids == [tokenizer.encode([t]).ids[0] for t in SPECIAL_TOKEN_TEXTS]


def test_a_batch_of_ascii_and_other_texts_keeps_its_order(tokenizer, library):
    texts = ["Hello THERE", "Café NAÏVE", "a\tb\r\nC", "中文 Text", "", "x\x00Y", "“Quoted” — dash", "end."]
    got = tokenizer.encode(texts)
    assert got.ids == [e.ids for e in library.encode_batch(texts)]
    assert got.ids == [tokenizer.encode([t]).ids[0] for t in texts]


@pytest.mark.parametrize(
    ("setting", "texts"),
    [
        ("clean_text", ["a\x00b\x07c", "tab\there", "nul\x00"]),  # control characters kept, not dropped
        ("strip_accents", ["cafe", "naive"]),  # ASCII has no accents: the shortcut still equals it
        ("handle_chinese_chars", ["plain ascii words"]),
    ],
)
def test_a_normaliser_unlike_berts_uncased_one_is_not_short_cut(
    encoder_and_checkpoint, tmp_path, setting, texts
):
    """The ASCII shortcut stands in for BERT's uncased normaliser with every setting as shipped; a
    tokenizer.json that turns one off gets its own normaliser's ids, whatever the shortcut would do."""
    source = encoder_and_checkpoint[1].directory / "tokenizer.json"
    config = json.loads(source.read_text())
    config["normalizer"][setting] = False
    changed = tmp_path / "tokenizer.json"
    changed.write_text(json.dumps(config))
    got = Tokenizer(changed, 256).encode(texts).ids
    assert got == [e.ids for e in library_tokenizer(changed).encode_batch(texts)]


def test_a_cased_tokenizer_keeps_its_capitals(encoder_and_checkpoint, tmp_path):
    """The ASCII shortcut stands in for the uncased BERT normaliser only: a tokenizer.json whose
    normaliser keeps case gets its own normaliser's ids."""
    source = encoder_and_checkpoint[1].directory / "tokenizer.json"
    config = json.loads(source.read_text())
    config["normalizer"]["lowercase"] = False
    cased = tmp_path / "tokenizer.json"
    cased.write_text(json.dumps(config))
    texts = ["Hello THERE", "hello there", "A\tB"]
    got = Tokenizer(cased, 256).encode(texts).ids
    assert got == [e.ids for e in library_tokenizer(cased).encode_batch(texts)]
    assert got[0] != got[1]  # case kept: "Hello" and "hello" are not the same ids


# Plain ASCII texts skip the library altogether when its pipeline is BERT's ------------------------------


def test_ascii_texts_near_and_over_the_token_limit_are_cut_as_the_library_cuts_them(
    tokenizer, library, encoder_and_checkpoint
):
    """Around 254 word pieces (the limit less [CLS] and [SEP]): the ids, the cut and the whole count."""
    rng = random.Random(1)
    words = ["the", "cat", ",", "embeddings", "x7q", "unbelievably", "!", "2026"]
    texts = [" ".join(rng.choices(words, k=k)) for k in range(80, 300, 7)]
    got = tokenizer.encode(texts)
    expected = library.encode_batch(texts)
    assert got.ids == [e.ids for e in expected]
    assert got.truncated == [bool(e.overflowing) for e in expected]
    assert any(got.truncated) and not all(got.truncated)
    unlimited = library_tokenizer(encoder_and_checkpoint[1].directory / "tokenizer.json", 10_000)
    assert got.original_lengths == [len(e.ids) for e in unlimited.encode_batch(texts)]


def test_words_over_the_word_piece_length_limit_are_unknown_as_in_the_library(tokenizer, library):
    texts = ["a" * 100, "a" * 101, "b" * 100 + " ok " + "c" * 2000, "x9" * 60 + ", then words"]
    got = tokenizer.encode(texts)
    assert got.ids == [e.ids for e in library.encode_batch(texts)]
    assert got.ids[1] == [CLS, 100, SEP]  # [UNK]


def test_words_split_into_pieces_are_remembered_within_a_bound(library, encoder_and_checkpoint):
    """Many distinct out-of-vocabulary words (a hostile stream): the same ids, and the remembered
    splits stay at their bound."""
    from minilm_embed.model import tokenizer as module

    fresh = Tokenizer(encoder_and_checkpoint[1].directory / "tokenizer.json", 256)
    texts = [f"zq{i}xv wq{i * 7}yk" for i in range(module.SPLIT_WORDS_KEPT)]
    assert fresh.encode(texts).ids == [e.ids for e in library.encode_batch(texts)]
    assert fresh.encode(texts[:50]).ids == [e.ids for e in library.encode_batch(texts[:50])]
    assert fresh._words is not None  # BERT's pipeline: the shortcut is in use
    assert fresh._words._split.cache_info().currsize == module.SPLIT_WORDS_KEPT


@pytest.mark.parametrize("pre_tokenizer", [{"type": "WhitespaceSplit"}, {"type": "Whitespace"}])
def test_a_pre_tokenizer_unlike_berts_gets_the_librarys_ids(encoder_and_checkpoint, tmp_path, pre_tokenizer):
    """The shortcut splits words as BERT's pre-tokenizer does; a tokenizer.json that splits otherwise
    gets its own pre-tokenizer's ids (WhitespaceSplit keeps "world!" whole, unlike BERT's)."""
    source = encoder_and_checkpoint[1].directory / "tokenizer.json"
    config = json.loads(source.read_text())
    config["pre_tokenizer"] = pre_tokenizer
    changed = tmp_path / "tokenizer.json"
    changed.write_text(json.dumps(config))
    texts = ["hello world!", "it's a dog-friendly cafe.", "x=1,y=2"]
    got = Tokenizer(changed, 256).encode(texts).ids
    assert got == [e.ids for e in library_tokenizer(changed).encode_batch(texts)]
