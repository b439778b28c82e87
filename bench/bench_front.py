"""The front end's capacity with the model cost removed, and the real model served, in one run.

    python bench/bench_front.py --model-dir build/model [--data-dir ../shared/data] [--seconds 6]

1. Baselines measured here, in this run: the floor of a Python gRPC server (an asyncio handler that
   does nothing, same client, same load), one front/engine round trip over ZeroMQ (and over a plain
   Unix socket, the alternative), and the CPU the tokenizer costs per sentence (the library with its
   own normaliser vs the service's Tokenizer, which normalises ASCII texts itself; interleaved, one
   thread, batches of 32).
2. The real server (supervisor, fronts, engine, batcher) over an instant stand-in model
   (`python -m tests.stand_in_server instant`, never startable from `minilm-embed-serve`), with each
   of --fronts front processes (1 and 2 by default; 1,2,4,8 on a 16-core GPU host, with
   --load-processes 4 so that the client keeps up): requests/s, sentences/s, and the server's CPU
   time per request and per sentence, summed from /proc over every server process (not wall time);
   over gRPC, then over HTTP (POST /v1/embeddings, base64) on the same server. Then the engine
   alone, fed by clients that speak the front/engine protocol to it directly: what one engine takes
   from any number of fronts, and its CPU per request, at the server's batch limits and at larger
   ones (--engine-batches, ROWSxTOKENS: 32x1024,256x8192 by default).
3. The real model: bench_server.py's table (in-process ceiling, the server at concurrency 1 and 64,
   1 and 32 sentences per request, and the unbatched server), with each of --fronts; then a lone
   request's latency, the server against the unbatched server, taking turns.
Writes markdown to stdout and JSON to build/bench/front.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import zmq
from tokenizers import Tokenizer as HFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import Row, ceiling, load, load_http, load_row, sentences, table

from minilm_embed.model.repository import CPU_PROVIDER, TOKENIZER_FILE
from minilm_embed.model.tokenizer import Tokenizer
from minilm_embed.proto.embedding.v1 import SERVICE_NAME
from minilm_embed.server import protocol
from minilm_embed.server.batcher import Rows
from minilm_embed.server.config import AUTO_BATCH_LIMITS
from tests.proc_tree import tree_cpu_seconds
from tests.server_process import start_server

STAND_IN = ("tests.stand_in_server", "instant")
LEVELS = ((64, 1), (64, 32))


@dataclass
class Capacity:
    setup: str
    fronts: int
    inputs_per_request: int
    requests_per_s: float
    sentences_per_s: float
    cpu_us_per_request: float
    cpu_us_per_sentence: float
    errors: int


def measure(
    setup: str,
    fronts: int,
    pid: int,
    address: str,
    texts: list[str],
    seconds: float,
    http: bool = False,
    load_processes: int = 1,
) -> list[Capacity]:
    """Server CPU per request at each level; over gRPC at `address`, or over HTTP (base64) at it."""
    result = []
    for concurrency, per_request in LEVELS:
        before = tree_cpu_seconds(pid)
        if http:
            row = asyncio.run(load_http(address, texts, concurrency, per_request, seconds, "base64"))
        else:
            row = load_row(address, texts, concurrency, per_request, seconds, load_processes)
        cpu = tree_cpu_seconds(pid) - before
        requests = row.requests + row.errors
        result.append(
            Capacity(
                setup, fronts, per_request, row.requests / seconds, row.sentences_per_s,
                cpu / max(requests, 1) * 1e6, cpu / max(requests * per_request, 1) * 1e6, row.errors,
            )
        )  # fmt: skip
        print(f"  {setup} x{per_request}: {result[-1].cpu_us_per_request:.0f} us/request", file=sys.stderr)
    return result


def stand_in(
    model_dir: Path, fronts: int, texts: list[str], seconds: float, load_processes: int
) -> list[Capacity]:
    flags = ["--model-dir", str(model_dir), "--queue-limit", "16384", "--front-processes", str(fronts)]
    server = start_server(*flags, metrics=False, entry=STAND_IN).wait_serving()
    setup, pid = f"stand-in model, {fronts} front(s)", server.proc.pid
    try:
        over_grpc = measure(setup, fronts, pid, server.address, texts, seconds, load_processes=load_processes)
        return over_grpc + measure(f"{setup}, HTTP", fronts, pid, server.http_url, texts, seconds, http=True)
    finally:
        server.stop()


def _echo_server(port_out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        async def embed(request: bytes, context: object) -> bytes:
            return b""

        handler = grpc.unary_unary_rpc_method_handler(embed)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Embed": handler}),)
        )
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def grpc_floor(texts: list[str], seconds: float) -> list[Capacity]:
    """A Python gRPC server whose Embed handler does nothing (answers an empty response)."""
    context = multiprocessing.get_context("spawn")
    ports = context.SimpleQueue()
    process = context.Process(target=_echo_server, args=(ports,), daemon=True)
    process.start()
    try:
        assert process.pid is not None
        return measure(
            "gRPC floor: empty handler", 1, process.pid, f"127.0.0.1:{ports.get()}", texts, seconds
        )
    finally:
        process.kill()


def _router(path: str, rows: int, dims: int) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    vectors = np.zeros((rows, dims), np.float32)
    while True:
        identity, *_ = sock.recv_multipart()
        sock.send_multipart([identity, b"h" * 29, vectors], copy=False)


def _zeromq_exchange(path: str, submit: list[Any]) -> Callable[[], None]:
    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.connect(f"ipc://{path}")

    def exchange() -> None:
        dealer.send_multipart(submit, copy=False)
        dealer.recv_multipart()

    return exchange


def _unix_echo(path: str, rows: int, dims: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    connection, _ = listener.accept()
    reply = b"h" * 29 + np.zeros((rows, dims), np.float32).tobytes()
    buffer = bytearray(1 << 20)
    while connection.recv_into(buffer):
        connection.send(reply)


def _unix_exchange(path: str, submit: list[Any]) -> Callable[[], None]:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for _ in range(100):  # until the echo process listens
        try:
            client.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)
    else:
        raise RuntimeError(f"the echo process never listened on {path}")
    message, buffer = b"".join(bytes(frame) for frame in submit), bytearray(1 << 20)

    def exchange() -> None:
        client.send(message)
        client.recv_into(buffer)

    return exchange


# transport: (the engine side's echo, the front side's exchange)
TRANSPORTS = {"zeromq": (_router, _zeromq_exchange), "unix socket": (_unix_echo, _unix_exchange)}


def round_trip(transport: str, rows: int, rounds: int = 20000, dims: int = 384) -> dict[str, float]:
    """One SUBMIT of `rows` rows of 16 ids and its RESULT of rows x 384 floats, the engine side an echo
    in another process: over ZeroMQ (DEALER/ROUTER, ipc; what the server uses) or, for comparison, a
    plain Unix SOCK_SEQPACKET socket (no I/O thread). Wall and CPU (both processes) per round trip."""
    path = f"/tmp/bench-front-{os.getpid()}-{transport.replace(' ', '-')}.sock"
    echo, connect = TRANSPORTS[transport]
    process = multiprocessing.get_context("spawn").Process(target=echo, args=(path, rows, dims), daemon=True)
    process.start()
    exchange = connect(path, [b"h" * 25, np.full(rows, 16, np.int32), np.zeros(16 * rows, np.int32)])
    try:
        for _ in range(1000):
            exchange()
        assert process.pid is not None
        cpu0, wall0 = tree_cpu_seconds(process.pid) + time.process_time(), time.perf_counter()
        for _ in range(rounds):
            exchange()
        wall = time.perf_counter() - wall0
        cpu = tree_cpu_seconds(process.pid) + time.process_time() - cpu0
    finally:
        process.kill()
        Path(path).unlink(missing_ok=True)
    return {"round_trip_us": wall / rounds * 1e6, "cpu_us_both_sides": cpu / rounds * 1e6}


def round_trips() -> dict[str, dict[str, float]]:
    return {
        f"{transport}, {rows} row(s)": round_trip(transport, rows)
        for rows in (1, 32)
        for transport in TRANSPORTS
    }


def _engine_address(engine_pid: int) -> str:
    """The ipc address the engine listens on: its listening Unix socket's path (/proc/net/unix),
    matched to the engine by the socket inodes among its open files."""
    inodes = set()
    for fd in Path(f"/proc/{engine_pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes and fields[7].endswith("engine.sock"):
            return f"ipc://{fields[7]}"
    raise RuntimeError(f"no engine.sock among the sockets of process {engine_pid}")


def _engine_client(
    address: str, requests: list[tuple[Any, Any]], window: int, seconds: float, out: Any
) -> None:
    """Keeps `window` SUBMITs in flight to the engine, a new one for each RESULT, for `seconds`."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    sent = answered = 0

    def send() -> None:
        nonlocal sent
        lengths, ids = requests[sent % len(requests)]
        sock.send_multipart(protocol.submit(sent, None, True, lengths, ids))
        sent += 1

    for _ in range(window):
        send()
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        frames = sock.recv_multipart()
        assert protocol.parse_result(frames, 384).status == protocol.OK
        answered += 1
        send()
    out.put(answered)


