"""The batcher with a fake model: which inputs run together, padding, order, and what is dropped or refused.

The fake model records every batch it is given, so a test can see exactly what reached "compute".
Row i's vector is (first id, length): each result can be traced back to the input it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minilm_embed.server.batcher import (
    Batcher,
    BatchLimits,
    Done,
    Rows,
    check_capacity,
    choose_batch,
    retry_after,
)
from minilm_embed.server.errors import BackendFailure, Dropped, InvalidInput, Overloaded
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.place import SharedQueue
from tests.server_process import wait_until


async def submit(batcher: Batcher, rows: list[list[int]], deadline: float | None = None) -> Done:
    """One request of these token-id rows."""
    return await batcher.submit(Rows.of(rows), deadline)


T = TypeVar("T")
PAD = 0
FAULT = 99  # a row starting with this id makes the fake model fail the whole batch
NAN = 98  # a row starting with this id gets a NaN vector (a numerically broken model or input)


class FakeModel:
    """Stands in for the ONNX backend: records every (ids, lengths) batch; can block or fail."""

    def __init__(self, blocked: bool = False) -> None:
        self.batches: list[tuple[np.ndarray, np.ndarray]] = []
        self.gate = threading.Event()
        if not blocked:
            self.gate.set()

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.batches.append((ids.copy(), lengths.copy()))
        assert self.gate_of(ids).wait(10), "the test never released the fake model"
        if (ids[:, 0] == FAULT).any():
            raise RuntimeError("fake model failure")
        vectors = np.stack([ids[:, 0], lengths], axis=1).astype(np.float32)  # (B, 2)
        vectors[ids[:, 0] == NAN] = np.nan
        return vectors, vectors * 2

    def gate_of(self, ids: np.ndarray) -> threading.Event:
        """What a batch waits for before it computes."""
        return self.gate

    def first_ids_seen(self) -> list[int]:
        return [int(i) for ids, _ in self.batches for i in ids[:, 0]]

    def first_ids_by_batch(self) -> list[list[int]]:
        return [[int(i) for i in ids[:, 0]] for ids, _ in self.batches]


# Each (depth, tokens) a batcher of new_batcher's published in which the tokens cannot be those of the
# inputs waiting (every input has at least one token); checked empty after every test.
BAD_TOKEN_COUNTS: list[tuple[int, int]] = []


@pytest.fixture(autouse=True)
def _queued_tokens_match_the_queued_inputs():
    BAD_TOKEN_COUNTS.clear()
    yield
    assert BAD_TOKEN_COUNTS == []


def _check_tokens(depth: int, tokens: int) -> None:
    if not (tokens >= depth >= 0 and (depth == 0) == (tokens == 0)):
        BAD_TOKEN_COUNTS.append((depth, tokens))


def new_batcher(
    model: FakeModel,
    max_batch_tokens: int = 64,
    max_batch_size: int = 8,
    max_queue_delay_s: float = 0.0,
    queue_limit: int = 64,
    workers: int = 1,
) -> Batcher:
    limits = BatchLimits(max_batch_tokens, max_batch_size, max_queue_delay_s, queue_limit)
    return Batcher(model.run, limits, Metrics(), pad_id=PAD, workers=workers, on_depth=_check_tokens)


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """Run one scenario on a fresh event loop, never longer than 20 s."""

    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), 20)

    return asyncio.run(bounded())


def sample(batcher: Batcher, name: str, **labels: str) -> float:
    value = batcher.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def first_ids(done: Done) -> list[int]:
    return [int(v) for v in done.embeddings[:, 0]]


# choose_batch ---------------------------------------------------------------------------------------


def test_choose_batch_keeps_the_oldest_input_even_when_it_is_the_longest():
    assert 0 in choose_batch([50, 3, 3, 3, 3], max_tokens=100, max_size=8)
    assert choose_batch([64, 3, 3], max_tokens=64, max_size=8) == [0]


def test_choose_batch_picks_similar_lengths_from_the_window():
    lengths = [10, 100, 11, 98, 12, 99, 10]
    assert choose_batch(lengths, max_tokens=1000, max_size=4) == [0, 2, 4, 6]


def test_choose_batch_respects_the_batch_size():
    assert len(choose_batch([5] * 20, max_tokens=10_000, max_size=6)) == 6


def test_choose_batch_respects_the_padded_token_budget():
    # 4 rows x 25 = 100 fits; a fifth row of 25 would make 125.
    assert len(choose_batch([25] * 10, max_tokens=100, max_size=32)) == 4


def test_choose_batch_takes_a_shorter_input_when_the_next_longer_one_does_not_fit():
    # Four rows of 200 cost 800. A fifth row of 210 would cost 1050 > 1024, but the row of 50
    # costs 5 x 200 = 1000: the batch should take it rather than stop at four rows.
    lengths = [200, 200, 200, 200, 210, 50]
    assert choose_batch(lengths, max_tokens=1024, max_size=32) == [0, 1, 2, 3, 5]


def test_choose_batch_keeps_the_share_of_padding_within_max_padding():
    # 100 + 10 tokens padded to 2 x 100: 45% padding. At max_padding 0.5 they share a batch; at 0.3
    # the short one waits for a batch of its own.
    assert choose_batch([100, 10], max_tokens=1000, max_size=8, max_padding=0.5) == [0, 1]
    assert choose_batch([100, 10], max_tokens=1000, max_size=8, max_padding=0.3) == [0]


@given(
    lengths=st.lists(st.integers(1, 32), min_size=1, max_size=40),
    max_padding=st.sampled_from([0.0, 0.1, 0.3, 0.5]),
)
def test_choose_batch_never_pads_past_max_padding(lengths, max_padding):
    chosen = choose_batch(lengths, 10_000, 32, max_padding)
    rows = [lengths[i] for i in chosen]
    if len(rows) > 1:  # the oldest input alone is always taken
        assert sum(rows) >= (1.0 - max_padding) * len(rows) * max(rows)


@given(
    # Short lengths and budgets, so that ties and budget edges come up often.
    lengths=st.lists(st.integers(1, 32), min_size=1, max_size=40),
    max_size=st.integers(1, 24),
    extra_tokens=st.integers(0, 160),
)
@example(lengths=[200, 200, 200, 200, 210, 50], max_size=32, extra_tokens=814)
def test_choose_batch_properties(lengths, max_size, extra_tokens):
    max_tokens = max(lengths) + extra_tokens  # the server guarantees one max-length input fits
    chosen = choose_batch(lengths, max_tokens, max_size)
    rows = [lengths[i] for i in chosen]
    assert 0 in chosen
    assert chosen == sorted(set(chosen))
    assert len(chosen) <= max_size
    assert len(chosen) * max(rows) <= max_tokens
    # Similar lengths: no input left out lies strictly between the batch's shortest and longest.
    left_out = [i for i in range(len(lengths)) if i not in set(chosen)]
    assert not [i for i in left_out if min(rows) < lengths[i] < max(rows)]
    # Full: while rows are left, no single input left out would still have fitted the budget.
    if len(chosen) < max_size:
        assert all((len(chosen) + 1) * max(max(rows), lengths[i]) > max_tokens for i in left_out)


# Batcher --------------------------------------------------------------------------------------------


def test_a_lone_input_on_an_idle_batcher_runs_without_waiting_for_company():
    """Waiting for company pays only while another batch computes: with every instance idle a lone
    input runs at once, long before a (here 60 s) queue delay would let it."""
    model = FakeModel()
    batcher = new_batcher(model, max_queue_delay_s=60.0)

    async def scenario():
        batcher.start()
        try:
            return await asyncio.wait_for(submit(batcher, [[7, 5]]), 10)
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == [7]


def test_inputs_of_one_request_spanning_several_batches_come_back_in_order():
    model = FakeModel()
    batcher = new_batcher(model, max_batch_size=2)
    rows = [[10 + i] + [5] * length for i, length in enumerate([7, 1, 4, 9, 1, 3, 6])]

    async def scenario():
        batcher.start()
        try:
            return await submit(batcher, rows)
        finally:
            await batcher.stop()

    results = run(scenario)
    assert first_ids(results) == [10, 11, 12, 13, 14, 15, 16]
    assert [int(v) for v in results.embeddings[:, 1]] == [len(r) for r in rows]
    assert len(model.batches) >= 4
    assert sorted(model.first_ids_seen()) == list(range(10, 17))
    assert sample(batcher, "embed_queue_depth") == 0


def test_two_workers_compute_two_batches_at_once_and_answers_keep_their_order():
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, max_batch_size=2, workers=2)
    rows = [[10 + i, 5] for i in range(6)]

    async def scenario():
        batcher.start()
        try:
            answers = asyncio.create_task(submit(batcher, rows))
            await wait_until(lambda: len(model.batches) == 2)  # both instances busy at once
            await asyncio.sleep(0.05)
            assert len(model.batches) == 2  # no third batch while both are busy
            assert batcher.depth == 2
            model.gate.set()
            return await answers
        finally:
            await batcher.stop()

    results = run(scenario)
    assert first_ids(results) == list(range(10, 16))
    assert len(model.batches) == 3


class Instances:
    """The fake model as `count` instances, one held by a batch while it runs (as OnnxBackend's
    instance()); counts the runs at once, and how long a batch held one (`hold_s` each)."""

    def __init__(self, model: FakeModel, hold_s: float = 0.0, count: int = 1) -> None:
        self.model, self.hold_s = model, hold_s
        self.slots = threading.Semaphore(count)
        self.counting = threading.Lock()
        self.at_once = self.most_at_once = 0

    @contextlib.contextmanager
    def instance(self):
        with self.slots:
            with self.counting:
                self.at_once += 1
                self.most_at_once = max(self.most_at_once, self.at_once)
            try:
                yield self.run
            finally:
                with self.counting:
                    self.at_once -= 1

    def run(self, ids, lengths):
        time.sleep(self.hold_s)
        return self.model.run(ids, lengths)


def batcher_ahead(one: Instances, ahead: int) -> Batcher:
    limits = BatchLimits(64, 2, 0.0, 64)
    return Batcher(one.model.run, limits, Metrics(), pad_id=PAD, ahead=ahead, instance=one.instance)


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_batch_is_prepared_ahead_while_the_one_instance_computes_and_waits_for_it(ahead):
    # On CUDA (engine.BATCHES_AHEAD) the next batch is taken and padded while the instance computes,
    # so the event loop's work overlaps the run: an H200's instance was idle a third of the time.
    one = Instances(FakeModel(blocked=True))
    batcher = batcher_ahead(one, ahead)
    rows = [[10 + i, 5] for i in range(6)]

    async def scenario():
        batcher.start()
        try:
            answers = asyncio.create_task(submit(batcher, rows))
            await wait_until(lambda: len(one.model.batches) == 1)
            await asyncio.sleep(0.05)
            assert len(one.model.batches) == 1  # the prepared batch waits for the instance
            assert batcher.depth == 4 - 2 * ahead  # taken from the queue: 2 rows a batch
            one.model.gate.set()
            return await answers
        finally:
            await batcher.stop()

    results = run(scenario)
    assert first_ids(results) == list(range(10, 16))
    assert len(one.model.batches) == 3 and one.most_at_once == 1


class SlowWakers(Instances):
    """One instance that a thread asking for it while it is free takes at once, but a thread already
    waiting looks again only every 50 ms: as a lock or queue.Queue, which hand a freed instance to
    whichever thread asks first, can do when the waiting thread is slow to wake (the GIL, a busy core)."""

    def __init__(self, model: FakeModel) -> None:
        super().__init__(model)
        self.free = True

    @contextlib.contextmanager
    def instance(self):
        while True:
            with self.counting:
                if self.free:
                    self.free = False
                    break
            time.sleep(0.05)
        try:
            yield self.run
        finally:
            with self.counting:
                self.free = True


def test_batches_prepared_ahead_run_in_the_order_taken_when_a_later_one_could_take_the_instance_first():
    # A bulk request's batches [10, 11] [12, 13] [14, 15]: once the first was done, its loop took the
    # third while the second's thread had not yet woken for the instance, and the third often ran
    # first (seen 1 run in 16 of the test below, 4 in 120 beside a CPU hog).
    one = SlowWakers(FakeModel(blocked=True))
    batcher = batcher_ahead(one, 1)

    async def scenario():
        batcher.start()
        try:
            answers = asyncio.create_task(submit(batcher, [[10 + i, 5] for i in range(8)]))
            await wait_until(lambda: len(one.model.batches) == 1)
            await asyncio.sleep(0.05)
            one.model.gate.set()
            return await answers
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == list(range(10, 18))
    assert one.model.first_ids_by_batch() == [[10, 11], [12, 13], [14, 15], [16, 17]]


class LateGivers(Instances):
    """Instances whose thread, after holding one only to give its batch back, is slow to come back
    (0.2 s: a thread descheduled there, by the GIL or a busy core). `held` records, for each batch
    that ran, when its thread got the instance and the batch's first id: the order batches began
    in. Two instances compute at once, so the order the model is entered in can differ from it by
    a thread's scheduling after the batch began (seen on a loaded machine: 5 in 25 runs)."""

    def __init__(self, model: FakeModel, count: int = 1) -> None:
        super().__init__(model, count=count)
        self.held: list[tuple[float, int]] = []

    @contextlib.contextmanager
    def instance(self):
        ran = []
        with super().instance():
            held_at = time.monotonic()

            def run(ids, lengths):
                ran.append(True)
                self.held.append((held_at, int(ids[0, 0])))
                return self.run(ids, lengths)

            yield run
        if not ran:
            time.sleep(0.2)


