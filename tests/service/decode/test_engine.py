"""The served decode engine (`DecodeEngine`): constrained beam search against brute-force
oracles — the exhaustive-beam search, GTM eligibility — and the reference search
(`tests.helpers.reference_search.ReferenceBeamSearch`) held to the same oracles, so the
other decode tests may compare the engine against it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.index_arrays import IndexArrays
from contracts.request import SCORINGS, FilterMode, Scoring, check_schedule
from contracts.targeting import Targeting
from service.decode.engine import DecodeEngine
from service.decode.kv_cache import PagedKVCache
from service.decode.step import DecoderStep
from service.model.decoder import SIDDecoder
from service.post import LocationVocabulary
from tests.helpers.oracle import Ad, eligible
from tests.helpers.reference_post import expand_and_filter
from tests.service.decode.cases import (
    CONFIG,
    TARGETING,
    WIDE,
    Case,
    assert_same,
    check_teacher_forcing,
    ctx_for,
    make_ads,
    requests,
    setup,
)

SEARCHES = ["served", "reference"]


def search_of(case: Case, which: str):
    """The served engine (default buckets: batches run padded) or the reference search."""
    return case.served() if which == "served" else case.reference


def brute_force_scores(index: IndexArrays, decoder: SIDDecoder, ctx: torch.Tensor) -> dict:
    """Teacher-forced score of every catalog SID under the CD-masked log-softmax."""
    sids = sorted({tuple(s) for s in index.ads.leaf_sids.tolist()})
    prefixes = {s[:n] for s in sids for n in range(4)}
    children = {p: sorted({s[len(p)] for s in sids if s[: len(p)] == p}) for p in prefixes}
    with torch.no_grad():
        logits = decoder.forward_train(ctx.expand(len(sids), -1, -1), torch.tensor(sids))
    out = {}
    for i, sid in enumerate(sids):
        total = 0.0
        for t in range(4):
            allowed = children[sid[:t]]
            logp = torch.log_softmax(logits[i, t, allowed], dim=-1)
            total += float(logp[allowed.index(sid[t])])
        out[sid] = total
    return out


def test_served_step_path_equals_teacher_forcing() -> None:
    """The engine's decoder step over its paged KV cache gives `forward_train`'s logits."""
    cache = PagedKVCache(CONFIG.decoder_layers, CONFIG.n_heads, CONFIG.d_head, [2] * 4,
                         dtype=torch.float32, device="cpu")  # fmt: skip
    check_teacher_forcing(DecoderStep, cache)


@pytest.mark.parametrize("which", SEARCHES)
def test_cd_only_with_wide_beams_returns_every_catalog_sid_with_brute_force_scores(
    which: str,
) -> None:
    ads = make_ads()
    case = setup(ads)
    ctx = ctx_for(1)
    res = search_of(case, which).run(ctx, None, WIDE, FilterMode.CD_ONLY)
    leaves, scores = res.valid(0)
    got = {
        tuple(case.index.ads.leaf_sids[i].tolist()): float(s)
        for i, s in zip(leaves, scores, strict=True)
    }
    want = brute_force_scores(case.index, case.decoder, ctx)
    assert got.keys() == want.keys()
    for sid, s in want.items():
        assert got[sid] == pytest.approx(s, abs=1e-4)
    assert torch.all(scores[:-1] >= scores[1:])  # best first
    ads_arrays = case.index.ads
    expanded = expand_and_filter(ads_arrays, LocationVocabulary(ads_arrays), leaves.numpy(),
                                 scores.numpy(), Targeting(), 10**6, exact=False)  # fmt: skip
    assert sorted(expanded.ad_ids.tolist()) == sorted(a.ad_id for a in ads)


@pytest.mark.parametrize("which", SEARCHES)
@pytest.mark.parametrize("k", [1, 5, 12])
def test_beam_search_equals_brute_force_top_k(k: int, which: str) -> None:
    """Beams wide enough to hold every prefix make beam search exact: its best k SIDs are
    the brute-force top-k over all catalog SIDs, in order, with the same scores."""
    ads = make_ads(60, seed=k)
    case = setup(ads, seed=k)
    ctx = ctx_for(1, seed=k)
    res = search_of(case, which).run(ctx, None, WIDE, FilterMode.CD_ONLY)
    brute = brute_force_scores(case.index, case.decoder, ctx)
    want = sorted(brute.items(), key=lambda kv: -kv[1])[:k]
    got = [tuple(s) for s in res.sids[0, :k].tolist()]
    assert got == [sid for sid, _ in want]
    np.testing.assert_allclose(res.scores[0, :k].numpy(), [s for _, s in want], atol=1e-4)


@pytest.mark.parametrize("which", SEARCHES)
@pytest.mark.parametrize(
    "req",
    [
        Targeting("US", 30, "female", ("US/R1",)),
        Targeting("CA", 0, "", ()),
        Targeting("GB", 70, "male", ("GB/R3", "elsewhere")),
        Targeting("FR", 16, "", ("US/R1",)),
    ],
)
def test_cd_gtm_with_exact_filter_returns_exactly_the_eligible_ads(
    req: Targeting, which: str
) -> None:
    ads = make_ads(50, seed=3)
    case = setup(ads)
    res = search_of(case, which).run(ctx_for(1), requests([req]), WIDE, FilterMode.CD_GTM)
    leaves, scores = res.valid(0)
    ads_arrays = case.index.ads
    out = expand_and_filter(ads_arrays, LocationVocabulary(ads_arrays), leaves.numpy(),
                            scores.numpy(), req, 10**6)  # fmt: skip
    assert sorted(out.ad_ids.tolist()) == sorted(a.ad_id for a in ads if eligible(a, req))
    # GTM itself only emits SIDs whose subtree may hold an eligible ad
    emitted = {tuple(ads_arrays.leaf_sids[i].tolist()) for i in leaves.tolist()}
    assert {a.sid for a in ads if eligible(a, req)} <= emitted


@pytest.mark.parametrize("scoring", SCORINGS)
def test_served_engine_equals_the_reference_with_narrow_beams(scoring: Scoring) -> None:
    """Beams narrower than the catalog (the pruning a server runs): the same SIDs as the
    reference, for a batch that runs padded in its bucket, with and without GTM, in both
    scorings (the beams kept at each step are chosen by the scoring)."""
    case = setup(make_ads(80, seed=5))
    served = case.served(scoring=scoring)
    ctx, reqs = ctx_for(3), requests([Targeting("US", 30), Targeting("CA"), Targeting("GB", 50)])
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = case.reference.run(ctx, reqs, (1, 3, 7, 5), mode, scoring)
        assert_same(served.run(ctx, reqs, (1, 3, 7, 5), mode), want)


@pytest.mark.parametrize("which", SEARCHES)
def test_requests_in_a_batch_are_independent_and_results_deterministic(which: str) -> None:
    ads = make_ads(80, seed=6)
    search = search_of(setup(ads), which)
    ctx = ctx_for(3)
    ts = [Targeting("US", 30), Targeting("CA", 40, "female"), Targeting()]
    batch = search.run(ctx, requests(ts), (1, 4, 8, 6))
    again = search.run(ctx, requests(ts), (1, 4, 8, 6))
    assert torch.equal(batch.sids, again.sids) and torch.equal(batch.scores, again.scores)
    for i, t in enumerate(ts):
        alone = search.run(ctx[i : i + 1], requests([t]), (1, 4, 8, 6))
        assert torch.equal(alone.sids[0], batch.sids[i])
        torch.testing.assert_close(alone.scores[0], batch.scores[i])


@pytest.mark.parametrize("which", SEARCHES)
def test_dead_beams_are_never_emitted(which: str) -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("US",)), Ad(2, (1, 1, 1, 1), countries=("CA",))]
    case = setup(ads)
    search = search_of(case, which)
    res = search.run(ctx_for(1), requests([Targeting("US")]), (1, 4, 4, 4), FilterMode.CD_GTM)
    leaves, scores = res.valid(0)
    assert [tuple(case.index.ads.leaf_sids[i].tolist()) for i in leaves.tolist()] == [(0, 0, 0, 0)]
    assert torch.isfinite(scores).all()
    assert (res.leaves[0] == -1).sum() == 3 and torch.isinf(res.scores[0, 1:]).all()
    nothing = search.run(ctx_for(1), requests([Targeting("FR")]), (1, 4, 4, 4))
    assert (nothing.leaves == -1).all()


@pytest.mark.parametrize("beams", [(2, 4, 4, 4), (1, 4, 4), (1, 600, 4, 4), (1, 0, 4, 4)])
def test_bad_schedules_are_refused(beams: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"M_|beam schedule"):
        check_schedule(beams, 4, 512)
    case = setup(make_ads(10))
    for search in (case.served(), case.reference):
        with pytest.raises(ValueError, match=r"M_|beam schedule"):
            search.run(ctx_for(1), None, beams, FilterMode.CD_ONLY)


@pytest.mark.parametrize("which", SEARCHES)
def test_wide_cd_only_emits_each_catalog_sid_once_per_request(which: str) -> None:
    ads = make_ads(30, seed=9)
    res = search_of(setup(ads), which).run(ctx_for(2), None, WIDE, FilterMode.CD_ONLY)
    for b in range(2):
        pairs = zip(res.sids[b].tolist(), res.leaves[b].tolist(), strict=True)
        live = [tuple(s) for s, leaf in pairs if leaf >= 0]
        assert len(live) == len(set(live)) == len({a.sid for a in ads})
    assert res.rows_per_step == (2, 1024, 1024, 1024)


def test_served_engine_serves_the_shared_targeting_cases() -> None:
    """Every shared targeting case (up to 5 locations: the 16-location bucket) in one
    padded batch of the default buckets equals the reference."""
    case = setup(make_ads(80, seed=2), seed=1)
    engine = DecodeEngine(case.decoder)
    plans = engine.plan(case.tables, case.level_offsets)
    ctx, reqs = ctx_for(len(TARGETING), seed=3), requests(TARGETING)
    want = case.reference.run(ctx, reqs, (1, 4, 9, 7), FilterMode.CD_GTM)
    assert_same(engine.run(plans, ctx, reqs, (1, 4, 9, 7), FilterMode.CD_GTM), want)
    ((bucket, _, _, n_loc),) = plans.plans
    assert (bucket, n_loc) == (8, 16)
