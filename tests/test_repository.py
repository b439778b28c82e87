"""model.repository: the manifest export writes is the manifest the server reads, field for field, and
a repository the server cannot trust (another manifest_version, a missing or inconsistent field, a
graph that is missing or changed) stops `minilm-embed-serve` with one line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minilm_embed.model.repository import (
    MANIFEST_FILE,
    MANIFEST_VERSION,
    ModelRepositoryError,
    open_repository,
    read_manifest,
)
from tests.server_process import ROOT


def test_reading_then_writing_the_built_manifest_gives_back_the_same_document(model_dir):
    written = json.loads((model_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert read_manifest(model_dir).to_dict() == written


def test_the_opened_repository_knows_its_graphs_and_shapes(model_dir):
    repo = open_repository(model_dir)
    assert (repo.dimensions, repo.max_input_tokens) == (384, 256)
    assert repo.graph_for("CPUExecutionProvider", "auto").file == "model.onnx"
    assert repo.graph_for("CUDAExecutionProvider", "fp32").precision == "fp32"  # CPU's graph as fallback
    with pytest.raises(ModelRepositoryError, match="no fp16 graph for CPUExecutionProvider"):
        repo.graph_for("CPUExecutionProvider", "fp16")


@pytest.fixture
def edited(model_dir: Path, tmp_path: Path) -> Callable[[Callable[[dict[str, Any]], object]], Path]:
    """A copy of the built repository (graphs linked) whose manifest the test edits."""

    def make(change: Callable[[dict[str, Any]], object]) -> Path:
        for entry in model_dir.iterdir():
            if entry.name != MANIFEST_FILE:
                (tmp_path / entry.name).symlink_to(entry.resolve())
        document = json.loads((model_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
        change(document)
        (tmp_path / MANIFEST_FILE).write_text(json.dumps(document), encoding="utf-8")
        return tmp_path

    return make


def serve(model_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "minilm_embed.server",
        "--model-dir",
        str(model_dir),
        "--address",
        "127.0.0.1:0",
    ]
    command += ["--metrics-address", "", "--http-address", ""]  # no "... on port" lines: stderr is the error
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("version", "advice"),
    [(MANIFEST_VERSION + 1, "upgrade this code"), (0, "rebuild the repository with `make model`")],
)
def test_server_refuses_another_manifest_version_naming_both(edited, version, advice):
    directory = edited(lambda d: d.update(manifest_version=version))
    done = serve(directory)
    assert done.returncode == 2
    assert done.stderr == (
        f"server: error: --model-dir (EMBED_MODEL_DIR): {directory / MANIFEST_FILE}: "
        f"manifest_version {version}, but this code reads "
        f"manifest_version {MANIFEST_VERSION}; {advice}\n"
    )


CASES: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "no manifest_version": (lambda d: d.pop("manifest_version"), "manifest_version None, but this code"),
    "a missing field": (lambda d: d.pop("weights_sha256"), "field 'weights_sha256' is None, expected str"),
    "a wrong type": (lambda d: d.update(opset="17"), "field 'opset' is '17', expected int"),
    "an unknown config field": (lambda d: d["config"].update(heads=2), "unknown EncoderConfig fields: heads"),
    "dimensions not the config's": (lambda d: d.update(dimensions=768), "dimensions is 768, but this code"),
    "a renamed graph input": (
        lambda d: d.update(inputs={"ids": "int64", "lengths": "int64"}),
        "inputs is {'ids': 'int64'",
    ),
    "an unknown precision": (lambda d: d["graphs"][0].update(precision="fp8"), "graph precision 'fp8'"),
    "a changed graph": (
        lambda d: d["graphs"][0].update(sha256="0" * 64),
        "does not match manifest " + "0" * 64,
    ),
    "a missing graph": (lambda d: d["graphs"][0].update(file="gone.onnx"), "gone.onnx: missing"),
    "a graph outside the repository": (
        lambda d: d["graphs"][0].update(file="../model.onnx"),
        "file '../model.onnx': a file name inside the repository, not a path",
    ),
    "a changed shared tensor": (
        lambda d: d["shared_tensors"][0].update(sha256="0" * 64),
        "word_embeddings.f32: sha256 ",
    ),
    "a shared tensor of another shape": (
        lambda d: d["shared_tensors"][0].update(shape=[30522, 383]),
        "bytes, but float32 of shape [30522, 383] is 46759704",
    ),
    "a shared tensor of another dtype": (
        lambda d: d["shared_tensors"][0].update(dtype="float16"),
        "shared tensor dtype 'float16': this code reads float32 only",
    ),
    "a missing shared tensor": (
        lambda d: d["shared_tensors"][0].update(file="gone.f32"),
        "gone.f32: missing",
    ),
    # The tokenizer decides the ids the graph sees: an edited one ("lowercase": false turned "Hello"
    # into [UNK]) is refused as a changed graph is.
    "a changed tokenizer": (
        lambda d: d.update(tokenizer_sha256="0" * 64),
        "tokenizer.json: sha256 ",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_an_untrustworthy_manifest_stops_the_server_with_one_line(edited, case):
    change, message = CASES[case]
    done = serve(edited(change))
    assert done.returncode == 2
    assert done.stderr.startswith("server: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr


def test_serving_a_training_checkpoint_says_to_export_it(tmp_path):
    """A fine-tuner's first mistake: --model-dir at what model.train wrote (weights, no manifest)."""
    checkpoint = tmp_path / "my-encoder"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")  # what tells a checkpoint apart; never read here
    done = serve(checkpoint)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"python -m minilm_embed.export --weights {checkpoint} --out DIR" in done.stderr
    assert "make model" not in done.stderr  # that builds the default weights, not these


