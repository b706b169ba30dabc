"""The fixed-shape decode engine against the reference `BeamSearch` (same DecodeResult)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from index_builder.build import build_arrays
from index_builder.kway import KwaySpec
from index_builder.lookup import FilterMode, GtmTables, RequestTensors
from index_builder.targeting import Targeting, encode_requests
from kernels._triton_beam_advance import triton_beam_advance
from kernels.beam_advance import beam_advance, beam_advance_reference
from service.decode import static_engine
from service.decode.engine import BeamSearch, DecodeResult, top_k
from service.decode.static_engine import SPLIT_MIN_BUCKET, DecodeOptions, StaticBeamSearch
from service.model.config import PROFILES
from service.model.decoder import SIDDecoder
from service.pipeline.stages import GRAPH_BUCKETS
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.indexes import small_index
from tests.helpers.oracle import Ad
from tests.service.decode.test_engine import CONFIG, ctx_for, make_ads, requests, setup

TARGETING = [
    Targeting("US", 30, "female", ("US/R1",)),
    Targeting("CA", 0, "", ()),
    Targeting("GB", 50, "male", ("GB/R3", "elsewhere", "US/R1", "x", "y")),
    Targeting("FR", 16, "", ("US/R1", "CA/R2")),
    Targeting(),
]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def assert_same(got: DecodeResult, want: DecodeResult) -> None:
    """Same live SIDs (in order) and dead slots; scores equal up to float rounding."""
    assert torch.equal(got.leaves.cpu(), want.leaves.cpu())
    torch.testing.assert_close(got.scores.cpu(), want.scores.cpu(), rtol=1e-4, atol=1e-4)
    live = want.leaves.cpu() >= 0
    assert torch.equal(got.sids.cpu()[live], want.sids.cpu()[live])
    assert got.rows_per_step == want.rows_per_step


def engine_for(search: BeamSearch, index, **kwargs) -> StaticBeamSearch:
    level_offsets = torch.from_numpy(index.trie.level_offsets)
    return StaticBeamSearch(search.decoder, search.tables, level_offsets, **kwargs)


@pytest.mark.parametrize("mode", [FilterMode.CD_ONLY, FilterMode.CD_GTM])
@pytest.mark.parametrize("beams", [(1, 3, 7, 5), (1, 4, 8, 8), (1, 16, 40, 64), (1, 2, 2, 1)])
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_equals_beam_search(mode: FilterMode, beams: tuple[int, ...], batch: int) -> None:
    """Padded into a bucket of 4; (1, 16, 40, 64) is wider than the catalog: rows die."""
    ads = make_ads(80, seed=5)
    index, _, search = setup(ads)
    engine = engine_for(search, index, batch_buckets=(4,))
    ctx, reqs = ctx_for(batch), requests(TARGETING[:batch])
    want = search.run(ctx, reqs, beams, mode)
    assert_same(engine.run(ctx, reqs, beams, mode), want)
    if beams[-1] > 8:
        assert (want.leaves == -1).any()  # the schedule really has dead slots


@pytest.mark.parametrize("cross", ["beam_as_query", "per_beam"])
@pytest.mark.parametrize("self_attn", ["fused", "gather", "sdpa"])
@pytest.mark.parametrize("kv", ["paged", "dense"])
@pytest.mark.parametrize("fixed_beams", [False, True])
@pytest.mark.parametrize("fused_tail", [False, True])
def test_ablation_switches_do_not_change_the_result(
    cross: str, self_attn: str, kv: str, fixed_beams: bool, fused_tail: bool
) -> None:
    ads = make_ads(80, seed=7)
    index, _, search = setup(ads, seed=2)
    options = DecodeOptions(
        cross=cross, self_attn=self_attn, kv=kv, fixed_beams=fixed_beams, fused_tail=fused_tail
    )
    engine = engine_for(search, index, options=options, batch_buckets=(2, 4))
    ctx, reqs, beams = ctx_for(3, seed=4), requests(TARGETING[:3]), (1, 5, 9, 6)
    want = search.run(ctx, reqs, beams, FilterMode.CD_GTM)
    got = engine.run(ctx, reqs, beams, FilterMode.CD_GTM)
    if fixed_beams:  # every step computes max(beams) rows; the search is the same
        assert got.rows_per_step == (3 * 9,) * 4
        got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
    assert_same(got, want)


def test_tiny_profile_on_the_small_test_index() -> None:
    """The real tiny profile and its default schedule (1, 64, 128, 128) over a 50-ad index:
    most beams die, none is emitted, and the live ones match the reference."""
    arrays = small_index(50)
    torch.manual_seed(0)
    decoder = SIDDecoder(PROFILES["tiny"]).eval()
    tables = GtmTables.from_arrays(arrays.trie)
    offsets = torch.from_numpy(arrays.trie.level_offsets)
    search = BeamSearch(decoder, tables, offsets)
    engine = StaticBeamSearch(decoder, tables, offsets, batch_buckets=(4,))
    c = PROFILES["tiny"]
    ctx = torch.randn(3, c.t_ctx, c.d_model, generator=torch.Generator().manual_seed(3))
    ts = [Targeting("US", locations=("US/R1",)), Targeting("CA"), Targeting()]
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = search.run(ctx, requests(ts), c.beams, mode)
        assert (want.leaves == -1).any()
        assert_same(engine.run(ctx, requests(ts), c.beams, mode), want)


def test_kway_mode_runs_eagerly_and_equals_beam_search() -> None:
    cat = catalog_from_ads(make_ads(60, seed=4))
    index = build_arrays(cat, cat.sid.astype(np.int64), KwaySpec("static", (3, 2, 2, 1)))
    torch.manual_seed(0)
    decoder = SIDDecoder(CONFIG).eval()
    tables = GtmTables.from_arrays(index.trie, index.kway)
    offsets = torch.from_numpy(index.trie.level_offsets)
    engine = StaticBeamSearch(decoder, tables, offsets, batch_buckets=(4,))
    reqs, mode = requests(TARGETING[:3]), FilterMode.CD_GTM_KWAY
    want = BeamSearch(decoder, tables, offsets).run(ctx_for(3), reqs, (1, 4, 8, 6), mode)
    assert_same(engine.run(ctx_for(3), reqs, (1, 4, 8, 6), mode), want)


def test_bitmask_only_gtm_equals_beam_search_without_bloom_rows() -> None:
    ads = make_ads(80, seed=8)
    index, _, search = setup(ads)
    engine = engine_for(search, index, options=DecodeOptions(bloom=False))
    reqs = requests(TARGETING[:4])
    no_bloom = RequestTensors(reqs.bitmask, torch.zeros_like(reqs.blooms[:, :1]))  # all pass
    want = search.run(ctx_for(4), no_bloom, (1, 4, 9, 7), FilterMode.CD_GTM)
    assert_same(engine.run(ctx_for(4), reqs, (1, 4, 9, 7), FilterMode.CD_GTM), want)
    with_bloom = search.run(ctx_for(4), reqs, (1, 4, 9, 7), FilterMode.CD_GTM)
    assert not torch.equal(with_bloom.leaves, want.leaves)  # Bloom really prunes here


def test_dead_rows_are_parked_and_never_emitted() -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("US",)), Ad(2, (1, 1, 1, 1), countries=("CA",))]
    index, _, search = setup(ads)
    engine = engine_for(search, index)
    reqs = requests([Targeting("US"), Targeting("FR")])
    got = engine.run(ctx_for(2), reqs, (1, 4, 4, 4), FilterMode.CD_GTM)
    assert_same(got, search.run(ctx_for(2), reqs, (1, 4, 4, 4), FilterMode.CD_GTM))
    assert got.leaves[0].tolist() == [0, -1, -1, -1] and torch.isinf(got.scores[0, 1:]).all()
    assert (got.leaves[1] == -1).all() and torch.isinf(got.scores[1]).all()


def test_padding_rows_and_stale_buffers_never_reach_real_requests() -> None:
    """KV pools and padding inputs poisoned with NaN; a large batch, then a small one in
    the same bucket: the small one still equals the reference run on its own."""
    ads = make_ads(80, seed=6)
    index, _, search = setup(ads)
    engine = engine_for(search, index, batch_buckets=(8,))
    beams, mode = (1, 4, 8, 6), FilterMode.CD_GTM
    engine.warm(beams, modes=(mode,), locations=(8,))
    (plan,) = engine._plans.values()
    for buf in (plan.cache.k, plan.cache.v):
        buf.fill_(float("nan"))
    big = engine.run(ctx_for(7, seed=2), requests((TARGETING * 2)[:7]), beams, mode)
    assert_same(big, search.run(ctx_for(7, seed=2), requests((TARGETING * 2)[:7]), beams, mode))
    plan.ctx[2:] = float("nan")  # what padding requests hold is never read into real rows
    small = requests(TARGETING[2:4])
    got = engine.run(ctx_for(2), small, beams, mode)
    assert len(engine._plans) == 1  # the 7-batch and the 2-batch share one plan
    assert_same(got, search.run(ctx_for(2), small, beams, mode))


def test_without_mask_greedy_search_follows_the_argmax() -> None:
    """mask=False (benchmark ablation): beams (1, 1, 1, 1) are greedy decoding."""
    index, decoder, search = setup(make_ads(20))
    engine = engine_for(search, index, options=DecodeOptions(mask=False))
    ctx = ctx_for(2)
    got = engine.run(ctx, None, (1, 1, 1, 1), FilterMode.CD_ONLY)
    assert (got.leaves == -1).all()
    sids = got.sids[:, 0]  # [2, 4]
    with torch.no_grad():
        logp = torch.log_softmax(decoder.forward_train(ctx, sids), dim=-1)  # [2, 4, V]
    assert torch.equal(logp.argmax(-1), sids)
    want = logp.gather(2, sids[:, :, None]).sum(dim=(1, 2))
    torch.testing.assert_close(got.scores[:, 0], want, rtol=1e-5, atol=1e-5)


def test_warm_builds_every_plan_once() -> None:
    index, _, search = setup(make_ads(30))
    engine = engine_for(search, index, batch_buckets=(1, 2, 4), location_buckets=(1, 8))
    beams = (1, 3, 5, 4)
    assert engine.warm(beams) == 3 * (2 + 1)  # CD_GTM per location bucket, CD_ONLY once
    # largest bucket first: its shapes are the ones the shared tuning keys are tuned on
    assert [key[0] for key in engine._plans] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    engine.run(ctx_for(3), requests(TARGETING[:3]), beams, FilterMode.CD_GTM)
    engine.run(ctx_for(1), None, beams, FilterMode.CD_ONLY)
    assert len(engine._plans) == 9 and engine.graphs == 0  # CPU: eager, no graphs
    with pytest.raises(ValueError, match="largest bucket"):
        engine.run(ctx_for(5), requests((TARGETING * 2)[:5]), beams, FilterMode.CD_GTM)
    with pytest.raises(ValueError, match="needs encoded requests"):
        engine.run(ctx_for(1), None, beams, FilterMode.CD_GTM)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="self_attn"):
        DecodeOptions(self_attn="flash")
    with pytest.raises(ValueError, match="kv"):
        DecodeOptions(kv="ring")


# ------------------------------------------------------------------------------- GPU


def random_index(n_ads: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    locs = [f"US/R{i}" for i in range(40)]
    ads = [
        Ad(
            i,
            tuple(int(x) for x in rng.integers(0, tokens, 4)),  # type: ignore[arg-type]
            countries=("US",) if rng.random() < 0.5 else (),
            locations=tuple(rng.choice(locs, rng.integers(0, 3), replace=False)),
        )
        for i in range(n_ads)
    ]
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64)), locs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("advance", ["eager", "kernel", "compiled"])
def test_gpu_graph_equals_beam_search(advance: str) -> None:
    """fp32 on CUDA: the captured graph (padded bucket) returns the reference's result,
    with each step's bookkeeping as torch ops, as the Triton kernel (the default) or
    torch.compile'd (its Inductor kernels inside the graph)."""
    index, decoder, _ = setup(make_ads(200, seed=3))
    decoder = decoder.cuda()
    tables = GtmTables.from_arrays(index.trie, device="cuda")
    offsets = torch.from_numpy(index.trie.level_offsets)
    search = BeamSearch(decoder, tables, offsets)
    options = DecodeOptions(advance=advance)
    engine = StaticBeamSearch(
        decoder, tables, offsets, options=options, batch_buckets=GRAPH_BUCKETS
    )
    for b in (1, 5, 10, 13):  # the served buckets 2, 6 (one part), 10 and 14 (two parts)
        ctx = ctx_for(b).cuda()
        reqs = RequestTensors.from_encoded(encode_requests((TARGETING * 4)[:b]), "cuda")
        for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
            got = engine.run(ctx, reqs, (1, 8, 16, 12), mode)
            assert_same(got, search.run(ctx, reqs, (1, 8, 16, 12), mode))
    assert engine.graphs == 8