class GateEach(FakeModel):
    """A batch whose first id is one of `gated` waits for its own gate, the others for `gate`."""

    def __init__(self, *gated: int) -> None:
        super().__init__(blocked=True)
        self.gates = {first: threading.Event() for first in gated}

    def gate_of(self, ids: np.ndarray) -> threading.Event:
        return self.gates.get(int(ids[0, 0]), self.gate)


def test_with_two_instances_a_bulk_batch_given_back_runs_before_the_later_ones_of_its_request():
    # [10, 11] and [12, 13] compute on the two instances, [14, 15] prepared ahead; an interactive
    # input comes, so [14, 15] is given back once it holds an instance. The next batch was taken as
    # soon as [14, 15] held one, before it was back in the queue: [16, 17] ran before it (a review,
    # 5-7 runs in 30 without the slow thread).
    two = LateGivers(GateEach(10, 12), count=2)
    limits = BatchLimits(64, 2, 0.0, 64)
    batcher = Batcher(two.model.run, limits, Metrics(), pad_id=PAD, workers=2, ahead=1, instance=two.instance)

    async def scenario():
        batcher.start()
        try:
            bulk = batcher.enqueue(Rows.of([[10 + i, 5] for i in range(10)]), bulk=True)
            await wait_until(lambda: len(two.model.batches) == 2 and batcher.depth == 4)
            interactive = asyncio.create_task(submit(batcher, [[50, 5]]))
            await asyncio.sleep(0.02)
            for gate in (two.model.gate, *two.model.gates.values()):
                gate.set()
            return first_ids(await bulk.future), first_ids(await interactive)
        finally:
            await batcher.stop()

    assert run(scenario) == (list(range(10, 20)), [50])
    began = [first for _, first in sorted(two.held) if first != 50]
    # [10, 11] and [12, 13] compute at once, in either order; then the rest in the order taken.
    assert sorted(began[:2]) == [10, 12] and began[2:] == [14, 16, 18], began
    assert sample(batcher, "embed_batches_given_back_total") == 1
    assert sample(batcher, "embed_queue_depth") == 0


