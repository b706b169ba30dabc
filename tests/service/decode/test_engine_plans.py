"""The served decode engine's plans (`DecodeEngine.plan/warm/run`, `IndexPlans`) against the
reference search (same `DecodeResult`): batch buckets and padding, location buckets,
stream parts, warm-up, stale buffers, the bookkeeping kernel, unsorted intermediate top-k,
k-way, and (GPU) the captured CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.tensors import GtmTables, RequestTensors
from index_builder.build import build_arrays
from index_builder.kway import KwaySpec
from kernels._triton_beam_advance import triton_beam_advance
from service.beam_ladder import default_rungs
from service.decode import engine as engine_module
from service.decode.engine import SPLIT_MIN_BUCKET, DecodeEngine
from service.model.config import PROFILES
from service.model.decoder import SIDDecoder
from service.model.precision import quantize_decoder
from service.pipeline.stages import GRAPH_BUCKETS
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.indexes import small_index
from tests.helpers.oracle import Ad
from tests.helpers.reference_search import ReferenceBeamSearch
from tests.service.decode.cases import (
    CONFIG,
    TARGETING,
    assert_same,
    check_served_buckets_on_gpu,
    ctx_for,
    make_ads,
    requests,
    setup,
    shuffling_topk,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("mode", [FilterMode.CD_ONLY, FilterMode.CD_GTM])
@pytest.mark.parametrize("beams", [(1, 3, 7, 5), (1, 4, 8, 8), (1, 16, 40, 64), (1, 2, 2, 1)])
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_equals_the_reference(mode: FilterMode, beams: tuple[int, ...], batch: int) -> None:
    """Padded into a bucket of 4; (1, 16, 40, 64) is wider than the catalog: rows die."""
    case = setup(make_ads(80, seed=5))
    served = case.served(batch_buckets=(4,))
    ctx, reqs = ctx_for(batch), requests(TARGETING[:batch])
    want = case.reference.run(ctx, reqs, beams, mode)
    assert_same(served.run(ctx, reqs, beams, mode), want)
    if beams[-1] > 8:
        assert (want.leaves == -1).any()  # the schedule really has dead slots


def test_tiny_profile_on_the_small_test_index() -> None:
    """The real tiny profile and its default schedule (1, 64, 128, 128) over a 50-ad index:
    most beams die, none is emitted, and the live ones match the reference."""
    arrays = small_index(50)
    torch.manual_seed(0)
    decoder = SIDDecoder(PROFILES["tiny"]).eval()
    tables = GtmTables.from_arrays(arrays.trie)
    offsets = torch.from_numpy(arrays.trie.level_offsets)
    search = ReferenceBeamSearch(decoder, tables, offsets)
    engine = DecodeEngine(decoder, batch_buckets=(4,))
    plans = engine.plan(tables, offsets)
    c = PROFILES["tiny"]
    ctx = torch.randn(3, c.t_ctx, c.d_model, generator=torch.Generator().manual_seed(3))
    ts = [Targeting("US", locations=("US/R1",)), Targeting("CA"), Targeting()]
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = search.run(ctx, requests(ts), c.beams, mode)
        assert (want.leaves == -1).any()
        assert_same(engine.run(plans, ctx, requests(ts), c.beams, mode), want)


def test_kway_mode_runs_eagerly_and_equals_the_reference() -> None:
    case = setup(make_ads(60, seed=4), kway=KwaySpec("static", (3, 2, 2, 1)))
    assert case.tables.kway_offsets is not None
    served = case.served(batch_buckets=(4,))
    reqs, mode = requests(TARGETING[:3]), FilterMode.CD_GTM_KWAY
    want = case.reference.run(ctx_for(3), reqs, (1, 4, 8, 6), mode)
    assert_same(served.run(ctx_for(3), reqs, (1, 4, 8, 6), mode), want)
    assert served.plans.graphs == 0


def test_dead_rows_are_parked_and_never_emitted() -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("US",)), Ad(2, (1, 1, 1, 1), countries=("CA",))]
    case = setup(ads)
    served = case.served()
    reqs = requests([Targeting("US"), Targeting("FR")])
    got = served.run(ctx_for(2), reqs, (1, 4, 4, 4), FilterMode.CD_GTM)
    assert_same(got, case.reference.run(ctx_for(2), reqs, (1, 4, 4, 4), FilterMode.CD_GTM))
    assert got.leaves[0].tolist() == [0, -1, -1, -1] and torch.isinf(got.scores[0, 1:]).all()
    assert (got.leaves[1] == -1).all() and torch.isinf(got.scores[1]).all()


def test_padding_rows_and_stale_buffers_never_reach_real_requests() -> None:
    """KV pools and padding inputs poisoned with NaN; a large batch, then a small one in
    the same bucket: the small one still equals the reference run on its own."""
    case = setup(make_ads(80, seed=6))
    engine = DecodeEngine(case.decoder, batch_buckets=(8,))
    plans = engine.plan(case.tables, case.level_offsets)
    beams, mode = (1, 4, 8, 6), FilterMode.CD_GTM
    assert engine.warm(plans, beams, modes=(mode,), locations=(8,)) == 1
    (plan,) = plans.plans.values()
    for buf in (plan.cache.k, plan.cache.v):
        buf.fill_(float("nan"))
    big_ctx, big_reqs = ctx_for(7, seed=2), requests((TARGETING * 2)[:7])
    big = engine.run(plans, big_ctx, big_reqs, beams, mode)
    assert_same(big, case.reference.run(big_ctx, big_reqs, beams, mode))
    plan.ctx[2:] = float("nan")  # what padding requests hold is never read into real rows
    small = requests(TARGETING[2:4])
    got = engine.run(plans, ctx_for(2), small, beams, mode)
    assert len(plans.plans) == 1  # the 7-batch and the 2-batch share one plan
    assert_same(got, case.reference.run(ctx_for(2), small, beams, mode))


def test_padding_locations_repeat_location_zero() -> None:
    """A request with fewer locations than its bucket holds: the bucket's spare Bloom rows
    repeat location 0 (ANY-of-many unchanged), even after a run that filled them all."""
    case = setup(make_ads(80, seed=3))
    served = case.served(batch_buckets=(2,), location_buckets=(8,))
    beams, mode = (1, 4, 8, 6), FilterMode.CD_GTM
    many = [Targeting("GB", 50, "male", (*(f"XX/{i}" for i in range(7)), "GB/R3"))] * 2
    few = [Targeting("US", 30, "female", ("US/R1",)), Targeting("FR", 16, "", ("CA/R2",))]
    for ts in (many, few):
        reqs = requests(ts)
        assert_same(served.run(ctx_for(2), reqs, beams, mode),
                    case.reference.run(ctx_for(2), reqs, beams, mode))  # fmt: skip
    assert len(served.plans.plans) == 1
    # more rows than the largest bucket (a schema's set attribute of more values than the
    # default's locations): a plan of the power of two holding them, answering the same
    wide = requests([Targeting(locations=tuple("abcdefghi"))] * 2)
    assert_same(served.run(ctx_for(2), wide, beams, mode),
                case.reference.run(ctx_for(2), wide, beams, mode))  # fmt: skip
    assert sorted(key[3] for key in served.plans.plans) == [8, 16]
    # each request's own row count reaches the plan: the mask reads no padding row
    served.run(ctx_for(2), requests(few), beams, mode)
    (plan,) = (p for k, p in served.plans.plans.items() if k[3] == 8)
    assert plan.requests.n_blooms[:2, 0].tolist() == [1, 1]


def test_warm_builds_every_plan_once() -> None:
    case = setup(make_ads(30))
    engine = DecodeEngine(case.decoder, batch_buckets=(1, 2, 4), location_buckets=(1, 8))
    plans = engine.plan(case.tables, case.level_offsets)
    beams = (1, 3, 5, 4)
    assert engine.warm(plans, beams) == 3 * (2 + 1)  # CD_GTM per location bucket, CD_ONLY once
    # largest bucket first: its shapes are the ones the shared tuning keys are tuned on
    assert [key[0] for key in plans.plans] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert engine.bucket(3) == 4 and engine.bucket(1) == 1
    engine.run(plans, ctx_for(3), requests(TARGETING[:3]), beams, FilterMode.CD_GTM)
    engine.run(plans, ctx_for(1), None, beams, FilterMode.CD_ONLY)
    assert len(plans.plans) == 9 and plans.graphs == 0  # CPU: eager, no graphs
    assert engine.warm(plans, beams) == 9  # warming again builds nothing new
    with pytest.raises(ValueError, match="largest bucket"):
        engine.run(plans, ctx_for(5), requests((TARGETING * 2)[:5]), beams, FilterMode.CD_GTM)
    with pytest.raises(ValueError, match="needs encoded requests"):
        engine.run(plans, ctx_for(1), None, beams, FilterMode.CD_GTM)


def test_plans_are_per_index_version() -> None:
    """One engine, two indexes: each version's plans decode against its own tables."""
    a, b = setup(make_ads(80, seed=1)), setup(make_ads(80, seed=2))
    engine = DecodeEngine(a.decoder, batch_buckets=(4,))
    plans_a = engine.plan(a.tables, a.level_offsets)
    plans_b = engine.plan(b.tables, b.level_offsets)
    ctx, reqs, beams = ctx_for(3), requests(TARGETING[:3]), (1, 4, 8, 6)
    ref_b = ReferenceBeamSearch(a.decoder, b.tables, b.level_offsets)
    for _ in range(2):  # interleaved
        assert_same(engine.run(plans_a, ctx, reqs, beams), a.reference.run(ctx, reqs, beams))
        assert_same(engine.run(plans_b, ctx, reqs, beams), ref_b.run(ctx, reqs, beams))
    assert len(plans_a.plans) == len(plans_b.plans) == 1


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize(
    ("bucket", "batch"),
    [(2, 1), (6, 5), (8, 3), (8, 5), (8, 8), (10, 7), (12, 9), (12, 12), (14, 13)],
)
def test_parts_on_their_own_streams_equal_the_reference(
    streams: int, bucket: int, batch: int
) -> None:
    """The server's buckets (every even size up to 16, not all powers of two) split into
    `streams` parts when the bucket is large enough and divides evenly (decoded one after
    another on CPU, on parallel streams in one graph on CUDA): a part may be partly or
    wholly padding."""
    case = setup(make_ads(120, seed=9), seed=3)
    served = case.served(batch_buckets=(bucket,), streams=streams)
    targeting = (TARGETING * 3)[:batch]
    ctx, reqs, beams = ctx_for(batch, seed=6), requests(targeting), (1, 4, 8, 6)
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        assert_same(served.run(ctx, reqs, beams, mode), case.reference.run(ctx, reqs, beams, mode))
    plans = list(served.plans.plans.values())
    split = streams > 1 and bucket >= SPLIT_MIN_BUCKET and bucket % streams == 0
    assert all(len(p.parts) == (streams if split else 0) for p in plans)


