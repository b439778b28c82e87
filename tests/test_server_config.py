"""Server settings: each has a flag and an EMBED_* variable, flags win, bad values are refused clearly."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from minilm_embed.client.client import EmbeddingClient
from minilm_embed.model.host import usable_cores
from minilm_embed.server import serve_command
from minilm_embed.server.config import (
    ConfigError,
    ServerConfig,
    batch_limits_for,
    build_parser,
    env_name,
    load_config,
)
from tests.server_process import ServerProcess, loopback_command, model_dir, serving
from tests.test_security import _authority

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(ServerConfig)]
# Two valid values per field that are not the default: one for the environment, one for the flag.
SPECIAL = {
    "device": ("cpu", "cuda"),
    "log_level": ("DEBUG", "WARNING"),
    "log_format": ("json", "text"),  # one value besides the default: the flag wins back to it
    "precision": ("fp32", "int8"),
    "max_padding": ("0.3", "0.7"),
    "bulk_queue_share": ("0.25", "0.75"),
    "address": ("127.0.0.1:50061", "[::1]:50071"),
    "http_address": ("127.0.0.1:8081", "0.0.0.0:8082"),
    "metrics_address": ("127.0.0.1:9465", "[::]:9466"),
    "otlp_endpoint": ("http://collector-from-env:4317", "https://collector-from-flag:4317"),
}
FLOATS = [name for name in FIELDS if isinstance(getattr(ServerConfig(), name), float)]


def two_values(name: str) -> tuple[str, str]:
    if name in SPECIAL:
        return SPECIAL[name]
    default = getattr(ServerConfig(), name)
    if isinstance(default, Path):
        return "/models/from-env", "/models/from-flag"
    if isinstance(default, (int, float)):
        return str(default + 3), str(default + 5)
    return f"{name}-from-env", f"{name}-from-flag"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parsed(name: str, text: str) -> object:
    return type(getattr(ServerConfig(), name))(text)


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_has_an_env_variable_and_a_flag_and_the_flag_wins(name):
    from_env, from_flag = two_values(name)
    env = {env_name(name): from_env}
    assert env_name(name) == "EMBED_" + name.upper()
    assert getattr(load_config([], {}), name) == getattr(ServerConfig(), name)
    assert getattr(load_config([], env), name) == parsed(name, from_env)
    assert getattr(load_config([flag(name), from_flag], {}), name) == parsed(name, from_flag)
    assert getattr(load_config([flag(name), from_flag], env), name) == parsed(name, from_flag)


def test_help_names_every_flag_and_env_variable():
    text = build_parser({}).format_help()
    for name in FIELDS:
        assert flag(name) in text and env_name(name) in text


def refusal(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    """The message a refused configuration gives: a ConfigError, argparse's own errors too, with
    nothing printed (argparse printed its whole usage, 35 lines, above its one line of error)."""
    with pytest.raises(ConfigError) as e:
        load_config(argv, env)
    assert capsys.readouterr() == ("", "")
    return str(e.value)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--max-batch-size", "-1"], {}, "--max-batch-size (EMBED_MAX_BATCH_SIZE) must be 0 (auto) or more"),
        (["--queue-limit", "-1"], {}, "--queue-limit (EMBED_QUEUE_LIMIT) must be at least 1, not -1"),
        (["--device", "tpu"], {}, "--device (EMBED_DEVICE) must be auto, cuda or cpu, not 'tpu'"),
        (
            [],
            {"EMBED_LOG_FORMAT": "yaml"},
            "--log-format (EMBED_LOG_FORMAT) must be text or json, not 'yaml'",
        ),
        ([], {"EMBED_LOG_LEVEL": "loud"}, "must be DEBUG, INFO, WARNING or ERROR, not 'loud'"),
        ([], {"EMBED_DEVICE": "tpu"}, "--device (EMBED_DEVICE) must be auto, cuda or cpu, not 'tpu'"),
        (["--max-batch-size", "many"], {}, "--max-batch-size (EMBED_MAX_BATCH_SIZE) must be a whole number"),
        (["--no-such-flag", "1"], {}, "unrecognized arguments: --no-such-flag 1"),
        # A stream with no room for one unanswered item would never answer anything.
        (
            ["--max-stream-in-flight", "0"],
            {},
            "--max-stream-in-flight (EMBED_MAX_STREAM_IN_FLIGHT) must be at",
        ),
        (["--max-queue-delay-ms", "-1"], {}, "--max-queue-delay-ms (EMBED_MAX_QUEUE_DELAY_MS) must be 0 or"),
        (
            [],
            {"EMBED_DRAIN_TIMEOUT_S": "-5"},
            "--drain-timeout-s (EMBED_DRAIN_TIMEOUT_S) must be 0 or more, not",
        ),
        (
            ["--max-connection-age-s", "0"],
            {},
            "--max-connection-age-s (EMBED_MAX_CONNECTION_AGE_S) must be more",
        ),
        # Heartbeats come every second: at 1 s a loaded but healthy process would be killed as frozen.
        (
            ["--liveness-timeout-s", "1"],
            {},
            "--liveness-timeout-s (EMBED_LIVENESS_TIMEOUT_S) must be 0 (never) or at least 3, not 1.0",
        ),
        (
            [],
            {"EMBED_LIVENESS_TIMEOUT_S": "nan"},
            "EMBED_LIVENESS_TIMEOUT_S",
        ),
        (["--threads", "-2"], {}, "--threads (EMBED_THREADS) must be 0 (auto) or more, not -2"),
        (["--max-padding", "2"], {}, "--max-padding (EMBED_MAX_PADDING) must be between 0 and 1, not 2.0"),
        # Past 32 bits gRPC or the API's Limits could not hold them: the model loaded, then "value
        # too large to convert to int" or "Value out of range", naming no setting.
        (
            ["--queue-limit", "5000000000"],
            {},
            "--queue-limit (EMBED_QUEUE_LIMIT) must be at most 2147483647 (gRPC's settings are 32-bit), "
            "not 5000000000",
        ),
        (
            [],
            {"EMBED_MAX_MESSAGE_BYTES": "2147483648"},
            "(EMBED_MAX_MESSAGE_BYTES) must be at most 2147483647 ",
        ),
        (
            ["--max-connection-age-s", "1e9"],
            {},
            "--max-connection-age-s (EMBED_MAX_CONNECTION_AGE_S) must be at most 2147483 (it is waited for "
            "in 32-bit milliseconds or microseconds), not 1000000000.0",
        ),
        (["--keepalive-s", "2147483.9"], {}, "--keepalive-s (EMBED_KEEPALIVE_S) must be at most 2147483 "),
        (["--max-queue-delay-ms", "1e7"], {}, "(EMBED_MAX_QUEUE_DELAY_MS) must be at most 2147483 "),
        # The supervisor's wait for a drain refused it ("timeout is too large") at the first SIGTERM.
        ([], {"EMBED_DRAIN_TIMEOUT_S": "1e9"}, "--drain-timeout-s (EMBED_DRAIN_TIMEOUT_S) must be at most"),
        (
            ["--max-concurrent-calls", "2000000000", "--max-waiting-calls", "2000000000"],
            {},
            "must add up to at most 1073741823 (gRPC's cap on calls is 32-bit), not 4000000000",
        ),
        (
            ["--bulk-queue-share", "0"],
            {},
            "--bulk-queue-share (EMBED_BULK_QUEUE_SHARE) must be above 0 and at most 1, not 0.0",
        ),
        ([], {"EMBED_BULK_QUEUE_SHARE": "1.5"}, "must be above 0 and at most 1, not 1.5"),
        (
            ["--max-request-bytes-in-flight", "1024"],
            {},
            "--max-request-bytes-in-flight (EMBED_MAX_REQUEST_BYTES_IN_FLIGHT) 1024 must be at least "
            "--max-message-bytes (EMBED_MAX_MESSAGE_BYTES) 2097152",
        ),
    ],
)
def test_invalid_settings_are_refused_with_a_message_naming_them(argv, env, message, capsys):
    assert message in refusal(argv, env, capsys)


@pytest.mark.parametrize(
    ("rows", "tokens", "provider", "resolved"),
    [
        (0, 0, "CPUExecutionProvider", (32, 1024)),
        (0, 0, "CUDAExecutionProvider", (1024, 131072)),
        (8, 0, "CUDAExecutionProvider", (8, 131072)),
        (0, 512, "CPUExecutionProvider", (32, 512)),
        (64, 4096, "CUDAExecutionProvider", (64, 4096)),
    ],
)
def test_auto_batch_limits_follow_the_provider_and_set_ones_stay(rows, tokens, provider, resolved):
    config = batch_limits_for(ServerConfig(max_batch_size=rows, max_batch_tokens=tokens), provider)
    assert (config.max_batch_size, config.max_batch_tokens) == resolved


def run_server(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    command = loopback_command("--model-dir", str(model_dir()), *args)
    environment = {**os.environ, **(env or {})}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment)


def refused_at_start(*args: str, env: dict[str, str] | None = None) -> str:
    """The one line a server that cannot use its settings prints: it exits 2, no traceback, no child
    started (a server that serves instead fails this by its timeout)."""
    done = run_server(*args, env=env, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("server: error: "), done.stderr
    return lines[0].removeprefix("server: error: ")


def test_a_warm_up_that_runs_out_of_memory_stops_the_server_with_one_line_naming_the_limits():
    # As on an H200 at the auto CUDA limits, when the warm-up ran smallest batch first (2026-11-29):
    # the engine's traceback, and the server exited 1 naming nothing.
    entry = ("tests.stand_in_server", "warm-oom")
    command = loopback_command("--model-dir", str(model_dir()), "--front-processes", "1", entry=entry)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "server: error: the warm-up batch of 4 rows x 256 tokens failed on CPUExecutionProvider"
    ), last
    assert "the CUDA memory arena is full (Available memory of 311442688" in last
    assert last.endswith(
        "(--max-batch-size 32, --max-batch-tokens 1024) ask more than a model instance can run here: "
        "lower them"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch-tokens", "-1"], "--max-batch-tokens (EMBED_MAX_BATCH_TOKENS) must be 0 (auto) or"),
        (["--device", "tpu"], "--device (EMBED_DEVICE) must be auto, cuda or cpu, not 'tpu'"),
    ],
)
def test_server_process_refuses_invalid_settings_without_a_traceback(args, message):
    done = run_server(*args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


HELP_POINTER = "(`minilm-embed-serve --help` lists every setting)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-batch-size", "many"],
            "--max-batch-size (EMBED_MAX_BATCH_SIZE) must be a whole number, not 'many'",
        ),
        (["--max-batch-size"], "argument --max-batch-size: expected one argument"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--queue-limit", "0"], "--queue-limit (EMBED_QUEUE_LIMIT) must be at least 1, not 0"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_pointing_to_help_not_the_whole_usage(args, message):
    """argparse printed its usage, all 38 flags in 35 lines, above the one line that said what was
    wrong; a value the settings refuse named the field (queue_limit), not the flag."""
    assert refused_at_start(*args) == f"{message} {HELP_POINTER}"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("queue_limit", "abc", "--queue-limit (EMBED_QUEUE_LIMIT) must be a whole number, not 'abc'"),
        (
            "max_batch_size",
            "2.5",
            "--max-batch-size (EMBED_MAX_BATCH_SIZE) must be a whole number, not '2.5'",
        ),
        (
            "drain_timeout_s",
            "20s",
            "--drain-timeout-s (EMBED_DRAIN_TIMEOUT_S) must be a number of seconds, not '20s'",
        ),
        (
            "max_queue_delay_ms",
            "2ms",
            "--max-queue-delay-ms (EMBED_MAX_QUEUE_DELAY_MS) must be a number of milliseconds, not '2ms'",
        ),
        ("max_padding", "half", "--max-padding (EMBED_MAX_PADDING) must be a number, not 'half'"),
    ],
)
def test_a_number_that_cannot_be_read_is_one_message_from_the_flag_or_the_variable(
    name, text, message, capsys
):
    """The variable's said `EMBED_QUEUE_LIMIT='abc' is not a valid int`, naming no flag; the flag's,
    argparse's `invalid int value`: Python's type names, two ways."""
    expected = f"{message} {HELP_POINTER}"
    assert refusal([flag(name), text], {}, capsys) == expected
    assert refusal([], {env_name(name): text}, capsys) == expected


def test_the_byte_budgets_are_not_held_to_32_bits():
    """Python's own budgets: only what goes to gRPC or into the API's Limits is."""
    config = load_config(["--max-request-bytes-held", str(2**32)], {})
    assert config.max_request_bytes_held == 2**32


def test_a_flag_overrides_a_variable_the_server_could_not_read():
    """Flags override variables: one that is not a number does not matter under its flag."""
    config = load_config(["--queue-limit", "10"], {"EMBED_QUEUE_LIMIT": "abc"})
    assert config.queue_limit == 10
    assert load_config([], {"EMBED_QUEUE_LIMIT": "12"}).queue_limit == 12


def test_a_variable_the_server_cannot_read_is_refused_at_start_as_its_flag_would_be():
    line = refused_at_start(env={"EMBED_DRAIN_TIMEOUT_S": "20s"})
    assert (
        line
        == f"--drain-timeout-s (EMBED_DRAIN_TIMEOUT_S) must be a number of seconds, not '20s' {HELP_POINTER}"
    )


def test_help_still_lists_every_flag_and_exits_0():
    done = run_server("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    for name in FIELDS:
        assert flag(name) in done.stdout and env_name(name) in done.stdout


def test_version_is_the_installed_packages_and_exits_0():
    done = run_server("--version", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"minilm-embed-serve {importlib.metadata.version('minilm-embed')}"


@pytest.mark.parametrize("name", ["threads", "model_instances", "front_processes"])
def test_threads_instances_or_fronts_above_the_usable_cores_are_refused_at_start(name):
    """--threads 100000 was reported to hang or exhaust the machine: ONNX Runtime starts every
    thread it is asked for. --front-processes 1000 did too: a Python interpreter each."""
    cores = usable_cores()
    line = refused_at_start(flag(name), str(cores + 1))
    assert line == (
        f"{flag(name)} ({env_name(name)}) {cores + 1} is more than the {cores} cores this server may use "
        "(its CPU affinity, at most its cgroup's CPU limit)"
    )


def test_threads_times_instances_above_the_cores_is_served_with_a_warning(caplog):
    from minilm_embed.server.app import check_cores

    check_cores(ServerConfig(threads=2, model_instances=2), cores=2)
    (warning,) = caplog.records
    assert warning.levelname == "WARNING"
    assert warning.getMessage() == (
        "--threads 2 x --model-instances 2 is 4 threads on 2 usable cores: they will take turns"
    )
    caplog.clear()
    check_cores(ServerConfig(threads=2, model_instances=1), cores=2)
    check_cores(ServerConfig(threads=0, model_instances=2), cores=2)  # auto: planned to fit
    assert not caplog.records


def test_max_batch_tokens_below_the_model_max_tokens_is_refused_at_start():
    """In one line naming the flag, before any child starts: the engine found it after the fronts had
    started (their log lines came first) and named no flag."""
    line = refused_at_start("--max-batch-tokens", "128")
    assert line == (
        "--max-batch-tokens (EMBED_MAX_BATCH_TOKENS) 128 cannot hold one input of the model's "
        "max_input_tokens 256: set at least 256, or 0 (auto)"
    )


# One server for the three tests that only call a server started from the environment and read what it
# logged as it started (each start costs model load and warm-up): settings from EMBED_* variables with a
# flag over one of them, misspelled variables beside them, and gRPC on an empty host with /metrics on
# [::1]. None of these settings bears on another's test.
SETTINGS_ENV = {"EMBED_MAX_INPUTS_PER_REQUEST": "7", "EMBED_MAX_BATCH_SIZE": "4", "EMBED_QUEUE_LIMIT": "99"}
MISSPELLED_ENV = {
    "EMBED_MAX_BATCH_SIZ": "5",  # misspelled: warned of, never read (the flag's 8 would hide it anyway)
    "EMBED_DEVCE": "cpu",
    "EMBED_DATA_DIR": "/data",
    "EMBED_TOKEN": "t",
}


@dataclasses.dataclass
class StartedServer:
    process: ServerProcess
    lines_at_start: list[str]  # its log once it served, before any test called it


@pytest.fixture(scope="module")
def env_server() -> Iterator[StartedServer]:
    args = ("--max-batch-size", "8", "--address", ":0", "--metrics-address", "[::1]:0")
    with serving(*args, env={**SETTINGS_ENV, **MISSPELLED_ENV}) as process:
        yield StartedServer(process, list(process.lines))


def test_server_process_takes_settings_from_env_and_flags_over_env(env_server):
    with EmbeddingClient(env_server.process.address, timeout=30) as c:
        limits = c.info().limits
        assert (limits.max_inputs_per_request, limits.max_batch_size, limits.queue_limit) == (7, 8, 99)
        assert limits.max_batch_tokens == 1024  # auto: the CPU's, the provider this server runs on
        assert c.embed(["x"] * 7).shape == (7, 384)
        with pytest.raises(grpc.RpcError) as e:
            c.embed(["x"] * 8)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_inputs_per_request=7" in e.value.details()


def test_the_tokenizing_budget_refuses_what_never_fits_and_what_does_not_fit_now():
    from minilm_embed.server.budget import tokenizing_budget
    from minilm_embed.server.errors import InvalidInput, Overloaded

    budget = tokenizing_budget(100)
    with pytest.raises(
        InvalidInput,
        match="101 characters being tokenized for one request can never fit max_tokenizing_chars=100",
    ):
        budget.reserve(101)
    budget.reserve(60)
    with pytest.raises(
        Overloaded, match="60 characters being tokenized, 50 more asked, max_tokenizing_chars is 100"
    ):
        budget.reserve(50)
    budget.release(60)
    budget.reserve(100)
    assert budget.in_use == 100


# Listen addresses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--address", "127.0.0.1:99999"], {}, "--address (EMBED_ADDRESS) '127.0.0.1:99999': the port"),
        (
            ["--http-address", "127.0.0.1:-5"],
            {},
            "--http-address (EMBED_HTTP_ADDRESS) '127.0.0.1:-5': the port",
        ),
        (
            [],
            {"EMBED_METRICS_ADDRESS": "127.0.0.1:x"},
            "--metrics-address (EMBED_METRICS_ADDRESS) '127.0.0.1:x'",
        ),
        (["--address", "127.0.0.1"], {}, "--address (EMBED_ADDRESS) '127.0.0.1': no port"),
        (
            ["--metrics-address", "localhost"],
            {},
            "--metrics-address (EMBED_METRICS_ADDRESS) 'localhost': no port",
        ),
        (["--address", ""], {}, "--address (EMBED_ADDRESS) is empty"),
        (
            ["--address", "::1:50051"],
            {},
            "--address (EMBED_ADDRESS) '::1:50051': an IPv6 host goes in brackets",
        ),
    ],
)
def test_listen_addresses_that_cannot_be_used_are_refused_naming_the_setting(argv, env, message, capsys):
    assert message in refusal(argv, env, capsys)


@pytest.mark.parametrize(
    ("argv", "name", "value"),
    [
        (["--address", ":51401"], "address", "0.0.0.0:51401"),  # an empty host: every IPv4 interface
        (["--http-address", ":8181"], "http_address", "0.0.0.0:8181"),
        (["--metrics-address", "[::1]:19401"], "metrics_address", "[::1]:19401"),
        (["--address", "[::]:50051"], "address", "[::]:50051"),
        (["--http-address", ""], "http_address", ""),  # off
        (["--metrics-address", ""], "metrics_address", ""),
        (["--address", "localhost:0"], "address", "localhost:0"),
    ],
)
def test_listen_addresses_are_read_alike_for_the_three_settings(argv, name, value):
    assert getattr(load_config(argv, {}), name) == value


@pytest.mark.parametrize(
    ("argv", "env", "first", "second", "port"),
    [
        (
            ["--address", "127.0.0.1:5000", "--http-address", "127.0.0.1:5000"],
            {},
            "--address",
            "--http-address",
            5000,
        ),
        (
            ["--address", "0.0.0.0:5001", "--metrics-address", "127.0.0.1:5001"],
            {},
            "--address",
            "--metrics-address",
            5001,
        ),
        (
            ["--http-address", "[::]:5002", "--metrics-address", "10.0.0.1:5002"],
            {},
            "--http-address",
            "--metrics-address",
            5002,
        ),
        (
            ["--address", ":5003"],
            {"EMBED_HTTP_ADDRESS": "127.0.0.1:5003"},
            "--address",
            "--http-address",
            5003,
        ),
        (
            ["--http-address", "127.0.0.1:9464"],
            {},
            "--http-address",
            "--metrics-address",
            9464,
        ),  # the default's
    ],
)
def test_two_settings_on_one_port_are_refused_naming_both(argv, env, first, second, port, capsys):
    """gRPC and HTTP on one port once started 'serving', /health answered 200, every gRPC call failed."""
    message = refusal(argv, env, capsys)
    assert first in message and second in message and f"port {port}" in message


@pytest.mark.parametrize(
    "argv",
    [
        ["--address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--metrics-address", "0.0.0.0:0"],
        ["--address", "127.0.0.1:5004", "--http-address", "127.0.0.2:5004", "--metrics-address", ""],
    ],
)
def test_port_0_or_other_hosts_are_no_clash(argv):
    load_config(argv, {})


def test_a_port_out_of_range_is_refused_by_the_server_without_a_traceback():
    line = refused_at_start("--address", "127.0.0.1:99999")
    assert "--address (EMBED_ADDRESS) '127.0.0.1:99999'" in line and "65535" in line


def test_an_empty_host_and_a_bracketed_ipv6_host_serve(env_server):
    """`:port` (every IPv4 interface) for gRPC, as HTTP and /metrics read it, and [::1] for /metrics."""
    server = env_server.process
    with EmbeddingClient(server.address, timeout=30) as c:  # 127.0.0.1: one of every interface
        assert c.embed(["x"]).shape == (1, 384)
    with socket.create_connection(("::1", server.metrics_port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.0 200")


def held_port(reuseport: bool) -> socket.socket:
    """A port another process listens on; with SO_REUSEPORT, as a stale second server would."""
    sock = socket.socket()
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    ("name", "reuseport"), [("address", True), ("http_address", False), ("metrics_address", True)]
)
def test_a_port_another_process_listens_on_is_refused_before_any_child_starts(name, reuseport):
    """With SO_REUSEPORT the kernel once split connections between the two servers, silently."""
    with held_port(reuseport) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        line = refused_at_start(flag(name), address)
    assert line == f"{flag(name)} ({env_name(name)}) {address} is in use: another server listening there?"


def closed_by_the_server(port: int) -> None:
    """One HTTP call with `Connection: close`, read to the end: the server closes first, and its side
    of the connection waits in TIME_WAIT on `port` for a minute."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while sock.recv(4096):
            pass