def test_a_part_batch_is_not_prepared_ahead_but_gathers_what_arrives_while_the_instance_computes():
    # Prepared early, a part batch would hold only what came before it, leaving what arrives during
    # the run to a batch of its own: more, smaller runs at a moderate load.
    one = Instances(FakeModel(blocked=True))
    limits = BatchLimits(64, 8, 0.0, 64)
    batcher = Batcher(one.model.run, limits, Metrics(), pad_id=PAD, ahead=1, instance=one.instance)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[10, 5]]))
            await wait_until(lambda: len(one.model.batches) == 1)  # a lone input runs at once
            later = [asyncio.create_task(submit(batcher, [[11 + i, 5]])) for i in range(3)]
            await asyncio.sleep(0.05)
            assert batcher.depth == 3  # not taken: no full batch waits
            later += [asyncio.create_task(submit(batcher, [[14 + i, 5]])) for i in range(2)]
            await asyncio.sleep(0.05)
            assert batcher.depth == 5
            one.model.gate.set()
            return [await first] + [await answer for answer in later]
        finally:
            await batcher.stop()

    results = run(scenario)
    assert [first_ids(r) for r in results] == [[10 + i] for i in range(6)]
    assert [len(ids) for ids, _ in one.model.batches] == [1, 5]


def test_a_batch_full_by_its_tokens_is_prepared_ahead_too():
    # CUDA's auto limits fill by tokens first with long inputs (512 rows of 256 tokens); a review
    # found only a count-full batch prepared ahead.
    one = Instances(FakeModel(blocked=True))
    limits = BatchLimits(20, 8, 0.0, 64)  # inputs of 5 tokens: 4 a batch by tokens, 8 by count
    batcher = Batcher(one.model.run, limits, Metrics(), pad_id=PAD, ahead=1, instance=one.instance)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[10, 1, 1, 1, 1]]))
            await wait_until(lambda: len(one.model.batches) == 1)
            later = asyncio.create_task(submit(batcher, [[11 + i, 1, 1, 1, 1] for i in range(7)]))
            await asyncio.sleep(0.05)
            assert batcher.depth == 3  # a batch of 4 taken ahead
            one.model.gate.set()
            return await first, await later
        finally:
            await batcher.stop()

    run(scenario)
    assert [len(ids) for ids, _ in one.model.batches] == [1, 4, 3]


def test_with_two_instances_a_part_batch_is_not_prepared_ahead_either():
    # Two workers waiting out the same queue delay: the second, timed out after the first had taken
    # the last free instance, took a part batch ahead (a review).
    model = FakeModel(blocked=True)
    limits = BatchLimits(64, 4, 0.05, 64)
    two = Instances(model, count=2)
    batcher = Batcher(model.run, limits, Metrics(), pad_id=PAD, workers=2, ahead=1, instance=two.instance)

    async def scenario():
        batcher.start()
        try:
            first = batcher.enqueue(Rows.of([[10, 5]]))
            await wait_until(lambda: len(model.batches) == 1)  # one instance computes
            interactive = batcher.enqueue(Rows.of([[20, 5]]))
            bulk = batcher.enqueue(Rows.of([[30, 5], [31, 5]]), bulk=True)
            await asyncio.sleep(0.3)
            assert batcher._running == 2 and batcher.depth == 2
            more = batcher.enqueue(Rows.of([[32, 5]]), bulk=True)  # arrives during the runs
            await asyncio.sleep(0.05)
            model.gate.set()
            for r in (first, interactive, bulk, more):
                await r.future
        finally:
            await batcher.stop()

    run(scenario)
    assert model.first_ids_by_batch() == [[10], [20], [30, 31, 32]]