def test_streams_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="streams"):
        DecodeEngine(SIDDecoder(CONFIG), streams=0)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the interpreter's run on CPU tensors; on a GPU the served engine's GPU tests run it",
)
def test_triton_bookkeeping_kernel_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's bookkeeping after top-k as the Triton kernel (run by the interpreter in
    place of the CPU dispatch): the reference's SIDs for a full and a padded bucket."""
    case = setup(make_ads(120, seed=5), seed=2)
    served = case.served(batch_buckets=(2, 4))
    calls: list[int] = []

    def kernel(*args):  # the interpreter's kernel where the CPU dispatch takes the reference
        calls.append(1)
        return triton_beam_advance(*args)

    monkeypatch.setattr(engine_module, "beam_advance", kernel)
    beams = (1, 6, 12, 9)
    for batch in (4, 3, 2):
        ctx, reqs = ctx_for(batch, seed=batch), requests((TARGETING * 2)[:batch])
        for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
            want = case.reference.run(ctx, reqs, beams, mode)
            assert_same(served.run(ctx, reqs, beams, mode), want)
            assert (want.leaves >= 0).any()
    assert calls  # it ran


def test_intermediate_beam_order_does_not_change_the_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Top-k may skip its sort before the last step: with the kept beams of every
    intermediate step shuffled within each request, the SIDs are still the reference's
    (the reference sorts every step: it is never shuffled)."""
    case = setup(make_ads(120, seed=4))
    served = case.served(batch_buckets=(4,))
    ctx, reqs = ctx_for(3, seed=2), requests(TARGETING[:3])
    shuffled = shuffling_topk(monkeypatch)
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = case.reference.run(ctx, reqs, (1, 6, 12, 9), mode)
        assert_same(served.run(ctx, reqs, (1, 6, 12, 9), mode), want)
    assert len(shuffled) == 2 * 3  # every intermediate step of both runs was shuffled


def test_concurrent_runs_on_one_index_are_serialised() -> None:
    """Threads sharing one engine and one index's plans (shared static buffers) each get
    their own batch's answer."""
    import threading

    case = setup(make_ads(80, seed=7))
    served = case.served(batch_buckets=(4,))
    beams = (1, 4, 8, 6)
    batches = [(ctx_for(n, seed=n), requests((TARGETING * 2)[n : 2 * n])) for n in (1, 2, 3, 4)]
    want = [case.reference.run(ctx, reqs, beams) for ctx, reqs in batches]
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            got[i] = [served.run(*batches[i], beams) for _ in range(3)]
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, w in enumerate(want):
        for g in got[i]:
            assert_same(g, w)


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
def test_gpu_graph_equals_the_reference() -> None:
    """fp32 on CUDA: the captured graph (padded bucket) returns the reference's result,
    with each step's bookkeeping as the Triton kernel."""
    check_served_buckets_on_gpu(lambda decoder: DecodeEngine(decoder, batch_buckets=GRAPH_BUCKETS))