def time_waits(port: int) -> int:
    """Connections whose local side is 127.0.0.1:`port`, in TIME_WAIT (state 06 in /proc/net/tcp)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1] == f"0100007F:{port:04X}" and row[3] == "06")


def test_a_server_started_again_binds_its_ports_while_connections_it_closed_wait():
    """A restart within a minute of a stop (Kubernetes restarting the container in the same network
    namespace) was refused "in use" on the HTTP port: the connections the server had closed first
    (idle keep-alives, Connection: close) held it in TIME_WAIT, unlike gRPC's port, whose listener
    sets SO_REUSEADDR."""
    with serving() as first:
        port = first.http_port
        closed_by_the_server(port)
    assert time_waits(port), "no connection of the first server's left in TIME_WAIT: nothing tested"
    with serving("--http-address", f"127.0.0.1:{port}") as again:
        assert again.http_port == port
        closed_by_the_server(port)


def test_a_host_that_does_not_resolve_is_refused_naming_the_setting():
    line = refused_at_start("--http-address", "no-such-host.invalid:0")
    assert line.startswith("--http-address (EMBED_HTTP_ADDRESS) no-such-host.invalid:0: cannot resolve")


# Numbers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_settings_must_be_finite(name, value, capsys):
    message = refusal([f"{flag(name)}={value}"], {}, capsys)
    assert message.startswith(f"{flag(name)} ({env_name(name)}) must be a finite number, not {value}")
    assert f"must be a finite number, not {value}" in refusal([], {env_name(name): value}, capsys)


def test_an_infinite_drain_timeout_is_refused_by_the_server_without_a_traceback():
    line = refused_at_start("--drain-timeout-s", "inf")
    assert line.startswith("--drain-timeout-s (EMBED_DRAIN_TIMEOUT_S) must be a finite number, not inf")


# Traces ---------------------------------------------------------------------------------------------


OTLP = "--otlp-endpoint (EMBED_OTLP_ENDPOINT)"
WANT_URL = "give the OTLP/gRPC collector as http://host:port (plaintext) or https://host:port (TLS)"


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("notaurl", f" is not an http:// or https:// URL with a host: {WANT_URL}"),
        # What the exporter would take as a TLS target, where the docs say the scheme decides.
        ("otel-collector:4317", f" is not an http:// or https:// URL with a host: {WANT_URL}"),
        ("grpc://otel-collector:4317", f" is not an http:// or https:// URL with a host: {WANT_URL}"),
        ("http://:4317", f" is not an http:// or https:// URL with a host: {WANT_URL}"),
        ("http://[::1:4317", f" is not a URL (Invalid IPv6 URL): {WANT_URL}"),
        ("http://otel-collector:43l7", ": the port must be a number from 0 to 65535"),
        ("http://otel-collector:70000", ": the port must be a number from 0 to 65535"),
        # OTLP/HTTP's traces path: the gRPC exporter would drop it and speak gRPC to the HTTP port.
        (
            "http://otel-collector:4318/v1/traces",
            ": OTLP/gRPC takes no path (the exporter would drop it): give http://otel-collector:4318",
        ),
    ],
)
def test_an_otlp_endpoint_that_is_no_http_url_is_refused_naming_it(value, problem, capsys):
    """`notaurl` was taken, and the server served: tracing's only sign was a warning, once serving,
    that "notaurl" did not resolve."""
    expected = f"{OTLP} {value!r}{problem} {HELP_POINTER}"
    assert refusal(["--otlp-endpoint", value], {}, capsys) == expected
    assert refusal([], {"EMBED_OTLP_ENDPOINT": value}, capsys) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "http://otel-collector:4317",
        "https://otel-collector:4317/",
        "HTTP://127.0.0.1:4317",
        "http://[::1]:4317",
    ],
)
def test_an_otlp_endpoint_the_exporter_reads_passes_and_empty_is_tracing_off(value):
    assert load_config([], {"EMBED_OTLP_ENDPOINT": value}).otlp_endpoint == value


def test_an_otlp_endpoint_that_is_no_url_is_refused_by_the_server_at_start():
    line = refused_at_start(env={"EMBED_OTLP_ENDPOINT": "notaurl"})
    assert (
        line == f"{OTLP} 'notaurl' is not an http:// or https:// URL with a host: {WANT_URL} {HELP_POINTER}"
    )


# TLS files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two self-signed certificates with their keys, and a file that is no PEM at all."""
    d = tmp_path_factory.mktemp("tls")
    _authority(d, "one")
    _authority(d, "two")
    (d / "junk.pem").write_text("not a certificate\n")
    return {stem: d / stem for stem in ("one.pem", "one.key", "two.key", "junk.pem")}


