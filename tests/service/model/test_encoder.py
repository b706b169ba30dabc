"""Context encoder (pipeline stage 3, first half): shapes, empty histories, invariances."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
from torch import nn

from service.model.config import PROFILES
from service.model.embeddings import FeatureEmbedder
from service.model.encoder import ContextEncoder
from service.model.features import FeatureBatch

CONFIG = PROFILES["tiny"]


def stages() -> nn.Sequential:
    """Stage 2's embedder then stage 3's encoder: FeatureBatch -> context."""
    return nn.Sequential(FeatureEmbedder(CONFIG), ContextEncoder(CONFIG))


@pytest.fixture(scope="module")
def encoder() -> nn.Sequential:
    torch.manual_seed(0)
    enc = stages().eval()
    # FiLM starts at the identity; give it weights so the cross-talk path is exercised
    with torch.no_grad():
        for layer in enc[1].layers:
            layer.nonseq_to_seq.weight.normal_(std=0.05)
    return enc


def _batch(lengths: list[int], width: int | None = None, seed: int = 0) -> FeatureBatch:
    """Random features; row b has lengths[b] real events, left-aligned."""
    g = torch.Generator().manual_seed(seed)
    b, c = len(lengths), CONFIG
    width = max(lengths, default=0) if width is None else width
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, L]

    def ints(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=g)

    return FeatureBatch(
        user_hash=ints(c.user_hash_buckets, b),
        country=ints(250, b),
        age_bucket=ints(8, b),
        gender=ints(3, b),
        hist_sid=ints(c.vocab_size, b, width, c.sid_length) * mask[..., None],
        hist_type=(ints(3, b, width) + 1) * mask,
        hist_gap=ints(c.time_gap_buckets, b, width) * mask,
        hist_mask=mask,
    )


def _rows(f: FeatureBatch, rows: list[int]) -> FeatureBatch:
    return FeatureBatch(**{k.name: getattr(f, k.name)[rows] for k in fields(f)})


@torch.no_grad()
def test_output_shape(encoder):
    ctx = encoder(_batch([5, 0, CONFIG.max_history]))
    assert ctx.shape == (3, CONFIG.t_ctx, CONFIG.d_model)
    assert ctx.dtype == torch.float32


@torch.no_grad()
def test_empty_history_gives_finite_context(encoder):
    for f in (_batch([0, 0]), _batch([0, 0], width=CONFIG.max_history), _batch([0, 3])):
        ctx = encoder(f)
        assert torch.isfinite(ctx).all()
    # users differ by their non-sequence features even without history
    ctx = encoder(_batch([0, 0]))
    assert not torch.allclose(ctx[0], ctx[1])


def _pad(f: FeatureBatch, width: int, fill: int) -> FeatureBatch:
    """Extend the history to `width` with masked events whose content is `fill`."""
    extra = width - f.hist_mask.shape[1]

    def grow(x: torch.Tensor, value: int | bool) -> torch.Tensor:
        tail = torch.full((x.shape[0], extra, *x.shape[2:]), value, dtype=x.dtype)
        return torch.cat([x, tail], dim=1)

    return replace(
        f,
        hist_sid=grow(f.hist_sid, fill),
        hist_type=grow(f.hist_type, fill),
        hist_gap=grow(f.hist_gap, fill),
        hist_mask=grow(f.hist_mask, False),
    )


@torch.no_grad()
def test_padding_does_not_change_the_output(encoder):
    tight = _batch([3, 7, 0], seed=1)
    base = encoder(tight)
    for fill in (0, 3):  # clean zero padding, and garbage under mask False
        padded = encoder(_pad(tight, CONFIG.max_history, fill))
        torch.testing.assert_close(padded, base, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_rows_are_independent(encoder):
    f = _batch([4, 0, 9, 2], seed=2)
    whole = encoder(f)
    for b in range(4):
        alone = encoder(_rows(f, [b]))
        torch.testing.assert_close(alone[0], whole[b], rtol=1e-5, atol=1e-5)
    # other rows with different inputs (and a different width) leave row 0 as it was
    other = _pad(_batch([4, 12, 1, 0], seed=3), CONFIG.max_history, 0)
    row0 = _pad(_rows(f, [0]), CONFIG.max_history, 0)
    mixed = FeatureBatch(
        **{
            k.name: torch.cat([getattr(row0, k.name), getattr(other, k.name)[1:]])
            for k in fields(f)
        }
    )
    torch.testing.assert_close(encoder(mixed)[0], whole[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_history_changes_the_output(encoder):
    f = _batch([6], seed=4)
    changed = replace(f, hist_sid=(f.hist_sid + 1) % CONFIG.vocab_size)
    assert not torch.allclose(encoder(f), encoder(changed))


@torch.no_grad()
def test_eval_mode_is_deterministic(encoder):
    f = _batch([5, 2], seed=5)
    assert torch.equal(encoder(f), encoder(f))


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    enc = stages()
    enc(_batch([3, 0, 5])).square().mean().backward()
    untouched = [n for n, p in enc.named_parameters() if p.grad is None]
    assert untouched == []