class GatedByFirstId(FakeModel):
    """Each batch waits for the gate of its first row's first id."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[int, threading.Event] = {}

    def gate_for(self, first: int) -> threading.Event:
        return self.gates.setdefault(first, threading.Event())

    def gate_of(self, ids: np.ndarray) -> threading.Event:
        return self.gate_for(int(ids[0, 0]))


@pytest.mark.parametrize("ahead", [0, 1])
def test_an_input_arriving_after_the_head_a_worker_timed_was_taken_waits_its_own_delay(ahead):
    # A worker that had waited out the delay of a head another worker then took sent a later input
    # off alone on that old clock the moment an instance came free (a review).
    model = GatedByFirstId()
    model.gate_for(30).set()
    two = Instances(model, count=2)
    limits = BatchLimits(64, 4, 0.2, 64)
    instance = two.instance if ahead else None
    batcher = Batcher(model.run, limits, Metrics(), pad_id=PAD, workers=2, ahead=ahead, instance=instance)

    async def scenario():
        batcher.start()
        try:
            a = batcher.enqueue(Rows.of([[10, 5]]))
            await wait_until(lambda: len(model.batches) == 1)  # alone at once: every instance idle
            b = batcher.enqueue(Rows.of([[20, 5]]))
            await wait_until(lambda: len(model.batches) == 2)  # after its 0.2 s delay
            await asyncio.sleep(0.1)
            x = batcher.enqueue(Rows.of([[30, 5]]))
            await asyncio.sleep(0.01)
            model.gate_for(10).set()  # an instance free; the other still computes [20]
            await asyncio.sleep(0.05)
            y = batcher.enqueue(Rows.of([[31, 5]]))  # within [30]'s own 0.2 s delay
            await x.future, await y.future
            model.gate_for(20).set()
            await a.future, await b.future
        finally:
            for gate in model.gates.values():
                gate.set()
            await batcher.stop()

    run(scenario)
    assert model.first_ids_by_batch() == [[10], [20], [30, 31]]


@pytest.mark.parametrize("ahead", [0, 1])
def test_interactive_inputs_go_before_a_bulk_batch_prepared_ahead(ahead):
    # The bulk batch prepared while the instance computed goes back to the queue once the instance
    # is free, if interactive inputs came meanwhile: they wait for one run, as without it.
    one = Instances(FakeModel(blocked=True))
    batcher = batcher_ahead(one, ahead)

    async def scenario():
        batcher.start()
        try:
            bulk = batcher.enqueue(Rows.of([[10 + i, 5] for i in range(6)]), bulk=True)
            await wait_until(lambda: len(one.model.batches) == 1)
            await asyncio.sleep(0.05)
            interactive = batcher.enqueue(Rows.of([[50, 5]]))
            one.model.gate.set()
            return first_ids(await bulk.future), first_ids(await interactive.future)
        finally:
            await batcher.stop()

    assert run(scenario) == (list(range(10, 16)), [50])
    assert one.model.first_ids_by_batch() == [
        [10, 11],
        [50],
        [12, 13],
        [14, 15],
    ]
    assert sample(batcher, "embed_batches_given_back_total") == ahead
    assert sample(batcher, "embed_queue_depth") == 0


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_request_whose_deadline_passes_while_its_batch_waits_for_the_instance_is_dropped(ahead):
    one = Instances(FakeModel(blocked=True))
    batcher = batcher_ahead(one, ahead)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[10, 5], [11, 5]]))
            await wait_until(lambda: len(one.model.batches) == 1)
            late = asyncio.create_task(submit(batcher, [[20, 5], [21, 5]], deadline=time.monotonic() + 0.05))
            await asyncio.sleep(0.15)  # its deadline passes while the first batch computes
            one.model.gate.set()
            await first
            with pytest.raises(Dropped):
                await late
        finally:
            await batcher.stop()

    run(scenario)
    assert len(one.model.batches) == 1  # not computed
    assert sample(batcher, "embed_inputs_dropped_total", reason="deadline") == 2
    assert sample(batcher, "embed_queue_depth") == 0


def test_a_prepared_batchs_wait_for_the_instance_is_not_counted_as_its_run():
    # The run time feeds the model-run histogram, the pace a full queue's retry hint is told from,
    # and the hung-run watchdog: a batch waiting its turn must not read as computing.
    one = Instances(FakeModel(), hold_s=0.2)
    batcher = batcher_ahead(one, ahead=1)

    async def scenario():
        batcher.start()
        try:
            answers = asyncio.create_task(submit(batcher, [[10 + i, 5] for i in range(4)]))
            return await answers
        finally:
            await batcher.stop()

    run(scenario)
    assert sample(batcher, "embed_model_run_duration_seconds_count") == 2
    # Each held the instance 0.2 s; counted from its hand-over, the second would read ~0.4 s.
    assert 0.4 <= sample(batcher, "embed_model_run_duration_seconds_sum") < 0.55


def test_padding_matches_the_lengths_given_to_the_model():
    model = FakeModel()
    batcher = new_batcher(model, max_batch_tokens=1000, max_queue_delay_s=0.05)
    rows = [[101, 102, 103], [104], [105, 106, 107, 108, 109], [110, 111]]

    async def scenario():
        batcher.start()
        try:
            return await submit(batcher, rows)
        finally:
            await batcher.stop()

    results = run(scenario)
    assert len(model.batches) == 1
    ids, lengths = model.batches[0]
    assert ids.dtype == np.int64 and lengths.dtype == np.int64
    assert ids.shape == (4, 5)
    by_first_id = {int(ids[i, 0]): i for i in range(4)}
    for row in rows:
        i = by_first_id[row[0]]
        assert lengths[i] == len(row)
        assert ids[i, : len(row)].tolist() == row
        assert (ids[i, len(row) :] == PAD).all()
    assert first_ids(results) == [101, 104, 105, 110]


def test_full_queue_refuses_at_once():
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, queue_limit=3)

    async def scenario():
        batcher.start()
        try:
            running = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)  # the model is busy with it
            queued = asyncio.create_task(submit(batcher, [[2, 5], [3, 5], [4, 5]]))
            await wait_until(lambda: batcher.depth == 3)
            with pytest.raises(Overloaded, match="queue_limit is 3"):
                await asyncio.wait_for(submit(batcher, [[5, 5]]), 1.0)  # would block if queued
            assert sample(batcher, "embed_requests_refused_total", reason="queue") == 1
            model.gate.set()
            return await running, await queued
        finally:
            await batcher.stop()

    running, queued = run(scenario)
    assert first_ids(running) == [1]
    assert first_ids(queued) == [2, 3, 4]
    assert 5 not in model.first_ids_seen()
    assert sample(batcher, "embed_queue_depth") == 0


@pytest.mark.parametrize(
    ("inputs", "s_per_input", "delay"),
    [(8, 0.0, None), (8, 0.025, 0.2), (8, 0.001, 0.1), (2_000, 0.05, 30.0)],
)
def test_a_retry_delay_is_the_compute_time_of_the_inputs_to_be_taken(inputs, s_per_input, delay):
    """No pace measured yet: no figure (the caller is told RETRY_AFTER_S, 1 s). Else the time `inputs`
    take, at least 0.1 s (a flood of retries costs the fronts) and at most 30 s."""
    assert retry_after(inputs, s_per_input) == pytest.approx(delay)


@pytest.mark.parametrize(
    ("waiting", "count", "share", "taken"),
    [(8, 4, None, 4), (8, 1, None, 1), (4096, 256, None, 256), (6, 1, 0.5, 3), (5, 1, 0.5, 2)],
)
def test_a_full_queue_says_when_enough_inputs_will_have_left_it_for_the_request(waiting, count, share, taken):
    """Not when the whole queue has drained (10 s at the default queue_limit of 4,096, where room for
    the request came within 0.4 s): when `taken` inputs have left it, so that the request fits, or for
    a bulk one, so that fewer than queue_limit x share wait."""
    with pytest.raises(Overloaded) as refused:
        check_capacity(waiting, count, 8 if waiting < 100 else 4096, share, s_per_input=0.05)
    assert refused.value.retry_after_s == pytest.approx(max(0.1, taken * 0.05))


class PacedModel(FakeModel):
    """A fake model that takes `batch_s` a batch and `row_s` a row, like a real one."""

    def __init__(self, row_s: float, batch_s: float = 0.0) -> None:
        super().__init__()
        self.row_s, self.batch_s = row_s, batch_s

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        answer = super().run(ids, lengths)  # seen by the test as it begins
        time.sleep(self.batch_s + self.row_s * len(ids))
        return answer


def test_a_full_queue_says_to_retry_about_when_the_request_would_fit():
    """RetryInfo and Retry-After said 1 s whatever the queue: OpenAI's client, which waits what it is
    told, left a queue that had room again in 0.2 s idle for the rest of the second. The delay is now
    the time the inputs that must leave the queue take at the pace of the recent batches, two workers
    side by side."""
    model = PacedModel(row_s=0.1)
    batcher = new_batcher(model, max_batch_size=4, queue_limit=8, workers=2)

    async def scenario() -> tuple[float, Overloaded, float, float]:
        batcher.start()
        try:
            assert batcher.s_per_input == 0.0  # nothing run yet
            for _ in range(3):  # two at a time: the queue holds 8 inputs
                await asyncio.gather(*(submit(batcher, [[i, 5]] * 4) for i in range(2)))
            pace = batcher.s_per_input  # 4 rows of 0.1 s a batch, two batches at once
            running = [asyncio.create_task(submit(batcher, [[i, 5]] * 4)) for i in (1, 2)]
            await wait_until(lambda: len(model.batches) == 8)  # both workers busy with them (0.4 s)
            queued = [asyncio.create_task(submit(batcher, [[i, 5]] * 4)) for i in (3, 4)]
            await wait_until(lambda: batcher.depth == 8)
            await asyncio.sleep(0.2)  # halfway through the batches in compute
            with pytest.raises(Overloaded) as refused:
                await submit(batcher, [[5, 5]] * 4)
            hint_pace, full_at = batcher.s_per_input, time.monotonic()
            await wait_until(lambda: batcher.depth <= 4)  # room for it: a worker took 4 queued inputs
            room_after = time.monotonic() - full_at
            await asyncio.gather(*running, *queued)
            return pace, refused.value, hint_pace, room_after
        finally:
            await batcher.stop()

    pace, error, hint_pace, room_after = run(scenario)
    assert 0.05 <= pace < 0.075, pace  # at least 0.1 s / 2 workers; sleeps and threads add a little
    assert error.retry_after_s == pytest.approx(4 * hint_pace), error.retry_after_s
    assert error.metadata["value"] == "8" and error.reason == "QUEUE_FULL"
    # Room came when a batch in compute ended (~0.2 s after the refusal): said to within 2x.
    assert room_after / 2 <= error.retry_after_s <= room_after * 2, (error.retry_after_s, room_after)


class TokenPacedModel(FakeModel):
    """A fake model that takes `token_s` a token (of the batch's real tokens), once its gate is open."""

    def __init__(self, token_s: float) -> None:
        super().__init__()
        self.token_s = token_s

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        answer = super().run(ids, lengths)
        time.sleep(self.token_s * int(lengths.sum()))
        return answer


def test_a_full_queue_of_long_inputs_after_short_ones_says_their_time_not_the_short_ones():
    """The pace is per token and the queue's inputs are counted by their tokens: per input, a queue of
    long inputs after a run of short ones was told the short ones' time (an acceptance pass: 0.1 s,
    where room came after 12.25 s and 73 refusals)."""
    model = TokenPacedModel(token_s=0.004)
    batcher = new_batcher(model, max_batch_tokens=256, max_batch_size=4, queue_limit=16)
    long = [[7] + [5] * 48 + [8]]  # 50 tokens, 0.2 s; the short ones 2 tokens, 0.008 s

    async def scenario() -> tuple[float, float, Overloaded]:
        batcher.start()
        try:
            for _ in range(4):
                await submit(batcher, [[1, 2]] * 4)
            short_pace, ran = batcher.s_per_input, len(model.batches)
            model.gate.clear()
            running = asyncio.create_task(submit(batcher, long * 4))
            await wait_until(lambda: len(model.batches) > ran and batcher.depth == 0)
            queued = asyncio.create_task(submit(batcher, long * 16))
            await wait_until(lambda: batcher.depth == 16)
            with pytest.raises(Overloaded) as refused:
                await submit(batcher, long * 4)
            pace = batcher.s_per_token
            model.gate.set()
            await asyncio.gather(running, queued)
            return short_pace, pace, refused.value
        finally:
            model.gate.set()
            await batcher.stop()

    short_pace, s_per_token, error = run(scenario)
    assert error.retry_after_s == pytest.approx(4 * 50 * s_per_token)  # 4 inputs of 50 tokens must leave
    # The pace is the short batches' (the long batch is held at the gate): 4 ms a token and each
    # batch's hand-off to its thread spread over its 8 tokens, so at least the 0.8 s the 4 inputs take.
    # The upper bound only says it is of that order: a loaded machine's hand-offs add to it.
    assert 0.8 <= error.retry_after_s < 4.0, error.retry_after_s
    assert 4 * short_pace < 0.1, short_pace  # per input, the short ones' pace said the 0.1 s floor


def test_the_fronts_read_the_same_pace_per_waiting_input_from_the_engines_shared_figures():
    queue = SharedQueue.local()
    assert queue.s_per_input == 0.0  # nothing waits, no pace yet
    queue.publish_pace(0.004)
    queue.publish_depth(16, 800)
    assert queue.depth == 16 and queue.s_per_input == pytest.approx(0.2)  # 50 tokens of 4 ms
    queue.publish_depth(0, 0)
    assert queue.s_per_input == 0.0


def test_the_pace_weighs_batches_by_their_inputs_so_lone_inputs_move_it_little():
    """20 queries alone (an input's latency, 3x its share of a full batch) after 64 inputs in full
    batches: the pace rises by about half, where decayed per batch the lone inputs set it (3x)."""
    model = PacedModel(row_s=0.005, batch_s=0.02)
    batcher = new_batcher(model, max_batch_size=8, queue_limit=64, workers=1)

    async def scenario() -> tuple[float, float]:
        batcher.start()
        try:
            await submit(batcher, [[1, 5]] * 64)
            before = batcher.s_per_input
            for _ in range(20):
                await submit(batcher, [[2, 5]])
            return before, batcher.s_per_input
        finally:
            await batcher.stop()

    before, after = run(scenario)
    assert 0.0075 <= before < 0.011, before  # (0.02 + 8 x 0.005) / 8
    assert before < after < 2 * before, (before, after)


def test_more_inputs_than_the_whole_queue_holds_are_invalid_not_overload():
    model = FakeModel()
    batcher = new_batcher(model, queue_limit=3)

    async def scenario():
        batcher.start()
        try:
            with pytest.raises(InvalidInput, match="4 inputs can never fit the queue_limit of 3"):
                await submit(batcher, [[1, 5], [2, 5], [3, 5], [4, 5]])
        finally:
            await batcher.stop()

    run(scenario)
    assert model.batches == []  # retrying could never help, so it is not a RESOURCE_EXHAUSTED
    assert sample(batcher, "embed_requests_refused_total", reason="queue") == 0


def test_input_whose_deadline_passed_in_the_queue_is_dropped_before_compute():
    model = FakeModel(blocked=True)
    batcher = new_batcher(model)

    async def scenario():
        batcher.start()
        try:
            running = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)
            late = asyncio.create_task(submit(batcher, [[2, 5]], deadline=time.monotonic() + 0.05))
            await asyncio.sleep(0.15)
            model.gate.set()
            await running
            with pytest.raises(Dropped):
                await late
            return await submit(batcher, [[3, 5]])  # and it keeps serving
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == [3]
    assert 2 not in model.first_ids_seen()
    assert sample(batcher, "embed_inputs_dropped_total", reason="deadline") == 1
    assert sample(batcher, "embed_queue_depth") == 0
    # Its wait is a queue wait too (past its 0.05 s deadline), once: the two answered waited ~0 s.
    assert sample(batcher, "embed_queue_wait_seconds_count") == 3
    assert sample(batcher, "embed_queue_wait_seconds_bucket", le="0.05") == 2


