"""The front/engine messages: what a front packs is what the engine reads back."""

from __future__ import annotations

import numpy as np
import pytest

from minilm_embed.server import logs, protocol
from minilm_embed.server.errors import BackendFailure, Overloaded
from minilm_embed.server.transport import error_for


def test_submit_carries_its_request_tag_and_arrays_to_the_engine():
    lengths = np.array([2, 3], dtype=np.int32)
    ids = np.arange(5, dtype=np.int32)
    tag = "t" * logs.MAX_REQUEST_ID_CHARS
    frames = [bytes(memoryview(f)) for f in protocol.submit(7, 12.5, True, lengths, ids, tag)]
    got = protocol.parse_submit(frames)
    assert (got.request_id, got.deadline, got.normalize, got.tag) == (7, 12.5, True, tag)
    assert got.lengths.tolist() == [2, 3] and got.ids.tolist() == list(range(5))


def test_submit_without_a_tag_or_deadline_reads_back_empty():
    one = np.array([1], dtype=np.int32)
    got = protocol.parse_submit([bytes(memoryview(f)) for f in protocol.submit(1, None, False, one, one)])
    assert (got.deadline, got.normalize, got.tag) == (None, False, "")


def test_a_tag_longer_than_the_header_holds_is_a_programming_error():
    one = np.array([1], dtype=np.int32)
    with pytest.raises(AssertionError):
        protocol.submit(1, None, False, one, one, "t" * (protocol.TAG_BYTES + 1))


def test_a_bulk_request_reaches_the_engine_as_bulk():
    lengths, ids = np.array([2], dtype=np.int32), np.array([101, 102], dtype=np.int32)
    for bulk in (False, True):
        frames = protocol.submit(3, None, True, lengths, ids, "tag", bulk)
        assert protocol.parse_submit([bytes(f) for f in frames]).bulk is bulk


def test_an_engine_refusal_reaches_the_front_as_the_same_error():
    """A failed RESULT carries the error's class (by its status), message, reason, field, metadata
    and retry delay: the front's google.rpc details say what the engine's error said."""
    sent = Overloaded(
        "queue full", "QUEUE_FULL", retry_after_s=0.25, setting="queue_limit", limit=4, value=3, asked=2
    )
    frames = protocol.failure(
        7, sent.code.value[0], str(sent), sent.reason, sent.field, sent.metadata, sent.retry_after_s
    )
    got = error_for(protocol.parse_result(frames, 384))
    assert type(got) is Overloaded and str(got) == "queue full"
    assert got.retry_after_s == 0.25
    assert (got.reason, got.field, got.metadata) == (
        "QUEUE_FULL",
        "",
        {"setting": "queue_limit", "limit": "4", "value": "3", "asked": "2"},
    )
    internal = error_for(
        protocol.parse_result(protocol.failure(8, 13, "internal error", "INTERNAL_ERROR"), 384)
    )
    assert (type(internal), internal.code, internal.reason) == (
        BackendFailure,
        BackendFailure.code,
        "INTERNAL_ERROR",
    )
