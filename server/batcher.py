"""The queue and the batching: the only place that decides which inputs run together.

Inputs wait in one queue, interactive requests' inputs ahead of bulk ones (each kind in arrival
order): a bulk job (`embed-file`, an ingestion pipeline) fills the batches the interactive traffic
leaves, and an interactive request waits for the batch in compute, not for the bulk work queued
before it. A bulk request is admitted only while less than `bulk_queue_share` of the queue is
taken, so the rest stays for interactive ones.

A batch always holds the input at the head of the queue (so none starves within its kind) and grows
with its neighbours in length order, taken from a window at the head of the queue (the interactive
inputs only, while there are any: a query does not wait for bulk neighbours' compute), choosing at
each step the neighbour that adds the least padding, while the padded cost (rows x longest row)
stays within the token budget and the rows within the batch size. The batch is padded here and its
per-row lengths go to the model, which builds its attention mask from them (and skips the padding in
every per-token layer, so padding costs only attention's share). Inputs whose caller cancelled, or
whose deadline passed, are dropped before compute. A full queue refuses new work at once, so memory
stays bounded under any load.

A request's inputs arrive as two arrays (lengths, and every token id one after another) and leave
as one (n, D) array per output, filled in place as its batches finish: no per-input futures.

Up to `workers` batches run at once, one per model instance: while one instance computes, another
takes the next batch. On the CPU provider two one-thread instances outran one two-thread instance on
the same two cores (no barrier between threads inside an op; see README, "Settings"). With `ahead`,
that many more batches are taken (when a full batch waits), padded and handed to a model thread
while every instance computes, and wait there for the next free instance: the event loop's work for
a batch (taking it, padding it, answering the one before) then overlaps the model's run instead of
leaving it idle. On an H200 one CUDA instance ran 67% of the time at 557-row batches of sentences,
2.9 ms of host work a batch between runs of 5.9 ms (docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np

from minilm_embed.server.errors import BackendFailure, Dropped, InvalidInput, Overloaded
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.place import s_per_waiting_input

log = logging.getLogger(__name__)

RunFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_size: int
    max_queue_delay_s: float
    queue_limit: int
    max_padding: float = 1.0
    window: int = 256  # how far into the queue a batch may look for inputs of similar length
    bulk_queue_share: float = 1.0  # of queue_limit, below which bulk requests are admitted

    @property
    def lookahead(self) -> int:
        """The window in force: never fewer inputs than a batch may hold (a window of 256 kept
        CUDA's 1,024-row batches to 256 rows)."""
        return max(self.window, self.max_batch_size)


BULK_SETTING = "bulk_queue_share"


# A full queue's refusal asks its caller to try again once enough of the inputs waiting have been
# taken for its request to fit, at the engine's recent pace, within these bounds: sooner, a flood of
# retries would cost the fronts more than it gives; later, a caller would sit out a busy spell long past.
RETRY_AFTER_BOUNDS_S = (0.1, 30.0)
# The pace (seconds of compute per token) is over about the last this many inputs computed: a batch's
# weight is its inputs, so a lone slow input (a query alone on an idle engine, a pause) moves it little.
PACE_INPUTS = 256


def retry_after(inputs: int, s_per_input: float) -> float | None:
    """Seconds until `inputs` more inputs are taken from the queue at `s_per_input`, within
    RETRY_AFTER_BOUNDS_S (None: no pace measured yet)."""
    if s_per_input <= 0:
        return None
    low, high = RETRY_AFTER_BOUNDS_S
    return min(high, max(low, inputs * s_per_input))


def check_capacity(
    waiting: int, count: int, queue_limit: int, bulk_share: float | None = None, s_per_input: float = 0.0
) -> None:
    """The admission rule, used by the fronts (before tokenizing) and by the engine (on arrival).

    `bulk_share`, for a bulk request: it is admitted only while fewer than queue_limit x bulk_share
    inputs wait. The share bounds where bulk work may start, not where it ends, so a bulk request as
    large as any other fits an empty queue (a job sizes its requests by max_inputs_per_request, not
    by the share) and interactive requests keep the queue's other share but one request.
    `s_per_input`: seconds of compute per waiting input (the engine's recent pace per token times the
    waiting inputs' mean length), from which a refusal says when to try again: once the inputs that
    must leave the queue for this request to fit have been taken (not once the whole queue has
    drained: at a large queue_limit that is far later).
    """
    if bulk_share is not None and waiting >= queue_limit * bulk_share:
        retry_after_s = retry_after(waiting - math.ceil(queue_limit * bulk_share) + 1, s_per_input)
        raise Overloaded(
            f"queue full for bulk requests: {waiting} inputs waiting, and bulk requests are admitted "
            f"only below {queue_limit * bulk_share:g} ({BULK_SETTING} {bulk_share:g} of the queue_limit "
            f"of {queue_limit}); retry with backoff",
            "QUEUE_FULL",
            retry_after_s=retry_after_s,
            setting=BULK_SETTING,
            limit=bulk_share,
            value=waiting,
            queueLimit=queue_limit,
            asked=count,
        )
    if count > queue_limit:
        raise InvalidInput(
            f"{count} inputs can never fit the queue_limit of {queue_limit}",
            "OVER_QUEUE_LIMIT",
            setting="queue_limit",
            limit=queue_limit,
            value=count,
        )
    if waiting + count > queue_limit:
        raise Overloaded(
            f"queue full: {waiting} inputs waiting, queue_limit is {queue_limit}; retry with backoff",
            "QUEUE_FULL",
            retry_after_s=retry_after(waiting + count - queue_limit, s_per_input),
            setting="queue_limit",
            limit=queue_limit,
            value=waiting,
            asked=count,
        )


@dataclass(frozen=True)
class Rows:
    """A request's inputs: (n,) lengths and their token ids one after another, both int32."""

    lengths: np.ndarray
    ids: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> Rows:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
        return cls(lengths, ids)

    def __len__(self) -> int:
        return int(self.lengths.size)


@dataclass(frozen=True)
class Done:
    """A request's answer: row i of each array is input i's vector."""

    embeddings: np.ndarray  # (n, D) L2-normalised
    pooled: np.ndarray  # (n, D) before normalisation
    queue_s: float  # the longest any of its inputs waited
    inference_s: float  # time during which at least one of its batches ran (instances overlap)

    def __len__(self) -> int:
        return len(self.embeddings)


@dataclass(eq=False)
class Request:
    rows: Rows
    future: asyncio.Future[Done]
    enqueued: float
    deadline: float | None  # time.monotonic() value
    tag: str = ""  # the caller's request id, for log lines (server/logs.py)
    bulk: bool = False  # queued behind every interactive request
    # Input i's length, and where its ids start in rows.ids, as Python ints: every batch choice reads
    # them for every input in the window.
    sizes: list[int] = field(init=False)
    starts: list[int] = field(init=False)
    remaining: int = field(init=False)
    queued: int = field(init=False)  # of its inputs, those in the queue and counted as waiting
    queued_tokens: int = field(init=False)  # their tokens
    embeddings: np.ndarray | None = None
    pooled: np.ndarray | None = None
    queue_s: float = 0.0
    spans: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sizes = self.rows.lengths.tolist()
        self.starts = list(itertools.accumulate(self.sizes[:-1], initial=0))
        self.remaining = self.queued = len(self.sizes)
        self.queued_tokens = sum(self.sizes)

    @property
    def abandoned(self) -> bool:
        return self.future.done()

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def fill(self, first: int, embeddings: np.ndarray, pooled: np.ndarray, started: float) -> bool:
        """Store the vectors of inputs `first`, `first` + 1, ... (the rows of `embeddings` and
        `pooled`); True when that completed the request."""
        if self.embeddings is None or self.pooled is None:
            self.embeddings = np.empty((len(self.rows), embeddings.shape[1]), dtype=np.float32)
            self.pooled = np.empty_like(self.embeddings)
        end = first + len(embeddings)
        self.embeddings[first:end] = embeddings
        self.pooled[first:end] = pooled
        self.queue_s = max(self.queue_s, started - self.enqueued)
        self.remaining -= len(embeddings)
        if self.remaining == 0 and not self.future.done():
            assert self.pooled is not None
            self.future.set_result(Done(self.embeddings, self.pooled, self.queue_s, running_time(self.spans)))
            return True
        return False


# One queued input: its request and its index there (a tuple: the queue holds many of these).
Entry = tuple[Request, int]


def running_time(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of these (start, end) spans ran (instances overlap)."""
    total, covered_to = 0.0, -math.inf
    for start, end in sorted(set(spans)):
        total += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return total


def choose_batch(
    lengths: Sequence[int], max_tokens: int, max_size: int, max_padding: float = 1.0
) -> list[int]:
    """Indices into `lengths` (a window, oldest first) forming the next batch; always holds 0.

    Grows a run of neighbours in length order around the oldest input, adding each time the
    neighbour that adds the least padding, while rows x longest row <= max_tokens and the share of
    padding in the batch stays <= max_padding (padding still costs attention, whose share grows with
    the longest row; the inputs left out form their own batch next).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)  # stable: equal lengths oldest first
    lo = hi = order.index(0)
    longest, real = lengths[0], lengths[0]

    def fits(rows: int, longest: int, real: int) -> bool:
        return rows * longest <= max_tokens and real >= (1.0 - max_padding) * rows * longest

    while hi - lo + 1 < max_size:
        count = hi - lo + 1
        left = lengths[order[lo - 1]] if lo > 0 else None
        right = lengths[order[hi + 1]] if hi + 1 < len(order) else None
        # Padding added (inf: the neighbour does not fit): a shorter row is padded to `longest`; a
        # longer row pads every row so far.
        waste_left = waste_right = math.inf
        if left is not None and fits(count + 1, longest, real + left):
            waste_left = longest - left
        if right is not None and fits(count + 1, right, real + right):
            waste_right = (right - longest) * count
        if waste_left == waste_right == math.inf:
            break
        if waste_left <= waste_right:
            lo -= 1
            real += lengths[order[lo]]
        else:
            hi += 1
            longest = lengths[order[hi]]
            real += longest
    return sorted(order[lo : hi + 1])


def refusal_label(error: Overloaded) -> str:
    """embed_requests_refused_total's reason for a refusal by check_capacity: bulk requests held back
    at their share (the pacing a bulk job expects) are not a full queue (which pages)."""
    return "bulk_queue" if error.metadata.get("setting") == BULK_SETTING else "queue"


Run = tuple[Request, int, int]  # a request, its first input, how many of its inputs


def runs(batch: list[Entry]) -> list[Run]:
    """The batch as runs of one request's inputs that follow one another there and in the batch. A
    request's inputs sit together in the queue, so a batch of 1,024 sentences from 32-sentence
    requests is ~32 runs: padding and answering copy a slice per run, not a row per input."""
    found: list[Run] = []
    for request, i in batch:
        if found:
            last, first, count = found[-1]
            if last is request and first + count == i:
                found[-1] = (last, first, count + 1)
                continue
        found.append((request, i, 1))
    return found


def pad(
    batch: list[Entry], pad_id: int = 0, batch_runs: list[Run] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The batch as ((B, T) int64 ids padded to the longest row, (B,) int64 lengths)."""
    lengths = np.fromiter((r.sizes[i] for r, i in batch), dtype=np.int64, count=len(batch))
    ids = np.full((len(batch), int(lengths.max())), pad_id, dtype=np.int64)
    batch_runs = runs(batch) if batch_runs is None else batch_runs
    if 2 * len(batch_runs) > len(batch):  # short runs (a batch drawn by length from many requests)
        for row, (request, i) in enumerate(batch):  # a row each costs less than a numpy call per run
            start, length = request.starts[i], request.sizes[i]
            ids[row, :length] = request.rows.ids[start : start + length]
        return ids, lengths
    pieces = []
    for request, first, count in batch_runs:
        end = first + count - 1
        pieces.append(request.rows.ids[request.starts[first] : request.starts[end] + request.sizes[end]])
    # Row-major, the real positions of the padded array are the ids one after another.
    ids[np.arange(ids.shape[1]) < lengths[:, None]] = np.concatenate(pieces)
    return ids, lengths


@dataclass
class Batcher:
    run: RunFn
    limits: BatchLimits
    metrics: Metrics
    pad_id: int = 0
    workers: int = 1  # batches in compute at once; `run` must be safe to call from that many threads
    ahead: int = 0  # batches prepared beyond those, each waiting on a model thread for an instance
    # One model instance held for a run (its wait for one not counted as the run's time); None: `run`.
    instance: Callable[[], AbstractContextManager[RunFn]] | None = None
    # Told the queue depth and its tokens whenever they change, and `s_per_token` after each batch.
    on_depth: Callable[[int, int], None] = lambda depth, tokens: None
    on_pace: Callable[[float], None] = lambda s_per_token: None
    # Interactive inputs first, then bulk ones, each oldest first. A list, not a deque: a batch reads
    # and rewrites the window at its head by slicing, and an interactive request is inserted ahead of
    # the bulk inputs (a memmove of at most queue_limit pointers).
    _queue: list[Entry] = field(default_factory=list)
    _interactive: int = 0  # the queue's first _interactive entries are interactive
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _executor: ThreadPoolExecutor | None = None
    _running: int = 0  # batches handed to a model thread, computing or waiting there for an instance
    # Batches handed to a model thread -> [when its run began on an instance; inf while it waits for one].
    # With `ahead`, at most `ahead` wait at once: with one (engine.BATCHES_AHEAD), no batch taken later
    # can take an instance from one taken earlier (an instance goes to whichever thread asks first once
    # it is free, not to the oldest); with more, those waiting at once can still overtake each other.
    _runs: dict[object, list[float]] = field(default_factory=dict)
    # Inputs waiting for their turn: those in the queue less those of requests already ended (their
    # caller cancelled, or one of their inputs failed), which stay in the queue until its head
    # reaches them and are dropped there, but hold no place in it: admission and depth count these.
    _waiting: int = 0
    _waiting_bulk: int = 0  # of _waiting, the bulk inputs
    _waiting_tokens: int = 0  # the tokens of the _waiting inputs
    # _waiting - _waiting_bulk, stored whole (_depth_changed) for a model thread to read: the two
    # counters it could see half-updated (a bulk batch given back for no interactive input).
    _interactive_waiting: int = 0
    # Inputs of ended requests still in the queue. Past queue_limit of them the queue is swept (at
    # the next enqueue), so it holds at most about twice the limit whatever callers do (submit and
    # cancel while every instance computes, for one).
    _dead: int = 0
    # Compute seconds, inputs and tokens of the batches run, decayed by exp(-inputs / PACE_INPUTS) a batch.
    _paced_s: float = 0.0
    _paced_inputs: float = 0.0
    _paced_tokens: float = 0.0

    def start(self) -> None:
        assert not self._tasks, "batcher already started"
        assert self.workers >= 1, f"workers must be at least 1, not {self.workers}"
        assert self.ahead >= 0 and (self.ahead == 0 or self.instance is not None), self.ahead
        loops = self.workers + self.ahead
        self._executor = ThreadPoolExecutor(max_workers=loops, thread_name_prefix="model")
        self._tasks = [asyncio.create_task(self._loop(), name=f"batcher-{i}") for i in range(loops)]

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The threads batches run on (`workers` + `ahead` of them), e.g. to warm the model up on."""
        assert self._executor is not None, "batcher not started"
        return self._executor

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return self._waiting

    @property
    def s_per_input(self) -> float:
        """The recent seconds of compute an input takes, the workers running side by side (0.0 until
        a batch has run). Batches weigh by their inputs: under load, full batches set it, not a lone
        input's latency; inputs run one by one after their batch failed do not count."""
        return self._paced_s / self._paced_inputs / self.workers if self._paced_inputs else 0.0

    @property
    def s_per_token(self) -> float:
        """The recent seconds of compute a token takes, weighed and decayed as s_per_input is."""
        return self._paced_s / self._paced_tokens / self.workers if self._paced_tokens else 0.0

    def check_capacity(self, count: int, bulk: bool = False) -> None:
        """Refuse at once when `count` more inputs cannot be queued (counted as a refusal)."""
        share = self.limits.bulk_queue_share if bulk else None
        try:
            pace = s_per_waiting_input(self.s_per_token, self._waiting_tokens, self._waiting)
            check_capacity(self._waiting, count, self.limits.queue_limit, share, pace)
        except Overloaded as e:
            self.metrics.refusals.labels(refusal_label(e)).inc()
            raise

    def enqueue(
        self, rows: Rows, deadline: float | None = None, tag: str = "", bulk: bool = False
    ) -> Request:
        """Queue one request's inputs; its future resolves when every input has its vectors.

        `cancel(request)` (the caller went away) drops the inputs not yet computed.
        """
        assert len(rows) > 0
        self.check_capacity(len(rows), bulk)
        if self._dead > self.limits.queue_limit:
            self._sweep()
        future = asyncio.get_running_loop().create_future()
        request = Request(rows, future, time.monotonic(), deadline, tag, bulk)
        entries = zip(itertools.repeat(request), range(len(rows)))
        if bulk:
            self._queue.extend(entries)
        else:
            self._queue[self._interactive : self._interactive] = entries
            self._interactive += len(rows)
        self._waiting += len(rows)
        self._waiting_bulk += len(rows) if bulk else 0
        self._waiting_tokens += request.queued_tokens
        self._depth_changed()
        self._wakeup.set()
        return request

    async def submit(self, rows: Rows, deadline: float | None = None) -> Done:
        """Queue one request and wait for its answer; on cancellation its inputs are dropped."""
        request = self.enqueue(rows, deadline)
        try:
            return await request.future
        finally:
            self.cancel(request)

    def cancel(self, request: Request) -> None:
        """The caller gave up: its inputs not yet computed give back their places now and are dropped
        before compute (a no-op for a request already answered)."""
        request.future.cancel()
        self._ended(request)

    def _fail(self, request: Request, error: Exception) -> None:
        request.fail(error)
        self._ended(request)

    def _ended(self, request: Request) -> None:
        """A request cancelled or failed: its inputs still queued no longer wait. Called where it
        ends (cancel, _fail) rather than from a callback on its future, which cost every request
        an event-loop turn; one cancelled elsewhere is accounted when the queue's head reaches it.

        Its wait until now is observed as its queue wait, as an answered request's is: a request
        dropped at its deadline (or whose caller gave up) waited too, and a queue wait counted only
        for the requests that beat their deadlines never reached any deadline (an acceptance pass:
        every call of a load past its deadline, and no wait observed)."""
        if request.queued:
            self.metrics.queue_wait.observe(time.monotonic() - request.enqueued)
            self._waiting -= request.queued
            self._waiting_bulk -= request.queued if request.bulk else 0
            self._waiting_tokens -= request.queued_tokens
            self._dead += request.queued
            request.queued = request.queued_tokens = 0
            self._depth_changed()

    def _sweep(self) -> None:
        """Drop every queued input of an ended request now, not when the queue's head reaches it."""
        now = time.monotonic()
        for request in {r for r, _ in self._queue if r.abandoned}:
            self._ended(request)  # one whose future was cancelled directly: its places come back here
        gone = collections.Counter(self._drop_reason(r, now) for r, _ in self._queue if r.abandoned)
        self._queue = [e for e in self._queue if not e[0].abandoned]
        self._interactive = sum(1 for request, _ in self._queue if not request.bulk)
        for reason, count in gone.items():
            self.metrics.dropped.labels(reason).inc(count)
        self._dead = 0

    def _depth_changed(self) -> None:
        self._interactive_waiting = self._waiting - self._waiting_bulk
        self.metrics.queue_depth.set(self._waiting)
        self.metrics.queue_interactive_depth.set(self._waiting - self._waiting_bulk)
        self.on_depth(self._waiting, self._waiting_tokens)

    async def _loop(self) -> None:
        """One worker: take the next batch whenever its previous one is done."""
        while True:
            await self._wait_for_batch()
            batch = self._take_batch()
            try:
                await self._run_batch(batch)
            except Exception:  # a bug here must fail one batch, never stop the server
                log.exception(
                    "batcher error; failing the %d inputs of this batch",
                    len(batch),
                    extra={"request_ids": _tags(batch)},
                )
                for request, _ in batch:
                    self._fail(request, BackendFailure("internal batching error", "INTERNAL_ERROR"))

    async def _wait_for_batch(self) -> None:
        """Until work is queued, then until a batch is full or the oldest input waited long enough.

        A lone input that finds every instance idle runs at once: waiting for company only pays
        while another batch is computing (its inputs arrive meanwhile). Interactive inputs batch
        among themselves, so while any wait it is their count that must fill a batch: a bulk backlog
        behind them does not send them off alone.

        A batch prepared ahead (while every instance computes) is taken only when a full one waits,
        by its inputs or by its tokens: a part batch waits for an instance to come free, gathering
        what arrives meanwhile, as it would without `ahead`. And only once those prepared before it
        hold an instance: batches then run in the order taken (a bulk request's rows in order, the
        interactive inputs a prepared batch was given back for before what came after them).
        """
        while True:
            while not self._queue or (self.ahead and self._waiting_for_instance() >= self.ahead):
                self._wakeup.clear()
                await self._wakeup.wait()
            if (self._interactive or len(self._queue)) >= self.limits.max_batch_size or not self._running:
                return
            if self._running >= self.workers:  # every instance spoken for: only with `ahead`
                # Full by its tokens too (a real token is at least a padded one); while both kinds
                # wait, the tokens waiting are not one kind's, and the inputs alone tell. A short
                # head among long inputs may still make a part batch: choosing the batch here at
                # each wake-up would cost ~0.9 ms of Python (a 1,024-input window, measured on
                # 2026-11-27: docs/benchmarks.md).
                one_kind = not self._interactive or not self._waiting_bulk
                if one_kind and self._waiting_tokens >= self.limits.max_batch_tokens:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()  # more inputs, or a run done
                continue
            # The head's own delay, looked at anew each time: another worker may have taken the
            # head this one waited on, or the last free instance (a review).
            remaining = self._queue[0][0].enqueued + self.limits.max_queue_delay_s - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    def _drop_reason(self, request: Request, now: float) -> str:
        """Why a request's inputs are dropped before compute ("" if they are not): its caller went
        away ("cancelled"), its deadline passed ("deadline", which fails it), or another of its inputs
        failed ("failed": the request has its answer, an error)."""
        expired = request.deadline is not None and now >= request.deadline
        if request.abandoned:
            if not request.future.cancelled() and not expired:
                return "failed"
            # gRPC cancels the call when its deadline passes, usually before this check sees it.
            return "deadline" if expired else "cancelled"
        if expired:
            self._fail(request, Dropped("deadline exceeded while queued; the input was not computed"))
            return "deadline"
        return ""

    def _take_batch(self) -> list[Entry]:
        """The next batch from the window at the head of the queue (dropping what is abandoned there).

        Each request in the window is checked once, not once per input.
        """
        now = time.monotonic()
        size = min(self.limits.lookahead, len(self._queue))
        # Interactive inputs batch among themselves (a query batched with bulk neighbours would wait
        # for their compute too), so the window is all interactive or all bulk.
        size = min(size, self._interactive or size)
        head = self._queue[:size]
        requests = dict.fromkeys(map(operator.itemgetter(0), head))
        dead = {r: why for r in requests if (why := self._drop_reason(r, now))}
        window = head
        if dead:
            for request in dead:
                self._ended(request)  # at the latest: a future cancelled outside `cancel`
            window = [e for e in head if e[0] not in dead]
            for request, count in collections.Counter(e[0] for e in head if e[0] in dead).items():
                self.metrics.dropped.labels(dead[request]).inc(count)
                self._dead = max(0, self._dead - count)
        if not window:
            del self._queue[:size]
            self._interactive -= size if self._interactive else 0
            self._depth_changed()
            return []
        lengths = [request.sizes[i] for request, i in window]
        chosen = choose_batch(
            lengths, self.limits.max_batch_tokens, self.limits.max_batch_size, self.limits.max_padding
        )
        taken = set(chosen)
        rest = [e for i, e in enumerate(window) if i not in taken]  # in order
        self._interactive -= size - len(rest) if self._interactive else 0
        self._queue[:size] = rest
        batch = [window[i] for i in chosen]
        for request, i in batch:  # live requests: an ended one's inputs are not chosen
            request.queued -= 1
            request.queued_tokens -= request.sizes[i]
            self._waiting_tokens -= request.sizes[i]
        self._waiting -= len(batch)
        self._waiting_bulk -= len(batch) if batch[0][0].bulk else 0  # a window is all of one kind
        self._depth_changed()
        return batch

    async def _run_batch(self, batch: list[Entry]) -> None:
        if not batch:
            return
        batch_runs = runs(batch)
        ids, lengths = pad(batch, self.pad_id, batch_runs)
        self._running += 1
        try:
            ran = await self._in_worker(ids, lengths, self._still_wanted(batch_runs) if self.ahead else None)
            if ran is None:
                self._give_back(batch)
                return
            (normalised, pooled), started, run_s = ran
        except Exception:
            log.exception(
                "a batch of %d inputs failed; retrying its inputs one by one",
                len(batch),
                extra={"request_ids": _tags(batch)},
            )
            self.metrics.batch_failures.inc()
            await self._run_singly(batch)
            return
        finally:
            self._running -= 1
            self._wakeup.set()  # an instance free: a part batch waiting for one (`ahead`) goes
        self._observe(batch, ids.size, int(lengths.sum()), started, run_s)
        self._paced(len(batch), int(lengths.sum()), run_s)
        self._resolve(batch_runs, normalised, pooled, started, run_s)

    def _paced(self, inputs: int, tokens: int, run_s: float) -> None:
        keep = math.exp(-inputs / PACE_INPUTS)
        self._paced_s = keep * self._paced_s + run_s
        self._paced_inputs = keep * self._paced_inputs + inputs
        self._paced_tokens = keep * self._paced_tokens + tokens
        self.on_pace(self.s_per_token)

    async def _run_singly(self, batch: list[Entry]) -> None:
        """After a batch failed: each input alone, so only the inputs that fail by themselves fail."""
        for entry in batch:
            request = entry[0]
            if request.abandoned:
                continue
            ids, lengths = pad([entry], self.pad_id)
            try:
                ran = await self._in_worker(ids, lengths)
                assert ran is not None  # nothing asked whether it is still wanted
                (normalised, pooled), started, run_s = ran
            except Exception as e:  # its caller may have gone while this input ran: fail() checks
                log.warning("input %d failed alone too: %r", entry[1], e, extra={"request_id": request.tag})
                self._fail(request, BackendFailure(f"model run failed for this input: {type(e).__name__}"))
                continue
            self._observe([entry], ids.size, ids.size, started, run_s)
            self._resolve(runs([entry]), normalised, pooled, started, run_s)

    def _still_wanted(self, batch_runs: list[Run]) -> Callable[[], bool]:
        """Whether a batch prepared ahead should run once it has an instance: not a bulk batch while
        interactive inputs wait (they would wait for its run too), nor one whose every request ended
        or passed its deadline while it waited (computed for nobody, or answered late)."""
        bulk = batch_runs[0][0].bulk

        def wanted() -> bool:  # on the model thread: reads only
            if bulk and self._interactive_waiting > 0:
                return False
            now = time.monotonic()
            return any(not r.abandoned and (r.deadline is None or now < r.deadline) for r, _, _ in batch_runs)

        return wanted

    def _give_back(self, batch: list[Entry]) -> None:
        """A batch prepared ahead that did not run: back at the head of its kind's inputs, counted
        as waiting again (those of ended requests as the queue's dead), to be taken anew. Its places
        may have gone to requests admitted meanwhile: the depth can pass queue_limit by a batch."""
        bulk = batch[0][0].bulk
        at = self._interactive if bulk else 0
        self._queue[at:at] = batch
        if not bulk:
            self._interactive += len(batch)
        for request, i in batch:
            if request.abandoned:
                self._dead += 1
                continue
            request.queued += 1
            request.queued_tokens += request.sizes[i]
            self._waiting_tokens += request.sizes[i]
            self._waiting += 1
            self._waiting_bulk += 1 if bulk else 0
        self.metrics.batches_given_back.inc()
        self._depth_changed()

    async def _in_worker(
        self, ids: np.ndarray, lengths: np.ndarray, wanted: Callable[[], bool] | None = None
    ) -> tuple[tuple[np.ndarray, np.ndarray], float, float] | None:
        """The batch's outputs, when its run began on an instance, and how long it ran there; None
        when `wanted`, asked once an instance is held, says it should not run."""
        assert self._executor is not None, "batcher not started"
        loop = asyncio.get_running_loop()
        key, began = object(), [math.inf]
        self._runs[key] = began
        # With `ahead`, a run's start wakes the loop: the next batch may be prepared (_wait_for_batch).
        # A batch given back frees it from _runs, _run_batch's wake-up following once it is queued again.
        began_wakes = functools.partial(loop.call_soon_threadsafe, self._wakeup.set) if self.ahead else None
        try:
            compute = functools.partial(self._compute, began, ids, lengths, wanted, began_wakes)
            return await loop.run_in_executor(self._executor, compute)
        finally:
            del self._runs[key]

    def _waiting_for_instance(self) -> int:
        """Batches handed to a model thread that have not begun their run on an instance."""
        return sum(began[0] == math.inf for began in self._runs.values())

    def _compute(
        self,
        began: list[float],
        ids: np.ndarray,
        lengths: np.ndarray,
        wanted: Callable[[], bool] | None,
        began_wakes: Callable[[], object] | None,
    ) -> tuple[tuple[np.ndarray, np.ndarray], float, float] | None:
        # On a model thread. The wait for an instance (a batch prepared ahead) is no part of the run.
        with self.instance() if self.instance is not None else contextlib.nullcontext(self.run) as run:
            if wanted is not None and not wanted():
                return None  # given back: the next batch is taken once it is in the queue again
            began[0] = started = time.monotonic()
            if began_wakes is not None:
                began_wakes()
            outputs = run(ids, lengths)
            return outputs, started, time.monotonic() - started

    def longest_run_s(self) -> float:
        """How long the oldest model run now computing has been at it (0: none is; a batch waiting
        for an instance is not computing)."""
        oldest = min((began[0] for began in self._runs.values()), default=math.inf)
        return time.monotonic() - oldest if oldest < math.inf else 0.0

    def _resolve(
        self, batch_runs: list[Run], normalised: np.ndarray, pooled: np.ndarray, started: float, run_s: float
    ) -> None:
        finite = np.isfinite(normalised).all(axis=1)
        check = not finite.all()
        span = (started, started + run_s)
        row = 0
        for request, first, count in batch_runs:
            start = row
            row = end = start + count
            if request.abandoned:
                continue
            if check and not finite[start:end].all():
                self._fail(
                    request,
                    BackendFailure(
                        "the model produced a non-finite vector for this input", "NON_FINITE_VECTOR"
                    ),
                )
                continue
            request.spans.append(span)
            if request.fill(first, normalised[start:end], pooled[start:end], started):
                self.metrics.queue_wait.observe(request.queue_s)

    def _observe(self, batch: list[Entry], padded: int, real: int, started: float, run_s: float) -> None:
        m = self.metrics
        m.batch_size.observe(len(batch))
        m.batch_padded_tokens.observe(padded)
        m.batch_tokens_total.inc(padded)
        m.tokens.inc(real)
        m.inputs.inc(len(batch))
        m.model_run_duration.observe(run_s)


def _tags(batch: list[Entry]) -> list[str]:
    """The request ids in a batch, each once, in order."""
    return list(dict.fromkeys(request.tag for request, _ in batch if request.tag))
