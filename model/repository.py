"""The model repository's format: the one contract between `python -m minilm_embed.export` and the server.

A repository is a directory holding the ONNX graphs, tokenizer.json, manifest.json, and the tensors
its graphs share, each in a raw file of its own that the graphs reference as ONNX external data (the
word-embedding table: every graph and every model instance of the server uses the one copy). The
manifest is the typed, versioned `Manifest` below: export builds one and writes `to_dict()`, the
server reads it with `open_repository`, which checks `manifest_version` first and the sha256 of every
graph and shared tensor after. The names the graphs are called by (inputs, outputs, execution
providers) are defined here too.

Torch-free on purpose: the serving image has no torch (tests/test_serving_without_torch.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from minilm_embed.model.checksum import sha256_file
from minilm_embed.model.config import EncoderConfig

# Bump when a reader of the previous version would misread the new one; readers refuse any other.
# 2: the word-embedding table left the graphs for a shared file (`shared_tensors`), which a version 1
# reader would neither check nor share.
MANIFEST_VERSION = 3  # 3: tokenizer_sha256 (the tokenizer decides the served tokens)
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
FP16_FILE = "model.fp16.onnx"
WORD_EMBEDDINGS_FILE = "word_embeddings.f32"

# The graph's inputs and outputs: ids (B, T) and lengths (B,) in; normalised and raw pooled (B, D) out.
INPUT_IDS = "input_ids"
LENGTHS = "lengths"
EMBEDDINGS = "embeddings"
POOLED = "pooled"
INPUTS = {INPUT_IDS: "int64 [batch, sequence]", LENGTHS: "int64 [batch]"}
OUTPUTS = {EMBEDDINGS: "float32 [batch, dim], L2-normalised", POOLED: "float32 [batch, dim]"}

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")


class ModelRepositoryError(Exception):
    """The model directory is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class Graph:
    """One ONNX graph the repository ships, and the provider it is meant for."""

    provider: str
    file: str
    precision: Precision
    graph: str  # how it was made, for people
    disabled_optimizers: tuple[str, ...]  # ORT runtime fusions to switch off for this graph
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), disabled_optimizers=list(self.disabled_optimizers))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Graph:
        precision = _get(d, "precision", str)
        if precision not in PRECISIONS:
            raise ModelRepositoryError(f"graph precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        return cls(
            provider=_get(d, "provider", str),
            file=_file_name(d),
            precision=cast(Precision, precision),
            graph=_get(d, "graph", str),
            disabled_optimizers=tuple(_get(d, "disabled_optimizers", list)),
            sha256=_get(d, "sha256", str),
        )


@dataclass(frozen=True)
class SharedTensor:
    """A graph initializer kept outside the graphs: `file` holds its values, raw little-endian float32
    in C order, which every graph that uses it references as ONNX external data (offset 0)."""

    name: str  # the initializer's name in the graphs
    file: str
    shape: tuple[int, ...]
    sha256: str

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), shape=list(self.shape), dtype="float32")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SharedTensor:
        dtype = d.get("dtype")
        if dtype != "float32":
            raise ModelRepositoryError(f"shared tensor dtype {dtype!r}: this code reads float32 only")
        shape = _get(d, "shape", list)
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            raise ModelRepositoryError(f"shared tensor shape {shape!r}: expected positive ints")
        name, sha256 = _get(d, "name", str), _get(d, "sha256", str)
        return cls(name=name, file=_file_name(d), shape=tuple(shape), sha256=sha256)


def _file_name(d: Mapping[str, Any]) -> str:
    """A file the manifest names: a plain name inside the repository, never a path out of it."""
    name = _get(d, "file", str)
    if Path(name).name != name or name in (".", ".."):
        raise ModelRepositoryError(f"file {name!r}: a file name inside the repository, not a path")
    return name


@dataclass(frozen=True)
class Manifest:
    """manifest.json: where the weights came from, the encoder's config, the graphs, the gate's figures."""

    model_id: str
    source: str
    weights_sha256: str
    onnx_sha256: str  # of the fp32 graph
    tokenizer_sha256: str  # of tokenizer.json, checked as the graphs are
    config: EncoderConfig
    opset: int
    ir_version: int
    graphs: tuple[Graph, ...]
    shared_tensors: tuple[SharedTensor, ...]
    versions: Mapping[str, str]  # of the packages that built it
    parity: Mapping[str, Any]  # the gate's report (export/parity.py)
    parity_int8: Mapping[str, Any]
    # The fp16 graph's gate, run on a GPU (export/fp16.py); absent from repositories built without one.
    parity_fp16: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    manifest_version: int = MANIFEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON document; fields derived from the config are written out for people and tools."""
        return {
            "manifest_version": self.manifest_version,
            "model_id": self.model_id,
            "source": self.source,
            "weights_sha256": self.weights_sha256,
            "onnx_sha256": self.onnx_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "config": self.config.to_dict(),
            "dimensions": self.config.hidden_size,
            "max_input_tokens": self.config.max_seq_length,
            "pooling": self.config.pooling,
            "normalize": self.config.normalize,
            "opset": self.opset,
            "ir_version": self.ir_version,
            "inputs": INPUTS,
            "outputs": OUTPUTS,
            "graphs": [g.to_dict() for g in self.graphs],
            "shared_tensors": [t.to_dict() for t in self.shared_tensors],
            "versions": dict(self.versions),
            "parity": dict(self.parity),
            "parity_int8": dict(self.parity_int8),
            "parity_fp16": dict(self.parity_fp16),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Check the version before anything else: another version's fields may mean other things."""
        version = d.get("manifest_version")
        if version != MANIFEST_VERSION:
            raise ModelRepositoryError(
                f"manifest_version {version}, but this code reads manifest_version {MANIFEST_VERSION}; "
                + ("rebuild the repository with `make model`" if _older(version) else "upgrade this code")
            )
        try:
            config = EncoderConfig.from_dict(_get(d, "config", dict))
        except (TypeError, ValueError) as e:
            raise ModelRepositoryError(f"config: {e}") from None
        manifest = cls(
            model_id=_get(d, "model_id", str),
            source=_get(d, "source", str),
            weights_sha256=_get(d, "weights_sha256", str),
            onnx_sha256=_get(d, "onnx_sha256", str),
            tokenizer_sha256=_get(d, "tokenizer_sha256", str),
            config=config,
            opset=_get(d, "opset", int),
            ir_version=_get(d, "ir_version", int),
            graphs=tuple(Graph.from_dict(g) for g in _get(d, "graphs", list)),
            shared_tensors=tuple(SharedTensor.from_dict(t) for t in _get(d, "shared_tensors", list)),
            versions=_get(d, "versions", dict),
            parity=_get(d, "parity", dict),
            parity_int8=_get(d, "parity_int8", dict),
            parity_fp16=_get(d, "parity_fp16", dict) if "parity_fp16" in d else {},
        )
        manifest.check_derived(d)
        return manifest

    def check_derived(self, d: Mapping[str, Any]) -> None:
        """The fields written for people must agree with what the reader derives from the config."""
        derived = self.to_dict()
        for key in ("dimensions", "max_input_tokens", "pooling", "normalize", "inputs", "outputs"):
            if d.get(key) != derived[key]:
                raise ModelRepositoryError(f"{key} is {d.get(key)!r}, but this code derives {derived[key]!r}")


