"""The bounds on how much a front takes in at once, whatever each request's size: gRPC calls being
served (`--max-concurrent-calls`) and waiting for a place (`--max-waiting-calls`), HTTP connections
open (`--http-max-connections`) and the time an HTTP connection may take to send a request's headers
(`--http-header-timeout-s`). A real server with the real model, each bound set small; what lies past
each is answered, named, counted, and leaves the rest of the server serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from minilm_embed.client.client import AsyncEmbeddingClient
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server.budget import Places
from minilm_embed.server.front import LONG_LIVED_CALLS, OTHER_CALLS
from minilm_embed.server.health import CHECK, StreamLimit
from tests.server_process import ServerProcess, flags, serving
from tests.test_server import error_details, metric

CALLS = 2
WAITING = 1
CONNECTIONS = 3
HEADER_TIMEOUT_S = 1.0
FLAGS = {
    "max_concurrent_calls": CALLS,
    "max_waiting_calls": WAITING,
    "http_max_connections": CONNECTIONS,
    "http_header_timeout_s": HEADER_TIMEOUT_S,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving(*flags(FLAGS)) as process:
        yield process


@pytest.fixture
def own_server() -> Iterator[ServerProcess]:
    """A server of the test's own, for a test that needs every health place free as it starts: the
    calls of the test before, cancelled by the thousand, are still counted by gRPC for as long as the
    front takes to end them (in CI, under load, long enough that a held call of the next test was
    refused: "every place held" failed)."""
    with serving(*flags(FLAGS)) as process:
        yield process


class HeldStream:
    """An EmbedStream call that sends nothing until ended: one call being served, for as long as
    the test wants."""

    def __init__(self, stub: pb_grpc.EmbeddingServiceStub) -> None:
        self._items: queue.Queue[pb.EmbedStreamRequest | None] = queue.Queue()
        self.call = stub.EmbedStream(iter(self._items.get, None), timeout=60)
        self.answers: list[pb.EmbedStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            self.answers.extend(self.call)
        except grpc.RpcError as e:
            self.error = e

    def end(self, text: str = "the last item") -> None:
        self._items.put(pb.EmbedStreamRequest(id="last", request=pb.EmbedRequest(texts=[text])))
        self._items.put(None)
        self._reader.join(30)


def embed(stub: pb_grpc.EmbeddingServiceStub, texts: list[str]) -> grpc.RpcError | pb.EmbedResponse:
    try:
        return stub.Embed(pb.EmbedRequest(texts=texts), timeout=30)
    except grpc.RpcError as e:
        return e


def hold_every_place(server: ServerProcess, stub: pb_grpc.EmbeddingServiceStub) -> list[HeldStream]:
    """CALLS held streams, returned once the front serves them all (its in-flight gauge says so)."""
    held = [HeldStream(stub) for _ in range(CALLS)]
    deadline = time.monotonic() + 20
    while metric(server, "embed_requests_in_flight") < CALLS:
        assert time.monotonic() < deadline, [s.error for s in held]
        time.sleep(0.05)
    assert all(s.error is None for s in held), [s.error for s in held]
    return held


def test_a_call_past_the_places_waits_one_past_the_waiting_is_refused_named_and_health_answers(
    server: ServerProcess,
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        refused_before = metric(server, "embed_requests_refused_total", reason="calls")
        held = hold_every_place(server, stub)
        waiting = stub.Embed.future(pb.EmbedRequest(texts=["served once a place frees"]), timeout=60)
        time.sleep(1.0)
        assert not waiting.done()  # waits in turn, as gRPC would have kept it waiting for a stream
        # 1.5 MB: refused before gRPC reads its message, so before the front's byte budgets see it.
        refused = embed(stub, ["word " * 20_000] * 15)
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        named = f"{CALLS} calls being served and {WAITING} waiting, max_concurrent_calls is {CALLS}"
        assert named in str(refused.details()), refused.details()
        assert f"max_waiting_calls {WAITING}" in str(refused.details())
        assert dict(refused.trailing_metadata() or ()).get("x-request-id")
        found = error_details(refused)
        assert found["ErrorInfo"].reason == "FRONT_BUSY", found
        assert dict(found["ErrorInfo"].metadata) == {
            "setting": "max_concurrent_calls",
            "limit": str(CALLS),
            "value": str(CALLS),
            "waiting": str(WAITING),
            "waitingLimit": str(WAITING),
        }
        assert found["RetryInfo"].retry_delay.seconds == 1
        assert server.health() == health_pb2.HealthCheckResponse.SERVING  # not an embedding call
        assert metric(server, "embed_requests_refused_total", reason="calls") == refused_before + 1
        assert metric(server, "embed_requests_refused_total", reason="request_bytes") == 0
        held[0].end()
        assert len(waiting.result(timeout=30).embeddings) == 1  # the freed place went to it
        held[1].end()
        assert all(s.error is None and [a.id for a in s.answers] == ["last"] for s in held)
        answered = embed(stub, ["served again once the streams ended"])
        assert isinstance(answered, pb.EmbedResponse) and len(answered.embeddings) == 1


def test_a_unary_call_that_never_sends_its_message_gives_its_place_back_at_the_timeout() -> None:
    """Calls that send their headers and never their message held every place and waiting place of a
    front for good, its health SERVING (an adversarial pass: 640 of them, a few kB in all). Each now
    has message_timeout_s once it has a place: DEADLINE_EXCEEDED, named, and the place is free."""

    async def silent(address: str) -> grpc.aio.AioRpcError:
        async def nothing() -> AsyncIterator[bytes]:
            await asyncio.Event().wait()  # headers only, and the stream left open
            yield b""

        async with grpc.aio.insecure_channel(address) as channel:
            embed = channel.stream_unary("/embedding.v1.EmbeddingService/Embed")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await embed(nothing(), timeout=30)
            return e.value

    settings = {"max_concurrent_calls": 1, "max_waiting_calls": 1, "message_timeout_s": 1}
    with serving(*flags(settings)) as process:
        started = time.monotonic()
        ended = asyncio.run(silent(process.address))
        took = time.monotonic() - started
        with grpc.insecure_channel(process.address) as channel:  # its place is free again
            stub = pb_grpc.EmbeddingServiceStub(channel)
            assert len(stub.Embed(pb.EmbedRequest(texts=["after"]), timeout=30).embeddings) == 1
    assert ended.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended
    assert "request had not all arrived 1 s after it had its place" in (ended.details() or "")
    assert error_details(ended)["ErrorInfo"].reason == "MESSAGE_TIMEOUT"  # type: ignore[attr-defined]
    assert took < 10, took  # the server's 1 s, not the call's own 30 s deadline


def test_health_watches_past_their_share_are_refused_and_embed_and_check_still_answer(
    server: ServerProcess,
) -> None:
    """Watch streams, no token needed, each held one of gRPC's places (maximum_concurrent_rpcs): 704 on
    one connection took them all, and every Embed and health Check got RESOURCE_EXHAUSTED "Concurrent
    RPC limit exceeded!" (an acceptance pass). Past LONG_LIVED_CALLS open, with a reflection stream,
    a Watch is refused at once; the connection's Embed and Check answer meanwhile."""
    watches = LONG_LIVED_CALLS + 8

    async def scenario() -> None:
        # Two connections (a connection takes 1,024 streams at once, --max-concurrent-streams), one front.
        async with own_channel(server) as channel, own_channel(server) as other:
            health = health_pb2_grpc.HealthStub(channel)
            stubs = (health, health_pb2_grpc.HealthStub(other))
            calls = [stubs[i % 2].Watch(health_pb2.HealthCheckRequest(service="")) for i in range(watches)]
            await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
            # Every Watch has its answer: nothing takes a place any more, once the ends have come.
            await wait_until_async(lambda: sum(not c.done() for c in calls) <= LONG_LIVED_CALLS, 10)
            await asyncio.sleep(0.2)
            ended = [c for c in calls if c.done()]
            assert len(calls) - len(ended) == LONG_LIVED_CALLS, len(ended)
            assert {await c.code() for c in ended} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            # Refused at once; or (sent together) one took the place of one whose request had not come
            # yet, or of the other connection's oldest while that held more: each names the limit.
            named = (f"{LONG_LIVED_CALLS} health Watch and reflection streams", "a newer call took")
            details = [await c.details() or "" for c in ended]
            assert all(any(n in d for n in named) for d in details), details
            assert all(f"{LONG_LIVED_CALLS}" in d for d in details), details
            # A reflection stream is of the same share. On the connection holding more of the streams
            # (sent together, they split unevenly), it is refused; on the other it would take a place
            # of the first's (the next test).
            held = [sum(not c.done() for c in calls[k::2]) for k in (0, 1)]
            heavier = (channel, other)[held.index(max(held))]
            reflection = reflection_pb2_grpc.ServerReflectionStub(heavier)
            # Refused as it arrives, before its request is read: so none is sent. A request written
            # as the refusal came back raced it, and gRPC's client once said INTERNAL "Internal error
            # from Core" instead (a 2-core machine under load).
            info = reflection.ServerReflectionInfo()
            assert await info.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, await info.details()
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            embedding = pb_grpc.EmbeddingServiceStub(channel)
            answer = await embedding.Embed(pb.EmbedRequest(texts=["watched"]), timeout=30)
            assert len(answer.embeddings) == 1
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.5)
            # Closed ones give their place back: a reflection stream opens again.
            info = reflection.ServerReflectionInfo()
            await info.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await info.read()
            await info.done_writing()
            assert {s.name for s in listed.list_services_response.service} >= {"grpc.health.v1.Health"}

    asyncio.run(scenario())


