"""Fixtures of the reliability suite, and the one setting it reads from the environment.

EMBED_SOAK_SECONDS: how long the soak keeps its load on (default 60, the form `make test` runs;
`make soak` sets 600). Every test here prints its figures in a "reliability figures" section at
the end of the run and writes them to build/reliability/<test>.json.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.workload import References, sentence_pool
from tests.server_process import ROOT, ServerProcess, serving

SOAK_SECONDS = float(os.environ.get("EMBED_SOAK_SECONDS", "60"))
FIGURES: dict[str, dict[str, Any]] = {}
FIGURES_DIR = ROOT / "build" / "reliability"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: runs for EMBED_SOAK_SECONDS; its timeout grows with it")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(pytest.mark.timeout(SOAK_SECONDS * 2 + 300))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for test, figures in FIGURES.items():
        terminalreporter.write_line(f"{test}:")
        for name, value in figures.items():
            terminalreporter.write_line(f"    {name}: {value}")


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    """`figures(name=value, ...)`: keep a test's figures for the summary and build/reliability/."""

    def report(**values: Any) -> None:
        name = request.node.name
        FIGURES.setdefault(name, {}).update(values)
        FIGURES_DIR.mkdir(parents=True, exist_ok=True)
        (FIGURES_DIR / f"{name}.json").write_text(json.dumps(FIGURES[name], indent=2) + "\n")

    return report


@pytest.fixture(scope="package")
def plain_server() -> Iterator[ServerProcess]:
    """A server with the default settings, shared by the fuzz tests and the replica tests."""
    with serving() as process:
        yield process


@pytest.fixture(scope="package")
def sentences() -> list[str]:
    return sentence_pool(64)


@pytest.fixture(scope="package")
def references(model_dir: Path, sentences: list[str]) -> References:
    refs = References(model_dir)
    refs.add(sentences)
    return refs