def test_serving_an_empty_directory_says_how_to_build_a_repository(tmp_path):
    done = serve(tmp_path)
    assert done.returncode == 2 and "manifest.json: missing; build the model repository" in done.stderr
    # The setting named, as every start-up refusal names its flag and variable.
    assert done.stderr.startswith(f"server: error: --model-dir (EMBED_MODEL_DIR): {tmp_path}/manifest.json")


def test_serving_a_directory_that_does_not_exist_says_so(tmp_path):
    done = serve(tmp_path / "nowhere")
    assert done.returncode == 2, done.stderr
    assert f"--model-dir (EMBED_MODEL_DIR): {tmp_path / 'nowhere'}: no such directory; build" in done.stderr


def test_a_directory_without_a_manifest_is_refused_before_any_port_is_taken(tmp_path):
    """Default addresses: no 'metrics on port' or 'http on port' line first, the error alone."""
    command = [
        sys.executable,
        "-m",
        "minilm_embed.server",
        "--model-dir",
        str(tmp_path),
        "--address",
        "127.0.0.1:0",
    ]
    command += ["--metrics-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("server: error: ") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize(("exported_from", "rebuilt"), [("other", True), ("weights", False)])
def test_make_model_rebuilds_a_repository_exported_from_other_weights(tmp_path, exported_from, rebuilt):
    """make compares only times: `make serve WEIGHTS=B MODEL_DIR=M` served A, which M was exported
    from after B was trained (an acceptance pass). The repository's manifest names its weights."""
    weights, other, repository = tmp_path / "weights", tmp_path / "other", tmp_path / "repository"
    for directory in (weights, other, repository):
        directory.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    os.utime(weights / "model.safetensors", (1e9, 1e9))  # older than the repository
    source = {"other": other, "weights": weights}[exported_from]
    (repository / "manifest.json").write_text(json.dumps({"source": str(source)}))
    planned = subprocess.run(
        ["make", "-n", "model", f"WEIGHTS={weights}", f"MODEL_DIR={repository}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (f"minilm_embed.export --out {repository} --weights {weights}" in planned) == rebuilt, planned
