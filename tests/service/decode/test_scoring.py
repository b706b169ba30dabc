"""The decode engine's `scoring` (contracts.request.Scoring): "masked" (the default) adds
each step's log-softmax over the allowed tokens, "unmasked" the model's own log-softmax
over the whole vocabulary — so an "unmasked" SID scores its model log-probability,
teacher-forced, whatever the filter mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.request import SCORINGS, FilterMode
from contracts.tensors import GtmTables
from index_builder.build import build_arrays
from service.decode.engine import DecodeEngine
from service.decode.plans import DecodeResult
from service.index.loaded import LoadedIndex
from service.model.config import PROFILES
from service.model.decoder import SIDDecoder
from service.model.retriever import GenerativeRetriever
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.oracle import Ad
from tests.service.decode.cases import (
    CONFIG,
    TARGETING,
    WIDE,
    Case,
    ctx_for,
    make_ads,
    requests,
    setup,
)
from training.offline import OfflineRetriever

NARROW = (1, 3, 7, 5)  # narrower than the catalog: the pruning a server runs


def model_log_prob(decoder: SIDDecoder, ctx: torch.Tensor, sids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probability of each SID [n, L] under the full-vocab softmax of
    every step (no mask), for one request's `ctx` [1, T, d]."""
    with torch.no_grad():
        logits = decoder.forward_train(ctx.expand(len(sids), -1, -1), sids)  # [n, L, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(2, sids[:, :, None]).squeeze(2).sum(dim=1)


def live_sids(res: DecodeResult, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sids [n, L], scores [n]) of request b's live slots."""
    keep = res.leaves[b] >= 0
    return res.sids[b][keep], res.scores[b][keep]


def scored(res: DecodeResult, b: int) -> dict[tuple[int, ...], float]:
    sids, scores = live_sids(res, b)
    return {tuple(s): float(x) for s, x in zip(sids.tolist(), scores.tolist(), strict=True)}


@pytest.fixture(scope="module")
def case() -> Case:
    return setup(make_ads(80, seed=5), seed=2)


def test_the_default_is_masked_and_unknown_scorings_are_refused(case: Case) -> None:
    assert DecodeEngine(case.decoder).scoring == "masked"
    with pytest.raises(ValueError, match="scoring must be one of"):
        DecodeEngine(case.decoder, scoring="raw")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [FilterMode.CD_ONLY, FilterMode.CD_GTM])
@pytest.mark.parametrize("beams", [NARROW, WIDE])
def test_unmasked_scores_are_the_models_log_probabilities(
    case: Case, mode: FilterMode, beams: tuple[int, ...]
) -> None:
    """Every SID an "unmasked" engine returns (a padded batch of the default buckets,
    every request kind) scores the sum of the model's full-vocab log-probabilities of its
    tokens; under "masked" the mask renormalises, so the scores are higher."""
    ctx, reqs = ctx_for(len(TARGETING)), requests(TARGETING)
    unmasked = case.served(scoring="unmasked").run(ctx, reqs, beams, mode)
    masked = case.served().run(ctx, reqs, beams, mode)
    checked = 0
    for b in range(len(TARGETING)):
        sids, scores = live_sids(unmasked, b)
        if not len(sids):
            continue
        want = model_log_prob(case.decoder, ctx[b : b + 1], sids)
        torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-4)
        assert torch.all(scores[:-1] >= scores[1:]), "best first"
        m_sids, m_scores = live_sids(masked, b)
        renormalised = m_scores - model_log_prob(case.decoder, ctx[b : b + 1], m_sids)
        assert (renormalised > 1e-3).all(), "masked: each step renormalises over < V tokens"
        checked += len(sids)
    assert checked, "no request returned anything: a vacuous comparison"


def test_unmasked_scores_a_sid_the_same_under_cd_only_and_cd_gtm(case: Case) -> None:
    """With wide beams both modes find every SID they allow: under "unmasked" each SID
    that CD_GTM returns has CD_ONLY's score (GTM only removes SIDs), under "masked" GTM
    renormalises over fewer tokens and scores the same SIDs differently."""
    ctx, reqs = ctx_for(len(TARGETING)), requests(TARGETING)
    for scoring in SCORINGS:
        served = case.served(scoring=scoring)
        cd = served.run(ctx, None, WIDE, FilterMode.CD_ONLY)
        gtm = served.run(ctx, reqs, WIDE, FilterMode.CD_GTM)
        differ = 0
        for b in range(len(TARGETING)):
            cd_b, gtm_b = scored(cd, b), scored(gtm, b)
            assert gtm_b.keys() <= cd_b.keys()
            diff = np.array([gtm_b[s] - cd_b[s] for s in gtm_b])
            if scoring == "unmasked":
                np.testing.assert_allclose(diff, 0.0, atol=1e-5)
            else:
                differ += int((np.abs(diff) > 1e-4).sum())
        if scoring == "masked":
            assert differ, "masked scores should depend on the filter mode"


