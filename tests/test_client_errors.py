"""client.errors: a failed call raises the client's own exception for its gRPC status, from both
clients, against a real server; each is still a grpc.RpcError with the server's code and message."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from minilm_embed.client import (
    AsyncEmbeddingClient,
    DeadlineExceeded,
    EmbeddingClient,
    EmbeddingError,
    InvalidInput,
    Overloaded,
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


def test_sync_client_raises_invalid_input_naming_the_input(server):
    with EmbeddingClient(server.address, timeout=30) as c, pytest.raises(InvalidInput) as e:
        c.embed(["fine", ""])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "input 1 is an empty string"


def test_async_client_raises_invalid_input_naming_the_input(server):
    async def call() -> None:
        async with AsyncEmbeddingClient(server.address, timeout=30) as c:
            await c.embed_ids([[101, 10**9]])

    with pytest.raises(InvalidInput, match="token id 1000000000 at position 1"):
        asyncio.run(call())


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
