"""minilm-embed: embed texts, embed a file of texts, or show the server's model and limits."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from minilm_embed.client import bulk
from minilm_embed.client.client import (
    DEFAULT_ADDRESS,
    MAX_MESSAGE_BYTES,
    MAX_TIMEOUT_S,
    AsyncEmbeddingClient,
    EmbeddingClient,
    Security,
    embed_request,
    lone_surrogate,
    to_array,
)
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server import __version__  # the package's; server/__init__.py imports nothing

# embed-file's --help: bulk.py's docstring is the library's, in Python's names.
FILE_JOB_HELP = """\
Embed a file of texts into a file of vectors: output row i is input line i.

Input: path (- for standard input), UTF-8, one text per line, split at "\\n"
only ("\\r\\n" accepted); with --jsonl, one {"id": ..., "text": "..."} object per
line. An empty line is refused by its number (skipped, it would move every later
row off its line); a line of spaces is a text. A .csv or .tsv is refused, and a
.jsonl or .json without --jsonl. Numeric ids are read as float64 or ints (give
ids as strings to keep them exact); one past float64 (1e400) is refused.

Output, by the suffix of --out:
  .npy    float32 [rows, dimensions]; with --jsonl the ids go beside it, one per
          line, in <stem>.ids.jsonl
  .jsonl  one {"id": ..., "embedding": [...]} per line; for text input the id is
          the line number, from 1

Rows go to OUT.partial while the job runs; OUT appears, renamed, only once every
row is written. A job that fails or is stopped keeps its whole rows there and
says so: run it again with --resume to go on (--resume also adds the rows of a
grown input to a finished OUT). A resume checks that the input, the model and
--no-normalize are those the output was made with, and is otherwise refused,
the output left as it was. A job that fails before its first row leaves no file.

Requests refused as busy (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED)
are retried for --retry-for seconds: after the wait the server's refusal asks
for, up to half as long again, or else with exponential backoff. A TLS handshake
that fails is not retried. Requests are kept within the server's limits, read
at the start; a line over its max_text_chars ends the job, naming the line,
after every row before it is written, and a request refused for a limit that
is lower now ends it too: run it again with --resume.
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minilm-embed", description=__doc__)
    p.add_argument("--version", action="version", version=f"minilm-embed {__version__}")
    p.add_argument(
        "--address",
        default=os.environ.get("EMBED_ADDRESS", DEFAULT_ADDRESS),
        help=f"server address [env EMBED_ADDRESS, default {DEFAULT_ADDRESS}]",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call [default %(default)g]")
    p.add_argument(
        "--ca-cert",
        type=Path,
        help="PEM CA bundle: connect with TLS [env EMBED_CA_CERT]",
        default=os.environ.get("EMBED_CA_CERT") or None,
    )
    p.add_argument("--client-cert", type=Path, help="PEM client certificate for mutual TLS")
    p.add_argument("--client-key", type=Path, help="PEM key of --client-cert")
    p.add_argument("--server-name", help="name to check the server certificate against")
    p.add_argument("--token-file", type=Path, help="file with the bearer token [or env EMBED_TOKEN]")
    sub = p.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", help="embed texts given as arguments; JSON out")
    embed.add_argument(
        "texts", nargs="+", help="the texts; messages about them count from 0: input 0 is the first"
    )
    embed.add_argument("--no-normalize", action="store_true")
    embed.add_argument("--no-truncate", action="store_true")
    ef = sub.add_parser(
        "embed-file",
        help="embed a file, one text per line (or JSONL), into .npy or .jsonl rows in input order",
        description=FILE_JOB_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ef.add_argument("path", help="input file, or - for standard input")
    ef.add_argument("--out", type=Path, required=True, help="output: .npy or .jsonl")
    ef.add_argument("--jsonl", action="store_true", help='input lines are {"id": ..., "text": "..."}')
    ef.add_argument(
        "--resume", action="store_true", help="go on from the rows already in OUT.partial, or in OUT"
    )
    ef.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="texts per request, at most the server's max_inputs_per_request and queue_limit "
        "[default %(default)s]",
    )
    ef.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="UTF-8 bytes of text per request, at most half the server's max_message_bytes "
        "[default %(default)s]",
    )
    ef.add_argument("--concurrency", type=int, default=16, help="requests in flight [default %(default)s]")
    ef.add_argument(
        "--priority",
        choices=("bulk", "interactive"),
        default="bulk",
        help="bulk: batched after interactive requests, within the server's --bulk-queue-share "
        "[default %(default)s]",
    )
    ef.add_argument(
        "--retry-for",
        type=float,
        default=600.0,
        help="seconds a request is retried for, on RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED "
        "[default %(default)g]",
    )
    ef.add_argument(
        "--retries",
        type=int,
        default=None,
        help="at most this many retries per request [default: as many as --retry-for allows]",
    )
    ef.add_argument(
        "--no-normalize",
        action="store_true",
        help="write the mean-pooled vectors, not normalised ones (length 1)",
    )
    sub.add_parser("info", help="the model and limits of the server; JSON out")
    return p.parse_args(argv)


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def as_json(message: Message) -> dict[str, Any]:
    """`message` as protobuf's JSON mapping has it, every field included, but 64-bit integers as JSON
    numbers: the mapping writes them as strings (for JavaScript, whose numbers are doubles), and
    `info` showed maxMessageBytes as "2097152", which `jq '... > 1000000'` compares as a string."""
    out = MessageToDict(message, always_print_fields_with_no_presence=True)
    _int64_as_numbers(message, out)
    return out


