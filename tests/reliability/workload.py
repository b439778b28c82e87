"""The load the reliability tests put on a server, and what its callers saw.

Callers are asyncio tasks spread over a few channels (each with its own connection); each sends Embed
requests of 1-8 mixed-length sentences in a loop and checks every vector against a reference
computed once per distinct sentence by ONNX Runtime in this process, one sentence at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from minilm_embed.client.client import channel_options, embed_request, to_array
from minilm_embed.export.optimize import cpu_session
from minilm_embed.export.parity import CARRIED_SENTENCES, MIN_COSINE
from minilm_embed.model.tokenizer import pad_batch
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from tests.reference import library_tokenizer

MAX_TOKENS = 256
OK = grpc.StatusCode.OK
# Word counts of the sentence pool: mostly short, some paragraphs, a few cut at 256 tokens.
LENGTHS = [3, 5, 8, 12, 16, 24, 32, 48, 64, 96, 240]
LENGTH_WEIGHTS = [12, 12, 12, 12, 10, 10, 8, 6, 4, 2, 1]


def sentence_pool(count: int, seed: int = 0) -> list[str]:
    """`count` distinct sentences of mixed length, made of the parity sentences' words."""
    lines = CARRIED_SENTENCES.read_text(encoding="utf-8").splitlines()
    words = " ".join(lines).split()
    rng = random.Random(seed)
    pool = []
    for i in range(count):
        n = rng.choices(LENGTHS, LENGTH_WEIGHTS)[0]
        start = rng.randrange(len(words))
        pool.append(f"{i} " + " ".join(words[(start + j) % len(words)] for j in range(n)))
    return pool


class References:
    """The model file run in this process, one text at a time: the vector each text must get."""

    def __init__(self, model_dir: Path) -> None:
        self.session = cpu_session(model_dir / "model.onnx")
        self.tokenizer = library_tokenizer(model_dir)  # the library's own, as tests/reference.py
        self.vectors: dict[str, np.ndarray] = {}

    def add(self, texts: Sequence[str]) -> None:
        for text in texts:
            if text not in self.vectors:
                ids, lengths = pad_batch([self.tokenizer.encode(text).ids])
                normalised, _ = self.session.run(None, {"input_ids": ids, "lengths": lengths})
                self.vectors[text] = normalised[0]

    def cosines(self, texts: Sequence[str], got: np.ndarray) -> np.ndarray:
        want = np.stack([self.vectors[t] for t in texts])
        assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
        return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


@dataclass(frozen=True)
class Call:
    started: float  # time.monotonic()
    seconds: float
    code: grpc.StatusCode
    inputs: int
    details: str = ""  # the status message of a failed call


@dataclass
class Tally:
    """Every call's outcome, and the worst vector seen."""

    calls: list[Call] = field(default_factory=list)
    worst_cosine: float = 1.0
    wrong: list[str] = field(default_factory=list)  # the first few wrong answers, described

    def codes(self, since: float = -np.inf, until: float = np.inf) -> Counter[str]:
        return Counter(c.code.name for c in self.calls if since <= c.started < until)

    def unexpected(self, *expected: str) -> list[str]:
        """The first few calls that ended with a code not in `expected`, with their messages."""
        odd = [c for c in self.calls if c.code.name not in expected]
        return [f"{c.code.name} after {c.seconds:.2f} s: {c.details}" for c in odd[:5]]

    def inputs(self, code: grpc.StatusCode = OK) -> int:
        return sum(c.inputs for c in self.calls if c.code == code)

    @property
    def slowest(self) -> float:
        return max((c.seconds for c in self.calls), default=0.0)

    def check(self, texts: Sequence[str], got: np.ndarray, references: References) -> None:
        cos = references.cosines(texts, got)
        if not np.isfinite(got).all() or cos.min() < MIN_COSINE:
            self.wrong.append(f"min cosine {cos.min():.7f} for {len(texts)} texts")
        self.worst_cosine = min(self.worst_cosine, float(np.nan_to_num(cos.min(), nan=-1.0)))


def channels(target: str, count: int) -> list[grpc.aio.Channel]:
    """Channels that do not share a connection (each has its own subchannel pool)."""
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(target, options=options) for _ in range(count)]


@dataclass
class Load:
    """`callers` tasks over `channel_count` channels, each calling Embed until `stop()`."""

    target: str
    sentences: Sequence[str]
    references: References
    callers: int = 256
    channel_count: int = 8
    deadline_s: float = 30.0
    seed: int = 0
    tally: Tally = field(default_factory=Tally)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _channels: list[grpc.aio.Channel] = field(default_factory=list)

    async def __aenter__(self) -> Load:
        self._channels = channels(self.target, self.channel_count)
        stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self._channels]
        for i in range(self.callers):
            rng = random.Random(self.seed * 100_003 + i)
            self._tasks.append(asyncio.create_task(self._caller(stubs[i % len(stubs)], rng)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> Tally:
        """Let every caller finish its call in flight, then close the channels."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self._tasks.clear()
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        return self.tally

    async def _caller(self, stub: Any, rng: random.Random) -> None:
        refusals = 0
        while not self._stop.is_set():
            texts = rng.sample(self.sentences, rng.randint(1, 8))
            code = await self._call(stub, texts)
            refusals = 0 if code == OK else refusals + 1
            if refusals:  # a refusal says "retry later": exponential backoff with jitter
                await self._pause(min(4.0, 0.1 * 2**refusals) * rng.uniform(0.5, 1.0))

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on stop()."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _call(self, stub: Any, texts: list[str]) -> grpc.StatusCode:
        started = time.monotonic()
        try:
            response = await stub.Embed(embed_request(texts), timeout=self.deadline_s)
        except grpc.aio.AioRpcError as e:
            call = Call(started, time.monotonic() - started, e.code(), len(texts), e.details() or "")
            self.tally.calls.append(call)
            return e.code()
        self.tally.calls.append(Call(started, time.monotonic() - started, OK, len(texts)))
        self.tally.check(texts, to_array(response), self.references)
        return OK
