"""Server settings: each has a flag and an EMBED_* variable, flags win, bad values are refused clearly."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from minilm_embed.client.client import EmbeddingClient
from minilm_embed.server.config import (
    ConfigError,
    ServerConfig,
    batch_limits_for,
    build_parser,
    env_name,
    load_config,
)
from tests.server_process import loopback_command, model_dir, start_server

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(ServerConfig)]
# Two valid values per field that are not the default: one for the environment, one for the flag.
SPECIAL = {
    "device": ("cpu", "cuda"),
    "log_level": ("DEBUG", "WARNING"),
    "log_format": ("json", "text"),  # one value besides the default: the flag wins back to it
    "precision": ("fp32", "int8"),
    "max_padding": ("0.3", "0.7"),
}


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
    """The message a refused configuration gives (load_config's own, or argparse's on stderr)."""
    with pytest.raises((SystemExit, ConfigError)) as e:
        load_config(argv, env)
    return str(e.value) if isinstance(e.value, ConfigError) else capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--max-batch-size", "-1"], {}, "max_batch_size must be 0 (auto) or more, not -1"),
        (["--queue-limit", "-1"], {}, "queue_limit must be at least 1, not -1"),
        (["--device", "tpu"], {}, "device must be auto, cuda or cpu, not 'tpu'"),
        ([], {"EMBED_LOG_FORMAT": "yaml"}, "log_format must be text or json, not 'yaml'"),
        ([], {"EMBED_DEVICE": "tpu"}, "device must be auto, cuda or cpu, not 'tpu'"),
        (["--max-batch-size", "many"], {}, "invalid int value: 'many'"),
        ([], {"EMBED_MAX_BATCH_SIZE": "many"}, "EMBED_MAX_BATCH_SIZE"),
        # A stream with no room for one unanswered item would never answer anything.
        (["--max-stream-in-flight", "0"], {}, "max_stream_in_flight must be at least 1, not 0"),
        (["--max-queue-delay-ms", "-1"], {}, "max_queue_delay_ms must be 0 or more, not -1.0"),
        ([], {"EMBED_DRAIN_TIMEOUT_S": "-5"}, "drain_timeout_s must be 0 or more, not -5.0"),
        (["--max-connection-age-s", "0"], {}, "max_connection_age_s must be more than 0, not 0.0"),
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


def run_server(*args: str) -> subprocess.CompletedProcess[str]:
    command = loopback_command("--model-dir", str(model_dir()), *args)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch-tokens", "-1"], "max_batch_tokens must be 0 (auto) or more, not -1"),
        (["--device", "tpu"], "device must be auto, cuda or cpu, not 'tpu'"),
    ],
)
def test_server_process_refuses_invalid_settings_without_a_traceback(args, message):
    done = run_server(*args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_metrics_port_in_use_is_refused_before_any_child_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_server("--metrics-address", f"127.0.0.1:{port}")
    assert done.returncode == 2
    assert "server: error:" in done.stderr and "Address already in use" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # children once crashed as the run dir went
    assert "front" not in done.stderr and "engine" not in done.stderr


def test_max_batch_tokens_below_the_model_max_tokens_is_refused_at_start():
    done = run_server("--max-batch-tokens", "128")
    assert done.returncode == 2
    assert "max_batch_tokens 128" in done.stderr and "max_input_tokens 256" in done.stderr
    assert "Traceback" not in done.stderr


def test_server_process_takes_settings_from_env_and_flags_over_env():
    env = {"EMBED_MAX_INPUTS_PER_REQUEST": "7", "EMBED_MAX_BATCH_SIZE": "4", "EMBED_QUEUE_LIMIT": "99"}
    server = start_server("--max-batch-size", "8", env=env).wait_serving()
    try:
        with EmbeddingClient(server.address, timeout=30) as c:
            limits = c.info().limits
            assert (limits.max_inputs_per_request, limits.max_batch_size, limits.queue_limit) == (7, 8, 99)
            assert limits.max_batch_tokens == 1024  # auto: the CPU's, the provider this server runs on
            assert c.embed(["x"] * 7).shape == (7, 384)
            with pytest.raises(grpc.RpcError) as e:
                c.embed(["x"] * 8)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_inputs_per_request=7" in e.value.details()
    finally:
        server.stop()


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
