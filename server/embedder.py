"""What a front does for one request, whatever protocol it came in on: check, tokenize, hand to the
engine. The gRPC servicer (service.py) and the HTTP API (http.py) are thin translations around it, so
both share one queue, one set of limits and one budget, and give the same vectors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from minilm_embed.server.budget import Budget, Hold
from minilm_embed.server.errors import InvalidInput, Overloaded
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.readiness import Readiness
from minilm_embed.server.tokenization import (
    Prepared,
    RequestTokenizer,
    TokenRow,
    inputs_field,
    tokenizing_cost,
)
from minilm_embed.server.transport import Answer, EngineClient

T = TypeVar("T")
# embed_requests_refused_total's reason for a refusal by each byte budget, by the setting it names.
REFUSAL_LABELS = {
    "max_request_bytes_held": "request_bytes_held",
    "max_request_bytes_in_flight": "request_bytes",
}

if TYPE_CHECKING:  # imported only when tracing is on (server/tracing.py)
    from minilm_embed.server.tracing import RequestTracer

# A request is tokenized on the event loop, not handed to a tokenizer thread and back (60-160 us of
# CPU on a Zen 4; 32 STS-B sentences take 170-250 us), when its cost is at most INLINE_TOKENIZE_CHARS
# and, at the rate inline runs took lately (InlineRate), within INLINE_BUDGET_US. Its cost is its
# characters, a text's counted NON_ASCII_WEIGHT times unless it takes the tokenizer's Python path
# (`Tokenizer.python_path`: plain ASCII), which holds the GIL on a thread too.
# Measured inline on a Zen 4, us a character: the Python path ~0.06 for known words, 2.2-2.9 for
# never-seen 100-letter ones (4,096 characters: 9-12 ms, once, then the rate sends the like to the
# thread); the library's path 0.5 (accented Latin) to 5-10 (ASCII holding special tokens' text),
# 1.5-3.3 ms within the weight. One 2,048-character CJK text, which an earlier rule inlined, took
# 3.8 ms. Anything else runs on the tokenizer's threads (the library's batch call releases the GIL).
INLINE_TOKENIZE_CHARS = 4096
INLINE_BUDGET_US = 500.0
INLINE_RATE_HALF_LIFE_S = 1.0
INLINE_BASE_US_PER_CHAR = 0.1  # about twice the Python path's rate on STS-B sentences
# Inline runs shorter than this teach the rate nothing: their fixed cost (the arrays) would read as a
# high rate per character.
INLINE_MIN_OBSERVED_CHARS = 256
NON_ASCII_WEIGHT = 16
# Token ids are checked on the event loop up to this many in a request (about 0.2-0.5 ms, mostly the
# rows' conversion to arrays), beyond it on a tokenizer thread: one 2 MB HTTP list of ids took 17 ms.
INLINE_TOKEN_IDS = 16384


@dataclass
class EmbedJob:
    """One embedding request, in the front's terms: texts or token ids (one of them), and options.

    The embedder lets go of the inputs once they are tokenized (`let_go`): parsed, they can cost far
    more than their bytes on the wire (2M one-byte token ids of a 2 MB gRPC message are ~27 MB of
    protobuf), and a request then waits seconds for the engine with only its token arrays needed."""

    texts: Sequence[str] = ()
    token_ids: Sequence[TokenRow] = ()
    truncate: bool = True
    normalize: bool = True
    deadline: float | None = None  # time.monotonic() by which the answer is due
    bulk: bool = False  # batched after interactive requests, within bulk_queue_share of the queue
    request_id: str = ""  # the caller's or a made-up id (server/logs.py), for log lines and traces

    @property
    def count(self) -> int:
        return len(self.texts) or len(self.token_ids)

    def let_go(self) -> None:
        """Drop the inputs (and with token ids, the parsed message they are views of)."""
        self.texts, self.token_ids = (), ()


@dataclass(frozen=True)
class Embedded:
    answer: Answer  # the engine's (n, D) vectors and timings
    prepared: Prepared  # the token arrays, for usage figures
    started: float  # time.perf_counter() when the job arrived
    tokenizing: float  # time.perf_counter() when its tokenizing (or checking token ids) began, and ended
    tokenized: float


class Embedder:
    def __init__(
        self,
        tokenizer: RequestTokenizer,
        engine: EngineClient,
        metrics: Metrics,
        readiness: Readiness,
        budget: Budget,
        request_bytes: Budget,
        held_bytes: Budget,
        tokenizer_threads: int = 1,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics
        self.readiness = readiness
        self.budget = budget
        self.request_bytes = request_bytes
        self.held_bytes = held_bytes
        self.tracer = tracer
        self._tokenizing = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenize")
        self._inline_rate = InlineRate()

    def receiving(self, size: int) -> Hold:
        """Hold a request's `size` bytes until it is tokenized (`release`) and until it is answered
        (`close`); refused at once past either budget."""
        hold = self.request_bytes.hold(0).keeping(self.held_bytes.hold(0))
        try:
            self.received_more(hold, size)
        except BaseException:
            hold.close()
            raise
        return hold

    def received_more(self, held: Hold, size: int) -> None:
        """`size` more bytes of a request held (an HTTP body's as they come): refused at once past
        either budget, counted under the budget's label."""
        try:
            held.grow(size)
        except Overloaded as e:
            self.metrics.refusals.labels(REFUSAL_LABELS[e.metadata["setting"]]).inc()
            raise

    async def waiting_to_receive(self, size: int) -> Hold:
        """`receiving`, waiting for room instead of refusing (a stream's reader, which meanwhile reads
        no further). Whatever its size it fits once nothing else is held."""
        held = await self.held_bytes.wait_for(size)
        try:
            return (await self.request_bytes.wait_for(size)).keeping(held)
        except BaseException:
            held.close()
            raise

    async def embed(self, job: EmbedJob, received: Hold | None = None) -> Embedded:
        """Check, tokenize (then release `received`, the request's bytes), and run on the engine."""
        started = time.perf_counter()
        self.readiness.check()
        if job.texts and job.token_ids:
            raise InvalidInput(
                "set either `texts` or `token_ids`, not both", "TEXTS_AND_TOKEN_IDS", "token_ids"
            )
        self.tokenizer.check_count(job.count, field=inputs_field(job.texts, job.token_ids))
        self.engine.check_capacity(job.count, job.bulk)  # refuse overload before paying for tokenization
        tokenizing = time.perf_counter()
        prepared = await self._prepare(job)
        job.let_go()
        if received is not None:
            received.release()
        tokenized = time.perf_counter()
        if cut := int(prepared.truncated.sum()):
            self.metrics.truncated.inc(cut)
        answer = await self.engine.embed(
            prepared.lengths, prepared.ids, job.deadline, job.normalize, job.request_id, job.bulk
        )
        embedded = Embedded(answer, prepared, started, tokenizing, tokenized)
        if self.tracer is not None:
            self.tracer.record(job, embedded)
        return embedded

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a tokenizer thread: Python work too long for the event loop (a request's
        other calls wait on it), which holds the GIL there too but lets the loop in between."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    async def tokenize(self, texts: list[str], truncate: bool) -> Prepared:
        """Token ids and usage; with truncate=False the whole text (original_tokens exact)."""
        return await self._tokenize_texts(texts, True, whole=not truncate)

    async def _prepare(self, job: EmbedJob) -> Prepared:
        if job.token_ids:
            if sum(map(len, job.token_ids)) <= INLINE_TOKEN_IDS:
                return self.tokenizer.from_ids(job.token_ids, job.truncate)
            return await self.off_loop(self.tokenizer.from_ids, job.token_ids, job.truncate)
        started = time.perf_counter()
        prepared = await self._tokenize_texts(list(job.texts), job.truncate)
        self.metrics.tokenize_duration.observe(time.perf_counter() - started)
        return prepared

    async def _tokenize_texts(self, texts: list[str], truncate: bool, whole: bool = False) -> Prepared:
        """Small requests inline (faster than a thread hop), anything more off the event loop.

        Within the front's budget of characters being tokenized at once, refused beyond it.
        """
        self.tokenizer.check_texts(texts)
        cost = tokenizing_cost(texts, whole)
        try:
            self.budget.reserve(cost)
        except Overloaded:
            self.metrics.refusals.labels("tokenizing").inc()
            raise
        try:
            if not whole and self._inline_rate.allows(
                inline := inline_cost(texts, self.tokenizer.python_path)
            ):
                # This thread's CPU time: a wait for the GIL (a tokenizer thread holding it) is not
                # the text's cost, and would send cheap requests to the thread for seconds.
                started = time.thread_time()
                prepared = self.tokenizer.from_texts(texts, truncate)
                self._inline_rate.observe(inline, time.thread_time() - started)
                return prepared
            loop = asyncio.get_running_loop()
            work = self.tokenizer.from_texts_whole if whole else self.tokenizer.from_texts
            return await loop.run_in_executor(self._tokenizing, work, texts, truncate)
        finally:
            self.budget.release(cost)


def inline_cost(texts: list[str], python_path: Callable[[str], bool]) -> int:
    """The texts' characters, each of a text not on the tokenizer's Python path counted
    NON_ASCII_WEIGHT times (the count ends once past the limit: it cannot be inline)."""
    cost = 0
    for text in texts:
        cost += len(text) if python_path(text) else len(text) * NON_ASCII_WEIGHT
        if cost > INLINE_TOKENIZE_CHARS:
            break
    return cost


@dataclass
class InlineRate:
    """What inline tokenizing costs lately, in us per (weighted) character: INLINE_BASE_US_PER_CHAR,
    or more after a slow run (never-seen long words), decaying back with a half-life of
    INLINE_RATE_HALF_LIFE_S. Such requests then go to the thread, and a client mixing them among cheap
    ones holds the loop about once every half-life x log2(rate / base) seconds, not once a request."""

    peak: float = 0.0  # us per character of the last slow run, above the base
    observed_at: float = field(default_factory=time.monotonic)

    def allows(self, cost: int) -> bool:
        return cost <= INLINE_TOKENIZE_CHARS and cost * self._rate(time.monotonic()) <= INLINE_BUDGET_US

    def observe(self, cost: int, seconds: float) -> None:
        now = time.monotonic()
        if cost >= INLINE_MIN_OBSERVED_CHARS and (rate := seconds * 1e6 / cost) > self._rate(now):
            self.peak, self.observed_at = rate - INLINE_BASE_US_PER_CHAR, now

    def _rate(self, now: float) -> float:
        decay = 0.5 ** ((now - self.observed_at) / INLINE_RATE_HALF_LIFE_S)
        return INLINE_BASE_US_PER_CHAR + self.peak * decay