@pytest.mark.parametrize(
    ("cert", "key", "client_ca", "named", "message"),
    [
        ("junk.pem", "one.key", "", "junk.pem", "--tls-cert (EMBED_TLS_CERT) {}: no PEM certificate"),
        ("one.pem", "junk.pem", "", "junk.pem", "--tls-key (EMBED_TLS_KEY) {}: no PEM private key"),
        ("one.pem", "two.key", "", "two.key", "--tls-key (EMBED_TLS_KEY) {} does not match --tls-cert"),
        ("one.pem", "one.key", "junk.pem", "junk.pem", "--tls-client-ca (EMBED_TLS_CLIENT_CA) {}: no PEM"),
    ],
)
def test_tls_files_that_do_not_parse_or_match_are_refused_before_the_model_loads(
    tls_files, cert, key, client_ca, named, message
):
    """They once failed after the model warmed up, as 'Failed to bind to address'."""
    from minilm_embed.server.app import check_security

    config = ServerConfig(
        tls_cert=str(tls_files[cert]),
        tls_key=str(tls_files[key]),
        tls_client_ca=str(tls_files[client_ca]) if client_ca else "",
    )
    with pytest.raises(ConfigError) as e:
        check_security(config)
    assert str(e.value).startswith(message.format(tls_files[named]))
    assert re.search(r"\((KEY_VALUES_MISMATCH|NO_CERTIFICATE_OR_CRL_FOUND|\[SSL\] PEM lib)\)$", str(e.value))