def test_one_connection_holding_every_health_stream_gives_one_up_to_a_new_client(
    server: ServerProcess,
) -> None:
    """Health Watch and reflection streams need no token: one connection could hold all
    LONG_LIVED_CALLS of a front with Watches that did send their message, and every new client's
    channel health check (the project's client holds one Watch a connection) was refused meanwhile,
    its calls UNAVAILABLE (left open by an acceptance pass). Past the bound, a stream of the
    connection holding the most, where it holds more than the newcomer's would, gives its place up."""

    async def scenario() -> None:
        async with own_channel(server) as channel:  # a connection takes 1,024 streams at once
            health = health_pb2_grpc.HealthStub(channel)
            calls = [health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(LONG_LIVED_CALLS)]
            firsts = await asyncio.gather(*(c.read() for c in calls))
            assert {f.status for f in firsts} == {health_pb2.HealthCheckResponse.SERVING}
            async with AsyncEmbeddingClient(server.address, timeout=30) as client:  # a connection of its own
                vectors = await client.embed(["a new client"])
                assert len(vectors) == 1
            await wait_until_async(lambda: any(c.done() for c in calls), 10)
            ended = [c for c in calls if c.done()]
            assert len(ended) == 1, len(ended)
            assert await ended[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            named = f"held {LONG_LIVED_CALLS} of the {LONG_LIVED_CALLS} health Watch"
            assert named in (await ended[0].details())
            for call in calls:
                call.cancel()

    asyncio.run(scenario())


def test_health_checks_that_send_no_request_cannot_take_the_services_places(
    own_server: ServerProcess,
) -> None:
    """gRPC reads a unary call's request before any handler runs: 80 Check calls that sent their
    headers and no message held every one of gRPC's places, and Embed and Check were refused
    "Concurrent RPC limit exceeded!" for good. Now health's calls are counted from their arrival, at
    most OTHER_CALLS; the service's places stay its own. Past OTHER_CALLS the oldest call still
    waiting for its message gives its place up: a probe's Check, which sends its message at once,
    answers while the client holds every place (it was refused until the calls ended)."""
    checks = OTHER_CALLS + 16

    async def scenario() -> None:
        async with own_channel(own_server) as channel, own_channel(own_server) as other:  # one front
            stuck = [
                ch.stream_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                for ch in (channel, other)
            ]
            never = asyncio.Event()

            async def no_request() -> AsyncIterator[health_pb2.HealthCheckRequest]:
                await never.wait()
                yield health_pb2.HealthCheckRequest()

            calls = []
            for i in range(checks):  # in order: the first ones have waited longest
                calls.append(stuck[i % 2](no_request()))
                await asyncio.sleep(0.001)
            await wait_until_async(lambda: sum(c.done() for c in calls) >= checks - OTHER_CALLS, 20)
            refused = [c for c in calls if c.done()]
            assert len(refused) == checks - OTHER_CALLS
            for call in refused:
                assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, await call.details()
            assert "a newer call took its place" in (await refused[0].details())
            assert f"{OTHER_CALLS} health and reflection calls" in (await refused[0].details())
            assert sum(c.done() for c in calls[: checks // 2]) == checks - OTHER_CALLS  # the oldest
            embedding = pb_grpc.EmbeddingServiceStub(channel)
            answer = await embedding.Embed(pb.EmbedRequest(texts=["checked"]), timeout=30)
            assert len(answer.embeddings) == 1
            health = health_pb2_grpc.HealthStub(other)  # a probe, every place held
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            gave = checks - OTHER_CALLS + 1  # one more gave its place
            await wait_until_async(lambda: sum(c.done() for c in calls) >= gave, 10)
            assert sum(c.done() for c in calls) == gave
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.5)
            health = health_pb2_grpc.HealthStub(channel)
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())


def test_a_probe_answers_while_every_embedding_place_and_every_health_place_is_held(
    own_server: ServerProcess,
) -> None:
    """gRPC's cap was exactly the service's places plus health's: a client holding all of both with
    calls that sent no message (auth is off by default) had a probe's Check refused by gRPC itself,
    "Concurrent RPC limit exceeded!", before health's count could give it a waiting call's place (a
    review). The Embed past the service's places is refused by the service, naming its limits."""

    async def scenario() -> None:
        # One front; a connection takes 1,024 streams at once (--max-concurrent-streams): the held
        # calls on two, the probe's and the Embed on a third.
        async with (
            own_channel(own_server) as channel,
            own_channel(own_server) as other,
            own_channel(own_server) as probe,
        ):
            never = asyncio.Event()

            async def no_request(message: Any) -> AsyncIterator[Any]:
                await never.wait()
                yield message

            embed = channel.stream_unary(
                "/embedding.v1.EmbeddingService/Embed",
                request_serializer=pb.EmbedRequest.SerializeToString,
                response_deserializer=pb.EmbedResponse.FromString,
            )
            held = [embed(no_request(pb.EmbedRequest())) for _ in range(CALLS + WAITING)]
            checks = [
                ch.stream_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                for ch in (channel, other)
            ]
            held += [checks[i % 2](no_request(health_pb2.HealthCheckRequest())) for i in range(OTHER_CALLS)]
            await asyncio.sleep(2)
            ended = [(held.index(c), await c.code(), await c.details()) for c in held if c.done()]
            assert not ended, (ended, own_server.lines[-20:])  # every place held
            stub = pb_grpc.EmbeddingServiceStub(probe)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Embed(pb.EmbedRequest(texts=["one more"]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Concurrent RPC limit" not in (refused.value.details() or "")
            health = health_pb2_grpc.HealthStub(probe)
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            for call in held:
                call.cancel()

    asyncio.run(scenario())


def test_health_calls_cancelled_before_their_message_log_no_error(server: ServerProcess) -> None:
    """A Check or Watch that its client cancels (or whose connection closes) before sending its
    message also ends its request stream: the NO_REQUEST read then replaced the cancellation and
    gRPC logged it as the servicer's own error, a traceback of ~36 lines a call (a review: 58 such
    calls wrote 2,146 lines), which any anonymous client could repeat. Their places come back too."""
    calls = 20

    async def scenario() -> None:
        async with own_channel(server) as channel:
            methods = [
                channel.stream_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                ),
                channel.stream_stream(
                    "/grpc.health.v1.Health/Watch",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                ),
            ]
            never = asyncio.Event()

            async def no_request() -> AsyncIterator[health_pb2.HealthCheckRequest]:
                await never.wait()
                yield health_pb2.HealthCheckRequest()

            for i in range(calls):
                call = methods[i % 2](no_request())
                await asyncio.sleep(0.05)  # arrived, waiting for its message
                call.cancel()
            await asyncio.sleep(1)
            health = health_pb2_grpc.HealthStub(channel)
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING

    before = len(server.lines)
    asyncio.run(scenario())
    logged = "".join(server.lines[before:])
    assert "Traceback" not in logged and "ERROR" not in logged, logged[-3000:]


class Aborted(Exception):
    pass


class FakeContext:
    """What StreamLimit asks of a call's context: abort, which ends the handler as gRPC's does."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:50000") -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, message: str, *_: object) -> None:
        self.aborted = (code, message)
        raise Aborted(message)


def test_stream_limit_gives_the_place_of_the_call_waiting_longest_for_its_message_counts_to_zero() -> None:
    """StreamLimit alone, three places: a fourth call takes the place of the oldest call still waiting
    for its message (refused, saying so), and is answered; with every call past its message, a fourth
    is refused at once; the counts end at zero, the taken call's too (counted off when taken)."""
    held = asyncio.Event()

    async def answer(request: str, _: object) -> str:
        await held.wait()
        return "answer to " + request

    async def continuation(_: object) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(answer)

    async def scenario() -> None:
        limit = StreamLimit(3, 2, message_timeout_s=30)
        method = type("Details", (), {"method": CHECK})()
        check = (await limit.intercept_service(continuation, method)).stream_unary
        messages: list[asyncio.Queue[str]] = [asyncio.Queue() for _ in range(5)]
        contexts = [FakeContext() for _ in range(5)]

        async def requests(i: int) -> AsyncIterator[str]:
            yield await messages[i].get()

        def call(i: int) -> asyncio.Task[str]:
            return asyncio.ensure_future(check(requests(i), contexts[i]))

        calls = [call(0)]
        await wait_until_async(lambda: len(limit.waiting) == 1, 5)
        calls += [call(1), call(2)]
        await wait_until_async(lambda: len(limit.waiting) == 3, 5)
        messages[1].put_nowait("b")  # past its message: no longer the one to give its place
        await wait_until_async(lambda: len(limit.waiting) == 2, 5)
        calls.append(call(3))  # over: call 0, waiting longest, gives its place
        with pytest.raises(Aborted, match="a newer call took its place"):
            await calls[0]
        assert contexts[0].aborted and contexts[0].aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (limit.open, len(limit.waiting)) == (3, 2)
        messages[2].put_nowait("c")
        messages[3].put_nowait("d")
        await wait_until_async(lambda: not limit.waiting, 5)
        with pytest.raises(Aborted, match="3 health and reflection calls are open"):
            await call(4)  # none waiting: refused at once
        held.set()
        assert [await c for c in calls[1:]] == ["answer to b", "answer to c", "answer to d"]
        assert (limit.open, limit.open_long_lived, limit.waiting) == (0, 0, {})

    asyncio.run(scenario())


async def watches_held_open() -> tuple[StreamLimit, Callable[..., Any], asyncio.Event]:
    """StreamLimit alone (10 calls, 3 streams) over a Watch handler that stays open until the event
    is set: the limit, its Watch handler, the event."""
    held = asyncio.Event()

    async def watch(request: str, context: FakeContext) -> None:
        await held.wait()

    async def continuation(_: object) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(watch)

    limit = StreamLimit(10, 3, message_timeout_s=30)
    method = type("Details", (), {"method": "/grpc.health.v1.Health/Watch"})()
    return limit, (await limit.intercept_service(continuation, method)).stream_stream, held


def test_stream_limit_shares_the_streams_among_connections() -> None:
    """StreamLimit alone, three streams: a connection holding all three gives its oldest up to another
    connection's stream, and again to a third's; then no connection holds more than a newcomer's
    would (2 against 1 + 1), and the newcomer is refused, saying so. The counts end at zero."""

    async def scenario() -> None:
        limit, watched, held = await watches_held_open()

        async def request() -> AsyncIterator[str]:
            yield "watch"

        def call(peer: str) -> tuple[asyncio.Task[None], FakeContext]:
            context = FakeContext(peer)
            return asyncio.ensure_future(watched(request(), context)), context

        first = [call("a") for _ in range(3)]
        await wait_until_async(lambda: limit.open_long_lived == 3 and not limit.waiting, 5)
        b = call("b")
        with pytest.raises(Aborted, match="held 3 of the 3 health Watch and reflection streams"):
            await first[0][0]
        await wait_until_async(lambda: not limit.waiting, 5)
        c = call("c")
        with pytest.raises(Aborted, match="held 2 of the 3"):
            await first[1][0]
        await wait_until_async(lambda: not limit.waiting, 5)
        assert {p: len(s) for p, s in limit.streams.items()} == {"a": 1, "b": 1, "c": 1}
        d = call("b")  # b would hold 2, no one holds more than 1
        refused = r"3 health Watch and reflection streams are open .* \(1 on this conn"
        with pytest.raises(Aborted, match=refused):
            await d[0]
        held.set()
        for task, _ in (first[2], b, c):
            await task
        assert (limit.open, limit.open_long_lived, limit.waiting, limit.streams) == (0, 0, {}, {})

    asyncio.run(scenario())


def test_stream_limit_keeps_a_new_connections_stream_waiting_for_its_message_from_the_richest() -> None:
    """A new client's Watch, its message come with its headers but not read yet, was the one call
    waiting, and the connection holding every other stream took its place back with its next Watch
    (a review: 16 of 102 new clients UNAVAILABLE). A waiting place goes only to a connection holding
    no more than the waiting call's."""

    async def scenario() -> None:
        limit, watched, held = await watches_held_open()
        message: asyncio.Queue[str] = asyncio.Queue()

        async def request(now: bool) -> AsyncIterator[str]:
            yield "watch" if now else await message.get()

        def call(peer: str, now: bool = True) -> asyncio.Task[None]:
            return asyncio.ensure_future(watched(request(now), FakeContext(peer)))

        richest = [call("a") for _ in range(3)]
        await wait_until_async(lambda: limit.open_long_lived == 3 and not limit.waiting, 5)
        newcomer = call("b", now=False)  # takes a's oldest; waits for its message
        with pytest.raises(Aborted, match="held 3 of the 3"):
            await richest[0]
        await wait_until_async(lambda: len(limit.waiting) == 1, 5)
        with pytest.raises(Aborted, match=r"\(2 on this connection"):
            await call("a")  # refused: it does not take the newcomer's place back
        assert not newcomer.done() and {p: len(s) for p, s in limit.streams.items()} == {"a": 2, "b": 1}
        message.put_nowait("watch")
        await wait_until_async(lambda: not limit.waiting, 5)
        held.set()
        for task in (*richest[1:], newcomer):
            await task
        assert (limit.open, limit.open_long_lived, limit.waiting, limit.streams) == (0, 0, {}, {})

    asyncio.run(scenario())


def own_channel(server: ServerProcess) -> grpc.aio.Channel:
    """A channel with a connection of its own (gRPC shares one between channels alike)."""
    return grpc.aio.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])


