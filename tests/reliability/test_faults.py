"""Faults: what callers see, and what the server counts, when calls are cancelled mid-flight,
deadlines pass in the queue, a burst overflows the queue, a batch fails in the backend, or a
replica is killed under a round_robin client. After each the server (or the surviving replica)
keeps serving, its counters agree with the callers, and no accepted request is lost.

The shared server waits up to 3 s for a batch to fill (--max-queue-delay-ms 3000), so a few
inputs sit in the queue for a known time without any CPU spent: long enough to cancel them, to
let short deadlines pass, and to put a faulty input in one batch with others.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from minilm_embed.client.client import embed_request, to_array
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from tests.reliability.probes import Scrape, metrics_text, parse, scrape, wait_idle
from tests.reliability.workload import MIN_COSINE, Load, References, Tally, channels
from tests.server_process import ServerProcess, fault_entry, one_instance_held, serving, wait_for

pytestmark = pytest.mark.alone  # make test runs it after the others, with nothing beside it

FAULT = "this exact text makes its batch fail in the backend"
QUEUE_LIMIT = 64
QUEUE_DELAY_S = 3.0
# The call that keeps one model instance busy while a scenario's inputs queue (one input, answered OK).
HELD = 1


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = ["--queue-limit", str(QUEUE_LIMIT), "--max-queue-delay-ms", str(QUEUE_DELAY_S * 1000)]
    with serving(*flags, entry=fault_entry(FAULT)) as process:
        yield process


@pytest.fixture(scope="module")
def short(sentences: list[str]) -> list[str]:
    """The pool's short sentences: cheap to embed, so the faults cost little CPU."""
    return [s for s in sentences if len(s.split()) <= 13]


@asynccontextmanager
async def stub(address: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield pb_grpc.EmbeddingServiceStub(channel)


async def until_queued(server: ServerProcess, depth: int) -> None:
    """Until `depth` inputs wait in the server's queue (they wait QUEUE_DELAY_S for company)."""

    def queued() -> bool:
        return scrape(server).value("embed_queue_depth") >= depth

    assert await asyncio.to_thread(wait_for, queued, QUEUE_DELAY_S, 0.02), f"{depth} inputs never queued"


def code(outcome: object) -> str:
    if isinstance(outcome, asyncio.CancelledError):
        return "CANCELLED"
    return outcome.code().name if isinstance(outcome, grpc.aio.AioRpcError) else "OK"


def assert_correct(references: References, texts: Sequence[str], response: Any) -> None:
    cos = references.cosines(texts, to_array(response))
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.7f}"


def assert_keeps_serving(server: ServerProcess, references: References, texts: Sequence[str]) -> None:
    async def one() -> Any:
        async with stub(server.address) as s:
            return await s.Embed(embed_request(texts), timeout=60)

    assert server.proc.poll() is None, "the server died"
    assert_correct(references, texts, asyncio.run(one()))


def test_cancelling_half_the_calls_mid_flight_drops_their_inputs_and_answers_the_rest(
    server, short, references, figures
):
    texts = [[s] for s in short[:20]]

    async def scenario() -> tuple[Scrape, list[bool], list[Any]]:
        async with stub(server.address) as s, one_instance_held(server.address):
            before = await asyncio.to_thread(scrape, server)
            calls = [s.Embed(embed_request(t), timeout=60) for t in texts]
            await until_queued(server, len(calls))
            cancelled = [call.cancel() for call in calls[::2]]
            return before, cancelled, await asyncio.gather(*calls, return_exceptions=True)

    before, cancelled, outcomes = asyncio.run(scenario())
    delta = wait_idle(server) - before
    assert all(cancelled)
    assert [code(o) for o in outcomes] == ["CANCELLED", "OK"] * 10
    for t, o in zip(texts[1::2], outcomes[1::2], strict=True):
        assert_correct(references, t, o)
    figures(cancelled=10, **counted(delta, "OK", "CANCELLED"), dropped_cancelled=delta.dropped("cancelled"))
    assert delta.requests("CANCELLED") == 10
    assert delta.requests("OK") == 10 + HELD
    assert delta.dropped("cancelled") == 10  # dropped before compute:
    assert delta.value("embed_inputs_total") == 10 + HELD  # only the answered inputs ran
    assert_keeps_serving(server, references, short[:2])


