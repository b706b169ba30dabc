"""The decode ladder's variants (`bench.baselines.decode_variants`: `DecodeOptions` switches
through `VariantEngine`) search what the served engine searches: each switch keeps the
reference's SIDs, except the ones that change the search on purpose (no mask, no Bloom),
which are checked against what they should compute instead."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bench.baselines.gelu_linear as gelu_linear_baseline
from bench.baselines.decode_variants import (
    DecodeOptions,
    LayerByLayerStep,
    VariantEngine,
    VariantStep,
)
from contracts.request import FilterMode
from contracts.tensors import GtmTables, RequestTensors
from kernels._triton_beam_advance import triton_beam_advance
from kernels.beam_advance import beam_advance, beam_advance_reference
from service.decode.engine import DecodeEngine
from service.model.decoder import SIDDecoder
from service.pipeline.stages import GRAPH_BUCKETS
from tests.service.decode.cases import (
    CONFIG,
    TARGETING,
    WIDE,
    assert_same,
    check_served_buckets_on_gpu,
    ctx_for,
    decoder_with_biases,
    make_ads,
    requests,
    run_steps,
    setup,
    shuffling_topk,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("cross", ["beam_as_query", "per_beam"])
@pytest.mark.parametrize("self_attn", ["fused", "gather", "sdpa"])
@pytest.mark.parametrize("kv", ["paged", "dense"])
@pytest.mark.parametrize("fixed_beams", [False, True])
@pytest.mark.parametrize("fused_tail", [False, True])
def test_ablation_switches_do_not_change_the_result(
    cross: str, self_attn: str, kv: str, fixed_beams: bool, fused_tail: bool
) -> None:
    case = setup(make_ads(80, seed=7), seed=2)
    options = DecodeOptions(
        cross=cross, self_attn=self_attn, kv=kv, fixed_beams=fixed_beams, fused_tail=fused_tail
    )
    engine = case.served(VariantEngine, options, batch_buckets=(2, 4))
    ctx, reqs, beams = ctx_for(3, seed=4), requests(TARGETING[:3]), (1, 5, 9, 6)
    want = case.reference.run(ctx, reqs, beams, FilterMode.CD_GTM)
    got = engine.run(ctx, reqs, beams, FilterMode.CD_GTM)
    if fixed_beams:  # every step computes max(beams) rows; the search is the same
        assert got.rows_per_step == (3 * 9,) * 4
        got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
    assert_same(got, want)


def test_default_options_are_the_served_engine() -> None:
    case = setup(make_ads(80, seed=7), seed=2)
    served, variant = case.served(batch_buckets=(4,)), case.served(VariantEngine, None,
                                                                   batch_buckets=(4,))  # fmt: skip
    assert variant.engine.options == DecodeOptions()
    ctx, reqs, beams = ctx_for(3, seed=4), requests(TARGETING[:3]), (1, 5, 9, 6)
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        got, want = variant.run(ctx, reqs, beams, mode), served.run(ctx, reqs, beams, mode)
        assert torch.equal(got.sids, want.sids) and torch.equal(got.leaves, want.leaves)
        assert torch.equal(got.scores, want.scores)


def test_bitmask_only_gtm_equals_the_reference_without_bloom_rows() -> None:
    case = setup(make_ads(80, seed=8))
    engine = case.served(VariantEngine, DecodeOptions(bloom=False))
    reqs = requests(TARGETING[:4])
    no_bloom = RequestTensors(reqs.bitmask, torch.zeros_like(reqs.blooms[:, :1]))  # all pass
    want = case.reference.run(ctx_for(4), no_bloom, (1, 4, 9, 7), FilterMode.CD_GTM)
    assert_same(engine.run(ctx_for(4), reqs, (1, 4, 9, 7), FilterMode.CD_GTM), want)
    with_bloom = case.reference.run(ctx_for(4), reqs, (1, 4, 9, 7), FilterMode.CD_GTM)
    assert not torch.equal(with_bloom.leaves, want.leaves)  # Bloom really prunes here


def test_without_mask_greedy_search_follows_the_argmax() -> None:
    """mask=False (benchmark ablation): beams (1, 1, 1, 1) are greedy decoding."""
    case = setup(make_ads(20))
    engine = case.served(VariantEngine, DecodeOptions(mask=False))
    ctx = ctx_for(2)
    got = engine.run(ctx, None, (1, 1, 1, 1), FilterMode.CD_ONLY)
    assert (got.leaves == -1).all()
    sids = got.sids[:, 0]  # [2, 4]
    with torch.no_grad():
        logp = torch.log_softmax(case.decoder.forward_train(ctx, sids), dim=-1)  # [2, 4, V]
    assert torch.equal(logp.argmax(-1), sids)
    want = logp.gather(2, sids[:, :, None]).sum(dim=(1, 2))
    torch.testing.assert_close(got.scores[:, 0], want, rtol=1e-5, atol=1e-5)


def test_bad_options_are_refused() -> None:
    for name, value in (
        ("self_attn", "flash"),
        ("kv", "ring"),
        ("cross", "ring"),
        ("ffn_up", "cutlass"),
        ("advance", "fast"),
    ):
        with pytest.raises(ValueError, match=name):
            DecodeOptions(**{name: value})


def test_streams_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="streams"):
        VariantEngine(SIDDecoder(CONFIG), DecodeOptions(streams=0))


@pytest.mark.parametrize(
    ("advance", "fixed_beams"),
    [("kernel-interpreted", True), ("compiled", False), ("compiled", True), ("eager", True)],
)
def test_bookkeeping_variants_equal_the_reference(
    advance: str, fixed_beams: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's bookkeeping after top-k as the Triton kernel (run by the interpreter in
    place of the CPU dispatch), through torch.compile (Inductor's CPU backend; one
    dynamic-shape function for every bucket and step) or as the eager reference: the
    reference's SIDs, also where slots past M_{t+1} are killed (fixed beams), for a full
    and a padded bucket. (The served engine with the kernel: test_engine_plans.py.)"""
    case = setup(make_ads(120, seed=5), seed=2)
    options = DecodeOptions(advance=advance.removesuffix("-interpreted"), fixed_beams=fixed_beams)
    engine = case.served(VariantEngine, options, batch_buckets=(2, 4))
    if advance == "kernel-interpreted":
        monkeypatch.setattr(engine.engine, "advance", triton_beam_advance)
    if advance == "eager":
        assert engine.engine.advance is beam_advance_reference
    else:
        assert engine.engine.advance not in (beam_advance, beam_advance_reference)
    beams = (1, 6, 12, 9)
    for batch in (4, 3, 2):
        ctx, reqs = ctx_for(batch, seed=batch), requests((TARGETING * 2)[:batch])
        for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
            want = case.reference.run(ctx, reqs, beams, mode)
            got = engine.run(ctx, reqs, beams, mode)
            if fixed_beams:
                got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
            assert_same(got, want)
            assert (want.leaves >= 0).any()