def test_a_tls_key_not_matching_its_certificate_is_refused_by_the_server(tls_files):
    args = ("--tls-cert", str(tls_files["one.pem"]), "--tls-key", str(tls_files["two.key"]))
    line = refused_at_start(*args)
    assert line.startswith(f"--tls-key (EMBED_TLS_KEY) {tls_files['two.key']} does not match --tls-cert")


def refused_security(**settings: str) -> str:
    from minilm_embed.server.app import check_security

    with pytest.raises(ConfigError) as e:
        check_security(ServerConfig(**settings))
    return str(e.value)


NO_FILE = "(No such file or directory)"


def test_tls_files_that_cannot_be_read_are_refused_naming_the_setting_the_certificate_first(
    tls_files, tmp_path
):
    """A missing certificate and key once reported the key, by its path alone, naming no setting."""
    cert, key, ca = tmp_path / "nope.pem", tmp_path / "nope.key", tmp_path / "nope-ca.pem"
    assert refused_security(tls_cert=str(cert), tls_key=str(key)) == (
        f"--tls-cert (EMBED_TLS_CERT) {cert}: cannot read the TLS certificate {NO_FILE}"
    )
    assert refused_security(tls_cert=str(tls_files["one.pem"]), tls_key=str(key)) == (
        f"--tls-key (EMBED_TLS_KEY) {key}: cannot read the TLS key {NO_FILE}"
    )
    good = {"tls_cert": str(tls_files["one.pem"]), "tls_key": str(tls_files["one.key"])}
    assert refused_security(**good, tls_client_ca=str(ca)) == (
        f"--tls-client-ca (EMBED_TLS_CLIENT_CA) {ca}: cannot read the client CA {NO_FILE}"
    )