def test_unmasked_wide_cd_only_ranks_the_catalog_by_model_probability(case: Case) -> None:
    """Beams wide enough to hold every prefix: the "unmasked" search returns every catalog
    SID, ranked by its model log-probability."""
    ctx = ctx_for(1, seed=4)
    res = case.served(scoring="unmasked").run(ctx, None, WIDE, FilterMode.CD_ONLY)
    sids, scores = live_sids(res, 0)
    catalog = {tuple(s) for s in case.index.ads.leaf_sids.tolist()}
    assert {tuple(s) for s in sids.tolist()} == catalog
    want = model_log_prob(case.decoder, ctx, sids)
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-4)
    assert torch.all(scores[:-1] >= scores[1:])


@pytest.mark.parametrize("scoring", SCORINGS)
def test_offline_retriever_decodes_with_its_scoring(scoring: str) -> None:
    """`OfflineRetriever(..., scoring=...)` hands its scoring to its engine."""
    ads = make_ads(20, seed=1)
    cat = catalog_from_ads(ads)
    index = LoadedIndex.from_arrays(build_arrays(cat, cat.sid.astype(np.int64)))
    model = GenerativeRetriever(PROFILES["tiny"])
    retriever = OfflineRetriever(model, index, 4, scoring=scoring)  # type: ignore[arg-type]
    assert retriever.engine.scoring == scoring
    assert OfflineRetriever(model, index, 4).engine.scoring == "masked"


def test_unmasked_engine_matches_a_small_decoder_on_cpu() -> None:
    """The tiny fixtures' decoder (CONFIG) on a catalog of two SIDs: the unmasked scores
    are the teacher-forced full-vocab log-probabilities, below the masked ones (which
    renormalise over at most two tokens per step)."""
    case = setup([Ad(1, (0, 1, 2, 3)), Ad(2, (0, 1, 2, 4))], seed=3)
    assert case.decoder.config == CONFIG
    ctx = ctx_for(1, seed=7)
    unmasked = case.served(scoring="unmasked").run(ctx, None, (1, 2, 2, 2), FilterMode.CD_ONLY)
    masked = case.served().run(ctx, None, (1, 2, 2, 2), FilterMode.CD_ONLY)
    sids, scores = live_sids(unmasked, 0)
    torch.testing.assert_close(scores, model_log_prob(case.decoder, ctx, sids))
    # masked: three forced steps score 0, the last is a two-way softmax
    m = scored(masked, 0)
    assert sum(np.exp(list(m.values()))) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_unmasked_graphs_score_the_models_log_probabilities(dtype: torch.dtype) -> None:
    """On CUDA (the fused Triton mask with UNMASKED, inside captured graphs; fp32 and the
    served bf16): the scores are the model's teacher-forced full-vocab log-probabilities,
    and CD_GTM scores each of its SIDs as CD_ONLY does."""
    case = setup(make_ads(200, seed=3))
    decoder = case.decoder.to("cuda", dtype)
    tables = GtmTables.from_arrays(case.index.trie, device="cuda")
    engine = DecodeEngine(decoder, batch_buckets=(2, 6), scoring="unmasked")
    plans = engine.plan(tables, case.level_offsets)
    ctx = ctx_for(5).to("cuda", dtype)
    reqs = requests(TARGETING, "cuda")
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 0, "atol": 0.1}
    cd = engine.run(plans, ctx, None, (1, 8, 16, 12), FilterMode.CD_ONLY)
    gtm = engine.run(plans, ctx, reqs, (1, 8, 16, 12), FilterMode.CD_GTM)
    assert plans.graphs == 2
    for res in (cd, gtm):
        for b in range(len(TARGETING)):
            sids, scores = live_sids(res, b)
            if len(sids):
                want = model_log_prob(decoder, ctx[b : b + 1], sids)
                torch.testing.assert_close(scores, want, **tol)
    for b in range(len(TARGETING)):
        cd_b, gtm_b = scored(cd, b), scored(gtm, b)
        for sid in gtm_b.keys() & cd_b.keys():
            assert gtm_b[sid] == pytest.approx(cd_b[sid], abs=1e-5)
