"""client.errors: a failed call raises the client's own exception for its gRPC status, from both
clients, against a real server; each is still a grpc.RpcError with the server's code and message."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import status_pb2

from minilm_embed.client import (
    AsyncEmbeddingClient,
    DeadlineExceeded,
    EmbeddingClient,
    EmbeddingError,
    InvalidInput,
    Overloaded,
    Security,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from minilm_embed.client.errors import from_rpc_error
from tests.server_process import ServerProcess, serving
from tests.test_server import free_port


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving() as process:
        yield process


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidInput),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, EmbeddingError),
        (grpc.StatusCode.CANCELLED, EmbeddingError),
    ],
)
def test_each_status_maps_to_its_exception_keeping_code_details_and_metadata(code, kind):
    raw = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(("k", "v")), "why", "debug")
    error = from_rpc_error(raw)
    assert type(error) is kind
    assert isinstance(error, grpc.RpcError) and isinstance(error, EmbeddingError)
    assert (error.code(), error.details(), error.trailing_metadata()["k"]) == (code, "why", "v")
    # No google.rpc details (gRPC's own errors): nothing made up.
    assert (error.reason, error.field, error.error_metadata, error.retry_after) == ("", "", {}, None)


@pytest.mark.parametrize(
    "trailer",
    [
        b"\xff\xff not a google.rpc.Status",  # garbled, a proxy's
        status_pb2.Status(code=3, message="another message").SerializeToString(),  # not this call's
    ],
)
def test_details_that_are_not_the_calls_own_are_ignored_not_raised(trailer):
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", trailer))
    raw = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailing, "why", "debug"
    )
    error = from_rpc_error(raw)
    assert type(error) is InvalidInput and error.details() == "why"
    assert (error.reason, error.field, error.error_metadata, error.retry_after) == ("", "", {}, None)


def test_sync_client_raises_invalid_input_naming_the_input(server):
    with EmbeddingClient(server.address, timeout=30) as c, pytest.raises(InvalidInput) as e:
        c.embed(["fine", ""])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "input 1 is an empty string"
    # The server's google.rpc details, read for the caller.
    assert (e.value.reason, e.value.field, e.value.error_metadata) == (
        "EMPTY_INPUT",
        "texts[1]",
        {"input": "1"},
    )
    assert e.value.retry_after is None


def test_async_client_raises_invalid_input_naming_the_input(server):
    async def call() -> None:
        async with AsyncEmbeddingClient(server.address, timeout=30) as c:
            await c.embed_ids([[101, 10**9, 102]])  # framed: another tokenizer's ids are named as such

    with pytest.raises(InvalidInput, match="token id 1000000000 at position 1") as e:
        asyncio.run(call())
    assert (e.value.reason, e.value.field) == ("TOKEN_ID_OUT_OF_RANGE", "token_ids[0].ids[1]")
    assert e.value.error_metadata["value"] == "1000000000"


def test_a_deadline_too_short_for_the_call_raises_deadline_exceeded(server):
    # A call that cannot finish in time whatever gRPC rounds the deadline to (its timers tick in
    # milliseconds: an Info call once beat a 1 us deadline): 64 texts of ~100 tokens to embed.
    texts = [f"text {i}: " + "several words for the model to read, " * 12 for i in range(64)]
    with EmbeddingClient(server.address, timeout=1e-6) as c, pytest.raises(DeadlineExceeded):
        c.embed(texts)


def test_no_server_raises_unavailable():
    with EmbeddingClient(f"127.0.0.1:{free_port()}", timeout=30) as c, pytest.raises(Unavailable):
        c.embed(["nobody listens"])


def test_async_client_raises_unavailable_too():
    async def call() -> None:
        async with AsyncEmbeddingClient(f"127.0.0.1:{free_port()}", timeout=30) as c:
            await c.info()

    with pytest.raises(Unavailable):
        asyncio.run(call())


def test_a_message_over_the_size_limit_is_too_large_not_overloaded(server):
    """gRPC refuses it as RESOURCE_EXHAUSTED, as a full queue; retried, it fails every time."""
    texts = [f"{i} " + "a long text for a large request " * 3_000 for i in range(30)]  # ~3 MB
    with EmbeddingClient(server.address, timeout=60) as c, pytest.raises(TooLarge) as e:
        c.embed(texts)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details() and not isinstance(e.value, Overloaded)


def test_a_server_saying_not_serving_is_named_in_unavailable():
    raw = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "connections to all backends failing; last error: ipv4:127.0.0.1:1: backend unhealthy",
    )
    error = from_rpc_error(raw)
    assert type(error) is Unavailable and "warming up, draining, or its engine stopped" in error.details()


def test_token_ids_over_the_limit_are_refused_with_truncate_false(server):
    ids = [101, *[2023] * 300, 102]
    with EmbeddingClient(server.address, timeout=30) as c:
        assert c.embed_ids([ids]).shape == (1, 384)  # cut at 256, as by default
        with pytest.raises(InvalidInput, match="302 tokens, over the limit max_input_tokens=256"):
            c.embed_ids([ids], truncate=False)


def test_a_closed_client_raises_value_error_not_grpcs_own(server):
    c = EmbeddingClient(server.address, timeout=30)
    c.close()
    c.close()
    with pytest.raises(ValueError, match="the client is closed"):
        c.info()

    async def closed_async() -> None:
        a = AsyncEmbeddingClient(server.address, timeout=30)
        await a.info()
        await a.close()
        await a.close()
        await a.info()

    with pytest.raises(ValueError, match="the client is closed"):
        asyncio.run(closed_async())


@contextlib.contextmanager
def silent_address() -> Iterator[str]:
    """An address that takes connections and never answers: a call to it stays in flight until its
    client closes (no server's speed to race)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_call_cut_off_by_close_raises_cancelled_from_both_clients():
    """The blocking client raised EmbeddingError (CANCELLED, "Channel closed!"); the asyncio one a bare
    asyncio.CancelledError, which its callers' `except EmbeddingError` missed."""
    with silent_address() as address:
        sync = EmbeddingClient(address, timeout=30)
        raised: list[BaseException] = []
        started = threading.Event()

        def call() -> None:
            started.set()
            try:
                sync.embed(["cut off by close"])
            except BaseException as e:  # whatever it is: compared below
                raised.append(e)

        thread = threading.Thread(target=call)
        thread.start()
        started.wait(10)
        time.sleep(0.5)
        sync.close()
        thread.join(10)

        async def cut_off() -> None:
            client = AsyncEmbeddingClient(address, timeout=30)
            in_flight = asyncio.create_task(client.embed(["cut off by close"]))
            await asyncio.sleep(0.5)
            await client.close()
            await in_flight

        with pytest.raises(EmbeddingError) as e:
            asyncio.run(cut_off())
    (sync_error,) = raised
    assert isinstance(sync_error, EmbeddingError)
    assert type(e.value) is type(sync_error) is EmbeddingError
    assert (e.value.code(), e.value.details()) == (sync_error.code(), sync_error.details())
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.CANCELLED, "Channel closed!")


