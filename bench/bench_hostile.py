"""Valid but hostile input: the largest requests the limits allow, from 16 callers at once.

    python bench/bench_hostile.py [--model-dir build/model]

For each kind of flood (Embed of as many 100 kB texts as the default message limit allows,
Tokenize of the same, EmbedStream items of 8 such texts, Embed of 256 inputs of 256 token ids):
the answers' status codes, the server's resident memory (all its processes) idle, at peak and 10 s
after the load (in all and per process), and the latency of a short Tokenize probe sent every
100 ms from a process of its own (tests/reliability/hostile.py). Issue 14's targets: only OK or
RESOURCE_EXHAUSTED, peak < 2x idle, after < 1.1x idle, probe p99 < 100 ms (README, "Hostile
input"; tests/reliability/test_hostile.py asserts all but the probe's latency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.hostile import FLAGS, KINDS, one_flood
from tests.server_process import serving


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--out", type=Path, default=Path("build/bench/hostile.json"))
    args = p.parse_args()
    rows = []
    with serving(*FLAGS, "--model-dir", str(args.model_dir)) as server:
        for kind, call, seconds in KINDS:
            rows.append(one_flood(server, kind, call, seconds))
            print(rows[-1], file=sys.stderr)
    print("| flood | calls | idle MiB | peak MiB | after MiB | probe p50 ms | probe p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        calls = ", ".join(f"{k} {v}" for k, v in r["calls"].items())
        print(
            f"| {r['kind']} | {calls} | {r['idle_mib']} | {r['peak_mib']} | {r['after_mib']} | "
            f"{r['probe_p50_ms']} | {r['probe_p99_ms']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
