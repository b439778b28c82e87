"""The servicer's account of a cancelled call (the caller's deadline passing, or the caller cancelling),
the Embed response it builds from the engine's array, and what an EmbedStream holds. The streams run
on a stand-in embedder that answers at once: what is measured is the servicer's own bookkeeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server.budget import held_bytes_budget, request_bytes_budget
from minilm_embed.server.embedder import Embedded, Embedder
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.service import DEADLINE_SLACK_S, EmbeddingService, _cancelled_code, _response
from minilm_embed.server.tokenization import Prepared
from minilm_embed.server.transport import Answer


@dataclass
class CancelledCall:
    remaining: float | None  # what grpc.aio's time_remaining() says: None without a deadline, never < 0

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    ("remaining", "code"),
    [
        (0.0, grpc.StatusCode.DEADLINE_EXCEEDED),  # the server's own deadline passed
        # The caller's deadline passed first: its RST_STREAM reaches the server while the server's
        # deadline, which started when it read the call's headers, still has a moment left.
        (0.004, grpc.StatusCode.DEADLINE_EXCEEDED),
        (DEADLINE_SLACK_S, grpc.StatusCode.DEADLINE_EXCEEDED),
        (DEADLINE_SLACK_S + 0.01, grpc.StatusCode.CANCELLED),  # the caller cancelled
        (59.9, grpc.StatusCode.CANCELLED),
        (None, grpc.StatusCode.CANCELLED),  # no deadline: only the caller can have cancelled
    ],
)
def test_a_cancel_at_the_deadline_counts_as_deadline_exceeded_and_any_other_as_cancelled(remaining, code):
    assert _cancelled_code(CancelledCall(remaining)) == code  # type: ignore[arg-type]


# 1, 31 and 32 floats: a byte length of one varint byte (4, 124) and of two (128); 384: the model's.
@pytest.mark.parametrize("dimensions", [1, 31, 32, 384])
def test_the_floats_format_carries_every_value_exactly_and_encodes_as_protobuf_does(dimensions):
    rows = 5
    vectors = np.random.default_rng(dimensions).standard_normal((rows, dimensions)).astype(np.float32)
    vectors[0, 0] = -0.0  # a value protobuf must still write (a packed field writes every element)
    lengths = np.arange(1, rows + 1, dtype=np.int32)
    prepared = Prepared(
        lengths,
        np.ones(int(lengths.sum()), dtype=np.int32),
        np.array([False, True, False, False, True]),
        lengths.astype(np.int64) + 3,
        np.array([False, True, False, False, False]),  # input 1's count is of a prefix only
    )
    embedded = Embedded(Answer(vectors, 7, 5, 0.0, 0.0), prepared, 0.0, 0.0, 0.0)

    floats = _response(embedded, pb.EMBEDDING_FORMAT_FLOATS)
    as_bytes = _response(embedded, pb.EMBEDDING_FORMAT_FLOAT32_BYTES)

    got = np.array([list(e.values) for e in floats.embeddings], dtype=np.float32)
    assert got.tobytes() == vectors.tobytes()  # bit for bit, the sign of -0.0 too
    assert all(not e.float32_le for e in floats.embeddings)
    assert b"".join(e.float32_le for e in as_bytes.embeddings) == vectors.tobytes()
    # What protobuf writes for the same rows given as Python floats.
    naive = pb.EmbedResponse()
    for vector, e in zip(vectors, floats.embeddings, strict=True):
        naive.embeddings.add(values=vector.tolist(), usage=e.usage)
    assert [e.SerializeToString() for e in floats.embeddings] == [
        e.SerializeToString() for e in naive.embeddings
    ]
    assert [(e.usage.tokens, e.usage.truncated, e.usage.original_tokens) for e in floats.embeddings] == [
        (1, False, 4), (2, True, 5), (3, False, 6), (4, False, 7), (5, True, 8)
    ]  # fmt: skip
    for response in (floats, as_bytes):
        assert [e.usage.original_tokens_lower_bound for e in response.embeddings] == [0, 1, 0, 0, 0]
    assert floats.dimensions == dimensions and floats.total_tokens == 15


ITEM = pb.EmbedStreamRequest(id="a", request=pb.EmbedRequest(texts=["hi"])).SerializeToString()


class InstantEmbedder:
    """What EmbeddingService._stream uses of an Embedder; every input's vector is ready at once."""

    def __init__(self) -> None:
        self.request_bytes = request_bytes_budget(1 << 20)
        self.held_bytes = held_bytes_budget(1 << 22)
        self.tracer = None
        self.tokenizer = self  # its count check: every count passes

    def check_count(self, count: int, wanted: str = "", field: str = "") -> None:
        pass

    waiting_to_receive = Embedder.waiting_to_receive

    async def embed(self, job, held) -> Embedded:
        held.release()
        n = len(job.texts)
        ones = np.ones(n, dtype=np.int32)
        prepared = Prepared(ones, ones, np.zeros(n, bool), ones.astype(np.int64), np.zeros(n, bool))
        return Embedded(Answer(np.ones((n, 4), np.float32), 0, 0, 0.0, 0.0), prepared, 0.0, 0.0, 0.0)


def stream_service(max_in_flight: int) -> tuple[EmbeddingService, InstantEmbedder]:
    embedder = InstantEmbedder()
    return EmbeddingService(embedder, Metrics(), max_in_flight, 1 << 21), embedder  # type: ignore[arg-type]


def test_a_stream_cancelled_as_it_reads_an_item_gives_back_the_items_request_bytes():
    """gRPC cancels the handler (the caller went away) in the same loop turn as the reader takes an
    item: the item's task is cancelled before its first step, so its body never runs. Its bytes must
    still go back to the front's budget, or unary calls are refused "front busy" for good."""
    service, embedder = stream_service(64)

    async def main() -> None:
        consumer: asyncio.Future[pb.EmbedStreamResponse] | None = None

        async def requests() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.05)
            assert consumer is not None
            consumer.cancel()
            yield ITEM
            await asyncio.sleep(3600)

        consumer = asyncio.ensure_future(service._stream(requests(), None).__anext__())
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert (embedder.request_bytes.in_use, embedder.request_bytes.open) == (0, 0)
    assert (embedder.held_bytes.in_use, embedder.held_bytes.open) == (0, 0)


def test_a_stream_whose_caller_does_not_read_stops_reading_its_items():
    """Answers the caller has not taken count against --max-stream-in-flight: a caller that writes and
    never reads makes the server stop reading, not pile up answers in its memory."""
    service, _ = stream_service(4)
    pulled = 0

    async def main() -> None:
        async def requests() -> AsyncIterator[bytes]:
            nonlocal pulled
            for _ in range(100):
                pulled += 1
                yield ITEM

        answers = service._stream(requests(), None)
        first = await answers.__anext__()  # one answer taken, then the caller reads no more
        assert first.WhichOneof("result") == "response"
        await asyncio.sleep(0.2)
        assert pulled <= 4 + 1  # N unwritten, and the one read that waits for a slot
        rest = [a async for a in answers]  # reading again lets the stream finish
        assert len(rest) == 99

    asyncio.run(main())