def test_bookkeeping_without_a_mask_is_the_same_in_every_variant() -> None:
    """The latency ablation without CD/GTM (no child nodes): every bookkeeping variant
    picks the same tokens and scores."""
    case = setup(make_ads(120, seed=5), seed=2)
    ctx, reqs, beams = ctx_for(3, seed=1), requests(TARGETING[:3]), (1, 6, 12, 9)
    engines = [
        case.served(VariantEngine, DecodeOptions(mask=False, advance=a), batch_buckets=(4,))
        for a in ("eager", "kernel", "compiled")
    ]
    runs = [e.run(ctx, reqs, beams, FilterMode.CD_ONLY) for e in engines]
    for run in runs[1:]:
        assert torch.equal(runs[0].sids, run.sids)
        assert torch.equal(runs[0].scores, run.scores)
        assert (run.leaves == -1).all()


def test_intermediate_beam_order_with_fixed_beams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed beams: with the kept beams of every unsorted intermediate step shuffled within
    each request, the SIDs are still the reference's, and the steps that kill slots past
    M_{t+1} keep their sort (widths 12 everywhere: t = 0 (M_1 = 6) and t = 2 (M_3 = 9))."""
    case = setup(make_ads(120, seed=4))
    engine = case.served(VariantEngine, DecodeOptions(fixed_beams=True), batch_buckets=(4,))
    ctx, reqs = ctx_for(3, seed=2), requests(TARGETING[:3])
    shuffled = shuffling_topk(monkeypatch)
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = case.reference.run(ctx, reqs, (1, 6, 12, 9), mode)
        got = engine.run(ctx, reqs, (1, 6, 12, 9), mode)
        assert_same(dataclasses.replace(got, rows_per_step=want.rows_per_step), want)
    assert len(shuffled) == 2 * 1


def test_engine_result_is_the_same_with_and_without_fused_layers() -> None:
    case = setup(make_ads(80, seed=11), seed=4)
    ctx, reqs, beams = ctx_for(3, seed=2), requests(TARGETING[:3]), (1, 5, 9, 6)
    want = case.reference.run(ctx, reqs, beams, FilterMode.CD_GTM)
    for fused in (True, False):
        engine = case.served(VariantEngine, DecodeOptions(fused_layers=fused))
        step_cls = VariantStep if fused else LayerByLayerStep
        assert type(engine.engine.step) is step_cls
        assert_same(engine.run(ctx, reqs, beams, FilterMode.CD_GTM), want)


def test_triton_up_projection_equals_teacher_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ffn_up="triton"`: the up-projection + GELU goes through the persistent Triton GEMM
    (on CPU under the interpreter, bf16 as served; the epilogue switch forced on, as CUDA
    sets it) and the logits stay the decoder's (and the layer-by-layer step's)."""
    config = dataclasses.replace(CONFIG, decoder_layers=2)
    decoder = decoder_with_biases(config).to(torch.bfloat16)
    step = VariantStep(decoder, DecodeOptions(ffn_up="triton"))
    step.gelu_epilogue = True  # CPU leaves it off: cuBLASLt exists only on CUDA
    calls = []
    real = gelu_linear_baseline.triton_gelu_linear
    monkeypatch.setattr(
        gelu_linear_baseline, "triton_gelu_linear", lambda *a: calls.append(1) or real(*a)
    )
    got, want = run_steps(decoder, step, 2, (1, 4, 4, 3), torch.bfloat16, "cpu")
    assert len(calls) == 4 * config.decoder_layers  # every layer of every step
    textbook, _ = run_steps(
        decoder, LayerByLayerStep(decoder, DecodeOptions()), 2, (1, 4, 4, 3), torch.bfloat16, "cpu"
    )
    for g, w, b in zip(got, want, textbook, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=1e-1)
        torch.testing.assert_close(g.float(), b.float(), rtol=5e-2, atol=1e-1)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("advance", ["eager", "compiled"])
