"""The front's per-request work (server/embedder.py): where a request's texts are tokenized."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from minilm_embed.server.budget import held_bytes_budget, request_bytes_budget, tokenizing_budget
from minilm_embed.server.embedder import INLINE_TOKENIZE_CHARS, NON_ASCII_WEIGHT, Embedder
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.tokenization import InputLimits, RequestTokenizer


class CountingPool(ThreadPoolExecutor):
    """The tokenizer's thread, counting the work handed to it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.handed = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.handed += 1
        return super().submit(fn, *args, **kwargs)


def embedder(tokenizer) -> tuple[Embedder, CountingPool]:
    requests = RequestTokenizer(tokenizer, InputLimits(256, 256, 1_000_000))
    budgets = tokenizing_budget(1 << 20), request_bytes_budget(1 << 20), held_bytes_budget(1 << 20)
    e = Embedder(requests, None, Metrics(CollectorRegistry()), None, *budgets)  # type: ignore[arg-type]
    pool = e._tokenizing = CountingPool()
    return e, pool


CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4096))
SENTENCE = "A man is playing a guitar on the stage tonight."  # 47 ASCII characters


@pytest.mark.parametrize(
    ("texts", "on_the_loop"),
    [
        ([SENTENCE] * 32, True),  # a typical bulk request: handing it to a thread cost more than it
        ([SENTENCE[:32]] * 128, True),  # 4,096 ASCII characters
        (["x" * 4097], False),
        ([SENTENCE[:32]] * 128 + ["x"], False),
        ([CJK[:2048]], False),  # 3.8 ms of the loop on a Zen 4 when one text of 2,048 was inlined
        (["é" * (INLINE_TOKENIZE_CHARS // NON_ASCII_WEIGHT)], True),
        (["é" * (INLINE_TOKENIZE_CHARS // NON_ASCII_WEIGHT + 1)], False),
        ([SENTENCE] * 8 + [CJK[:300]], False),
    ],
)
def test_small_requests_tokenize_on_the_loop_and_costly_ones_on_the_tokenizer_thread(
    tokenizer, texts, on_the_loop
):
    e, pool = embedder(tokenizer)
    prepared = asyncio.run(e.tokenize(texts, truncate=True))
    assert pool.handed == (0 if on_the_loop else 1)
    expected = e.tokenizer.from_texts(texts, True)
    assert np.array_equal(prepared.ids, expected.ids) and np.array_equal(prepared.lengths, expected.lengths)
