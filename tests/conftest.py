"""Fixtures shared by every test file: where the model repository and data are, and the real weights.

The environment is read here and nowhere else in the tests: EMBED_MODEL_DIR (a built model repository,
default build/model) and EMBED_DATA_DIR (holding stsbenchmark/; optional).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from minilm_embed.model.encoder import Encoder
from minilm_embed.model.tokenizer import Tokenizer
from minilm_embed.model.weights import DEFAULT_SHA256, Checkpoint, default_weights_dir, load_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The model repository `make model` builds; the tests never build it themselves."""
    path = Path(os.environ.get("EMBED_MODEL_DIR") or REPO_ROOT / "build" / "model")
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path}: no model repository (manifest.json missing); run `make model`", pytrace=False)
    return path


@pytest.fixture(scope="session")
def data_dir() -> Path | None:
    """The directory holding stsbenchmark/, or None: every test must also pass without it."""
    value = os.environ.get("EMBED_DATA_DIR")
    return Path(value) if value else None


@pytest.fixture(scope="session")
def encoder_and_checkpoint() -> tuple[Encoder, Checkpoint]:
    """The packaged all-MiniLM-L6-v2, checksum verified. Shared: tests must not modify it."""
    return load_checkpoint(default_weights_dir(), DEFAULT_SHA256)


@pytest.fixture(scope="session")
def tokenizer(encoder_and_checkpoint: tuple[Encoder, Checkpoint]) -> Tokenizer:
    _, checkpoint = encoder_and_checkpoint
    return Tokenizer(checkpoint.directory / "tokenizer.json", checkpoint.config.max_seq_length)


@pytest.fixture
def checkpoint_copy(tmp_path: Path) -> Callable[..., Path]:
    """Make the default checkpoint in tmp_path/ckpt: files symlinked, config.json a copy with changes
    applied (a value of None deletes the key). For bad-checkpoint tests that edit one file."""

    def make(config_changes: dict[str, object] | None = None) -> Path:
        source, target = default_weights_dir(), tmp_path / "ckpt"
        target.mkdir()
        for entry in source.iterdir():
            if entry.name != "config.json":
                (target / entry.name).symlink_to(entry)
        config = json.loads((source / "config.json").read_text())
        for key, value in (config_changes or {}).items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (target / "config.json").write_text(json.dumps(config))
        return target

    return make


# `make test` hands whole files to its xdist workers (--dist loadfile) in the order of this table:
# the longest first, then the rest in collection order, so that the run does not end with one worker
# alone on a long file while the others idle. xdist's own reorder (most tests first) is turned off
# in the Makefile. Seconds per file, summed over set-up, call and tear-down, from `make test`'s first
# run on three workers (Zen 3, 2 vCPUs, 2026-11-29); a stale table costs only balance, never a result.
LONGEST_FILES = {
    "test_server.py": 250,
    "test_export.py": 169,
    "test_bulk.py": 167,
    "test_fronts.py": 88,
    "test_http.py": 72,
    "test_server_config.py": 64,
    "test_packaging.py": 58,
    "test_train.py": 56,
    "test_front_restarts.py": 54,
    "test_fp16.py": 41,
    "test_security.py": 35,
    "test_repository.py": 33,
    "test_prometheus.py": 32,
    "test_call_bounds.py": 28,
    "test_tracing.py": 28,
    "test_logs.py": 26,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # xdist's controller schedules what its workers collected, in their order (only workers have
    # `workerinput`; a plain pytest run keeps the files' own order).
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))  # stable: in-file order kept
