"""The servicer's account of a cancelled call: the caller's deadline passing, or the caller cancelling."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from minilm_embed.server.service import DEADLINE_SLACK_S, _cancelled_code


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
