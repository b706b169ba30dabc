"""The decode ladder's unserved rows (`bench.baselines.ladder`): the textbook loop with any
`Rung` finds what the reference search finds (masks "cd" and "bloom", fp32), "bitmask" what
the served engine finds on `bitmask_only` requests, fixed widths what dynamic ones find;
the KV-cache baselines (`bench.baselines.kv_cache`) give `forward_train`'s logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.baselines.kv_cache import ATTENTION_MODES, DenseKVCache, GatherPagedKVCache
from bench.baselines.ladder import Rung, TextbookSearch, bitmask_only
from contracts.request import FilterMode
from service.decode.plans import DecodeResult
from service.decode.step import DecoderStep
from tests.service.decode.cases import (
    CONFIG,
    TARGETING,
    Case,
    assert_same,
    check_teacher_forcing,
    ctx_for,
    make_ads,
    requests,
    setup,
)

BEAMS = (1, 3, 7, 5)
RUNGS = [  # the default (everything on), one switch off at a time, and the naive row
    Rung(),
    Rung(cross="per_beam"),
    Rung(self_attn="gather"),
    Rung(self_attn="sdpa"),
    Rung(kv="dense"),
    Rung(kv="dense", self_attn="gather"),
    Rung(fixed_beams=True),
    Rung(cross="per_beam", self_attn="sdpa", kv="dense", fixed_beams=True),
]
CACHES = {"paged": GatherPagedKVCache, "dense": DenseKVCache}


@pytest.fixture(scope="module")
def case() -> Case:
    return setup(make_ads(80, seed=5))


def search(case: Case, rung: Rung, mask: str) -> TextbookSearch:
    rung = dataclasses.replace(rung, mask=mask)
    return TextbookSearch(case.decoder, rung, case.tables, case.level_offsets)


def same_sids(got: DecodeResult, want: DecodeResult, rung: Rung) -> None:
    """`assert_same`; fixed widths run max(M_t) rows per request at every step."""
    if rung.fixed_beams:
        assert got.rows_per_step == tuple(len(want.leaves) * max(BEAMS) for _ in BEAMS)
        got = dataclasses.replace(got, rows_per_step=want.rows_per_step)
    assert_same(got, want)


@pytest.mark.parametrize("rung", RUNGS, ids=str)
def test_textbook_loop_finds_the_reference_search_sids(case: Case, rung: Rung) -> None:
    ctx, reqs = ctx_for(4), requests(TARGETING[:4])
    for mask, mode in (("cd", FilterMode.CD_ONLY), ("bloom", FilterMode.CD_GTM)):
        got = search(case, rung, mask).run(ctx, reqs, BEAMS)
        same_sids(got, case.reference.run(ctx, reqs, BEAMS, mode), rung)


@pytest.mark.parametrize("rung", [RUNGS[0], RUNGS[-1]], ids=str)
def test_bitmask_rung_is_the_served_engine_on_bitmask_only_requests(case: Case, rung: Rung):
    ctx, reqs = ctx_for(4), requests(TARGETING[:4])
    got = search(case, rung, "bitmask").run(ctx, reqs, BEAMS)
    served = case.served().run(ctx, bitmask_only(reqs), BEAMS, FilterMode.CD_GTM)
    same_sids(got, served, rung)
    # the Bloom rows matter for these requests: the bitmask-only search is a different one
    bloom = search(case, rung, "bloom").run(ctx, reqs, BEAMS)
    assert not torch.equal(got.leaves, bloom.leaves)


@pytest.mark.parametrize("rung", RUNGS, ids=str)
def test_unmasked_loop_is_the_plain_beam_search(case: Case, rung: Rung) -> None:
    """Mask "none": no trie, so no leaves; every SID's score is its teacher-forced
    log-probability over the whole vocabulary, best first; fixed widths find the dynamic
    widths' SIDs."""
    ctx = ctx_for(3)
    got = search(case, rung, "none").run(ctx, None, BEAMS)
    assert (got.leaves == -1).all()
    b, m, length = got.sids.shape
    sids = got.sids.view(b * m, length)
    logits = case.decoder.forward_train(ctx.repeat_interleave(m, dim=0), sids).detach()
    logp = logits.log_softmax(-1).gather(2, sids[:, :, None]).sum((1, 2)).view(b, m)
    torch.testing.assert_close(got.scores, logp, rtol=1e-4, atol=1e-4)
    assert (got.scores.diff(dim=1) <= 0).all()
    if rung.fixed_beams:
        dynamic = search(case, dataclasses.replace(rung, fixed_beams=False), "none")
        want = dynamic.run(ctx, None, BEAMS)
        assert torch.equal(got.sids, want.sids)
        torch.testing.assert_close(got.scores, want.scores)


@pytest.mark.parametrize(
    ("field", "value"),
    [("cross", "per_head"), ("self_attn", "flash"), ("kv", "sparse"), ("mask", "gtm")],
)
def test_unknown_rung_values_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        Rung(**{field: value})


@pytest.mark.parametrize("kv", sorted(CACHES))
@pytest.mark.parametrize("attention", ATTENTION_MODES)
@pytest.mark.parametrize("step", ["served", "textbook"])
def test_baseline_caches_equal_teacher_forcing(
    case: Case, kv: str, attention: str, step: str
) -> None:
    """Every cache and attention mode under the served step (its layer-0 table read too)
    and the textbook loop's layer-by-layer step: `forward_train`'s logits at every step."""
    cache = CACHES[kv](CONFIG.decoder_layers, CONFIG.n_heads, CONFIG.d_head, [2] * 4,
                       dtype=torch.float32, device="cpu", attention=attention)  # fmt: skip
    if step == "served":
        check_teacher_forcing(DecoderStep, cache)
    else:  # the step reads no table: any index's will do
        textbook = lambda d: TextbookSearch(d, Rung(), case.tables, case.level_offsets)._step  # noqa: E731
        check_teacher_forcing(textbook, cache)


def test_unknown_attention_modes_are_refused() -> None:
    for cls in CACHES.values():
        with pytest.raises(ValueError, match="attention"):
            cls(1, 2, 16, [2] * 4, dtype=torch.float32, device="cpu", attention="flash")