async def wait_until_async(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def test_calls_cancelled_at_any_point_give_their_place_back(server: ServerProcess) -> None:
    """Calls cancelled while their message arrives, while served, or while waiting for a place all
    end counted out: afterwards exactly CALLS calls are served and WAITING wait, as before."""

    async def cancel_many() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.EmbeddingServiceStub(channel)
            large = pb.EmbedRequest(texts=["word " * 20_000] * 15)
            for delay in (0.0, 0.001, 0.005, 0.02, 0.1) * 8:
                calls = [
                    stub.Embed(large, timeout=30),
                    stub.EmbedStream(timeout=30),
                    stub.Embed(large, timeout=30),
                ]
                await asyncio.sleep(delay)
                for call in calls:
                    call.cancel()

    asyncio.run(cancel_many())
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        # Once the cancelled calls have ended in the front: every place free again.
        deadline = time.monotonic() + 20
        while metric(server, "embed_requests_in_flight") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        held = hold_every_place(server, stub)  # both served: no place was kept by a cancelled call
        waiting = stub.Embed.future(pb.EmbedRequest(texts=["waits"]), timeout=60)
        time.sleep(1.0)
        refused = embed(stub, ["one more"])
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not waiting.done()
        for stream in held:
            stream.end()
        assert len(waiting.result(timeout=30).embeddings) == 1


def test_places_go_in_turn_and_a_waiter_cancelled_as_it_is_handed_one_passes_it_on() -> None:
    async def scenario() -> None:
        places = Places(limit=1, waiting_limit=3)
        await places.take()
        first, second, third = (asyncio.ensure_future(places.take()) for _ in range(3))
        await asyncio.sleep(0)
        assert (places.taken, places.waiting, places.full()) == (1, 3, True)
        places.give_back()  # handed to the first in turn...
        first.cancel()  # ...which is cancelled before it runs: the place goes on to the second
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0)
        assert second.done() and not third.done()
        third.cancel()  # cancelled while waiting: takes none
        await asyncio.gather(third, return_exceptions=True)
        assert (places.taken, places.waiting) == (1, 0)
        places.give_back()
        assert (places.taken, places.waiting) == (0, 0)

    asyncio.run(scenario())


