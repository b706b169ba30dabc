"""The decode engine on a model made FP8 at load (service/model/precision.py):
the masks are the same, so a search wide enough to keep every prefix returns exactly the
fp32 engine's SIDs; a narrow one keeps most of its top SIDs."""

from __future__ import annotations

import torch

from contracts.request import FilterMode
from tests.service.decode.cases import TARGETING, WIDE, ctx_for, make_ads, requests, setup


def _live(result) -> list[set[int]]:
    """Per request, the set of live leaves (SID rows of the trie's last level)."""
    leaves = result.leaves.cpu()
    return [set(row[row >= 0].tolist()) for row in leaves]


def test_a_wide_fp8_search_returns_the_fp32_sids_with_close_scores() -> None:
    case = setup(make_ads(60))
    ctx, req = ctx_for(len(TARGETING)), requests(TARGETING)
    exact = case.served().run(ctx, req, WIDE, FilterMode.CD_GTM)
    fp8 = case.served(fp8=True).run(ctx, req, WIDE, FilterMode.CD_GTM)
    assert _live(fp8) == _live(exact)  # every eligible SID, in either precision
    assert any(_live(exact))
    order = exact.leaves.argsort(dim=1)  # align the two by leaf before comparing scores
    a = exact.scores.gather(1, order)
    b = fp8.scores.gather(1, fp8.leaves.argsort(dim=1))
    live = exact.leaves.gather(1, order) >= 0
    assert not torch.equal(a[live], b[live])  # quantised for real
    torch.testing.assert_close(b[live], a[live], rtol=0.05, atol=0.05)


def test_a_narrow_fp8_search_keeps_most_top_sids() -> None:
    case = setup(make_ads(300, seed=2))
    ctx, req = ctx_for(len(TARGETING), seed=3), requests(TARGETING)
    beams = (1, 4, 8, 8)
    exact = _live(case.served().run(ctx, req, beams, FilterMode.CD_ONLY))
    fp8 = _live(case.served(fp8=True).run(ctx, req, beams, FilterMode.CD_ONLY))
    kept = sum(len(a & b) for a, b in zip(exact, fp8, strict=True))
    assert kept >= 0.8 * sum(len(a) for a in exact)
