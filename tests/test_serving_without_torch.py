"""The serving path needs no torch: the server is run as the image runs it, from only the files the
Dockerfile's runtime stage copies, with torch made unimportable, and answers a real Embed call."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from minilm_embed import model as model_package
from minilm_embed import proto as proto_package
from minilm_embed import server as server_package
from minilm_embed.client.client import EmbeddingClient
from minilm_embed.export.optimize import cpu_session
from minilm_embed.model.repository import FP32_FILE, TOKENIZER_FILE, read_manifest
from minilm_embed.model.runtime import run_graph
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from tests.server_process import ROOT, ServerProcess, loopback_command
from tests.test_deploy import stages

# Imported first by every Python process that has this directory on PYTHONPATH. It also drops the
# editable install's finder, which would otherwise find a package the image lacks in the checkout.
BLOCKER = """
import sys


class NoTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"torch is blocked in this process (importing {name})")
        return None


sys.meta_path = [NoTorch] + [f for f in sys.meta_path if not f.__module__.startswith("__editable__")]
"""
TEXTS = ["A man is playing a guitar.", "Someone plays an instrument."]
# The packages' names as the code imports them, and their directories in the image's /app.
MODEL, SERVER = model_package.__name__, server_package.__name__
MODEL_DIR, PROTO_DIR = (Path(*package.__name__.split(".")) for package in (model_package, proto_package))


def runtime_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context into the runtime image."""
    copies = []
    for keyword, rest in stages()[-1]:
        if keyword == "COPY" and "--from=" not in rest:
            *sources, destination = rest.split()
            copies.append((sources, destination))
    return copies


def stage_image(app: Path) -> None:
    """The runtime image's /app: what the Dockerfile copies, and the proto package with its stubs."""
    for sources, destination in runtime_copies():
        for source in sources:
            target = app / destination / (Path(source).name if destination.endswith("/") else "")
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, app / destination, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / source, target)
    shutil.copytree(ROOT / "proto", app / PROTO_DIR, ignore=shutil.ignore_patterns("__pycache__"))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The staged /app, and an environment in which torch cannot be imported."""
    root = tmp_path_factory.mktemp("image")
    (root / "blocker").mkdir()
    (root / "blocker" / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    stage_image(root / "app")
    env = {**os.environ, "PYTHONPATH": str(root / "blocker"), "PYTHONUNBUFFERED": "1"}
    return root / "app", env


def python(app: Path, env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=app, env=env, capture_output=True, text=True, timeout=60
    )


def test_torch_is_unimportable_under_the_blocker(image) -> None:
    app, env = image
    done = python(app, env, "import torch")
    assert done.returncode == 1
    assert "ModuleNotFoundError: torch is blocked in this process" in done.stderr


def test_every_server_module_imports_without_torch_from_exactly_the_model_files_copied(image) -> None:
    app, env = image
    code = (
        f"import importlib, pkgutil, sys, {SERVER} as server\n"
        "for m in pkgutil.iter_modules(server.__path__):\n"
        f"    importlib.import_module('{SERVER}.' + m.name)\n"
        f"print(' '.join(sorted(m for m in sys.modules if (m + '.').startswith('{MODEL}.'))))"
    )
    done = python(app, env, code)
    assert done.returncode == 0, done.stderr
    imported = {name.replace(".", "/") + ".py" for name in done.stdout.split()}
    imported = {str(MODEL_DIR / "__init__.py") if name == f"{MODEL_DIR}.py" else name for name in imported}
    copied = {str(p.relative_to(app)) for p in (app / MODEL_DIR).glob("*.py")}
    assert copied == imported, "the image must copy the model modules serving imports, and no others"


def reference(model_dir: Path) -> np.ndarray:
    """The same model file in this process (which may import torch), for the vectors to match."""
    tokenizer = Tokenizer(model_dir / TOKENIZER_FILE, read_manifest(model_dir).config.max_seq_length)
    normalised, _ = run_graph(cpu_session(model_dir / FP32_FILE), *pad_batch(tokenizer.encode(TEXTS).ids))
    return normalised


def test_server_serves_a_real_embed_call_without_torch(image, model_dir: Path) -> None:
    app, env = image
    proc = subprocess.Popen(
        loopback_command("--model-dir", str(model_dir.resolve())),
        cwd=app,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    server = ServerProcess(proc)
    threading.Thread(target=server._pump, daemon=True).start()
    try:
        server.wait_serving()
        with EmbeddingClient(server.address, timeout=60) as client:
            vectors = client.embed(TEXTS)
        server.terminate()
        assert server.wait() == 0
    finally:
        server.stop()
    assert vectors.shape == (2, 384)
    cosines = (vectors * reference(model_dir)).sum(axis=1)
    assert cosines.min() > 0.99999, cosines