def test_half_a_tls_setting_is_refused_naming_what_is_set_and_what_is_not(tmp_path):
    cert, key, ca = tmp_path / "a.pem", tmp_path / "a.key", tmp_path / "ca.pem"
    assert refused_security(tls_cert=str(cert)) == (
        f"TLS needs both --tls-cert and --tls-key: --tls-cert (EMBED_TLS_CERT) {cert} is set, "
        "--tls-key (EMBED_TLS_KEY) is not"
    )
    assert refused_security(tls_key=str(key)) == (
        f"TLS needs both --tls-cert and --tls-key: --tls-key (EMBED_TLS_KEY) {key} is set, "
        "--tls-cert (EMBED_TLS_CERT) is not"
    )
    assert refused_security(tls_client_ca=str(ca)) == (
        f"--tls-client-ca (EMBED_TLS_CLIENT_CA) {ca} needs --tls-cert (EMBED_TLS_CERT) and --tls-key "
        "(EMBED_TLS_KEY) too: client certificates are asked for in the TLS handshake"
    )


def test_missing_tls_files_are_refused_by_the_server_at_start_naming_the_certificate(tmp_path):
    cert, key = tmp_path / "nope.pem", tmp_path / "nope.key"
    line = refused_at_start(env={"EMBED_TLS_CERT": str(cert), "EMBED_TLS_KEY": str(key)})
    assert line == f"--tls-cert (EMBED_TLS_CERT) {cert}: cannot read the TLS certificate {NO_FILE}"


