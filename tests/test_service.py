"""The servicer's account of a cancelled call (the caller's deadline passing, or the caller cancelling),
and the Embed response it builds from the engine's array."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server.embedder import Embedded
from minilm_embed.server.service import DEADLINE_SLACK_S, _cancelled_code, _response
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
        np.zeros(rows, dtype=bool),
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
    assert floats.dimensions == dimensions and floats.total_tokens == 15