def engine_alone(
    model_dir: Path, texts: list[str], seconds: float, load_processes: int, batch: tuple[int, int]
) -> list[Capacity]:
    """The engine's own capacity: clients speak the front/engine protocol to it directly (SUBMITs of
    the same sentences' token ids, 64 in flight), no front. What one engine can take from any number
    of fronts; its CPU per request from /proc. `batch`: the engine's (max_batch_size,
    max_batch_tokens); the engine's CPU per input falls as batches grow (per-batch work amortised)."""
    tokenizer = Tokenizer(model_dir / TOKENIZER_FILE, 256)
    size, budget = batch
    server = start_server(
        "--model-dir", str(model_dir), "--queue-limit", "16384", "--front-processes", "1",
        "--max-batch-size", str(size), "--max-batch-tokens", str(budget),
        metrics=False, entry=STAND_IN,
    ).wait_serving()  # fmt: skip
    context = multiprocessing.get_context("spawn")
    result = []
    try:
        assert server.engine_pid is not None
        address = _engine_address(server.engine_pid)
        for concurrency, per_request in LEVELS:
            requests = []
            for i in range(0, min(len(texts), 4096) - per_request + 1, per_request):
                rows = Rows.of(tokenizer.encode(texts[i : i + per_request]).ids)
                requests.append((rows.lengths, rows.ids))
            out = context.Queue()
            clients = [
                context.Process(
                    target=_engine_client,
                    args=(address, requests, concurrency // load_processes, seconds, out),
                    daemon=True,
                )
                for _ in range(load_processes)
            ]
            for client in clients:
                client.start()
            time.sleep(1.0)  # started and connected: measure a window inside the clients' run
            before, started = tree_cpu_seconds(server.engine_pid), time.perf_counter()
            time.sleep(seconds / 2)
            cpu, wall = tree_cpu_seconds(server.engine_pid) - before, time.perf_counter() - started
            answered = sum(out.get() for _ in clients)
            for client in clients:
                client.join()
            # The clients' total over their whole run gives the rate; CPU per request is the engine's
            # CPU in the middle window against that rate over the same window.
            rate = answered / seconds
            per_request_cpu = cpu / (rate * wall)
            result.append(
                Capacity(
                    f"engine alone, batches of {size} rows / {budget} tokens: ZeroMQ clients, no front",
                    0, per_request, rate, rate * per_request,
                    per_request_cpu * 1e6, per_request_cpu / per_request * 1e6, 0,
                )
            )  # fmt: skip
            print(
                f"  engine alone ({size}/{budget}) x{per_request}: "
                f"{result[-1].cpu_us_per_request:.0f} us/request",
                file=sys.stderr,
            )
    finally:
        server.stop()
    return result


def tokenizer_cost(model_dir: Path, texts: list[str], rounds: int = 5) -> dict[str, float]:
    """CPU us per sentence, batches of 32 (one thread): the library's tokenizer with its own
    normaliser, and the service's Tokenizer; rounds interleaved, the median of each."""
    library = HFTokenizer.from_file(str(model_dir / TOKENIZER_FILE))
    library.no_padding()
    library.enable_truncation(256)
    service = Tokenizer(model_dir / TOKENIZER_FILE, 256)
    batches = [texts[i : i + 32] for i in range(0, len(texts) - 31, 32)]
    ways = {
        "library_us_per_sentence": lambda b: [e.ids for e in library.encode_batch_fast(b)],
        "service_us_per_sentence": lambda b: service.encode(b).ids,
    }
    costs: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, encode in ways.items():
            started = time.process_time()
            for batch in batches:
                encode(batch)
            costs[name].append((time.process_time() - started) / (32 * len(batches)) * 1e6)
    return {name: float(np.median(runs)) for name, runs in costs.items()}


def capacity_table(rows: list[Capacity]) -> str:
    lines = [
        "| setup | inputs/req | requests/s | sentences/s | server CPU us/request | us/sentence | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.inputs_per_request} | {r.requests_per_s:,.0f} | {r.sentences_per_s:,.0f} | "
            f"{r.cpu_us_per_request:,.0f} | {r.cpu_us_per_sentence:,.1f} | {r.errors} |"
        )
    return "\n".join(lines)


def real_model(
    model_dir: Path, texts: list[str], seconds: float, repeats: int, fronts: list[int], load_processes: int
) -> str:
    from bench_server import best_of, run_server_levels

    ceilings = ceiling(model_dir, texts, repeats)
    base = ["--queue-limit", "16384", "--model-dir", str(model_dir)]
    plan = [(1, 1), (64, 1), (1, 32), (64, 32)]
    series: dict[str, list[list[Row]]] = {}
    setups = {f"server, {n} front(s)": [*base, "--front-processes", str(n)] for n in fronts}
    setups["server, max batch 1"] = [*base, "--max-batch-size", "1"]
    for _ in range(repeats):
        for setup, flags in setups.items():
            levels = plan if "batch 1" not in setup else [(1, 1), (64, 1)]
            series.setdefault(setup, []).append(
                run_server_levels(setup, flags, texts, levels, seconds, load_processes)
            )
    rows = [row for runs in series.values() for row in best_of(runs)]
    unbatched = {r.concurrency: r.tokens_per_s for r in rows if r.setup == "server, max batch 1"}
    return table(rows, ceilings, unbatched)


def lone_request_latency(model_dir: Path, texts: list[str], rounds: int, seconds: float) -> dict[str, Any]:
    """Concurrency 1, one sentence per request: the server with its defaults against the unbatched
    server (--max-batch-size 1), both up at once, taking turns (order alternating) for `rounds`
    rounds; the median of each one's p50s. The machine's noise moves both alike."""
    base = ["--queue-limit", "16384", "--model-dir", str(model_dir)]
    servers = {
        "batched": start_server(*base, metrics=False),
        "unbatched": start_server(*base, "--max-batch-size", "1", metrics=False),
    }
    p50s: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            server.wait_serving()
        for i in range(rounds):
            for name in sorted(servers, reverse=bool(i % 2)):
                row = asyncio.run(load(servers[name].address, texts, 1, 1, seconds))
                p50s[name].append(row.p50_ms)
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: float(np.median(values)) for name, values in p50s.items()}
    return {
        "p50_ms_median": medians,
        "p50_ms_rounds": p50s,
        "batched_minus_unbatched_ms": medians["batched"] - medians["unbatched"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("build/model"))
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-real-model", action="store_true")
    p.add_argument(
        "--fronts",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[1, 2],
        help="front process counts to measure, comma-separated (default 1,2; e.g. 1,2,4,8 on 16 cores)",
    )
    p.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="client processes generating the gRPC load at 64 callers (1 here; e.g. 4 on 16 cores, where "
        "one asyncio client is slower than several fronts)",
    )
    p.add_argument(
        "--engine-batches",
        type=lambda v: [tuple(int(n) for n in b.split("x")) for b in v.split(",")],
        default=[AUTO_BATCH_LIMITS[CPU_PROVIDER], (256, 8192)],
        help="the engine alone at each of these batch limits, ROWSxTOKENS, comma-separated (default: the "
        "server's, 32x1024, and 256x8192, a GPU-sized batch)",
    )
    p.add_argument("--out", type=Path, default=Path("build/bench/front.json"))
    args = p.parse_args()
    texts = sentences(args.data_dir)
    trips = round_trips()
    tokenizing = tokenizer_cost(args.model_dir, texts)
    rows = grpc_floor(texts, args.seconds)
    for fronts in args.fronts:
        rows += stand_in(args.model_dir, fronts, texts, args.seconds, args.load_processes)
    for batch in args.engine_batches:
        rows += engine_alone(args.model_dir, texts, args.seconds, args.load_processes, batch)
    for name, trip in trips.items():
        print(f"front/engine round trip ({name} of 16 ids in, 384 floats per row out): {trip}")
    print(f"tokenizer CPU per sentence, batches of 32, one thread: {tokenizing}\n")
    print(capacity_table(rows))
    report: dict[str, object] = {
        "round_trips": trips,
        "tokenizer": tokenizing,
        "capacity": [asdict(r) for r in rows],
    }
    if not args.skip_real_model:
        real = real_model(args.model_dir, texts, args.seconds, args.repeats, args.fronts, args.load_processes)
        print("\n" + real)
        report["real_model_markdown"] = real
        lone = lone_request_latency(args.model_dir, texts, rounds=6, seconds=4.0)
        print(f"\nconcurrency 1, one sentence, 6 alternating rounds of 4 s: {lone}")
        report["lone_request"] = lone
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