@pytest.mark.gpu
@gpu
def test_gpu_paper_profile_graph_equals_eager() -> None:
    """Paper shapes: B=16, (1, 512, 1024, 1024), bf16, 64 locations per request; the graph
    replays what the same engine computes uncaptured."""
    c = PROFILES["paper"]
    arrays, locs = random_index(20_000, 64)
    torch.manual_seed(0)
    decoder = SIDDecoder(c).to("cuda", torch.bfloat16).eval()
    tables = GtmTables.from_arrays(arrays.trie, device="cuda")
    offsets = torch.from_numpy(arrays.trie.level_offsets)
    graph = DecodeEngine(decoder)
    eager = DecodeEngine(decoder)
    eager.cuda_graphs = False
    graph_plans, eager_plans = graph.plan(tables, offsets), eager.plan(tables, offsets)
    rng = np.random.default_rng(1)
    ts = [
        Targeting("US", 30, "", tuple(locs[:1]) + tuple(f"XX/{i}/{j}" for j in range(63)))
        for i in range(int(rng.integers(10, 16)))
    ]
    reqs = requests(ts, "cuda")
    ctx = torch.randn(len(ts), c.t_ctx, c.d_model, device="cuda", dtype=torch.bfloat16)
    for b in (len(ts), 3):  # a full-ish bucket, then a padded one on the same graph
        sub = RequestTensors(reqs.bitmask[:b], reqs.blooms[:b])
        want = eager.run(eager_plans, ctx[:b], sub, c.beams, FilterMode.CD_GTM)
        got = graph.run(graph_plans, ctx[:b], sub, c.beams, FilterMode.CD_GTM)
        assert_same(got, want)
        assert (want.leaves >= 0).any()
    assert graph_plans.graphs == 2 and eager_plans.graphs == 0  # buckets 16 and 4


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_every_rung_of_the_beam_ladder_graph_equals_eager(fp8: bool) -> None:
    """Paper shapes, bf16 and FP8: each rung of the default ladder (service/beam_ladder.py:
    the paper's beams, halved, quartered) replays as a captured graph what the same engine
    computes uncaptured, on one set of plans holding all of them."""
    c = PROFILES["paper"]
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8")
    arrays, locs = random_index(20_000, 64)
    torch.manual_seed(0)
    decoder = SIDDecoder(c).to("cuda", torch.bfloat16).eval()
    if fp8:
        quantize_decoder(decoder)
    tables = GtmTables.from_arrays(arrays.trie, device="cuda")
    offsets = torch.from_numpy(arrays.trie.level_offsets)
    graph, eager = DecodeEngine(decoder), DecodeEngine(decoder)
    eager.cuda_graphs = False
    graph_plans, eager_plans = graph.plan(tables, offsets), eager.plan(tables, offsets)
    ts = [Targeting("US", 30, "", (locs[i % 40],)) for i in range(12)]
    reqs = requests(ts, "cuda")
    ctx = torch.randn(len(ts), c.t_ctx, c.d_model, device="cuda", dtype=torch.bfloat16)
    rungs = default_rungs(c.beams)
    assert len(set(rungs)) == 3 and rungs[0] == tuple(c.beams)
    for schedule in rungs:
        want = eager.run(eager_plans, ctx, reqs, schedule, FilterMode.CD_GTM)
        got = graph.run(graph_plans, ctx, reqs, schedule, FilterMode.CD_GTM)
        assert_same(got, want)
        assert (want.leaves >= 0).sum(dim=1).max() <= schedule[-1]
    assert graph_plans.graphs == len(rungs) and eager_plans.graphs == 0


@pytest.mark.gpu
@gpu
def test_gpu_warm_captures_every_plan() -> None:
    case = setup(make_ads(200, seed=1))
    decoder = case.decoder.cuda()
    tables = GtmTables.from_arrays(case.index.trie, device="cuda")
    engine = DecodeEngine(decoder, batch_buckets=(2, 8), location_buckets=(1, 16))
    plans = engine.plan(tables, case.level_offsets)
    assert engine.warm(plans, (1, 4, 8, 6)) == 2 * 3
    assert plans.graphs == 6
    search = ReferenceBeamSearch(decoder, tables, case.level_offsets)
    ctx, reqs = ctx_for(7).cuda(), requests((TARGETING * 2)[:7], "cuda")
    got = engine.run(plans, ctx, reqs, (1, 4, 8, 6), FilterMode.CD_GTM)
    assert_same(got, search.run(ctx, reqs, (1, 4, 8, 6), FilterMode.CD_GTM))
    assert plans.graphs == 6  # nothing new captured
