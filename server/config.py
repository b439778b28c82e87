"""Server settings: every flag has an environment variable; built once at start-up, frozen.

Nothing else in the server reads the environment. Defaults come from measurements on the 2-core CI
machine (see README, "Settings"): length-sorted batches of 16-32 rows ran fastest on the CPU provider.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import itertools
import math
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn
from urllib.parse import urlsplit

from minilm_embed.model.repository import CPU_PROVIDER, CUDA_PROVIDER
from minilm_embed.server import __version__

Device = Literal["auto", "cuda", "cpu"]


class ConfigError(Exception):
    """A setting that cannot be used; the message names it and its value."""


ENV_PREFIX = "EMBED_"
# EMBED_* variables the project reads that are not server settings: the client's (client/__main__.py;
# EMBED_ADDRESS it shares with the server), the data directory the Makefile exports to every tool,
# and the soak's length (tests/reliability). A server started beside them must not warn of them.
OTHER_VARIABLES = frozenset({"EMBED_TOKEN", "EMBED_CA_CERT", "EMBED_DATA_DIR", "EMBED_SOAK_SECONDS"})
LISTEN_SETTINGS = ("address", "http_address", "metrics_address")
WILDCARD_HOSTS = ("0.0.0.0", "::")


def setting(name: str) -> str:
    """How a message names a setting: its flag and its variable, `--max-padding (EMBED_MAX_PADDING)`."""
    return f"--{name.replace('_', '-')} ({env_name(name)})"


MIN_LIVENESS_TIMEOUT_S = 3.0
# gRPC's channel arguments and the API's Limits (uint32) hold these whole numbers in 32 bits: past it
# a server loaded the model and then failed with "value too large to convert to int", naming no
# setting (an acceptance pass). The byte and character budgets are Python's own, unbounded.
MAX_WHOLE_SETTING = 2**31 - 1
THIRTY_TWO_BIT_SETTINGS = (
    "max_message_bytes",
    "max_concurrent_streams",
    "max_inputs_per_request",
    "max_text_chars",
    "queue_limit",
    "max_stream_in_flight",
    "max_batch_tokens",
    "max_batch_size",
)
# Seconds (and max_queue_delay_ms) that go out in 32-bit milliseconds or microseconds, to gRPC, to Info
# or to the poll and select timeouts the supervisor waits with (multiprocessing's wait refused 2.2e6 s
# as "timeout is too large"): at most ~24.8 days.
LONGEST_WAIT = MAX_WHOLE_SETTING // 1000


@dataclass(frozen=True)
class ListenAddress:
    """host:port, IPv6 hosts in brackets ([::1]:50051); port 0 picks a free port."""

    host: str  # without brackets; an empty host is 0.0.0.0 (every IPv4 interface), as HTTP always read it
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def clashes(self, other: ListenAddress) -> bool:
        """Whether both ask for one port (port 0 never does) on one host, or on every host."""
        hosts = {self.host.lower(), other.host.lower()}
        return self.port == other.port != 0 and (len(hosts) == 1 or bool(hosts & set(WILDCARD_HOSTS)))


def listen_address(text: str) -> ListenAddress:
    """`text` read as host:port; ValueError says what is wrong with it."""
    host, colon, port = text.rpartition(":")
    if not colon:
        raise ValueError("no port: give host:port (port 0 picks a free port)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 host goes in brackets, as in [::1]:50051")
    if "[" in host or "]" in host:
        raise ValueError("brackets go around a whole IPv6 host, as in [::1]:50051")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"the port must be a number from 0 to 65535, not {port!r}")
    return ListenAddress(host or "0.0.0.0", int(port))


def otlp_endpoint_problem(text: str) -> str | None:
    """What keeps `text` from being an endpoint the exporter (server/tracing.py) reads as meant,
    http(s)://host[:port], the scheme saying plaintext or TLS: it takes any text and only fails once
    serving, resolving it. None for such an endpoint."""
    want = "http://host:port (plaintext) or https://host:port (TLS)"
    try:
        url = urlsplit(text)
    except ValueError as e:  # an unclosed IPv6 bracket
        return f" is not a URL ({e}): give the OTLP/gRPC collector as {want}"
    if url.scheme not in ("http", "https") or not url.hostname:
        return f" is not an http:// or https:// URL with a host: give the OTLP/gRPC collector as {want}"
    try:
        url.port  # noqa: B018 (raises ValueError for a port that is no number or past 65535)
    except ValueError:
        return ": the port must be a number from 0 to 65535"
    if url.path.strip("/") or url.query or url.fragment:
        return f": OTLP/gRPC takes no path (the exporter would drop it): give {url.scheme}://{url.netloc}"
    return None


@dataclass(frozen=True)
class ServerConfig:
    address: str = "0.0.0.0:50051"
    # OpenAI-compatible HTTP API (server/http.py) beside gRPC, on the same engine; empty: off.
    http_address: str = "0.0.0.0:8080"
    # How long an HTTP request body may take to arrive; its bytes are held against the front's budgets
    # meanwhile, so a stalled upload must end (408), not hold them for good.
    http_body_timeout_s: float = 30.0
    # How long a unary gRPC call (Embed, Tokenize, Info) that has its place may take to send its one
    # message; then DEADLINE_EXCEEDED. 640 calls that sent headers and no message held every place
    # and waiting place of a front for good, its gRPC health SERVING (an adversarial pass).
    message_timeout_s: float = 30.0
    # How long an HTTP connection may take to send a request's headers (its first, or its next once
    # an answer has gone out); then 408 and closed. uvicorn has no such limit: 20,000 connections
    # that never sent a byte held a front's file descriptors for good, gRPC's listener included.
    http_header_timeout_s: float = 10.0
    # HTTP connections open at once per front; a connection past it is answered 429 and closed.
    http_max_connections: int = 1024
    model_dir: Path = Path("build/model")
    device: Device = "auto"
    # auto: the provider's first graph (fp32 on the CPU); int8 is an opt-in on the CPU provider.
    precision: str = "auto"
    # Padded tokens per batch (rows x longest row): bounds one model run's work and memory. 0: auto,
    # by the provider the model really runs on (batch_limits_for).
    max_batch_tokens: int = 0
    max_batch_size: int = 0
    # Largest share of padding a batch may carry. The graph skips padding everywhere but in
    # attention, so this bounds attention's waste when long and short inputs meet (0.3-1.0 ran
    # within noise on STS-B; a padded graph wanted 0.15).
    max_padding: float = 0.5
    # How long the first input of a batch may wait for company before its batch runs anyway, while
    # another batch computes (an idle instance runs a lone input at once).
    max_queue_delay_ms: float = 2.0
    max_inputs_per_request: int = 256
    max_text_chars: int = 100_000
    # Characters being tokenized at once in one front process (a text longer than 4,096 characters
    # counts 4,096: only its prefix is read, see model/tokenizer.py): bounds the tokenizer's memory.
    max_tokenizing_chars: int = 2 * 256 * 4096
    # Inputs waiting for a batch; past it a request is refused at once (RESOURCE_EXHAUSTED).
    queue_limit: int = 4096
    # Bulk requests (EmbedRequest.priority BULK, embed-file's) are admitted only while fewer than this
    # share of queue_limit inputs wait: the rest stays for interactive ones, also batched first.
    bulk_queue_share: float = 0.5
    # 2 MiB, as text-embeddings-inference's payload limit: 256 texts of 8 kB, or 20 of 100 kB. At
    # 8 MiB, 16 callers of the largest requests took one front to 820 MB (gRPC assembles each message
    # before a handler sees it) and a probe's p99 past a second; at 2 MiB, 225 MB and ~200 ms.
    max_message_bytes: int = 2 * 1024 * 1024
    # Bytes of requests being parsed and tokenized, per front process: bounds the event loop's
    # parsing work and the memory requests hold (a refused request is not parsed).
    max_request_bytes_in_flight: int = 8 * 1024 * 1024
    # Bytes of requests not yet answered, per front process: each keeps its bytes, parsed message and
    # strings (2-3x its size) until answered, whatever the queue limit (which counts inputs) allows.
    max_request_bytes_held: int = 64 * 1024 * 1024
    max_stream_in_flight: int = 64
    max_concurrent_streams: int = 1024
    # Embedding-service calls (Embed, EmbedStream, Tokenize, Info) served at once per front; past it
    # a call waits in turn, or is refused, before its message is read. The byte budgets below count
    # a request once read, and gRPC reads each admitted call's whole message: 1,200 callers of 2 MiB
    # took one front to 2,470 MiB without this, 1,525 at 256, 1,112 at 128, 693 at 64 (docs/benchmarks.md).
    max_concurrent_calls: int = 128
    # Calls waiting in turn for one of those places (they have read nothing yet: a waiting call costs
    # gRPC's buffers of its stream's window, not its message); past it a call is refused at once. 200
    # concurrent single-sentence callers on one front are served, not refused.
    max_waiting_calls: int = 512
    # Batches computed at once, and ONNX Runtime intra-op threads per instance; 0: auto (backend.py).
    model_instances: int = 0
    threads: int = 0
    # gRPC front processes sharing the port over one engine; 0: auto (server/app.py, plan_fronts).
    front_processes: int = 0
    drain_timeout_s: float = 20.0
    # A model run longer than this is taken as hung (a stuck kernel or driver): the engine exits, so
    # the server exits 1 and is restarted, instead of staying ready while every call times out.
    batch_timeout_s: float = 120.0
    # An event loop (the engine's or a front's) that has not run this long is taken as frozen (a
    # deadlock holding the GIL, a stopped process): the supervisor kills it, as nothing inside it can.
    liveness_timeout_s: float = 30.0
    max_connection_age_s: float = 300.0
    # The server pings each gRPC connection after this long without a frame from its client, and
    # closes it when no answer comes within as long (at most 20 s): a client gone without a FIN (its node
    # lost, a NAT's entry expired) otherwise held an open EmbedStream's call place for good.
    keepalive_s: float = 60.0
    metrics_address: str = "0.0.0.0:9464"
    log_level: str = "INFO"
    log_format: str = "text"
    # OpenTelemetry traces go to this OTLP/gRPC collector; empty: tracing off (server/tracing.py).
    otlp_endpoint: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Never printed: repr=False keeps it out of any log of the config.
    auth_token: str = dataclasses.field(default="", repr=False)
    auth_token_file: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{setting(f.name)} must be a finite number, not {value}")
        self._read_listen_addresses()
        positive = (
            "max_inputs_per_request",
            "queue_limit",
            "max_stream_in_flight",
            "max_concurrent_streams",
            "max_concurrent_calls",
            "http_max_connections",
            "max_message_bytes",
            "max_text_chars",
            "max_tokenizing_chars",
            "max_request_bytes_in_flight",
            "max_request_bytes_held",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{setting(name)} must be at least 1, not {getattr(self, name)}")
        self._check_bounds()
        self._check_choices()
        self._check_otlp_endpoint()

    def _check_bounds(self) -> None:
        for name in THIRTY_TWO_BIT_SETTINGS:
            if getattr(self, name) > MAX_WHOLE_SETTING:
                raise ValueError(
                    f"{setting(name)} must be at most {MAX_WHOLE_SETTING} (gRPC's settings are 32-bit), "
                    f"not {getattr(self, name)}"
                )
        calls, most = self.max_concurrent_calls + self.max_waiting_calls, MAX_WHOLE_SETTING // 2
        if calls > most:  # with health's and reflection's, gRPC's one 32-bit cap (server/front.py)
            raise ValueError(
                f"{setting('max_concurrent_calls')} and {setting('max_waiting_calls')} must add up to at "
                f"most {most} (gRPC's cap on calls is 32-bit), not {calls}"
            )
        waits = [f.name for f in dataclasses.fields(self) if f.name.endswith("_s")] + ["max_queue_delay_ms"]
        for name in waits:
            if getattr(self, name) > LONGEST_WAIT:
                raise ValueError(
                    f"{setting(name)} must be at most {LONGEST_WAIT} (it is waited for in 32-bit "
                    f"milliseconds or microseconds), not {getattr(self, name)}"
                )
        if self.max_request_bytes_in_flight < self.max_message_bytes:
            raise ValueError(
                f"{setting('max_request_bytes_in_flight')} {self.max_request_bytes_in_flight} must be at "
                f"least {setting('max_message_bytes')} {self.max_message_bytes}, or a largest request "
                "could never fit"
            )
        if self.max_request_bytes_held < self.max_request_bytes_in_flight:
            raise ValueError(
                f"{setting('max_request_bytes_held')} {self.max_request_bytes_held} must be at least "
                f"{setting('max_request_bytes_in_flight')} {self.max_request_bytes_in_flight}: requests "
                "being handled are held too"
            )
        for name in (
            "http_body_timeout_s",
            "http_header_timeout_s",
            "message_timeout_s",
            "max_connection_age_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{setting(name)} must be more than 0, not {getattr(self, name)}")
        if self.keepalive_s < 1:  # a ping every few milliseconds on every connection is no setting
            raise ValueError(f"{setting('keepalive_s')} must be at least 1, not {self.keepalive_s}")
        # Heartbeats come and are looked at every second (server/place.py): under 3 s a loaded but
        # healthy process would be taken as frozen.
        if self.liveness_timeout_s and not self.liveness_timeout_s >= MIN_LIVENESS_TIMEOUT_S:
            raise ValueError(
                f"{setting('liveness_timeout_s')} must be 0 (never) or at least {MIN_LIVENESS_TIMEOUT_S:g}, "
                f"not {self.liveness_timeout_s}"
            )
        for name in ("max_waiting_calls", "max_queue_delay_ms", "drain_timeout_s", "batch_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{setting(name)} must be 0 or more, not {getattr(self, name)}")
        auto = ("max_batch_tokens", "max_batch_size", "front_processes", "model_instances", "threads")
        for name in auto:
            if getattr(self, name) < 0:
                raise ValueError(f"{setting(name)} must be 0 (auto) or more, not {getattr(self, name)}")
        if not 0.0 <= self.max_padding <= 1.0:
            raise ValueError(f"{setting('max_padding')} must be between 0 and 1, not {self.max_padding}")
        if not 0.0 < self.bulk_queue_share <= 1.0:
            raise ValueError(
                f"{setting('bulk_queue_share')} must be above 0 and at most 1, not {self.bulk_queue_share}"
            )

    def _check_choices(self) -> None:
        choices = {
            "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
            "log_format": ("text", "json"),
            "precision": ("auto", "fp32", "fp16", "int8"),
            "device": ("auto", "cuda", "cpu"),
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if (value.upper() if name == "log_level" else value) not in allowed:
                named = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
                raise ValueError(f"{setting(name)} must be {named}, not {value!r}")

    def _check_otlp_endpoint(self) -> None:
        if self.otlp_endpoint:  # empty: tracing off
            problem = otlp_endpoint_problem(self.otlp_endpoint)
            if problem:
                raise ValueError(f"{setting('otlp_endpoint')} {self.otlp_endpoint!r}{problem}")

    def _read_listen_addresses(self) -> None:
        """Each address checked and written one way (host:port, [v6]:port), and no port asked twice."""
        if not self.address:
            raise ValueError(f"{setting('address')} is empty: gRPC is always served; give host:port")
        for name in LISTEN_SETTINGS:
            text = getattr(self, name)
            if text:  # an empty HTTP or metrics address: off
                try:
                    object.__setattr__(self, name, str(listen_address(text)))
                except ValueError as e:
                    raise ValueError(f"{setting(name)} {text!r}: {e}") from None
        for (a, x), (b, y) in itertools.combinations(self.listen_addresses().items(), 2):
            if x.clashes(y):
                raise ValueError(
                    f"{setting(a)} {x} and {setting(b)} {y} both ask for port {x.port}: give each its own"
                )

    def listen_addresses(self) -> dict[str, ListenAddress]:
        """Where the server listens, by setting: gRPC, then HTTP and /metrics when they are on."""
        return {name: listen_address(getattr(self, name)) for name in LISTEN_SETTINGS if getattr(self, name)}


# The batch limits `0` (auto) stands for, by execution provider (rows, padded tokens): on the CPU
# 16-32 rows ran fastest (`make bench-model`, README's settings table); on CUDA the H100's in-process
# best batch, 1,024 rows (docs/gpu.md; the H200's served sweep had found no gain past 256 rows
# while a batch's window held every batch to 256).
AUTO_BATCH_LIMITS = {CPU_PROVIDER: (32, 1024), CUDA_PROVIDER: (1024, 131072)}


def batch_limits_for(config: ServerConfig, provider: str) -> ServerConfig:
    """`config` with its auto (0) batch limits set for the provider the model runs on."""
    rows, tokens = AUTO_BATCH_LIMITS.get(provider, AUTO_BATCH_LIMITS[CPU_PROVIDER])
    return dataclasses.replace(
        config,
        max_batch_size=config.max_batch_size or rows,
        max_batch_tokens=config.max_batch_tokens or tokens,
    )


_HELP = {
    "address": (
        "gRPC listen address host:port or [IPv6]:port (an empty host: every IPv4 interface; port 0 "
        "picks a free port; no two listen addresses may share a port)"
    ),
    "http_address": (
        "HTTP listen address host:port of the OpenAI-compatible /v1/embeddings, /v1/models and /health "
        "(port 0 picks a free port; empty: off)"
    ),
    "http_body_timeout_s": (
        "seconds an HTTP request body may take to arrive (its bytes are held against the front's "
        "budgets meanwhile); then 408. Also how long an answer may sit unread: then the connection is cut"
    ),
    "message_timeout_s": (
        "seconds a unary gRPC call (Embed, Tokenize, Info), once it has its place, may take to send "
        "its message; then DEADLINE_EXCEEDED and the place is given back"
    ),
    "http_header_timeout_s": (
        "seconds an HTTP connection may take to send a request's headers (its first, or its next "
        "after an answer); then 408 and the connection closed"
    ),
    "http_max_connections": (
        "HTTP connections open at once per front process; past it a new one gets 429 and is closed"
    ),
    "model_dir": "model repository written by `python -m minilm_embed.export`",
    "device": "auto: CUDA where a GPU is usable, else CPU; cuda: fail without a GPU; cpu",
    "precision": "auto, fp32, fp16 or int8: which shipped graph runs (int8: opt-in, faster on CPU)",
    "max_batch_tokens": (
        "padded tokens (rows x longest row) per batch; must hold one max-length input (0: auto, "
        f"{AUTO_BATCH_LIMITS[CPU_PROVIDER][1]} on the CPU, {AUTO_BATCH_LIMITS[CUDA_PROVIDER][1]} on CUDA)"
    ),
    "max_batch_size": (
        f"rows per batch (0: auto, {AUTO_BATCH_LIMITS[CPU_PROVIDER][0]} on the CPU, "
        f"{AUTO_BATCH_LIMITS[CUDA_PROVIDER][0]} on CUDA)"
    ),
    "max_padding": "largest share of padded tokens in a batch (0-1); inputs left out form the next batch",
    "max_queue_delay_ms": "longest wait for a batch to fill while another batch computes (an idle "
    "instance runs a lone input at once)",
    "max_inputs_per_request": "inputs in one Embed/Tokenize request",
    "max_text_chars": "characters in one text, checked before tokenization",
    "max_tokenizing_chars": (
        "characters being tokenized at once per front process (a text counts at most 4096, "
        "whole in a Tokenize call with truncate=false); beyond it requests get RESOURCE_EXHAUSTED"
    ),
    "queue_limit": "inputs waiting for a batch; beyond it requests get RESOURCE_EXHAUSTED",
    "bulk_queue_share": "bulk requests are admitted only while fewer than this share of queue_limit wait",
    "max_message_bytes": "largest gRPC message received or sent, and largest HTTP request body",
    "max_request_bytes_in_flight": (
        "bytes of requests being parsed and tokenized per front process; beyond it requests get "
        "RESOURCE_EXHAUSTED before they are parsed (at least max_message_bytes)"
    ),
    "max_request_bytes_held": (
        "bytes of requests not yet answered per front process (each keeps its bytes, parsed message "
        "and strings until answered); beyond it requests get RESOURCE_EXHAUSTED before they are "
        "parsed (at least max_request_bytes_in_flight)"
    ),
    "max_stream_in_flight": "unanswered items per EmbedStream before the server stops reading it",
    "max_concurrent_streams": "concurrent HTTP/2 streams (calls) per connection",
    "max_concurrent_calls": (
        "embedding-service calls served at once per front process, streams included; past it a call "
        "waits in turn (max_waiting_calls) before its message is read (health checks not counted)"
    ),
    "max_waiting_calls": (
        "calls waiting per front process for a place among max_concurrent_calls, having read nothing; "
        "past it a call gets RESOURCE_EXHAUSTED at once"
    ),
    "model_instances": (
        "batches computed at once, at most the usable cores (0: as many as fit the cores at --threads, "
        "at most 2; 1 on CUDA)"
    ),
    "threads": "ONNX Runtime intra-op threads per instance, at most the usable cores (0: usable cores / "
    "instances)",
    "front_processes": (
        "front processes (gRPC and HTTP: validate, tokenize, respond) sharing the port over one engine, "
        "at most the usable cores (0: auto, 1 on the CPU provider, half the cores up to 8 on CUDA)"
    ),
    "drain_timeout_s": "on SIGTERM, how long in-flight calls may take to finish (a second signal stops "
    "at once)",
    "batch_timeout_s": "a model run longer than this is taken as hung: the engine exits and the server "
    "exits 1 (0: never)",
    "liveness_timeout_s": "the engine's or a front's event loop that has not run for this long is taken as "
    "frozen: a front is killed and started again, the engine killed and the server exits 1 (0: never; "
    "else at least 3)",
    "max_connection_age_s": "connections are closed (gracefully) after this age so clients re-resolve",
    "keepalive_s": (
        "a gRPC connection silent this long is pinged, and closed when its client does not answer "
        "within as long, at most 20 s (a peer gone without closing)"
    ),
    "metrics_address": "host:port or [IPv6]:port of the Prometheus /metrics endpoint (empty: off)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "text or json (one JSON object per line); lines about a request carry its id",
    "otlp_endpoint": (
        "OTLP/gRPC collector for OpenTelemetry traces, e.g. http://localhost:4317 (empty: tracing off)"
    ),
    "tls_cert": "PEM certificate chain: serve gRPC and HTTP over TLS (with --tls-key)",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    "auth_token": (
        "require `authorization: Bearer <token>` on embedding calls, gRPC and HTTP (health stays open)"
    ),
    "auth_token_file": "file holding the bearer token (preferred over the env var)",
}


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _wanted(name: str, kind: type) -> str:
    """What a setting's text must be, in a user's words: a whole number, a number of seconds."""
    if kind is int:
        return "a whole number"
    units = {"_s": " of seconds", "_ms": " of milliseconds"}
    return "a number" + next((words for end, words in units.items() if name.endswith(end)), "")


def _reader(name: str, kind: type) -> Callable[[str], Any]:
    """`kind` read from a flag's or its variable's text; text it cannot read is a ConfigError naming
    both and the text, one message whichever gave it (argparse's said `invalid int value`)."""

    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{setting(name)} must be {_wanted(name, kind)}, not {text!r}") from None

    return read


PROG = "minilm-embed-serve"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a flag it cannot read is a ConfigError of one line: argparse's own
    error() printed the whole usage (all 38 flags, 35 lines) above the one line that mattered."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Batched gRPC and HTTP embedding server.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    defaults = ServerConfig()
    for f in dataclasses.fields(ServerConfig):
        default = getattr(defaults, f.name)
        read = _reader(f.name, type(default))
        env = env_name(f.name)
        # The variable's text as the default: argparse reads (`type`) a default given as a string only
        # when the flag is absent, so a flag overrides a variable it could not read, as it overrides
        # one it could (a bad EMBED_QUEUE_LIMIT stopped a server started with --queue-limit).
        value = environ.get(env, default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=read,  # its ConfigError passes argparse, which would say `invalid read value`
            default=value,
            help=f"{_HELP[f.name]} [env {env}, default {default}]",
        )
    return parser


def requested_log_format(argv: Sequence[str] | None, environ: Mapping[str, str]) -> str:
    """The log format asked for (`--log-format`, else its variable, else text), read leniently before
    the settings are, so that a setting refused then is reported in it: a JSON log pipeline got one
    plain line for a mistyped flag."""
    given = _flags_given(argv, ("log_format",))["log_format"]
    return given if given is not None else environ.get(env_name("log_format"), "text")


def load_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> ServerConfig:
    """Flags override environment variables, which override the defaults. A setting that cannot be
    used is a ConfigError naming it and the value, with a pointer to --help."""
    try:
        args = build_parser(environ).parse_args(argv)
        config = ServerConfig(**vars(args))
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{e} (`{PROG} --help` lists every setting)") from None
    for name in ("auth_token", "auth_token_file"):
        # An empty variable is most often a secret that did not arrive: serving open would hide it.
        if environ.get(env_name(name)) == "" and not (config.auth_token or config.auth_token_file):
            raise ConfigError(f"{env_name(name)} is set but empty: unset it to serve without authentication")
    for name in _auth_flags_given_empty(argv):
        # The same for a flag: `--auth-token "$TOKEN"` with TOKEN unset served without authentication,
        # over a token in EMBED_AUTH_TOKEN too, and said nothing (an acceptance pass).
        if not (config.auth_token or config.auth_token_file):
            raise ConfigError(
                f"--{name.replace('_', '-')} is empty: leave it out to serve without authentication"
            )
    return config


def _auth_flags_given_empty(argv: Sequence[str] | None) -> list[str]:
    """The authentication settings given as flags with an empty value (argparse's own parse gives their
    defaults too, so it cannot tell)."""
    given = _flags_given(argv, ("auth_token", "auth_token_file"))
    return [name for name, value in given.items() if value == ""]


def _flags_given(argv: Sequence[str] | None, names: Sequence[str]) -> dict[str, str | None]:
    """These settings' flags as given in `argv`, read leniently (None: not given; every other flag is
    let be); all None where one is given without its value, which the full parse refuses."""
    parser = _Parser(add_help=False)
    for name in names:
        parser.add_argument("--" + name.replace("_", "-"), default=None)
    try:
        given = vars(parser.parse_known_args(argv)[0])
    except ConfigError:
        return dict.fromkeys(names)
    return {name: given[name] for name in names}


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """EMBED_* variables that are no setting (nor another part of the project's), each with the
    setting whose name is closest to it, if one is close (difflib, 0.5: DEVCE is DEVICE, FOO is none)."""
    fields = [f.name for f in dataclasses.fields(ServerConfig)]
    known = {env_name(name) for name in fields} | OTHER_VARIABLES
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
    return [(name, _closest_setting(name, fields)) for name in unknown]


def _closest_setting(variable: str, fields: list[str]) -> str | None:
    close = difflib.get_close_matches(variable.removeprefix(ENV_PREFIX).lower(), fields, n=1, cutoff=0.5)
    return env_name(close[0]) if close else None