def test_deadlines_shorter_than_the_queue_wait_expire_on_time_and_cost_no_compute(
    server, short, references, figures
):
    outcomes, seconds, delta = expire_in_queue(server, short[:16], deadline_s=0.5)
    assert Counter(code(o) for o in outcomes) == {"DEADLINE_EXCEEDED": 16}
    assert max(seconds) < 0.5 + 1.0, f"a call outlived its 0.5 s deadline: {max(seconds):.2f} s"
    figures(
        calls=16,
        slowest_s=round(max(seconds), 3),
        **counted(delta, "DEADLINE_EXCEEDED", "CANCELLED"),
        dropped_deadline=delta.dropped("deadline"),
        dropped_cancelled=delta.dropped("cancelled"),
    )
    assert delta.requests("DEADLINE_EXCEEDED") == 16  # as the callers saw them, not as CANCELLED
    assert delta.dropped("deadline") == 16
    assert delta.value("embed_inputs_total") == HELD
    assert_keeps_serving(server, references, short[:2])


def expire_in_queue(
    server: ServerProcess, texts: Sequence[str], deadline_s: float
) -> tuple[list[Any], list[float], Scrape]:
    """One single-text call per text with a deadline shorter than the queue wait."""

    async def timed(call: Any) -> tuple[Any, float]:
        started = time.monotonic()
        try:
            return await call, time.monotonic() - started
        except grpc.aio.AioRpcError as e:
            return e, time.monotonic() - started

    async def scenario() -> tuple[Scrape, list[tuple[Any, float]]]:
        async with stub(server.address) as s, one_instance_held(server.address):
            before = await asyncio.to_thread(scrape, server)
            calls = [s.Embed(embed_request([t]), timeout=deadline_s) for t in texts]
            return before, await asyncio.gather(*(timed(c) for c in calls))

    before, results = asyncio.run(scenario())
    wait_idle(server)
    # The callers' deadlines pass a moment before the server's handlers and the engine's queue
    # see them: wait (bounded) until every call is counted as ended and its input as dropped,
    # whichever way; the test then checks which way.
    last: list[Scrape] = []

    def settled() -> bool:
        last[:] = [scrape(server) - before]
        ended = last[0].requests("DEADLINE_EXCEEDED") + last[0].requests("CANCELLED")
        dropped = last[0].dropped("deadline") + last[0].dropped("cancelled")
        return ended >= len(texts) and dropped >= len(texts)

    wait_for(settled, timeout=10.0, interval=0.1)  # calls settled() at least once
    return [o for o, _ in results], [t for _, t in results], last[0]