def test_a_request_given_up_while_queued_is_observed_once_with_its_wait():
    """The runbook compares the queue wait's p99 with callers' deadlines: observed only for answered
    requests, it never reached them however long the queue (every call of a load timed out, none
    was observed). A request that ends with inputs still queued is observed then, and not again."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model)
    run(lambda: cancel_while_queued(batcher, model, queued_s=0.3, then=False))
    assert sample(batcher, "embed_queue_wait_seconds_count") == 2
    assert sample(batcher, "embed_queue_wait_seconds_bucket", le="0.25") == 1  # the answered one
    assert sample(batcher, "embed_queue_wait_seconds_sum") >= 0.3


async def cancel_while_queued(
    batcher: Batcher, model: FakeModel, queued_s: float = 0.0, then: bool = True
) -> Done | None:
    """Input 1 computing (the model held), a request of inputs 2 and 3 cancelled after `queued_s` in
    the queue, then the model let go; with `then`, the answer to input 4, submitted after."""
    batcher.start()
    try:
        running = asyncio.create_task(submit(batcher, [[1, 5]]))
        await wait_until(lambda: model.batches)
        gone = asyncio.create_task(submit(batcher, [[2, 5], [3, 5]]))
        await wait_until(lambda: batcher.depth == 2)
        await asyncio.sleep(queued_s)
        gone.cancel()
        await asyncio.sleep(0)
        model.gate.set()
        await running
        await wait_until(lambda: sample(batcher, "embed_inputs_dropped_total", reason="cancelled") == 2)
        return await submit(batcher, [[4, 5]]) if then else None
    finally:
        await batcher.stop()


def test_inputs_of_a_cancelled_caller_are_dropped_before_compute():
    model = FakeModel(blocked=True)
    batcher = new_batcher(model)
    assert first_ids(run(lambda: cancel_while_queued(batcher, model))) == [4]
    assert not {2, 3} & set(model.first_ids_seen())
    assert sample(batcher, "embed_queue_depth") == 0


def test_inputs_of_a_cancelled_caller_give_back_their_queue_places_at_once():
    """They stay in the queue until its head reaches them, but no longer count as waiting: after a
    burst of timeouts, new work is not refused for a queue full of inputs nobody waits for."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, queue_limit=3)

    async def scenario():
        batcher.start()
        try:
            running = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)  # the model is busy: nothing leaves the queue
            gone = asyncio.create_task(submit(batcher, [[2, 5], [3, 5], [4, 5]]))
            await wait_until(lambda: batcher.depth == 3)
            gone.cancel()
            await wait_until(lambda: batcher.depth == 0)
            assert sample(batcher, "embed_queue_depth") == 0
            later = asyncio.create_task(submit(batcher, [[5, 5], [6, 5], [7, 5]]))  # refused before
            await wait_until(lambda: batcher.depth == 3)
            model.gate.set()
            await running
            return await later
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == [5, 6, 7]
    assert not {2, 3, 4} & set(model.first_ids_seen())
    assert sample(batcher, "embed_queue_depth") == 0


