"""Checkpoint import: a bad checkpoint is a WeightsError naming the file; a good one matches the reference."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.encoder import Encoder
from minilm_embed.model.tokenizer import pad_batch
from minilm_embed.model.weights import (
    DEFAULT_SHA256,
    WEIGHTS_FILE,
    WeightsError,
    default_weights_dir,
    load_checkpoint,
    save_checkpoint,
)

SENTENCES = [
    "A man is playing a guitar.",
    "The stock market fell sharply after the announcement of new tariffs.",
    "Ein Mann spielt Gitarre. 中文字 😀",
    "a",
    "",
    "word " * 400,  # truncated at max_seq_length by both implementations
]


def with_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Replace the (symlinked) model.safetensors in directory by these tensors."""
    path = directory / WEIGHTS_FILE
    path.unlink()
    save_file(tensors, str(path))
    return path


def replace_file(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.unlink()
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def default_tensors() -> dict[str, torch.Tensor]:
    return load_file(str(default_weights_dir() / WEIGHTS_FILE))


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_weights_dir()), device="cpu", local_files_only=True)


def embed(encoder: Encoder, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token states (B, T, C), normalised embeddings (B, C) and lengths (B,)."""
    ids, lengths = (torch.from_numpy(a) for a in pad_batch(rows))
    with torch.no_grad():
        return encoder.token_states(ids, lengths), encoder.embed(ids, lengths), lengths


def test_default_checkpoint_imports_with_its_config(encoder_and_checkpoint):
    encoder, checkpoint = encoder_and_checkpoint
    assert not encoder.training
    assert checkpoint.sha256 == DEFAULT_SHA256
    assert checkpoint.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert checkpoint.config == EncoderConfig(max_seq_length=256, pooling="mean", normalize=True)


def test_import_matches_sentence_transformers(encoder_and_checkpoint, tokenizer, reference):
    encoder, _ = encoder_and_checkpoint
    assert reference.max_seq_length == tokenizer.max_length
    states, ours, lengths = embed(encoder, tokenizer.encode(SENTENCES).ids)
    want = reference.encode(SENTENCES, convert_to_tensor=True)
    assert (ours - want).abs().max() <= 1e-5
    want_states = reference.encode(SENTENCES, output_value="token_embeddings")
    for i, n in enumerate(lengths.tolist()):
        assert want_states[i].shape == (n, encoder.config.hidden_size)
        assert (states[i, :n] - want_states[i]).abs().max() <= 1e-5, SENTENCES[i]


def test_bert_prefixed_checkpoint_imports_the_same(checkpoint_copy, default_tensors, encoder_and_checkpoint):
    encoder, _ = encoder_and_checkpoint
    directory = checkpoint_copy()
    with_tensors(directory, {f"bert.{k}": v for k, v in default_tensors.items()})
    loaded, _ = load_checkpoint(directory)
    for key, value in encoder.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_nonexistent_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(WeightsError, match=re.escape(f"{missing}: no such directory")):
        load_checkpoint(missing)


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(WeightsError, match=re.escape(f"{tmp_path}: not a BERT-family checkpoint")) as e:
        load_checkpoint(tmp_path)
    assert "config.json" in str(e.value) and WEIGHTS_FILE in str(e.value)


def test_checksum_mismatch():
    problem = f"{default_weights_dir() / WEIGHTS_FILE}: sha256 {DEFAULT_SHA256} does not match"
    with pytest.raises(WeightsError, match=re.escape(problem)) as e:
        load_checkpoint(default_weights_dir(), "0" * 64)
    assert "0" * 64 in str(e.value)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"num_attention_heads": 7}, "hidden_size 384 is not divisible by num_heads 7"),
        ({"max_position_embeddings": 128}, "max_seq_length 256 exceeds max_position_embeddings 128"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not BERT-family"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"hidden_size": None}, "missing field 'hidden_size'"),
    ],
)
def test_config_the_encoder_cannot_represent(checkpoint_copy, changes, problem):
    directory = checkpoint_copy(changes)
    with pytest.raises(WeightsError, match=re.escape(str(directory / "config.json"))) as e:
        load_checkpoint(directory)
    assert problem in str(e.value)


def test_missing_tensor(checkpoint_copy, default_tensors):
    directory = checkpoint_copy()
    gone = "encoder.layer.3.attention.self.key.weight"
    path = with_tensors(directory, {k: v for k, v in default_tensors.items() if k != gone})
    with pytest.raises(WeightsError, match=re.escape(f"{path}: missing tensors {gone}")):
        load_checkpoint(directory)


def test_unexpected_tensor(checkpoint_copy, default_tensors):
    directory = checkpoint_copy()
    extra = "encoder.layer.0.attention.self.rotary.weight"
    path = with_tensors(directory, {**default_tensors, extra: torch.zeros(4)})
    with pytest.raises(WeightsError, match=re.escape(f"{path}: unexpected tensors {extra}")):
        load_checkpoint(directory)


def test_wrong_tensor_shape(checkpoint_copy, default_tensors):
    directory = checkpoint_copy()
    name = "encoder.layer.2.intermediate.dense.bias"
    path = with_tensors(directory, {**default_tensors, name: torch.zeros(1535)})
    problem = f"{path}: {name} has shape (1535,), the config needs (1536,)"
    with pytest.raises(WeightsError, match=re.escape(problem)):
        load_checkpoint(directory)


def test_unreadable_safetensors(checkpoint_copy):
    path = replace_file(checkpoint_copy(), WEIGHTS_FILE, "not a safetensors file")
    with pytest.raises(WeightsError, match=re.escape(f"{path}: cannot read safetensors")):
        load_checkpoint(path.parent)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("modules.json", "{broken"),
        ("modules.json", "[1]"),
        ("sentence_bert_config.json", '{"max_seq_length": null}'),
        ("config.json", '{"vocab_size": null}'),
    ],
    ids=["modules-not-json", "modules-not-objects", "max-seq-length-null", "vocab-size-null"],
)
def test_malformed_side_files_name_the_file(checkpoint_copy, name, text):
    path = replace_file(checkpoint_copy(), name, text)
    with pytest.raises(WeightsError, match=re.escape(str(path))):
        load_checkpoint(path.parent)


@pytest.mark.parametrize(
    "changes",
    [{}, {"position": "sinusoidal", "pooling": "cls", "normalize": False}],
    ids=["learned-mean-normalized", "sinusoidal-cls-raw"],
)
def test_save_then_load_gives_identical_outputs(tmp_path, tokenizer, changes):
    config = EncoderConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        max_seq_length=48,
        **changes,
    )
    torch.manual_seed(0)
    model = Encoder(config).eval()
    save_checkpoint(model, default_weights_dir() / "tokenizer.json", tmp_path / "saved")
    loaded, checkpoint = load_checkpoint(tmp_path / "saved")
    assert checkpoint.config == config
    assert checkpoint.model_id == "trained-here"
    rows = [row[: config.max_seq_length] for row in tokenizer.encode(SENTENCES).ids]
    states, embeddings, _ = embed(model, rows)
    loaded_states, loaded_embeddings, _ = embed(loaded, rows)
    assert torch.equal(loaded_states, states)
    assert torch.equal(loaded_embeddings, embeddings)
    norms = embeddings.norm(dim=1).numpy()
    assert np.allclose(norms, 1.0, atol=1e-5) == config.normalize


@pytest.mark.parametrize(
    ("layout", "hint"),
    [
        (["pytorch_model.bin", "config.json", "tokenizer.json"], "pytorch_model.bin is not read"),
        (["model.safetensors", "config.json", "vocab.txt"], "vocab.txt is not read"),
        (["snapshots/abc123/config.json", "refs/main"], "a Hugging Face cache folder"),
    ],
)
def test_a_hub_layout_missing_our_files_says_what_to_give_instead(tmp_path, layout, hint):
    """Directories a user has at hand from the Hugging Face hub: older checkpoints' pytorch_model.bin
    and vocab.txt, the cache's models--org--name folder. The error says what it lacks and why."""
    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    with pytest.raises(WeightsError, match=re.escape(f"{tmp_path}: not a BERT-family checkpoint")) as e:
        load_checkpoint(tmp_path)
    assert hint in str(e.value), str(e.value)