def test_matching_tls_files_pass(tls_files):
    from minilm_embed.server.app import check_security

    check_security(ServerConfig(tls_cert=str(tls_files["one.pem"]), tls_key=str(tls_files["one.key"])))


# Tokens ---------------------------------------------------------------------------------------------


SECRET = "s3cret-token"


@pytest.mark.parametrize(
    "content",
    [
        (SECRET + "\nsecond-line\n").encode(),
        (SECRET + "\x01\n").encode(),
        "s3cret-tökén".encode(),
    ],
)
def test_a_token_file_no_header_can_carry_is_refused_naming_the_file(tmp_path, content):
    """Every call was once UNAUTHENTICATED: gRPC metadata holds printable ASCII only."""
    from minilm_embed.server.app import check_security

    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_security(ServerConfig(auth_token_file=str(path)))
    assert str(e.value).startswith(f"--auth-token-file (EMBED_AUTH_TOKEN_FILE) {path}: ")
    assert "s3cret" not in str(e.value)


def test_a_token_file_that_cannot_be_read_or_is_empty_is_refused_naming_the_setting(tmp_path):
    """A missing one once gave `/nope: cannot read the auth token file`, naming no setting."""
    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.write_text("\n")
    assert refused_security(auth_token_file=str(missing)) == (
        f"--auth-token-file (EMBED_AUTH_TOKEN_FILE) {missing}: cannot read the auth token file {NO_FILE}"
    )
    assert refused_security(auth_token_file=str(empty)) == (
        f"--auth-token-file (EMBED_AUTH_TOKEN_FILE) {empty}: the auth token file is empty"
    )


