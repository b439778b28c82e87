"""Peak memory of `minilm-embed embed-file` as the file grows: it must stay flat (streaming).

    python bench/bench_bulk.py [--lines 100000 1000000] [--out-format npy]

The client runs as a child process against a stub server (in another child) that answers Embed with
a constant 384-float vector per text at once, so the measure is the client's own cost, not the model's:
a real server on these 2 cores embeds about 500 sentences a second, 30 minutes for 1M lines. The peak
RSS (ru_maxrss of the client process, from wait4) is printed per file size, with the ratio to the
smallest. Writes build/bench/bulk.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIMS = 384
STUB = """
import asyncio, sys
import grpc
import numpy as np
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb, embedding_pb2_grpc as pb_grpc

ROW = np.full(DIMS, 1 / np.sqrt(DIMS), dtype="<f4").tobytes()

class Stub(pb_grpc.EmbeddingServiceServicer):
    async def Embed(self, request, context):
        rows = [pb.Embedding(float32_le=ROW) for _ in request.texts]
        return pb.EmbedResponse(embeddings=rows, dimensions=DIMS)

    async def Info(self, request, context):
        return pb.InfoResponse(dimensions=DIMS)

async def main():
    server = grpc.aio.server()
    pb_grpc.add_EmbeddingServiceServicer_to_server(Stub(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
""".replace("DIMS", str(DIMS))


def write_corpus(path: Path, lines: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in range(lines):
            f.write(f"line {i}: a short sentence about item number {i % 977}\n")


def run_client(port: int, corpus: Path, out: Path) -> tuple[int, float]:
    """(peak RSS in KiB, seconds) of one embed-file run."""
    command = [sys.executable, "-m", "minilm_embed.client", "--address", f"127.0.0.1:{port}", "embed-file"]
    command += [str(corpus), "--out", str(out)]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    tail = proc.stderr.read()[-2000:]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"embed-file failed:\n{tail.decode(errors='replace')}")
    return usage.ru_maxrss, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--out-format", choices=["npy", "jsonl"], default="npy")
    args = parser.parse_args()
    stub = subprocess.Popen([sys.executable, "-c", STUB], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert stub.stdout is not None
    port = int(stub.stdout.readline())
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for lines in args.lines:
                corpus, out = Path(tmp) / f"{lines}.txt", Path(tmp) / f"{lines}.{args.out_format}"
                write_corpus(corpus, lines)
                peak_kib, seconds = run_client(port, corpus, out)
                results.append({"lines": lines, "peak_rss_mib": peak_kib / 1024, "seconds": seconds})
                out.unlink()
                corpus.unlink()
    finally:
        stub.terminate()
        stub.wait(10)
    print("| lines | peak RSS MiB | x smallest | seconds | out |\n|---:|---:|---:|---:|---|")
    for r in results:
        ratio = r["peak_rss_mib"] / results[0]["peak_rss_mib"]
        figures = f"{r['peak_rss_mib']:.1f} | {ratio:.2f} | {r['seconds']:.1f}"
        print(f"| {r['lines']:,} | {figures} | {args.out_format} |")
    (ROOT / "build" / "bench").mkdir(parents=True, exist_ok=True)
    (ROOT / "build" / "bench" / "bulk.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
