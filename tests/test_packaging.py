"""The wheel as a user gets it: built from this checkout's files the way `pip install` builds it (the
stubs generated at build time), installed client-only into a fresh virtual environment with no
ONNX Runtime and no torch, whose console script embeds a sentence through a real server.

Needs the network or pip's cache: the build requirements (setuptools, grpcio-tools) and the client's
dependencies (grpcio, protobuf, numpy) are installed by pip as for a user.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from minilm_embed.client.client import EmbeddingClient
from tests.server_process import ROOT, ServerProcess, serving

pytestmark = pytest.mark.slow

NAMESPACE = "minilm_embed"
OLD_TOP_LEVEL = ("server", "model", "proto", "client", "export")
CLIENT_DEPENDENCIES = {"grpcio", "protobuf", "numpy", "grpcio-status"}
NOT_IN_A_CLIENT = ("onnxruntime", "onnxruntime-gpu", "torch", "tokenizers", "pyzmq")
STUBS = ("embedding_pb2.py", "embedding_pb2.pyi", "embedding_pb2_grpc.py")
# What an earlier build in the same checkout left in setuptools' build tree: a module since deleted.
STALE = "minilm_embed/client/deleted_since.py"
TEXT = "A man is playing a guitar."


def run(*command: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Outside the checkout and without this process's PYTHONPATH, as a user's shell would run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def checkout_files() -> list[str]:
    """What a clone of this checkout holds (with uncommitted changes): no stubs, no venv, no build/."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    assert not list(source.glob("proto/**/*_pb2*")), "the copy must not carry generated stubs"
    stale = source / "build" / "lib" / STALE
    stale.parent.mkdir(parents=True)
    stale.write_text("raise ImportError('deleted from the checkout')\n")
    built = run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, source, cwd=dist)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = dist.glob("minilm_embed-*.whl")
    return path


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with `pip install minilm-embed` (the wheel, no extras)."""
    env_dir = tmp_path_factory.mktemp("client-venv")
    venv.create(env_dir, with_pip=True)
    installed = run(env_dir / "bin" / "python", "-m", "pip", "install", "-q", wheel, cwd=env_dir)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return env_dir


def wheel_entry_points(wheel: Path) -> configparser.ConfigParser:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(z.read(name).decode())
    return parser


def test_wheel_holds_the_generated_stubs_under_the_namespace_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        grpc_stub = z.read(f"{NAMESPACE}/proto/embedding/v1/embedding_pb2_grpc.py").decode()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in names} == {NAMESPACE, dist_info}
    assert all(f"{NAMESPACE}/proto/embedding/v1/{stub}" in names for stub in STUBS)
    assert f"from {NAMESPACE}.proto.embedding.v1 import embedding_pb2 as" in grpc_stub
    assert f"{NAMESPACE}/__init__.py" not in names, "minilm_embed is a namespace package"
    assert f"{NAMESPACE}/export/parity_sentences.txt" in names


def test_wheel_leaves_out_what_an_earlier_build_left_behind(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        assert STALE not in z.namelist()


def test_wheel_declares_both_console_scripts(wheel: Path) -> None:
    scripts = dict(wheel_entry_points(wheel)["console_scripts"])
    assert scripts == {
        "minilm-embed": f"{NAMESPACE}.client.__main__:main",
        "minilm-embed-serve": f"{NAMESPACE}.server:serve_command",
    }


def test_wheel_requires_only_the_client_without_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = z.read(name).decode()
    requirements = [
        Requirement(line.split(":", 1)[1])
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert {r.name for r in requirements if r.marker is None} == CLIENT_DEPENDENCIES
    server = {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": "server"})}
    assert "onnxruntime-gpu" in server and "torch" not in server


def test_client_install_has_no_onnxruntime_or_torch(client_venv: Path) -> None:
    listed = run(client_venv / "bin" / "python", "-m", "pip", "list", "--format", "json", cwd=client_venv)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert installed >= CLIENT_DEPENDENCIES
    assert not installed & set(NOT_IN_A_CLIENT), installed


def test_client_install_imports_the_namespace_and_no_top_level_names(client_venv: Path) -> None:
    code = (
        "import importlib.util, json, minilm_embed.client, minilm_embed.proto.embedding.v1 as v1\n"
        f"found = [n for n in {OLD_TOP_LEVEL!r} if importlib.util.find_spec(n)]\n"
        "print(json.dumps([v1.SERVICE_NAME, found]))"
    )
    done = run(client_venv / "bin" / "python", "-c", code, cwd=client_venv)
    assert done.returncode == 0, done.stderr
    service, importable = json.loads(done.stdout)
    assert service == "embedding.v1.EmbeddingService"
    assert importable == [], f"top-level names on a user's path: {importable}"


def test_client_console_script_runs_and_serve_says_what_to_install(client_venv: Path) -> None:
    helped = run(client_venv / "bin" / "minilm-embed", "--help", cwd=client_venv)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: minilm-embed ") and "embed-file" in helped.stdout
    for command in (["minilm-embed-serve"], ["python", "-m", "minilm_embed.server"]):
        serve = run(client_venv / "bin" / command[0], *command[1:], "--help", cwd=client_venv)
        assert serve.returncode == 2, command  # `python -m` gave a traceback and exit 1
        assert "pip install 'minilm-embed[server]'" in serve.stderr and "Traceback" not in serve.stderr


def test_serve_console_script_of_the_editable_install_runs() -> None:
    script = Path(sys.executable).parent / "minilm-embed-serve"
    helped = run(script, "--help", cwd=ROOT)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: minilm-embed-serve ") and "--model-dir" in helped.stdout


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving() as process:
        yield process


def test_client_install_embeds_through_a_real_server(client_venv: Path, server: ServerProcess) -> None:
    done = run(
        client_venv / "bin" / "minilm-embed", "--address", server.address, "embed", TEXT, cwd=client_venv
    )
    assert done.returncode == 0, done.stderr
    (vector,) = np.asarray(json.loads(done.stdout)["embeddings"], dtype=np.float32)
    with EmbeddingClient(server.address, timeout=60) as c:
        (expected,) = c.embed([TEXT])
    assert vector.shape == (384,)
    assert float(vector @ expected) > 0.99999