def _older(version: object) -> bool:
    return not isinstance(version, int) or version < MANIFEST_VERSION


def _get(d: Mapping[str, Any], key: str, kind: type) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelRepositoryError(f"field {key!r} is {value!r}, expected {kind.__name__}")
    return value


@dataclass(frozen=True)
class ModelRepository:
    """An opened repository: its directory and its checked manifest."""

    directory: Path
    manifest: Manifest

    @property
    def max_input_tokens(self) -> int:
        return self.manifest.config.max_seq_length

    @property
    def dimensions(self) -> int:
        return self.manifest.config.hidden_size

    @property
    def tokenizer_file(self) -> Path:
        return self.directory / TOKENIZER_FILE

    def path(self, item: Graph | SharedTensor) -> Path:
        return self.directory / item.file

    def graph_for(self, provider: str, precision: str) -> Graph:
        """The graph shipped for this provider: the asked precision, else the first listed for it."""
        graphs = [g for g in self.manifest.graphs if g.provider == provider] or [
            g for g in self.manifest.graphs if g.provider == CPU_PROVIDER
        ]
        if precision == "auto":
            return graphs[0]
        for g in graphs:
            if g.precision == precision:
                return g
        shipped = ", ".join(sorted({g.precision for g in graphs}))
        raise ModelRepositoryError(
            f"{self.directory}: no {precision} graph for {provider} (shipped: {shipped})"
            + (
                "; int8 is built by `python -m minilm_embed.export --data-dir ...`"
                if precision == "int8"
                else ""
            )
        )


def read_manifest(directory: Path) -> Manifest:
    """manifest.json, version-checked and typed; every problem is one line naming the file."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise ModelRepositoryError(f"{directory}: no such directory; {_how_to_build(directory)}")
    if not path.is_file():
        raise ModelRepositoryError(f"{path}: missing; {_how_to_build(directory)}")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelRepositoryError(f"{path}: not JSON ({e})") from None
    if not isinstance(document, dict):
        raise ModelRepositoryError(f"{path}: not a JSON object")
    try:
        return Manifest.from_dict(document)
    except ModelRepositoryError as e:
        raise ModelRepositoryError(f"{path}: {e}") from None


def _how_to_build(directory: Path) -> str:
    """A checkpoint (weights, not a model repository) is exported; anything else built from the default."""
    if (directory / "model.safetensors").is_file():
        return (
            f"{directory} holds a checkpoint, not a model repository: export it with "
            f"`python -m minilm_embed.export --weights {directory} --out DIR` and serve DIR"
        )
    return "build the model repository with `make model` (or `python -m minilm_embed.export --out DIR`)"


def verified_tokenizer(directory: Path, manifest: Manifest) -> Path:
    """The repository's tokenizer.json, its sha256 checked against the manifest (it decides the
    ids every graph sees): what the engine opens, and what every front reads."""
    tokenizer = directory / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ModelRepositoryError(f"{tokenizer}: missing")
    if (actual := sha256_file(tokenizer)) != manifest.tokenizer_sha256:
        raise ModelRepositoryError(
            f"{tokenizer}: sha256 {actual} does not match manifest {manifest.tokenizer_sha256}"
        )
    return tokenizer


def open_repository(directory: Path) -> ModelRepository:
    """Read manifest.json and verify the checksum of every graph, shared tensor and the tokenizer."""
    repo = ModelRepository(directory, read_manifest(directory))
    verified_tokenizer(directory, repo.manifest)
    items: list[Graph | SharedTensor] = [*repo.manifest.graphs, *repo.manifest.shared_tensors]
    for item in items:
        file = repo.path(item)
        if not file.is_file():
            raise ModelRepositoryError(f"{file}: missing")
        if isinstance(item, SharedTensor) and file.stat().st_size != item.nbytes:
            size, shape = file.stat().st_size, list(item.shape)
            raise ModelRepositoryError(f"{file}: {size} bytes, but float32 of shape {shape} is {item.nbytes}")
        actual = sha256_file(file)
        if actual != item.sha256:
            raise ModelRepositoryError(f"{file}: sha256 {actual} does not match manifest {item.sha256}")
    return repo