def read_answer(sock: socket.socket) -> bytes:
    sock.settimeout(HEADER_TIMEOUT_S + 10)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_http_connections_past_the_cap_get_429_and_silent_ones_are_closed_while_grpc_serves(
    server: ServerProcess,
) -> None:
    port = server.http_port
    assert port is not None
    started = time.monotonic()
    open_ = [socket.create_connection(("127.0.0.1", port)) for _ in range(CONNECTIONS)]
    open_[0].sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # headers begun, never ended
    time.sleep(0.3)  # all accepted
    extra = socket.create_connection(("127.0.0.1", port))
    answer = read_answer(extra)
    assert answer.startswith(b"HTTP/1.1 429 "), answer
    assert f"{CONNECTIONS} HTTP connections open, http_max_connections is {CONNECTIONS}".encode() in answer
    # As every other answer: the reason as OpenAI's code, Retry-After on a 429, an x-request-id.
    assert b'"code":"front_busy"' in answer and b"\r\nretry-after: 1\r\n" in answer
    assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", answer), answer
    assert metric(server, "embed_requests_refused_total", reason="http_connections") >= 1
    with grpc.insecure_channel(server.address) as channel:  # the front's other listener serves
        served = embed(pb_grpc.EmbeddingServiceStub(channel), ["gRPC is not held up"])
        assert isinstance(served, pb.EmbedResponse)
    late = read_answer(open_[0])
    assert late.startswith(b"HTTP/1.1 408 "), late
    assert f"http_header_timeout_s={HEADER_TIMEOUT_S:g}".encode() in late
    assert b'"code":"header_timeout"' in late and b"retry-after" not in late
    assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", late), late
    assert [read_answer(s) for s in open_[1:]] == [b"", b""]  # sent nothing: closed, no answer
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 8
    for s in [*open_, extra]:
        s.close()
    # The places are free again, and requests are answered as before.
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        statuses = [client.get("/health").status_code for _ in range(3)]
        assert statuses == [200, 200, 200]


