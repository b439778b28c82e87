"""The queue and the batching: the only place that decides which inputs run together.

Inputs wait in one FIFO queue. A batch always holds the oldest waiting input (so none starves) and
grows with its neighbours in length order, taken from a window at the head of the queue, choosing at
each step the neighbour that adds the least padding, while the padded cost (rows x longest row) stays
within the token budget and the rows within the batch size. The batch is padded here and its
per-row lengths go to the model, which builds its attention mask from them (and skips the padding
in every per-token layer, so padding costs only attention's share). Inputs whose caller
cancelled, or whose deadline passed, are dropped before compute. A full queue refuses new work at
once, so memory stays bounded under any load.

Up to `workers` batches run at once, one per model instance: while one instance computes, another
takes the next batch. On the CPU provider two one-thread instances outran one two-thread instance on
the same two cores (no barrier between threads inside an op; see README, "Settings").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from model.tokenizer import pad_batch
from server.errors import BackendFailure, Dropped, InvalidInput, Overloaded
from server.metrics import Metrics

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


@dataclass(frozen=True)
class Result:
    embedding: np.ndarray  # (D,) L2-normalised
    pooled: np.ndarray  # (D,) before normalisation
    queue_s: float
    run_started: float  # time.monotonic() when its batch started
    run_s: float
    batch_id: int


@dataclass(eq=False)
class Pending:
    ids: Sequence[int]
    future: asyncio.Future[Result]
    enqueued: float
    deadline: float | None = None  # time.monotonic() value

    @property
    def abandoned(self) -> bool:
        return self.future.done()


def choose_batch(
    lengths: Sequence[int], max_tokens: int, max_size: int, max_padding: float = 1.0
) -> list[int]:
    """Indices into `lengths` (a window, oldest first) forming the next batch; always holds 0.

    Grows a run of neighbours in length order around the oldest input, adding each time the
    neighbour that adds the least padding, while rows x longest row <= max_tokens and the share of
    padding in the batch stays <= max_padding (padding still costs attention, whose share grows with
    the longest row; the inputs left out form their own batch next).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
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