def test_gpu_graph_bookkeeping_variants_equal_the_reference(advance: str) -> None:
    """fp32 on CUDA: the captured graph with each step's bookkeeping as torch ops or
    torch.compile'd (its Inductor kernels inside the graph) returns the reference's
    result. (The served kernel: test_engine_plans.py.)"""
    check_served_buckets_on_gpu(
        lambda decoder: VariantEngine(
            decoder, DecodeOptions(advance=advance), batch_buckets=GRAPH_BUCKETS
        )
    )


@pytest.mark.gpu
@gpu
def test_gpu_uncaptured_variant_equals_the_served_graph() -> None:
    """`cuda_graph=False` runs the served plans eagerly: the graph's result."""
    case = setup(make_ads(200, seed=2))
    decoder = case.decoder.cuda()
    tables = GtmTables.from_arrays(case.index.trie, device="cuda")
    graph = DecodeEngine(decoder, batch_buckets=(4,))
    eager = VariantEngine(decoder, DecodeOptions(cuda_graph=False), batch_buckets=(4,))
    gp, ep = graph.plan(tables, case.level_offsets), eager.plan(tables, case.level_offsets)
    ctx, reqs = ctx_for(3).cuda(), requests(TARGETING[:3], "cuda")
    for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
        want = eager.run(ep, ctx, reqs, (1, 8, 16, 12), mode)
        assert_same(graph.run(gp, ctx, reqs, (1, 8, 16, 12), mode), want)
    assert gp.graphs == 2 and ep.graphs == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_up_projection_equals_teacher_forcing(dtype: torch.dtype) -> None:
    """On CUDA with the Triton GEMM for the up-projection (bf16; fp32 falls back to the
    served dispatcher)."""
    from service.model.config import PROFILES

    config = dataclasses.replace(PROFILES["tiny"], decoder_layers=3)
    decoder = decoder_with_biases(config, "cuda").to(dtype)
    step = VariantStep(decoder, DecodeOptions(ffn_up="triton"))
    assert step.gelu_epilogue
    got, want = run_steps(decoder, step, 4, (1, 16, 32, 32), dtype, "cuda")
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("ffn", ["rowwise", "triton_down", "promoted", "pointer_up"])
def test_the_other_fp8_ffns_search_like_the_served_fp8_engine(ffn: str) -> None:
    """`fp8_ffn="rowwise"` (the FFN served before the 1 x 128 one: rowwise GEMMs, a
    per-row quantised GELU between), `triton_down` (the down GEMM in Triton) and
    `promoted` (the up GEMM's K steps added in fp32) and `pointer_up` (the up GEMM one
    program per tile, not persistent), at d_model 128 and d_ff 256 (two
    scale blocks), in a search wide enough to keep every prefix: the served FP8 engine's
    SIDs, with scores close to its own (rowwise: not equal, its scales are coarser)."""
    torch.manual_seed(0)
    wide = dataclasses.replace(CONFIG, d_model=128, d_ff=256)
    case = dataclasses.replace(setup(make_ads(60)), decoder=SIDDecoder(wide).eval())
    ctx = ctx_for(len(TARGETING), d_model=128)
    reqs = requests(TARGETING)
    served = case.served(fp8=True).run(ctx, reqs, WIDE, FilterMode.CD_GTM)
    other = case.served(VariantEngine, DecodeOptions(fp8=True, fp8_ffn=ffn)).run(
        ctx, reqs, WIDE, FilterMode.CD_GTM
    )
    assert torch.equal(other.leaves.sort(dim=1).values, served.leaves.sort(dim=1).values)
    assert (served.leaves >= 0).any()
    a = served.scores.gather(1, served.leaves.argsort(dim=1))
    b = other.scores.gather(1, other.leaves.argsort(dim=1))
    live = served.leaves.gather(1, served.leaves.argsort(dim=1)) >= 0
    if ffn == "rowwise":
        assert not torch.equal(a[live], b[live])
    torch.testing.assert_close(b[live], a[live], rtol=0.05, atol=0.05)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ffn", ["exp_tanh", "pointer_up"])