def test_the_queue_stays_bounded_however_often_callers_submit_and_cancel():
    """Places come back at once, but the inputs stay in the queue until its head reaches them: with
    every instance computing, submit-then-cancel could grow it without bound. Past queue_limit such
    inputs it is swept, and they are counted as dropped."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, queue_limit=3)

    async def scenario():
        batcher.start()
        try:
            running = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)  # the one instance is busy: nothing is taken
            longest = 0
            for _ in range(1000):
                gone = asyncio.create_task(submit(batcher, [[2, 5], [3, 5], [4, 5]]))
                await asyncio.sleep(0)  # queued
                gone.cancel()
                await asyncio.sleep(0)  # its places come back
                longest = max(longest, len(batcher._queue))
            model.gate.set()
            await running
            return longest, await submit(batcher, [[5, 5]])
        finally:
            await batcher.stop()

    longest, after = run(scenario)
    assert longest <= 2 * 3 + 3  # was 3,000: every cancelled input kept
    assert first_ids(after) == [5]
    assert 2 not in model.first_ids_seen()
    assert sample(batcher, "embed_inputs_dropped_total", reason="cancelled") == 3000


def test_a_request_whose_future_is_cancelled_directly_gives_back_its_places_when_swept():
    """Not through Batcher.cancel (e.g. asyncio.wait_for on the future): its places come back when the
    queue's head reaches it, or when a sweep removes it first."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, queue_limit=3)

    async def scenario():
        batcher.start()
        try:
            busy = batcher.enqueue(Rows.of([[1, 5]]))
            await wait_until(lambda: model.batches)  # the one instance is busy
            batcher.enqueue(Rows.of([[2, 5]])).future.cancel()  # directly
            for _ in range(2):  # 4 inputs of ended requests, over the limit of 3: the next enqueue sweeps
                batcher.cancel(batcher.enqueue(Rows.of([[3, 5], [3, 5]])))
            last = batcher.enqueue(Rows.of([[4, 5]]))
            model.gate.set()
            await busy.future
            await last.future
            await wait_until(lambda: batcher.depth == 0)
            return await submit(batcher, [[5, 5]] * 3)  # the whole queue: nothing is held for the swept
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == [5, 5, 5]
    assert not {2, 3} & set(model.first_ids_seen())


def test_a_failing_row_fails_only_its_own_request():
    model = FakeModel()
    batcher = new_batcher(model, max_queue_delay_s=0.05)

    async def scenario():
        batcher.start()
        try:
            requests = [[[1, 5]], [[FAULT, 5]], [[3, 5], [4, 5]]]
            return await asyncio.gather(*(submit(batcher, r) for r in requests), return_exceptions=True)
        finally:
            await batcher.stop()

    ok_a, failed, ok_c = run(scenario)
    assert model.batches[0][0].shape[0] == 4  # all four rows shared the batch that failed
    assert isinstance(failed, BackendFailure)
    assert first_ids(ok_a) == [1]
    assert first_ids(ok_c) == [3, 4]
    assert all(ids.shape[0] == 1 for ids, _ in model.batches[1:])  # then re-run one by one
    assert sample(batcher, "embed_batch_failures_total") == 1
    assert sample(batcher, "embed_queue_depth") == 0