@pytest.mark.parametrize("method", ["POST", "PUT"])  # no such path; a path without that method
def test_a_refusal_given_before_the_body_came_closes_the_connection(
    server: ServerProcess, method: str
) -> None:
    """A 404 or 405 answered while the body still arrives: the rest was taken for the next request's
    headers, and the header timeout answered a 408 nobody asked for (a reviewer found it)."""
    port = server.http_port
    assert port is not None
    path = "/v1/nothing" if method == "POST" else "/v1/embeddings"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n".encode() + b"{" * 10
        )
        answers = b""
        with contextlib.suppress(OSError):
            for _ in range(8):  # the body trickles on, past the header timeout
                time.sleep(HEADER_TIMEOUT_S / 4)
                sock.sendall(b"{" * 10)
        answers = read_answer(sock)
    assert answers.count(b"HTTP/1.1 ") == 1 and b" 408 " not in answers, answers
    assert b"\r\nconnection: close\r\n" in answers, answers


def test_a_connection_that_begins_its_next_request_and_stalls_gets_408_after_an_answer(
    server: ServerProcess,
) -> None:
    """The header timeout applies to each request on a kept-alive connection, not only the first."""
    port = server.http_port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, begun and left
        answers = first + read_answer(sock)  # the rest of the first answer, then the 408
        assert answers.index(b"HTTP/1.1 408 ") > answers.index(b'{"status":"serving"}'), answers
