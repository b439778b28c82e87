"""The encoder's own behaviour: masks from lengths, padding invariance, positions, pooling, config checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.encoder import Encoder, Packing, padding_mask, pool, sinusoidal_table
from minilm_embed.model.tokenizer import pad_batch

SENTENCES = [
    "A man is playing a guitar.",
    "Two dogs are running through a field of tall grass.",
    "ok",
]

TINY = EncoderConfig(
    vocab_size=1000,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    max_seq_length=64,
)


@pytest.fixture(scope="module")
def encoder(encoder_and_checkpoint):
    return encoder_and_checkpoint[0]


@pytest.fixture(scope="module")
def batch(tokenizer):
    """Real token ids for SENTENCES, padded: ((B, T) ids, (B,) lengths)."""
    ids, lengths = pad_batch(tokenizer.encode(SENTENCES).ids)
    return torch.from_numpy(ids), torch.from_numpy(lengths)


def tiny_encoder(**changes) -> Encoder:
    torch.manual_seed(0)
    return Encoder(dataclasses.replace(TINY, **changes)).eval()


def test_padding_mask_is_true_exactly_on_real_tokens():
    mask = padding_mask(torch.tensor([3, 1, 5, 0]), seq_len=5)
    expected = torch.tensor(
        [
            [True, True, True, False, False],
            [True, False, False, False, False],
            [True, True, True, True, True],
            [False, False, False, False, False],
        ]
    )
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_packing_keeps_exactly_the_real_tokens_in_row_order():
    lengths = torch.tensor([3, 1, 4, 2])
    x = torch.arange(4 * 4 * 2).reshape(4, 4, 2)  # (B, T, C): every slot distinct
    packing = Packing(lengths, seq_len=4)
    packed = packing.pack(x)
    want = torch.cat([x[b, :n] for b, n in enumerate(lengths.tolist())])
    assert torch.equal(packed, want)  # (N, C), N = sum(lengths): no padded slot computed
    unpacked = packing.unpack(packed)
    assert unpacked.shape == x.shape
    assert torch.equal(unpacked[packing.mask], x[packing.mask])  # real slots back in place


@pytest.mark.parametrize("pad", [1, 7, 40])
def test_padding_tokens_do_not_change_real_token_states(encoder, tokenizer, pad):
    row = tokenizer.encode(["Two dogs are running through a field of tall grass."]).ids[0]
    n = len(row)
    alone = torch.tensor([row])
    generator = torch.Generator().manual_seed(pad)
    junk = torch.randint(1000, tokenizer.vocab_size, (1, pad), generator=generator)
    padded = torch.cat([alone, junk], dim=1)  # (1, n + pad): random ids after the real tokens
    with torch.no_grad():
        want = encoder.token_states(alone, torch.tensor([n]))
        got = encoder.token_states(padded, torch.tensor([n]))
        pooled_want, pooled_got = encoder(alone, torch.tensor([n])), encoder(padded, torch.tensor([n]))
    assert torch.allclose(got[:, :n], want, rtol=0, atol=1e-5), (got[:, :n] - want).abs().max()
    assert torch.allclose(pooled_got, pooled_want, rtol=0, atol=1e-5)


def test_rows_in_a_mixed_length_batch_match_each_row_alone(encoder, batch):
    ids, lengths = batch
    with torch.no_grad():
        together = encoder.embed(ids, lengths)
        rows = [(ids[i : i + 1, :n], lengths[i : i + 1]) for i, n in enumerate(lengths.tolist())]
        alone = torch.cat([encoder.embed(row, length) for row, length in rows])
    assert torch.allclose(together, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [7, 16, 384])
def test_sinusoidal_table_follows_the_formula(dim):
    positions = 50
    want = np.zeros((positions, dim))
    for pos in range(positions):
        for i in range((dim + 1) // 2):
            angle = pos / 10000 ** (2 * i / dim)
            want[pos, 2 * i] = math.sin(angle)
            if 2 * i + 1 < dim:
                want[pos, 2 * i + 1] = math.cos(angle)
    got = sinusoidal_table(positions, dim)
    assert got.shape == (positions, dim)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)


def test_sinusoidal_encoder_adds_the_table_and_has_no_learned_positions():
    encoder = tiny_encoder(position="sinusoidal")
    assert encoder.embeddings.position is None
    assert not any("position" in name for name in encoder.state_dict())
    table = sinusoidal_table(TINY.max_position_embeddings, TINY.hidden_size)
    assert torch.equal(encoder.embeddings.positions(10), table[:10])


def test_sinusoidal_encoder_runs_with_dynamic_lengths():
    encoder = tiny_encoder(position="sinusoidal")
    generator = torch.Generator().manual_seed(0)
    for seq_len, lengths in [(5, [5, 2]), (17, [17, 9, 1]), (64, [64])]:
        ids = torch.randint(1, TINY.vocab_size, (len(lengths), seq_len), generator=generator)
        with torch.no_grad():
            out = encoder.embed(ids, torch.tensor(lengths))
            alone = [encoder.embed(ids[i : i + 1, :n], torch.tensor([n])) for i, n in enumerate(lengths)]
        assert out.shape == (len(lengths), TINY.hidden_size)
        assert torch.isfinite(out).all()
        assert torch.allclose(out.norm(dim=1), torch.ones(len(lengths)), atol=1e-5)
        assert torch.allclose(out, torch.cat(alone), rtol=0, atol=1e-5)


def test_cls_pooling_is_token_zero_and_differs_from_mean(encoder, batch):
    ids, lengths = batch
    cls_encoder = Encoder(dataclasses.replace(encoder.config, pooling="cls")).eval()
    cls_encoder.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        states = encoder.token_states(ids, lengths)  # (B, T, C)
        mean, cls = encoder(ids, lengths), cls_encoder(ids, lengths)
    assert torch.equal(cls, states[:, 0])
    manual_mean = torch.stack([states[i, :n].mean(dim=0) for i, n in enumerate(lengths.tolist())])
    assert torch.allclose(mean, manual_mean, rtol=0, atol=1e-6)
    assert (mean - cls).abs().max() > 0.1


def test_pool_mean_ignores_padded_positions():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # (B, T, C)
    hidden[1, 2:] = 1e6  # padding that must not count
    lengths = torch.tensor([4, 2])
    mask = padding_mask(lengths, 4)
    mean = pool(hidden, mask, lengths, "mean")
    assert torch.equal(mean[0], hidden[0].mean(dim=0))
    assert torch.equal(mean[1], hidden[1, :2].mean(dim=0))
    assert torch.equal(pool(hidden, mask, lengths, "cls"), hidden[:, 0])


def test_hidden_size_must_divide_into_heads():
    with pytest.raises(ValueError, match=r"hidden_size 100 is not divisible by num_heads 12"):
        EncoderConfig(hidden_size=100, num_heads=12)


def test_max_seq_length_cannot_exceed_positions():
    with pytest.raises(ValueError, match=r"max_seq_length 513 exceeds max_position_embeddings 512"):
        EncoderConfig(max_seq_length=513, max_position_embeddings=512)


@pytest.mark.parametrize(("field", "value"), [("position", "rotary"), ("pooling", "max")])
def test_unknown_position_or_pooling_kind_is_refused(field, value):
    with pytest.raises(ValueError, match=value):
        EncoderConfig(**{field: value})


def test_config_round_trips_through_dict_and_refuses_unknown_fields():
    config = dataclasses.replace(TINY, pooling="cls", position="sinusoidal", normalize=False)
    assert EncoderConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="num_experts"):
        EncoderConfig.from_dict({**config.to_dict(), "num_experts": 8})