def _int64_as_numbers(message: Message, out: dict[str, Any]) -> None:
    for field in message.DESCRIPTOR.fields:
        key = field.json_name
        if key not in out:
            continue
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:  # JSON: an object, its keys strings
            if kind.fields_by_name["value"].type in _INT64:  # (the API has no map of messages)
                out[key] = {k: int(v) for k, v in out[key].items()}
        elif field.type in _INT64:
            out[key] = [int(v) for v in out[key]] if field.is_repeated else int(out[key])
        elif kind is not None:
            value = getattr(message, field.name)
            pairs = zip(value, out[key], strict=True) if field.is_repeated else [(value, out[key])]
            for item, item_out in pairs:
                _int64_as_numbers(item, item_out)


class UsageError(Exception):
    """A flag's or a setting's value that no call can use; the message names it and the value."""


def check_flags(args: argparse.Namespace) -> None:
    """What argparse's types let through and a command cannot use, refused before any call: a
    timeout of 0, below it or NaN made the client raise a bare ValueError (a traceback), and gRPC
    takes an infinite one, or one past about 7.4e9 s, as already past; a --retry-for of NaN retried
    for ever."""
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(
            f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, not {args.timeout}"
        )
    if args.command != "embed-file":
        return
    for name in ("batch_size", "concurrency", "max_request_bytes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not (math.isfinite(args.retry_for) and args.retry_for >= 0):
        raise UsageError(f"--retry-for must be a finite number of seconds, at least 0, not {args.retry_for}")
    if args.retries is not None and args.retries < 0:
        raise UsageError(f"--retries must be at least 0, not {args.retries}")


def token_source(args: argparse.Namespace) -> str:
    """Where this client's token comes from: --token-file, else EMBED_TOKEN."""
    return f"--token-file {args.token_file}" if args.token_file else "EMBED_TOKEN"


def security(args: argparse.Namespace) -> Security:
    """The token from --token-file, else EMBED_TOKEN; one that is not UTF-8, or that no header can
    carry, is the user's to fix and is said as such, naming where it came from."""
    source = token_source(args)
    try:
        token = (
            args.token_file.read_text(encoding="utf-8") if args.token_file else os.environ.get("EMBED_TOKEN")
        )
        return Security(args.ca_cert, args.client_cert, args.client_key, token or None, args.server_name)
    except UnicodeDecodeError as e:
        raise UsageError(f"{source}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # Security's refusal of a token no header can carry
        raise UsageError(f"{source}: {e}") from None


def token_hint(args: argparse.Namespace, code: grpc.StatusCode) -> str:
    """For UNAUTHENTICATED, how this client sends a token, or where the refused one came from (a new
    user's pass: the server's words name the metadata, not the flag)."""
    if code != grpc.StatusCode.UNAUTHENTICATED:
        return ""
    if args.token_file or os.environ.get("EMBED_TOKEN", "").strip():
        return f" (the token from {token_source(args)} was refused)"
    return " (this client sends the token from --token-file FILE, or EMBED_TOKEN)"


def cmd_embed(args: argparse.Namespace) -> int:
    for i, text in enumerate(args.texts):
        check_argument(text, i)
    with EmbeddingClient(args.address, args.timeout, security(args)) as c:
        request = embed_request(args.texts, normalize=not args.no_normalize, truncate=not args.no_truncate)
        response = c.embed_response(request)
    out = {
        "dimensions": response.dimensions,
        "embeddings": to_array(response).tolist(),
        "usage": [as_json(e.usage) for e in response.embeddings],
        "timing": as_json(response.timing),
    }
    print(json.dumps(out))
    return 0


def check_argument(text: str, index: int) -> None:
    """A shell argument that is not UTF-8 arrives with its bytes as lone surrogates (PEP 383), which
    no request can carry: say which text, and where. Texts are "input i" from 0, as the server's
    refusals of the same texts name them."""
    if not lone_surrogate(text):
        return
    raw = os.fsencode(text)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bulk.InputFileError(
            f"input {index} is not UTF-8 ({e.reason}: byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
    raise bulk.InputFileError(f"input {index} {lone_surrogate(text)}")


def bulk_job(args: argparse.Namespace) -> bulk.Job:
    return bulk.Job(
        source=None if args.path == "-" else Path(args.path),
        out=args.out,
        jsonl=args.jsonl,
        resume=args.resume,
        batch_size=args.batch_size,
        max_request_bytes=args.max_request_bytes,
        concurrency=args.concurrency,
        normalize=not args.no_normalize,
        priority=args.priority,
        backoff=bulk.Backoff(for_s=args.retry_for, retries=args.retries),
    )


@contextlib.contextmanager
def progress() -> Iterator[Callable[[int], None]]:
    """tqdm's bar where tqdm is installed (`minilm-embed[progress]`), else a count at the end: the
    client alone needs only grpcio, protobuf and numpy. The bar starts with the first rows, so a job
    refused before it writes any (an existing output, a bad line) prints no empty bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def count(n: int) -> None:
            done[0] += n

        yield count
        print(f"{done[0]} texts embedded", file=sys.stderr)
        return
    bars: list[tqdm] = []

    def advance(n: int) -> None:
        if not bars:
            bars.append(tqdm(unit="text", file=sys.stderr))
        bars[0].update(n)

    try:
        yield advance
    finally:
        for bar in bars:
            bar.close()


def served(info: pb.InfoResponse) -> bulk.Served:
    """What the job sizes its requests by: the server's limits, and for messages the smaller of its
    max_message_bytes and the client's own (an answer past the client's is refused on arrival: a
    job of --batch-size 50000 on a server of 128 MiB messages was told the server's limits changed)."""
    limits = info.limits
    return bulk.Served(
        info.dimensions,
        limits.max_inputs_per_request,
        limits.max_text_chars,
        min(limits.max_message_bytes or MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES),
        limits.queue_limit,
        info.onnx_sha256,
    )


class RetryNotice:
    """A line on stderr when refusals start, then at most one every NOTICE_EVERY_S: a server that is
    busy, warming up or unreachable is said, not left to look like a job that hangs."""

    NOTICE_EVERY_S = 30.0

    def __init__(self, address: str, backoff: bulk.Backoff) -> None:
        self.address = address
        self.backoff = backoff
        self.count = 0
        self.said_at = -self.NOTICE_EVERY_S

    def __call__(self, error: grpc.RpcError) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.said_at >= self.NOTICE_EVERY_S:
            self.said_at = now
            print(
                f"client: {self.address}: {error.code().name}: {error.details()}; retrying each request "
                f"{self.bound()}; {self.count} retried so far",
                file=sys.stderr,
            )

    def bound(self) -> str:
        """How long a request is retried, as the flags that bound it say."""
        if self.backoff.retries is None:
            return f"for up to {self.backoff.for_s:.0f} s (--retry-for)"
        times = plural(self.backoff.retries, "time")
        seconds = f"{self.backoff.for_s:.0f} s"
        return f"up to {times} or for {seconds}, whichever ends first (--retries, --retry-for)"


async def embed_file(
    job: bulk.Job, address: str, timeout: float, security: Security, stop: Stop
) -> bulk.Stats:
    stop.cancels(asyncio.current_task())
    notice = RetryNotice(address, job.backoff)
    async with AsyncEmbeddingClient(address, timeout, security) as c:
        # A server still warming up (UNAVAILABLE) is waited for, as a refused request would be.
        info = await bulk.with_retries(c.info, job.backoff, bulk.Stats(on_retry=notice))
        with progress() as update:
            return await bulk.run_job(job, c, served(info), update, notice)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cmd_embed_file(args: argparse.Namespace) -> int:
    job = bulk_job(args)
    stop = Stop()
    try:
        stats = asyncio.run(embed_file(job, args.address, args.timeout, security(args), stop))
    except (KeyboardInterrupt, asyncio.CancelledError):
        if stop.signum is None:
            raise
        if (partial := bulk.partial_path(job.out)).exists():
            print(
                f"client: stopped; {partial} holds the rows so far; run again with --resume to go on "
                f"from there ({job.out} is written when every row is)",
                file=sys.stderr,
            )
        return 128 + stop.signum  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports them
    resumed = f", {stats.resumed} of them from before" if stats.resumed else ""
    retried = plural(stats.retried, "refusal")
    print(f"wrote {plural(stats.rows, 'row')} to {job.out}{resumed}; {retried} retried", file=sys.stderr)
    return 0


class Stop:
    """SIGINT and SIGTERM (a batch system's or Kubernetes' stop) end a job with its whole rows kept and
    a line saying where they are. While the job runs, a signal cancels its task from the event loop
    (`loop.add_signal_handler`), so the job stops at an await. A KeyboardInterrupt raised wherever the
    main thread happened to be (as a plain signal handler does) could land inside grpc.aio's completion
    callbacks, which swallow it after waking nothing: the job then ignored the stop and hung on a call
    that would never end (seen once in CI). Input is read in a daemon thread (bulk.ReadAhead), so a
    stalled stdin holds neither the cancel nor the exit. A second signal stops the job at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        for signum in self.SIGNALS:  # until the job's event loop takes them over (`cancels`)
            signal.signal(signum, self.at_once)

    def at_once(self, signum: int, frame: object = None) -> None:
        """Before and after the event loop, and a second signal: nothing to wake, nothing to lose."""
        self.signum = signum
        raise KeyboardInterrupt

    def cancels(self, task: asyncio.Task[Any] | None) -> None:
        assert task is not None, "called from the job's task"
        loop = asyncio.get_running_loop()
        for signum in self.SIGNALS:
            loop.add_signal_handler(signum, self._cancel, signum, task)

    def _cancel(self, signum: int, task: asyncio.Task[Any]) -> None:
        if self.signum is not None:
            self.at_once(signum)
        self.signum = signum
        task.cancel()


def cmd_info(args: argparse.Namespace) -> int:
    with EmbeddingClient(args.address, args.timeout, security(args)) as c:
        info = c.info()
    print(json.dumps(as_json(info), indent=2))
    return 0


# The server's hints name request fields; on the command line they are flags.
AS_FLAGS = {"send truncate=true to cut it": "drop --no-truncate to cut it"}


def in_flags(details: str) -> str:
    for field, flag in AS_FLAGS.items():
        details = details.replace(field, flag)
    return details


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {"embed": cmd_embed, "embed-file": cmd_embed_file, "info": cmd_info}
    try:
        check_flags(args)
        code = commands[args.command](args)
        sys.stdout.flush()  # inside the try: a reader that went away is caught below, not at exit
        return code
    except grpc.RpcError as e:
        report(f"{e.code().name}: {in_flags(e.details() or '')}{token_hint(args, e.code())}", e)
        return 1
    except (bulk.GraphChanged, bulk.LimitsChanged) as e:
        report(str(e), e)
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a Unix tool killed by SIGPIPE does. stdout
        # points at /dev/null so the flush at exit does not fail again (Python's docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (OSError, UsageError, bulk.InputFileError, bulk.OutputFileError) as e:
        report(str(e), e)
        return 2


def report(message: str, error: BaseException) -> None:
    """The error on one line, then what it leaves behind (its notes: an output that resumes)."""
    for line in (f"error: {message}", *getattr(error, "__notes__", ())):
        print(f"client: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