@pytest.mark.gpu
@gpu
def test_gpu_paper_profile_graph_equals_eager() -> None:
    """Paper shapes: B=16, (1, 512, 1024, 1024), bf16, 64 locations per request."""
    c = PROFILES["paper"]
    arrays, locs = random_index(20_000, 64)
    torch.manual_seed(0)
    decoder = SIDDecoder(c).to("cuda", torch.bfloat16).eval()
    tables = GtmTables.from_arrays(arrays.trie, device="cuda")
    offsets = torch.from_numpy(arrays.trie.level_offsets)
    graph = StaticBeamSearch(decoder, tables, offsets)
    eager = StaticBeamSearch(decoder, tables, offsets, options=DecodeOptions(cuda_graph=False))
    rng = np.random.default_rng(1)
    ts = [
        Targeting("US", 30, "", tuple(locs[:1]) + tuple(f"XX/{i}/{j}" for j in range(63)))
        for i in range(int(rng.integers(10, 16)))
    ]
    reqs = RequestTensors.from_encoded(encode_requests(ts), "cuda")
    ctx = torch.randn(len(ts), c.t_ctx, c.d_model, device="cuda", dtype=torch.bfloat16)
    for b in (len(ts), 3):  # a full-ish bucket, then a padded one on the same graph
        sub = RequestTensors(reqs.bitmask[:b], reqs.blooms[:b])
        want = eager.run(ctx[:b], sub, c.beams, FilterMode.CD_GTM)
        got = graph.run(ctx[:b], sub, c.beams, FilterMode.CD_GTM)
        assert_same(got, want)
        assert (want.leaves >= 0).any()
    assert graph.graphs == 2  # buckets 16 and 4


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize(
    ("bucket", "batch"),
    [(2, 1), (6, 5), (8, 3), (8, 5), (8, 8), (10, 7), (12, 9), (12, 12), (14, 13)],
)
def test_parts_on_their_own_streams_equal_beam_search(
    streams: int, bucket: int, batch: int
) -> None:
    """The server's buckets (every even size up to 16, not all powers of two) split into
    `streams` parts when the bucket is large enough and divides evenly (decoded one after
    another on CPU, on parallel streams in one graph on CUDA): a part may be partly or
    wholly padding."""
    index, _, search = setup(make_ads(120, seed=9), seed=3)
    options = DecodeOptions(streams=streams)
    engine = engine_for(search, index, options=options, batch_buckets=(bucket,))
    targeting = (TARGETING * 3)[:batch]
    ctx, reqs, beams = ctx_for(batch, seed=6), requests(targeting), (1, 4, 8, 6)
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        assert_same(engine.run(ctx, reqs, beams, mode), search.run(ctx, reqs, beams, mode))
    plans = list(engine._plans.values())
    split = streams > 1 and bucket >= SPLIT_MIN_BUCKET and bucket % streams == 0
    assert all(len(p.parts) == (streams if split else 0) for p in plans)


