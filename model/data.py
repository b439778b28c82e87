"""Readers for the sentence-pair data the encoder is evaluated and trained on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ScoredPair:
    first: str
    second: str
    score: float  # gold similarity, 0-5


class DataError(Exception):
    """A data file that cannot be read. The message names the file and line."""


def sts_path(data_dir: Path, split: str) -> Path:
    """``<data_dir>/stsbenchmark/sts-<split>.csv`` (data_dir may also be the stsbenchmark folder)."""
    for candidate in (data_dir / "stsbenchmark" / f"sts-{split}.csv", data_dir / f"sts-{split}.csv"):
        if candidate.is_file():
            return candidate
    raise DataError(f"{data_dir}: no STS Benchmark {split} split (sts-{split}.csv)")


def read_sts(path: Path) -> list[ScoredPair]:
    """STS-B rows, read by position with quoting off: some rows carry two extra source columns."""
    pairs = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 7:
                raise DataError(f"{path}:{number}: expected at least 7 tab-separated fields")
            try:
                score = float(fields[4])
            except ValueError as e:
                raise DataError(f"{path}:{number}: score {fields[4]!r} is not a number") from e
            pairs.append(ScoredPair(fields[5], fields[6], score))
    return pairs