@pytest.mark.parametrize("and_closed", [False, True])
def test_an_async_call_whose_task_is_cancelled_still_raises_cancelled_error(and_closed):
    """The task's own cancellation is not the channel's closing, even when the client closes too."""

    async def cancelled(address: str) -> None:
        client = AsyncEmbeddingClient(address, timeout=30)
        in_flight = asyncio.create_task(client.embed(["cancelled"]))
        await asyncio.sleep(0.5)
        in_flight.cancel()
        if and_closed:
            await client.close()
        try:
            await in_flight
        finally:
            await client.close()

    with silent_address() as address, pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled(address))


def test_an_async_client_made_outside_a_loop_serves_the_loop_of_its_first_call(server):
    """Made at import time it failed every call ("attached to a different loop"), and made after an
    asyncio.run had ended its constructor raised."""
    asyncio.run(asyncio.sleep(0))
    c = AsyncEmbeddingClient(server.address, timeout=30)
    assert asyncio.run(c.embed(["made before the loop"])).shape == (1, 384)
    with pytest.raises(RuntimeError, match="make one client per event loop"):
        asyncio.run(c.info())


def test_settings_a_user_gets_wrong_are_refused_or_taken_as_meant(tmp_path):
    assert Security(ca_cert=str(tmp_path / "ca.pem")).ca_cert == tmp_path / "ca.pem"
    # A token read from a file keeps its newline; as a header it failed every call (INTERNAL).
    assert Security(token="s3cret\n").metadata() == (("authorization", "Bearer s3cret"),)
    with pytest.raises(ValueError, match="characters a header cannot carry"):
        Security(token="s3c\x00ret")
    with pytest.raises(ValueError, match="timeout is 0"):
        EmbeddingClient("127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="timeout is inf"):  # gRPC takes it as a deadline already past
        EmbeddingClient("127.0.0.1:1", timeout=float("inf"))
    # A deadline past gRPC's int64 nanoseconds (about 7.4e9 s from now) was also already past.
    with pytest.raises(ValueError, match=r"timeout is 10000000000\.0: .* at most 1e\+09"):
        EmbeddingClient("127.0.0.1:1", timeout=1e10)
    with EmbeddingClient("127.0.0.1:1", timeout=1e9) as c:
        assert c.timeout == 1e9
    with EmbeddingClient("127.0.0.1:1") as c, pytest.raises(TypeError, match="decode it to str"):
        c.embed(b"hello")  # iterated, it was one int per byte


def test_a_text_utf8_cannot_encode_is_a_value_error_naming_it():
    """A lone surrogate (a JSON "\\udc80" escape, a file name's undecodable bytes) raised protobuf's
    bare UnicodeEncodeError, naming no text; a text that is not a str names it (TypeError)."""
    bad = ["fine", "also fine é", "a\udc80b"]
    message = r"texts\[2\] holds a lone surrogate, U\+DC80 at character 1"
    with EmbeddingClient("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match=message):
            c.embed(bad)
        with pytest.raises(ValueError, match=message):
            c.tokenize(bad)

    async def call() -> None:
        async with AsyncEmbeddingClient("127.0.0.1:1") as c:
            await c.embed(bad)

    with pytest.raises(ValueError, match=message):
        asyncio.run(call())


def test_a_priority_that_is_neither_interactive_nor_bulk_is_refused_before_sending(server):
    with EmbeddingClient(server.address, timeout=30) as c, pytest.raises(ValueError, match="'urgent'"):
        c.embed(["a query"], priority="urgent")
