"""The KV-cache baselines of the decode ladder (`bench.baselines.kv_cache`: the dense
per-row cache, the paged cache with unfused attention) and the layer-by-layer step
(`bench.baselines.decode_variants.LayerByLayerStep`) compute what the served cache and
step compute: `forward_train`'s logits, and the served engine's SIDs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.baselines.decode_variants import DecodeOptions, LayerByLayerStep, VariantEngine
from bench.baselines.kv_cache import ATTENTION_MODES, DenseKVCache, GatherPagedKVCache
from contracts.request import FilterMode
from contracts.targeting import Targeting
from service.decode.kv_cache import PagedKVCache
from service.decode.step import DecoderStep
from tests.service.decode.cases import (
    CONFIG,
    assert_same,
    check_teacher_forcing,
    ctx_for,
    decoder_with_biases,
    make_ads,
    requests,
    run_steps,
    setup,
)

CACHES = {"paged": GatherPagedKVCache, "dense": DenseKVCache}


@pytest.mark.parametrize("attention", ATTENTION_MODES)
def test_layer_by_layer_step_on_the_dense_cache_equals_teacher_forcing(attention: str) -> None:
    cache = DenseKVCache(CONFIG.decoder_layers, CONFIG.n_heads, CONFIG.d_head, [2] * 4,
                         dtype=torch.float32, device="cpu", attention=attention)  # fmt: skip
    check_teacher_forcing(lambda d: LayerByLayerStep(d, DecodeOptions()), cache)


@pytest.mark.parametrize("kv", sorted(CACHES))
@pytest.mark.parametrize("attention", ATTENTION_MODES)
@pytest.mark.parametrize("fused", [True, False])
def test_baseline_caches_with_random_parents_equal_teacher_forcing(
    kv: str, attention: str, fused: bool
) -> None:
    """Every cache and attention mode under the served step (its layer-0 table read too)
    and the layer-by-layer one, through a search with random parents: each step gives
    `forward_train`'s logits of the rows' own prefixes, as the served paged cache does."""
    decoder = decoder_with_biases(dataclasses.replace(CONFIG, decoder_layers=3))
    step = DecoderStep(decoder) if fused else LayerByLayerStep(decoder, DecodeOptions())
    args = (decoder, step, 3, (1, 4, 6, 5), torch.float32, "cpu")
    got, want = run_steps(*args, CACHES[kv], attention=attention)
    served, _ = run_steps(*args, PagedKVCache)
    for g, s, w in zip(got, served, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-5)


def test_unknown_attention_modes_are_refused() -> None:
    for cls in CACHES.values():
        with pytest.raises(ValueError, match="attention"):
            cls(1, 2, 16, [2] * 4, dtype=torch.float32, device="cpu", attention="flash")


def test_dense_cache_engine_equals_the_served_engine() -> None:
    """The dense cache (reorder copies the bytes) through `VariantEngine(kv="dense")` gives
    the served engine's (paged) SIDs, and both the reference's."""
    case = setup(make_ads(80, seed=5))
    served = case.served()
    dense = case.served(VariantEngine, DecodeOptions(kv="dense"))
    ctx = ctx_for(3)
    reqs = requests([Targeting("US", 30), Targeting("CA"), Targeting("GB", 50, "male")])
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        a = served.run(ctx, reqs, (1, 3, 7, 5), mode)
        b = dense.run(ctx, reqs, (1, 3, 7, 5), mode)
        assert torch.equal(a.sids, b.sids) and torch.equal(a.leaves, b.leaves)
        torch.testing.assert_close(a.scores, b.scores)
        assert_same(b, case.reference.run(ctx, reqs, (1, 3, 7, 5), mode))
    assert dense.plans.caches and all(
        isinstance(c, DenseKVCache) for c in dense.plans.caches.values()
    )
    assert all(type(c) is PagedKVCache for c in served.plans.caches.values())