def test_gpu_other_up_kernels_search_like_the_served_fp8_engine(ffn: str) -> None:
    """`fp8_ffn="exp_tanh"` (the served FP8 FFN, its up GEMM's GELU taking tanh from exp
    and a division rather than the served tanh.approx.f32) and `"pointer_up"` (the up
    GEMM one program per tile, not the served persistent TMA kernel) on CUDA, captured,
    in a search wide enough to keep every prefix: the served FP8 engine's SIDs and
    scores within FP8's noise of its own (a few codes one e4m3 step apart)."""
    torch.manual_seed(0)
    wide = dataclasses.replace(CONFIG, d_model=128, d_ff=256)
    case = dataclasses.replace(setup(make_ads(60)), decoder=SIDDecoder(wide).eval().cuda())
    tables = GtmTables.from_arrays(case.index.trie, device="cuda")
    ctx, reqs = ctx_for(len(TARGETING), d_model=128).cuda(), requests(TARGETING, "cuda")
    results = []
    for engine in (
        DecodeEngine(case.decoder, batch_buckets=(8,), fp8=True),
        VariantEngine(case.decoder, DecodeOptions(fp8=True, fp8_ffn=ffn), batch_buckets=(8,)),
    ):
        plans = engine.plan(tables, case.level_offsets)
        results.append(engine.run(plans, ctx, reqs, WIDE, FilterMode.CD_GTM))
    served, exp = results
    assert torch.equal(exp.leaves.sort(dim=1).values, served.leaves.sort(dim=1).values)
    assert (served.leaves >= 0).any()
    a = served.scores.gather(1, served.leaves.argsort(dim=1))
    b = exp.scores.gather(1, exp.leaves.argsort(dim=1))
    live = served.leaves.gather(1, served.leaves.argsort(dim=1)) >= 0
    torch.testing.assert_close(b[live], a[live], rtol=0.05, atol=0.05)


def test_the_fp8_ffn_is_an_fp8_switch() -> None:
    with pytest.raises(ValueError, match="fp8_ffn applies to the fused FP8 step"):
        DecodeOptions(fp8_ffn="rowwise")
    with pytest.raises(ValueError, match="fp8_ffn must be one of"):
        DecodeOptions(fp8=True, fp8_ffn="tensorwise")
