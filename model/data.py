"""Readers for the sentence-pair data the encoder is evaluated and trained on."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
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


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) for each line; bytes that are not UTF-8 are a DataError naming the line. A
    byte-order mark at the start (Windows tools write one) is skipped."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{number}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from e


def read_sts(path: Path) -> list[ScoredPair]:
    """STS-B rows, read by position with quoting off: some rows carry two extra source columns."""
    pairs = []
    for number, line in utf8_lines(path):
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 7:
            raise DataError(f"{path}:{number}: expected at least 7 tab-separated fields")
        try:
            score = float(fields[4])
        except ValueError as e:
            raise DataError(f"{path}:{number}: score {fields[4]!r} is not a number") from e
        pairs.append(ScoredPair(fields[5], fields[6], score))
    if not pairs:
        raise DataError(f"{path}: no scored pairs (the file is empty)")
    return pairs