@dataclass
class Batcher:
    run: RunFn
    limits: BatchLimits
    metrics: Metrics
    pad_id: int = 0
    workers: int = 1  # batches in compute at once; `run` must be safe to call from that many threads
    _queue: deque[Pending] = field(default_factory=deque)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _executor: ThreadPoolExecutor | None = None
    _batch_ids: itertools.count[int] = field(default_factory=itertools.count)

    def start(self) -> None:
        assert not self._tasks, "batcher already started"
        assert self.workers >= 1, f"workers must be at least 1, not {self.workers}"
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="model")
        self._tasks = [asyncio.create_task(self._loop(), name=f"batcher-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return len(self._queue)

    def check_capacity(self, count: int) -> None:
        """Refuse at once (before any tokenizing) when `count` more inputs cannot be queued."""
        if count > self.limits.queue_limit:
            raise InvalidInput(f"{count} inputs can never fit the queue_limit of {self.limits.queue_limit}")
        if len(self._queue) + count > self.limits.queue_limit:
            self.metrics.refused.inc()
            raise Overloaded(
                f"queue full: {len(self._queue)} inputs waiting, queue_limit is {self.limits.queue_limit}; "
                "retry with backoff"
            )

    async def submit(self, rows: Sequence[Sequence[int]], deadline: float | None = None) -> list[Result]:
        """Queue one request's rows; results come back in the rows' order."""
        self.check_capacity(len(rows))
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        pending = [Pending(row, loop.create_future(), now, deadline) for row in rows]
        self._queue.extend(pending)
        self.metrics.queue_depth.set(len(self._queue))
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        finally:
            for p in pending:  # on failure or cancellation, the rest is dropped before compute
                p.future.cancel()

    async def _loop(self) -> None:
        """One worker: take the next batch whenever its previous one is done."""
        while True:
            await self._wait_for_batch()
            batch = self._take_batch()
            try:
                await self._run_batch(batch)
            except Exception:  # a bug here must fail one batch, never stop the server
                log.exception("batcher error; failing the %d inputs of this batch", len(batch))
                for p in batch:
                    if not p.abandoned:
                        p.future.set_exception(BackendFailure("internal batching error"))

    async def _wait_for_batch(self) -> None:
        """Until work is queued, then until a batch is full or the oldest input waited long enough."""
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        flush_at = self._queue[0].enqueued + self.limits.max_queue_delay_s
        while len(self._queue) < self.limits.max_batch_size:
            remaining = flush_at - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _drop_abandoned(self) -> None:
        now = time.monotonic()
        kept: deque[Pending] = deque()
        for p in self._queue:
            expired = p.deadline is not None and now >= p.deadline
            if p.abandoned:
                # gRPC cancels the call when its deadline passes, usually before this check sees it.
                self.metrics.dropped.labels("deadline" if expired else "cancelled").inc()
            elif expired:
                self.metrics.dropped.labels("deadline").inc()
                p.future.set_exception(Dropped("deadline exceeded while queued; the input was not computed"))
            else:
                kept.append(p)
        self._queue = kept

    def _take_batch(self) -> list[Pending]:
        self._drop_abandoned()
        window = list(itertools.islice(self._queue, self.limits.window))
        if not window:
            self.metrics.queue_depth.set(0)
            return []
        lengths = [len(p.ids) for p in window]
        chosen = choose_batch(
            lengths, self.limits.max_batch_tokens, self.limits.max_batch_size, self.limits.max_padding
        )
        taken = set(chosen)
        batch = [window[i] for i in chosen]
        rest = (p for i, p in enumerate(self._queue) if i not in taken)
        self._queue = deque(rest)
        self.metrics.queue_depth.set(len(self._queue))
        return batch

    async def _run_batch(self, batch: list[Pending]) -> None:
        if not batch:
            return
        ids, lengths = pad_batch([list(p.ids) for p in batch], self.pad_id)
        batch_id = next(self._batch_ids)
        started = time.monotonic()
        try:
            normalised, pooled = await self._in_worker(ids, lengths)
        except Exception:
            log.exception("batch %d (%d inputs) failed; retrying its inputs one by one", batch_id, len(batch))
            self.metrics.batch_failures.inc()
            await self._run_singly(batch, batch_id)
            return
        run_s = time.monotonic() - started
        self._observe(batch, ids.size, int(lengths.sum()), started, run_s)
        for i, p in enumerate(batch):
            self._resolve(p, normalised[i], pooled[i], started, run_s, batch_id)

    async def _run_singly(self, batch: list[Pending], batch_id: int) -> None:
        """After a batch failed: each input alone, so only the inputs that fail by themselves fail."""
        for p in batch:
            if p.abandoned:
                continue
            started = time.monotonic()
            try:
                normalised, pooled = await self._in_worker(*pad_batch([list(p.ids)], self.pad_id))
            except Exception as e:
                if not p.abandoned:  # its caller may have gone while this input ran
                    p.future.set_exception(
                        BackendFailure(f"model run failed for this input: {type(e).__name__}")
                    )
                continue
            run_s = time.monotonic() - started
            self._observe([p], len(p.ids), len(p.ids), started, run_s)
            self._resolve(p, normalised[0], pooled[0], started, run_s, batch_id)

    async def _in_worker(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self._executor is not None, "batcher not started"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, ids, lengths)

    def _resolve(
        self, p: Pending, vector: np.ndarray, pooled: np.ndarray, started: float, run_s: float, batch_id: int
    ) -> None:
        if p.abandoned:
            return
        if not np.isfinite(vector).all():
            p.future.set_exception(BackendFailure("the model produced a non-finite vector for this input"))
            return
        p.future.set_result(Result(vector, pooled, started - p.enqueued, started, run_s, batch_id))

    def _observe(self, batch: list[Pending], padded: int, real: int, started: float, run_s: float) -> None:
        m = self.metrics
        m.batch_size.observe(len(batch))
        m.batch_padded_tokens.observe(padded)
        m.batch_tokens_total.inc(padded)
        m.tokens.inc(real)
        m.inputs.inc(len(batch))
        m.model_run_duration.observe(run_s)
        for p in batch:
            m.queue_wait.observe(started - p.enqueued)