def test_a_non_finite_vector_fails_its_request_not_its_batchmates():
    """A NaN row is refused as a model failure of that input; the rows beside it are answered."""
    model = FakeModel()
    batcher = new_batcher(model, max_queue_delay_s=0.05)

    async def scenario():
        batcher.start()
        try:
            requests = [[[1, 5]], [[NAN, 5]], [[3, 5]]]
            return await asyncio.gather(*(submit(batcher, r) for r in requests), return_exceptions=True)
        finally:
            await batcher.stop()

    ok_a, failed, ok_c = run(scenario)
    assert isinstance(failed, BackendFailure) and "non-finite" in str(failed)
    assert first_ids(ok_a) == [1] and first_ids(ok_c) == [3]
    assert sample(batcher, "embed_queue_depth") == 0


def test_a_bug_in_the_batchers_own_code_fails_the_batchs_callers_instead_of_leaving_them_waiting(
    monkeypatch: pytest.MonkeyPatch,
):
    model = FakeModel()
    batcher = new_batcher(model, max_queue_delay_s=0.05)
    broken = {"once": True}
    real_observe = batcher._observe

    def observe(*args: object) -> None:
        if broken.pop("once", False):
            raise ValueError("a bug")
        real_observe(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(batcher, "_observe", observe)

    async def scenario():
        batcher.start()
        try:
            first = await asyncio.gather(
                submit(batcher, [[1, 5]]), submit(batcher, [[2, 5]]), return_exceptions=True
            )
            return first, await submit(batcher, [[3, 5]])  # and the worker goes on
        finally:
            await batcher.stop()

    (a, b), after = run(scenario)
    assert isinstance(a, BackendFailure) and "internal batching error" in str(a)
    assert isinstance(b, BackendFailure) or first_ids(b) == [2]  # in that batch or the next
    assert first_ids(after) == [3]


def test_inputs_left_of_a_failed_request_are_dropped_as_failed_not_cancelled():
    model = FakeModel()
    batcher = new_batcher(model, max_batch_size=1)  # one input per batch: the second waits

    async def scenario():
        batcher.start()
        try:
            return await asyncio.gather(submit(batcher, [[FAULT, 5], [3, 5]]), return_exceptions=True)
        finally:
            await batcher.stop()

    [failed] = run(scenario)
    assert isinstance(failed, BackendFailure)
    assert 3 not in model.first_ids_seen()  # the request had its answer: its other input is not run
    assert sample(batcher, "embed_inputs_dropped_total", reason="failed") == 1
    assert sample(batcher, "embed_inputs_dropped_total", reason="cancelled") == 0  # was counted here


def test_batcher_keeps_serving_after_a_request_with_several_failing_rows():
    model = FakeModel()
    batcher = new_batcher(model, max_queue_delay_s=0.05)

    async def scenario():
        batcher.start()
        try:
            requests = [[[1, 5]], [[FAULT, 5], [FAULT, 6], [FAULT, 7]]]
            outcome = await asyncio.gather(*(submit(batcher, r) for r in requests), return_exceptions=True)
            after = await asyncio.wait_for(submit(batcher, [[2, 5]]), 5)
            return outcome, after
        finally:
            await batcher.stop()

    (ok, failed), after = run(scenario)
    assert first_ids(ok) == [1]
    assert isinstance(failed, BackendFailure)
    assert first_ids(after) == [2]
    assert sample(batcher, "embed_queue_depth") == 0


def test_batches_drawn_across_several_requests_carry_each_inputs_own_ids():
    """Similar lengths drawn from interleaved requests: a batch holds runs of several requests'
    inputs, not all consecutive; every padded row is its own input's ids and every answer its own."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, max_batch_tokens=1000, max_batch_size=6)
    lengths = [[3, 9, 3, 3, 9, 2], [9, 3, 2, 9, 3, 3, 9], [2, 2, 9, 3]]
    requests = [
        [[100 * (r + 1) + i] + [100 * (r + 1) + i] * (n - 1) for i, n in enumerate(row)]
        for r, row in enumerate(lengths)
    ]

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[1, 1]]))  # holds the model while the rest queue
            await wait_until(lambda: len(model.batches) == 1)
            answers = [asyncio.create_task(submit(batcher, rows)) for rows in requests]
            await asyncio.sleep(0.01)
            model.gate.set()
            await first
            return await asyncio.gather(*answers)
        finally:
            await batcher.stop()

    results = run(scenario)
    for rows, done in zip(requests, results, strict=True):
        assert first_ids(done) == [row[0] for row in rows]
        assert [int(v) for v in done.embeddings[:, 1]] == [len(row) for row in rows]
    source = {row[0]: row for rows in requests for row in rows}
    for ids, sizes in model.batches[1:]:
        for padded, size in zip(ids.tolist(), sizes.tolist(), strict=True):
            assert padded[:size] == source[padded[0]] and set(padded[size:]) <= {PAD}
    mixed = [b for b in model.batches[1:] if len({i // 100 for i in b[0][:, 0].tolist()}) > 1]
    assert mixed, "no batch mixed requests: the scenario does not exercise runs across requests"


def test_a_batch_may_hold_more_inputs_than_the_window_when_the_batch_size_allows():
    """The window never holds fewer inputs than a batch may (CUDA batches of 1,024 were held to the
    window's 256)."""
    model = FakeModel(blocked=True)
    limits = BatchLimits(1000, 8, 0.0, 64, window=4)
    batcher = Batcher(model.run, limits, Metrics(), pad_id=PAD)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[1, 1]]))
            await wait_until(lambda: len(model.batches) == 1)
            rest = asyncio.create_task(submit(batcher, [[10 + i, 5] for i in range(8)]))
            await asyncio.sleep(0.01)
            model.gate.set()
            await first
            return await rest
        finally:
            await batcher.stop()

    assert first_ids(run(scenario)) == list(range(10, 18))
    assert [len(ids) for ids, _ in model.batches] == [1, 8]


# Priority --------------------------------------------------------------------------------------------


