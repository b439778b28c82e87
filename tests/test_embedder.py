"""The front's per-request work (server/embedder.py): where a request's texts are tokenized."""

from __future__ import annotations

import asyncio
import random
import string
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from minilm_embed.server.budget import held_bytes_budget, request_bytes_budget, tokenizing_budget
from minilm_embed.server.embedder import (
    INLINE_RATE_HALF_LIFE_S,
    INLINE_TOKENIZE_CHARS,
    NON_ASCII_WEIGHT,
    Embedder,
    EmbedJob,
)
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
        ([SENTENCE] * 32, True),  # 1,504 characters: handing them to a thread cost more than they do
        ([SENTENCE[:32]] * 128, True),  # 4,096 ASCII characters
        (["x" * 4097], False),
        ([SENTENCE[:32]] * 128 + ["x"], False),
        ([CJK[:2048]], False),  # 3.8 ms of the loop on a Zen 4 when one text of 2,048 was inlined
        (["é" * (INLINE_TOKENIZE_CHARS // NON_ASCII_WEIGHT)], True),
        (["é" * (INLINE_TOKENIZE_CHARS // NON_ASCII_WEIGHT + 1)], False),
        (["[SEP] " + "a" * 300], False),  # ASCII, but the library's path (a special token's text)
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


def never_seen_words(chars: int, seed: int) -> list[str]:
    """ASCII text the Python path splits word by word (each new to its cache): ~25x the usual cost."""
    rng = random.Random(seed)
    text = " ".join("".join(rng.choices(string.ascii_lowercase, k=99)) for _ in range(chars // 100 + 1))
    return [text[:chars]]


def test_after_a_slow_inline_run_such_requests_go_to_the_thread_until_the_rate_decays(tokenizer):
    """4,096 characters of never-seen long words held the loop 9 ms inline (Zen 4): once, then the
    learned rate sends the like to the thread, and cheap requests come back inline as it decays."""
    e, pool = embedder(tokenizer)
    run = lambda texts: asyncio.run(e.tokenize(texts, truncate=True))  # noqa: E731
    run(never_seen_words(4096, seed=1))
    assert pool.handed == 0  # the first is inline: nothing is known of it before it runs
    run(never_seen_words(4096, seed=2))
    run([SENTENCE] * 32)  # at the slow rate, 1,504 characters would hold the loop too long
    assert pool.handed == 2
    e._inline_rate.observed_at -= 10 * INLINE_RATE_HALF_LIFE_S  # ten half-lives later
    run([SENTENCE] * 32)
    assert pool.handed == 2


class Stop(Exception):
    """What the stand-in engine raises once it has looked at the job."""


@pytest.mark.parametrize("inputs", [{"texts": [SENTENCE] * 3}, {"token_ids": [[101, 1037, 2158, 102]] * 3}])
def test_a_job_lets_go_of_its_inputs_before_it_waits_for_the_engine(tokenizer, inputs):
    """Parsed, a request's inputs can cost far more than their bytes (2M one-byte token ids of a 2 MB
    gRPC message are ~27 MB of protobuf, of which the ids are views), and the request then waits
    seconds for the engine: by then the job holds only its token arrays."""
    e, _ = embedder(tokenizer)
    job = EmbedJob(**inputs)
    seen = []

    class Engine:
        def check_capacity(self, count: int, bulk: bool) -> None:
            pass

        async def embed(self, lengths, ids, *rest):  # type: ignore[no-untyped-def]
            seen.append((job.texts, job.token_ids, lengths.tolist()))
            raise Stop

    class Ready:
        def check(self) -> None:
            pass

    e.engine, e.readiness = Engine(), Ready()  # type: ignore[assignment]
    with pytest.raises(Stop):
        asyncio.run(e.embed(job))
    ((texts, token_ids, lengths),) = seen
    assert (texts, token_ids) == ((), ())
    assert len(lengths) == 3 and min(lengths) >= 4  # the engine got the three inputs' tokens