def test_a_burst_of_ten_times_the_queue_limit_is_refused_at_once_beyond_it(
    server, short, references, figures
):
    n = len(short)
    requests = [[short[(i + j) % n] for j in range(4)] for i in range(10 * QUEUE_LIMIT // 4)]

    async def scenario() -> tuple[Scrape, list[tuple[Any, float]]]:
        pool = channels(server.address, 4)
        stubs = [pb_grpc.EmbeddingServiceStub(c) for c in pool]
        before = await asyncio.to_thread(scrape, server)

        async def timed(i: int, texts: list[str]) -> tuple[Any, float]:
            started = time.monotonic()
            try:
                response = await stubs[i % 4].Embed(embed_request(texts), timeout=60)
            except grpc.aio.AioRpcError as e:
                return e, time.monotonic() - started
            return response, time.monotonic() - started

        results = await asyncio.gather(*(timed(i, t) for i, t in enumerate(requests)))
        for channel in pool:
            await channel.close()
        return before, results

    before, results = asyncio.run(scenario())
    delta = wait_idle(server) - before
    seen = Counter(code(o) for o, _ in results)
    refused = [(o, s) for o, s in results if code(o) == "RESOURCE_EXHAUSTED"]
    answered = [(o, s) for o, s in results if code(o) == "OK"]
    figures(
        calls=len(requests),
        inputs=sum(map(len, requests)),
        **seen,
        refused_median_s=round(statistics.median(s for _, s in refused), 3),
        answered_median_s=round(statistics.median(s for _, s in answered), 3),
        refused_counted=delta.refused(),
    )
    assert set(seen) == {"OK", "RESOURCE_EXHAUSTED"}, seen
    assert seen["OK"] >= QUEUE_LIMIT // 4  # at least a full queue was admitted
    assert all(f"queue_limit is {QUEUE_LIMIT}" in o.details() for o, _ in refused)
    for (o, _), texts in zip(results, requests, strict=True):
        if code(o) == "OK":
            assert_correct(references, texts, o)
    assert delta.refused() == seen["RESOURCE_EXHAUSTED"]
    assert delta.requests("RESOURCE_EXHAUSTED") == seen["RESOURCE_EXHAUSTED"]
    assert delta.requests("OK") == seen["OK"]
    assert delta.value("embed_inputs_total") == 4 * seen["OK"]
    assert_keeps_serving(server, references, short[:2])


def test_a_backend_failure_in_one_batch_fails_only_the_request_holding_the_input(
    server, short, references, figures
):
    texts = [[s] for s in short[:16]]
    texts.insert(5, [FAULT])

    async def scenario() -> tuple[Scrape, list[Any]]:
        async with stub(server.address) as s, one_instance_held(server.address):
            before = await asyncio.to_thread(scrape, server)
            calls = [s.Embed(embed_request(t), timeout=60) for t in texts]
            return before, await asyncio.gather(*calls, return_exceptions=True)

    before, outcomes = asyncio.run(scenario())
    delta = wait_idle(server) - before
    failed = outcomes.pop(5)
    texts.pop(5)
    figures(**counted(delta, "OK", "INTERNAL"), batch_failures=delta.value("embed_batch_failures_total"))
    assert code(failed) == "INTERNAL"
    assert "model run failed for this input" in failed.details()
    assert [code(o) for o in outcomes] == ["OK"] * 16
    for t, o in zip(texts, outcomes, strict=True):
        assert_correct(references, t, o)
    assert delta.value("embed_batch_failures_total") == 1  # all 17 shared one batch
    assert delta.requests("INTERNAL") == 1
    assert delta.requests("OK") == 16 + HELD
    assert any("retrying its inputs one by one" in line for line in server.lines)
    assert_keeps_serving(server, references, short[:2])


def counted(delta: Scrape, *codes: str) -> dict[str, float]:
    return {f"server_{c}": delta.requests(c) for c in codes}


# A replica killed behind a round_robin client ------------------------------------------------------


@pytest.fixture
def replicas(plain_server: ServerProcess) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A fresh replica to kill, and the shared default server as the one that survives."""
    with serving() as doomed:
        yield doomed, plain_server


def freeze_and_kill(replica: ServerProcess) -> Scrape:
    """Read the replica's counters, freeze it at once (SIGSTOP), then SIGKILL it.

    Freezing right after the read means no call can finish there unseen, except those the reading
    shows in flight: the bound the test allows on what the dead replica answered.
    """
    text = metrics_text(replica)
    os.kill(replica.proc.pid, signal.SIGSTOP)
    os.kill(replica.proc.pid, signal.SIGKILL)
    return parse(text)


def test_a_replica_killed_under_load_costs_round_robin_callers_nothing(
    replicas, sentences, references, figures
):
    a, b = replicas
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"

    async def scenario() -> tuple[Tally, Scrape, float]:
        async with Load(target, sentences, references, callers=32, channel_count=4, deadline_s=60) as load:
            await asyncio.sleep(4)
            last_a = await asyncio.to_thread(freeze_and_kill, a)
            killed_at = time.monotonic()
            await asyncio.sleep(4)
        return load.tally, last_a, killed_at

    before_b = scrape(b)
    tally, last_a, killed_at = asyncio.run(scenario())
    assert a.proc.wait(10) == -signal.SIGKILL
    final_b = wait_idle(b) - before_b
    seen, after_kill = tally.codes(), tally.codes(since=killed_at)
    in_flight_a = last_a.value("embed_requests_in_flight")
    answered_a = seen["OK"] - final_b.requests("OK")
    figures(
        calls=sum(seen.values()),
        **seen,
        ok_after_kill=after_kill["OK"],
        killed_replica_ok_at_last_read=last_a.requests("OK"),
        killed_replica_in_flight_at_last_read=in_flight_a,
        survivor_ok=final_b.requests("OK"),
        slowest_s=round(tally.slowest, 2),
        worst_cosine=round(tally.worst_cosine, 7),
    )
    # UNAVAILABLE from the dead replica was retried on the other one: the callers never saw it.
    assert set(seen) <= {"OK", "RESOURCE_EXHAUSTED"}, tally.unexpected("OK", "RESOURCE_EXHAUSTED")
    assert after_kill["OK"] > 0
    assert not tally.wrong, tally.wrong[:5]
    assert tally.slowest < 60
    # Every answer came from one of the two: what b did not answer, a did before it died.
    assert abs(answered_a - last_a.requests("OK")) <= in_flight_a
    refused_a = seen["RESOURCE_EXHAUSTED"] - final_b.requests("RESOURCE_EXHAUSTED")
    assert abs(refused_a - last_a.requests("RESOURCE_EXHAUSTED")) <= in_flight_a
    assert final_b.requests("RESOURCE_EXHAUSTED") == final_b.refused()
    assert_keeps_serving(b, references, sentences[:2])