def test_an_interactive_request_is_batched_before_the_bulk_inputs_queued_ahead_of_it():
    """A bulk job's queued inputs do not hold up a caller who waits: it takes the next batches, and
    the bulk inputs follow in their own order, none lost."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, max_batch_size=2)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)  # the model is busy with it
            bulk = batcher.enqueue(Rows.of([[10, 5], [11, 5], [12, 5], [13, 5]]), bulk=True)
            more_bulk = batcher.enqueue(Rows.of([[14, 5]]), bulk=True)
            interactive = batcher.enqueue(Rows.of([[20, 5], [21, 5], [22, 5]]))
            assert batcher.depth == 8
            model.gate.set()
            return await first, await bulk.future, await more_bulk.future, await interactive.future
        finally:
            await batcher.stop()

    first, bulk, more_bulk, interactive = run(scenario)
    # Interactive inputs batch among themselves: 22 runs alone rather than wait for 10's compute too.
    assert model.first_ids_by_batch() == [[1], [20, 21], [22], [10, 11], [12, 13], [14]]
    assert (first_ids(first), first_ids(bulk), first_ids(more_bulk)) == ([1], [10, 11, 12, 13], [14])
    assert first_ids(interactive) == [20, 21, 22]
    assert sample(batcher, "embed_queue_depth") == 0


def test_the_interactive_queue_depth_leaves_out_the_bulk_inputs_waiting():
    """embed_queue_interactive_depth counts the queue's interactive inputs, beside embed_queue_depth,
    as inputs come in, leave with a cancel and leave into batches; bulk inputs never count there."""
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, max_batch_size=2)
    seen: list[tuple[float, float]] = []  # depths() as each batch reaches the model
    run_model = model.run

    def depths() -> tuple[float, float]:
        return sample(batcher, "embed_queue_depth"), sample(batcher, "embed_queue_interactive_depth")

    def observed(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append(depths())
        return run_model(ids, lengths)

    batcher.run = observed

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)
            bulk = batcher.enqueue(Rows.of([[10, 5], [11, 5], [12, 5], [13, 5]]), bulk=True)
            gone = batcher.enqueue(Rows.of([[14, 5]]), bulk=True)
            interactive = batcher.enqueue(Rows.of([[20, 5], [21, 5], [22, 5]]))
            queued = depths()
            batcher.cancel(gone)
            cancelled = depths()
            model.gate.set()
            await first, await bulk.future, await interactive.future
            return queued, cancelled
        finally:
            await batcher.stop()

    queued, cancelled = run(scenario)
    assert (queued, cancelled) == ((8, 3), (7, 3))
    assert seen == [(0, 0), (5, 1), (4, 0), (2, 0), (0, 0)]
    assert model.first_ids_seen() == [1, 20, 21, 22, 10, 11, 12, 13]
    assert depths() == (0, 0)


def test_interactive_inputs_wait_for_interactive_company_while_bulk_inputs_queue_behind_them():
    """Two instances, one busy: an interactive input waits up to --max-queue-delay-ms for company as
    it would on an empty queue, rather than run alone because bulk inputs make the queue long."""
    model = FakeModel()
    held = {90: threading.Event(), 10: threading.Event()}  # first ids whose batches wait for their gate
    entered: list[list[int]] = []  # each batch's first ids, as it reaches the model

    def gated(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        entered.append([int(i) for i in ids[:, 0]])
        for first in ids[:, 0]:
            if int(first) in held:
                assert held[int(first)].wait(10), "the test never released the batch"
        return model.run(ids, lengths)

    batcher = new_batcher(model, max_batch_size=4, max_queue_delay_s=1.0, workers=2)
    batcher.run = gated

    async def scenario():
        batcher.start()
        try:
            busy = asyncio.create_task(submit(batcher, [[90, 5]]))  # one instance, held throughout
            await wait_until(lambda: len(entered) == 1)
            bulk = batcher.enqueue(Rows.of([[10, 5]] * 4), bulk=True)  # the other instance, held
            await wait_until(lambda: len(entered) == 2)
            backlog = batcher.enqueue(Rows.of([[30, 5]] * 8), bulk=True)
            first = batcher.enqueue(Rows.of([[20, 5]]))
            held[10].set()
            await bulk.future  # that instance is free, the bulk backlog and one interactive input wait
            await asyncio.sleep(0.05)
            second = batcher.enqueue(Rows.of([[21, 5]]))
            answers = await first.future, await second.future
            held[90].set()
            await busy, await backlog.future
            return answers
        finally:
            await batcher.stop()

    first, second = run(scenario)
    assert (first_ids(first), first_ids(second)) == ([20], [21])
    assert entered == [[90], [10] * 4, [20, 21], [30] * 4, [30] * 4]


def test_interactive_requests_keep_their_order_among_themselves_and_ahead_of_bulk_ones():
    model = FakeModel(blocked=True)
    batcher = new_batcher(model, max_batch_size=1)

    async def scenario():
        batcher.start()
        try:
            first = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)
            queued = [
                batcher.enqueue(Rows.of([[10, 5]]), bulk=True),
                batcher.enqueue(Rows.of([[20, 5], [21, 5]])),
                batcher.enqueue(Rows.of([[11, 5]]), bulk=True),
                batcher.enqueue(Rows.of([[22, 5]])),
            ]
            model.gate.set()
            await first
            return [first_ids(await r.future) for r in queued]
        finally:
            await batcher.stop()

    assert run(scenario) == [[10], [20, 21], [11], [22]]
    assert model.first_ids_seen() == [1, 20, 21, 22, 10, 11]


def test_bulk_requests_are_admitted_only_below_their_share_of_the_queue():
    """queue_limit 8, bulk_queue_share 0.5: a bulk request gets in while fewer than 4 inputs wait,
    whatever its size; past that only interactive requests do, up to the whole queue."""
    model = FakeModel(blocked=True)
    limits = BatchLimits(64, 8, 0.0, 8, bulk_queue_share=0.5)
    batcher = Batcher(model.run, limits, Metrics(), pad_id=PAD)

    async def scenario():
        batcher.start()
        try:
            running = asyncio.create_task(submit(batcher, [[1, 5]]))
            await wait_until(lambda: model.batches)
            bulk = [batcher.enqueue(Rows.of([[10, 5]] * 3), bulk=True)]  # 0 waiting
            bulk.append(batcher.enqueue(Rows.of([[11, 5]] * 2), bulk=True))  # 3 waiting: below 4
            with pytest.raises(
                Overloaded, match=r"queue full for bulk requests: 5 inputs waiting, .* below 4"
            ) as e:
                batcher.enqueue(Rows.of([[12, 5]]), bulk=True)
            assert (e.value.reason, e.value.metadata) == (
                "QUEUE_FULL",
                {
                    "setting": "bulk_queue_share",
                    "limit": "0.5",
                    "value": "5",
                    "queueLimit": "8",
                    "asked": "1",
                },
            )
            interactive = batcher.enqueue(Rows.of([[20, 5]] * 3))  # the whole queue is theirs: 8 of 8
            with pytest.raises(Overloaded, match="queue_limit is 8"):
                batcher.enqueue(Rows.of([[21, 5]]))
            model.gate.set()
            await running
            return [first_ids(await r.future) for r in (*bulk, interactive)]
        finally:
            await batcher.stop()

    assert run(scenario) == [[10] * 3, [11] * 2, [20] * 3]
    # Held back at its share, a bulk request is paced, not refused by a full queue (which pages).
    assert sample(batcher, "embed_requests_refused_total", reason="bulk_queue") == 1
    assert sample(batcher, "embed_requests_refused_total", reason="queue") == 1


def test_a_bulk_request_larger_than_its_share_fits_an_empty_queue():
    """A job sizes its requests by max_inputs_per_request, not by the share: refused for ever before."""
    model = FakeModel()
    batcher = Batcher(model.run, BatchLimits(64, 8, 0.0, 8, bulk_queue_share=0.25), Metrics(), pad_id=PAD)

    async def scenario():
        batcher.start()
        try:
            return first_ids(await batcher.enqueue(Rows.of([[30, 5]] * 8), bulk=True).future)
        finally:
            await batcher.stop()

    assert run(scenario) == [30] * 8
