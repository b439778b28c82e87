"""The front/engine messages: what a front packs is what the engine reads back."""

from __future__ import annotations

import numpy as np
import pytest

from minilm_embed.server import logs, protocol


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
