"""Valid but hostile input (issue 14): 16 callers sending the largest requests the limits allow,
of the longest texts, one kind of call after another on one server (Embed for 30 s, Tokenize,
EmbedStream and 256 inputs of ~8,000 one-byte token ids (the 2 MiB message, ~27 MB parsed) for 5 s
each), while a probe asks every 100 ms.

What must hold, each flood: every call ends OK or RESOURCE_EXHAUSTED and some are answered, the
probe is answered every time, resident memory (all the server's processes) stays below 2x its idle
value and is back within 10% of it 5 s after the flood. The probe's latency is a figure here, not
a bound: bench/bench_hostile.py measures it (docs/benchmarks.md, "Hostile input").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.hostile import FLAGS, KINDS, embed_texts, one_flood
from tests.server_process import ServerProcess, serving

pytestmark = pytest.mark.alone  # make test runs it after the others, with nothing beside it

SETTLE_S = 5.0
ANSWERS = {"OK", "RESOURCE_EXHAUSTED", "probe OK"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving(*FLAGS) as process:
        yield process


@pytest.mark.parametrize("kind, call", [(k, c) for k, c, _ in KINDS], ids=[k for k, _, _ in KINDS])
def test_a_flood_of_the_largest_requests_is_answered_or_refused_within_bounded_memory(
    server, kind, call, figures
):
    seconds = 30.0 if call is embed_texts else 5.0
    row = one_flood(server, kind, call, seconds, settle_s=SETTLE_S)
    figures(seconds=seconds, **row)
    calls, idle = row["calls"], row["idle_mib"]
    assert set(calls) <= ANSWERS, f"unexpected answers: {calls}"
    assert calls.get("OK", 0) > 0 and calls.get("probe OK", 0) > 0, calls
    assert row["peak_mib"] < 2 * idle, f"peak {row['peak_mib']} MiB, idle {idle} MiB"
    assert row["after_mib"] < 1.1 * idle, (
        f"{row['after_mib']} MiB {SETTLE_S:.0f} s after, idle {idle} MiB: "
        f"{row['idle_by_process_mib']} -> {row['after_by_process_mib']}"
    )
    assert server.proc.poll() is None, "the server died"