@pytest.mark.parametrize("fixed_beams", [False, True])
@pytest.mark.parametrize("advance", ["kernel-interpreted", "compiled"])
def test_bookkeeping_variants_equal_beam_search(
    advance: str, fixed_beams: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's bookkeeping after top-k as the Triton kernel (run by the interpreter in
    place of the CPU dispatch) or through torch.compile (Inductor's CPU backend; one
    dynamic-shape function for every bucket and step): the reference's SIDs, also where
    slots past M_{t+1} are killed (fixed beams), for a full and a padded bucket."""
    if advance == "kernel-interpreted":
        monkeypatch.setattr(static_engine, "beam_advance", triton_beam_advance)
    index, _, search = setup(make_ads(120, seed=5), seed=2)
    options = DecodeOptions(advance=advance.removesuffix("-interpreted"), fixed_beams=fixed_beams)
    engine = engine_for(search, index, options=options, batch_buckets=(2, 4))
    assert engine._advance not in (beam_advance, beam_advance_reference)  # the variant runs
    beams = (1, 6, 12, 9)
    for batch in (4, 3, 2):
        ctx, reqs = ctx_for(batch, seed=batch), requests((TARGETING * 2)[:batch])
        for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
            want = search.run(ctx, reqs, beams, mode)
            got = engine.run(ctx, reqs, beams, mode)
            if fixed_beams:
                got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
            assert_same(got, want)
            assert (want.leaves >= 0).any()


def test_bookkeeping_without_a_mask_is_the_same_in_every_variant() -> None:
    """The latency ablation without CD/GTM (no child nodes): every bookkeeping variant
    picks the same tokens and scores."""
    index, _, search = setup(make_ads(120, seed=5), seed=2)
    ctx, reqs, beams = ctx_for(3, seed=1), requests(TARGETING[:3]), (1, 6, 12, 9)
    engines = [
        engine_for(search, index, options=DecodeOptions(mask=False, advance=a), batch_buckets=(4,))
        for a in ("eager", "kernel", "compiled")
    ]
    runs = [e.run(ctx, reqs, beams, FilterMode.CD_ONLY) for e in engines]
    for run in runs[1:]:
        assert torch.equal(runs[0].sids, run.sids)
        assert torch.equal(runs[0].scores, run.scores)
        assert (run.leaves == -1).all()


def test_unknown_bookkeeping_is_refused() -> None:
    with pytest.raises(ValueError, match="advance"):
        DecodeOptions(advance="fast")


def test_streams_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="streams"):
        DecodeOptions(streams=0)


@pytest.mark.parametrize("fixed_beams", [False, True])
def test_intermediate_beam_order_does_not_change_the_result(monkeypatch, fixed_beams) -> None:
    """Top-k may skip its sort before the last step: with the kept beams of every
    intermediate step shuffled within each request, the SIDs are still the reference's
    (with fixed beams the steps that kill slots past M_{t+1} keep their sort)."""
    gen = torch.Generator().manual_seed(0)
    shuffled = []

    def shuffling_top_k(cand, keep, ordered=True):
        top, flat = top_k(cand, keep, ordered)
        if ordered:
            return top, flat
        perm = torch.stack([torch.randperm(keep, generator=gen) for _ in range(cand.shape[0])])
        shuffled.append(True)
        return top.gather(1, perm), flat.gather(1, perm)

    monkeypatch.setattr(static_engine, "top_k", shuffling_top_k)
    index, _, search = setup(make_ads(120, seed=4))
    options = DecodeOptions(fixed_beams=fixed_beams)
    engine = engine_for(search, index, options=options, batch_buckets=(4,))
    ctx, reqs = ctx_for(3, seed=2), requests(TARGETING[:3])
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = search.run(ctx, reqs, (1, 6, 12, 9), mode)
        got = engine.run(ctx, reqs, (1, 6, 12, 9), mode)
        if fixed_beams:
            got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
        assert_same(got, want)
    # every intermediate step was shuffled, except (fixed beams) the ones that cut slots:
    # widths 12 everywhere: t = 0 (M_1 = 6) and t = 2 (M_3 = 9) keep the sort
    assert len(shuffled) == 2 * (1 if fixed_beams else 3)