def test_a_token_given_both_ways_is_refused_naming_both_settings_but_not_the_token(tmp_path):
    path = tmp_path / "token"
    path.write_text(SECRET)
    assert refused_security(auth_token=SECRET, auth_token_file=str(path)) == (
        "give the auth token either directly or as a file, not both: --auth-token (EMBED_AUTH_TOKEN) "
        f"and --auth-token-file (EMBED_AUTH_TOKEN_FILE) {path} are both set"
    )


def test_a_token_file_that_cannot_be_read_is_refused_by_the_server_at_start(tmp_path):
    path = tmp_path / "nope"
    line = refused_at_start(env={"EMBED_AUTH_TOKEN_FILE": str(path)})
    assert (
        line == f"--auth-token-file (EMBED_AUTH_TOKEN_FILE) {path}: cannot read the auth token file {NO_FILE}"
    )


def test_a_token_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    from minilm_embed.server.app import check_security

    path = tmp_path / "token"
    path.write_bytes(b"s3cret-\xff\xfe")
    with pytest.raises(ConfigError) as e:
        check_security(ServerConfig(auth_token_file=str(path)))
    assert str(e.value).startswith(f"--auth-token-file (EMBED_AUTH_TOKEN_FILE) {path}: not UTF-8 text")


@pytest.mark.parametrize("token", [SECRET + "\n", SECRET + "\r\nx", " " + SECRET, SECRET + "\x7f"])
def test_a_token_no_header_can_carry_is_refused_without_printing_it(token):
    from minilm_embed.server.app import check_security

    with pytest.raises(ConfigError) as e:
        check_security(load_config([], {"EMBED_AUTH_TOKEN": token}))
    assert str(e.value).startswith("--auth-token (EMBED_AUTH_TOKEN): ")
    assert "s3cret" not in str(e.value)


