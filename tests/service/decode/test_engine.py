"""The reference decode engine: constrained beam search against brute-force oracles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from index_builder.build import build_arrays
from index_builder.exact import LocationVocabulary, expand_and_filter
from index_builder.format import IndexArrays
from index_builder.lookup import FilterMode, GtmTables, RequestTensors
from index_builder.targeting import Targeting, encode_requests
from service.decode.engine import BeamSearch, check_schedule
from service.decode.kv_cache import DenseKVCache
from service.model.config import PROFILES
from service.model.decoder import SIDDecoder
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.oracle import Ad, eligible

CONFIG = dataclasses.replace(PROFILES["tiny"], d_model=32, n_heads=2, d_head=16, d_ff=64, t_ctx=6)
WIDE = (1, 512, 512, 512)  # wider than any level of the test catalogs


def make_ads(n: int = 40, seed: int = 0) -> list[Ad]:
    rng = np.random.default_rng(seed)
    countries, locs = ("US", "CA", "GB"), ("US/R1", "CA/R2", "GB/R3")
    ads = []
    for i in range(n):
        sid = tuple(int(x) for x in rng.integers(0, 3, 4))
        ads.append(
            Ad(
                500 + i,
                sid,  # type: ignore[arg-type]
                countries=tuple(rng.choice(countries, rng.integers(0, 2), replace=False)),
                age_buckets=("25-34",) if rng.random() < 0.3 else (),
                genders=("female",) if rng.random() < 0.2 else (),
                locations=tuple(rng.choice(locs, rng.integers(0, 2), replace=False)),
            )
        )
    return ads


def setup(ads: list[Ad], seed: int = 0) -> tuple[IndexArrays, SIDDecoder, BeamSearch]:
    cat = catalog_from_ads(ads)
    index = build_arrays(cat, cat.sid.astype(np.int64))
    torch.manual_seed(seed)
    decoder = SIDDecoder(CONFIG).eval()
    level_offsets = torch.from_numpy(index.trie.level_offsets)
    return index, decoder, BeamSearch(decoder, GtmTables.from_arrays(index.trie), level_offsets)


def ctx_for(b: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        b, CONFIG.t_ctx, CONFIG.d_model, generator=torch.Generator().manual_seed(seed)
    )


def requests(ts: list[Targeting]) -> RequestTensors:
    return RequestTensors.from_encoded(encode_requests(ts))


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


def test_step_path_equals_teacher_forcing() -> None:
    torch.manual_seed(0)
    decoder = SIDDecoder(CONFIG).eval()
    ctx = ctx_for(2)
    sid = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    with torch.no_grad():
        want = decoder.forward_train(ctx, sid)
        cache = DenseKVCache(CONFIG.decoder_layers, CONFIG.n_heads, CONFIG.d_head, [2] * 4,
                             dtype=torch.float32, device="cpu")  # fmt: skip
        cross = decoder.cross_kv(ctx)
        tokens = torch.full((2,), decoder.bos)
        for t in range(4):
            got = decoder.step(tokens, t, cross, cache)
            torch.testing.assert_close(got, want[:, t], rtol=1e-4, atol=1e-5)
            tokens = sid[:, t]


def test_cd_only_with_wide_beams_returns_every_catalog_sid_with_brute_force_scores() -> None:
    ads = make_ads()
    index, decoder, search = setup(ads)
    ctx = ctx_for(1)
    res = search.run(ctx, None, WIDE, FilterMode.CD_ONLY)
    leaves, scores = res.valid(0)
    got = {
        tuple(index.ads.leaf_sids[i].tolist()): float(s)
        for i, s in zip(leaves, scores, strict=True)
    }
    want = brute_force_scores(index, decoder, ctx)
    assert got.keys() == want.keys()
    for sid, s in want.items():
        assert got[sid] == pytest.approx(s, abs=1e-4)
    assert torch.all(scores[:-1] >= scores[1:])  # best first
    expanded = expand_and_filter(index.ads, LocationVocabulary(index.ads), leaves.numpy(),
                                 scores.numpy(), Targeting(), 10**6, exact=False)  # fmt: skip
    assert sorted(expanded.ad_ids.tolist()) == sorted(a.ad_id for a in ads)


@pytest.mark.parametrize("k", [1, 5, 12])
def test_beam_search_equals_brute_force_top_k(k: int) -> None:
    """Beams wide enough to hold every prefix make beam search exact: its best k SIDs are
    the brute-force top-k over all catalog SIDs, in order, with the same scores."""
    ads = make_ads(60, seed=k)
    index, decoder, search = setup(ads, seed=k)
    ctx = ctx_for(1, seed=k)
    res = search.run(ctx, None, WIDE, FilterMode.CD_ONLY)
    want = sorted(brute_force_scores(index, decoder, ctx).items(), key=lambda kv: -kv[1])[:k]
    got = [tuple(s) for s in res.sids[0, :k].tolist()]
    assert got == [sid for sid, _ in want]
    np.testing.assert_allclose(res.scores[0, :k].numpy(), [s for _, s in want], atol=1e-4)


@pytest.mark.parametrize(
    "req",
    [
        Targeting("US", 30, "female", ("US/R1",)),
        Targeting("CA", 0, "", ()),
        Targeting("GB", 70, "male", ("GB/R3", "elsewhere")),
        Targeting("FR", 16, "", ("US/R1",)),
    ],
)
def test_cd_gtm_with_exact_filter_returns_exactly_the_eligible_ads(req: Targeting) -> None:
    ads = make_ads(50, seed=3)
    index, _, search = setup(ads)
    res = search.run(ctx_for(1), requests([req]), WIDE, FilterMode.CD_GTM)
    leaves, scores = res.valid(0)
    out = expand_and_filter(index.ads, LocationVocabulary(index.ads), leaves.numpy(),
                            scores.numpy(), req, 10**6)  # fmt: skip
    assert sorted(out.ad_ids.tolist()) == sorted(a.ad_id for a in ads if eligible(a, req))
    # GTM itself only emits SIDs whose subtree may hold an eligible ad
    emitted = {tuple(index.ads.leaf_sids[i].tolist()) for i in leaves.tolist()}
    assert {a.sid for a in ads if eligible(a, req)} <= emitted


def test_paged_cache_equals_dense_oracle() -> None:
    ads = make_ads(80, seed=5)
    index, decoder, paged = setup(ads)
    dense = BeamSearch(decoder, paged.tables, torch.from_numpy(index.trie.level_offsets),
                       paged=False)  # fmt: skip
    ctx = ctx_for(3)
    reqs = requests([Targeting("US", 30), Targeting("CA"), Targeting("GB", 50, "male")])
    a = paged.run(ctx, reqs, (1, 3, 7, 5), FilterMode.CD_GTM)
    b = dense.run(ctx, reqs, (1, 3, 7, 5), FilterMode.CD_GTM)
    assert torch.equal(a.sids, b.sids) and torch.equal(a.leaves, b.leaves)
    torch.testing.assert_close(a.scores, b.scores)


def test_requests_in_a_batch_are_independent_and_results_deterministic() -> None:
    ads = make_ads(80, seed=6)
    _, _, search = setup(ads)
    ctx = ctx_for(3)
    ts = [Targeting("US", 30), Targeting("CA", 40, "female"), Targeting()]
    batch = search.run(ctx, requests(ts), (1, 4, 8, 6))
    again = search.run(ctx, requests(ts), (1, 4, 8, 6))
    assert torch.equal(batch.sids, again.sids) and torch.equal(batch.scores, again.scores)
    for i, t in enumerate(ts):
        alone = search.run(ctx[i : i + 1], requests([t]), (1, 4, 8, 6))
        assert torch.equal(alone.sids[0], batch.sids[i])
        torch.testing.assert_close(alone.scores[0], batch.scores[i])


def test_dead_beams_are_never_emitted() -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("US",)), Ad(2, (1, 1, 1, 1), countries=("CA",))]
    index, _, search = setup(ads)
    res = search.run(ctx_for(1), requests([Targeting("US")]), (1, 4, 4, 4), FilterMode.CD_GTM)
    leaves, scores = res.valid(0)
    assert [tuple(index.ads.leaf_sids[i].tolist()) for i in leaves.tolist()] == [(0, 0, 0, 0)]
    assert torch.isfinite(scores).all()
    assert (res.leaves[0] == -1).sum() == 3 and torch.isinf(res.scores[0, 1:]).all()
    nothing = search.run(ctx_for(1), requests([Targeting("FR")]), (1, 4, 4, 4))
    assert (nothing.leaves == -1).all()


@pytest.mark.parametrize("beams", [(2, 4, 4, 4), (1, 4, 4), (1, 600, 4, 4), (1, 0, 4, 4)])
def test_bad_schedules_are_refused(beams: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"M_|beam schedule"):
        check_schedule(beams, 4, 512)


def test_wide_cd_only_emits_each_catalog_sid_once_per_request() -> None:
    ads = make_ads(30, seed=9)
    _, _, search = setup(ads)
    res = search.run(ctx_for(2), None, WIDE, FilterMode.CD_ONLY)
    for b in range(2):
        pairs = zip(res.sids[b].tolist(), res.leaves[b].tolist(), strict=True)
        live = [tuple(s) for s, leaf in pairs if leaf >= 0]
        assert len(live) == len(set(live)) == len({a.sid for a in ads})
    assert res.rows_per_step == (2, 1024, 1024, 1024)