def test_a_printable_token_passes():
    from minilm_embed.server.app import check_security

    check_security(load_config([], {"EMBED_AUTH_TOKEN": "Abc.123_~+/= inner space"}))


@pytest.mark.parametrize("name", ["EMBED_AUTH_TOKEN", "EMBED_AUTH_TOKEN_FILE"])
def test_a_token_variable_set_but_empty_is_refused(name, capsys):
    """A missing secret once turned authentication off without a word."""
    assert refusal([], {name: ""}, capsys) == (
        f"{name} is set but empty: unset it to serve without authentication"
    )


@pytest.mark.parametrize(
    ("flag", "env"),
    [
        ("--auth-token", {}),
        ("--auth-token-file", {}),
        ("--auth-token", {"EMBED_AUTH_TOKEN": SECRET}),  # the flag overrides the variable's token
        ("--auth-token-file", {"EMBED_AUTH_TOKEN_FILE": "/run/secrets/token"}),
    ],
)
def test_a_token_flag_given_empty_is_refused(flag, env, capsys):
    """`--auth-token "$TOKEN"` with TOKEN unset served without authentication, over a token in the
    variable too (flags override), and said nothing."""
    for argv in ([flag, ""], [f"{flag}="]):
        assert refusal(argv, env, capsys) == f"{flag} is empty: leave it out to serve without authentication"


def test_an_empty_token_flag_beside_a_token_file_is_no_harm(tmp_path):
    path = tmp_path / "token"
    path.write_text(SECRET)
    assert load_config(["--auth-token", "", "--auth-token-file", str(path)], {}).auth_token_file


def test_an_empty_token_variable_beside_a_token_file_is_no_harm(tmp_path):
    path = tmp_path / "token"
    path.write_text(SECRET)
    assert load_config(["--auth-token-file", str(path)], {"EMBED_AUTH_TOKEN": ""}).auth_token_file


# Unknown variables ----------------------------------------------------------------------------------


def test_misspelled_variables_are_named_with_the_closest_setting():
    from minilm_embed.server.config import unknown_variables

    env = {"EMBED_MAX_BATCH_SIZ": "8", "EMBED_DEVCE": "cpu", "EMBED_DEVICE": "cpu", "HOME": "/root"}
    assert unknown_variables({**env, "EMBED_FOO": "1"}) == [
        ("EMBED_DEVCE", "EMBED_DEVICE"),
        ("EMBED_FOO", None),  # nothing close: no setting is suggested
        ("EMBED_MAX_BATCH_SIZ", "EMBED_MAX_BATCH_SIZE"),
    ]


SHIPPED = ["Makefile", "Dockerfile", "docker-compose.yml", "deploy", "scripts", "client", "tests/conftest.py"]


def test_no_variable_the_project_itself_sets_or_reads_is_taken_for_a_misspelling():
    """The client's variables, the data directory, the soak's length: every EMBED_ name in what ships."""
    from minilm_embed.server.config import unknown_variables

    names = set()
    for entry in SHIPPED:
        path = ROOT / entry
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            names |= set(re.findall(r"EMBED_[A-Z0-9_]*[A-Z0-9]", file.read_text(errors="replace")))
    names |= {"EMBED_SOAK_SECONDS"}  # tests/reliability/conftest.py
    assert {"EMBED_DATA_DIR", "EMBED_TOKEN", "EMBED_CA_CERT", "EMBED_ADDRESS"} <= names
    assert unknown_variables(dict.fromkeys(names, "x")) == []


def test_the_server_warns_once_of_variables_that_are_no_setting(env_server):
    """MISSPELLED_ENV, on env_server: what it logged until it served, as it starts."""
    warnings = [line for line in env_server.lines_at_start if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert "EMBED_DEVCE (closest setting: EMBED_DEVICE)" in warnings[0]
    assert "EMBED_MAX_BATCH_SIZ (closest setting: EMBED_MAX_BATCH_SIZE)" in warnings[0]
    assert "EMBED_DATA_DIR" not in warnings[0] and "EMBED_TOKEN" not in warnings[0]


def test_serve_without_a_server_module_installed_says_what_to_install_before_starting(monkeypatch, capsys):
    """The supervisor never imports ONNX Runtime (the engine does): without it installed, the command
    says what to install at once, not after the engine process failed to start."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a)
    )
    assert serve_command() == 2
    err = capsys.readouterr().err
    assert "No module named 'onnxruntime'" in err and "pip install 'minilm-embed[server]'" in err
