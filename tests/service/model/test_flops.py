"""Decoder FLOP counter: the paper profile's sizing and how the terms scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.model.config import PROFILES
from service.model.flops import CROSS_KV, DECODER_TERMS, decoder_flops, encoder_flops

PAPER = PROFILES["paper"]
PAPER_BEAMS = (1, 512, 1024, 1024)


def test_paper_profile_lands_on_446_gflops():
    total = decoder_flops(PAPER, PAPER_BEAMS).total
    assert abs(total - 446e9) <= 0.05 * 446e9, f"{total / 1e9:.1f} GFLOPs"


def test_default_beams_are_the_profile_schedule():
    assert decoder_flops(PAPER).total == decoder_flops(PAPER, PAPER_BEAMS).total


def test_hand_count_of_one_row_step():
    c = replace(PROFILES["tiny"], decoder_layers=1)
    d, da, dff, t_ctx = c.d_model, c.d_attn, c.d_ff, c.t_ctx
    r = decoder_flops(c, (1, 1, 1, 1))
    # step 2: one row; the query attends to 2 prefix tokens
    expect = (
        2 * d * 3 * da
        + 2 * da * d  # self-attention projections
        + 2 * 2 * 2 * da  # Q·K^T and P·V over 2 keys
        + 2 * 2 * d * da  # cross Q and output
        + 2 * 2 * t_ctx * da  # cross Q·K^T and P·V over T_ctx keys
        + 2 * 2 * d * dff  # FFN
        + 2 * d * c.vocab_size  # head
    )
    assert r.step_total(2) == expect
    assert r.once[CROSS_KV] == 2 * t_ctx * d * 2 * da


def test_doubling_the_last_beam_changes_only_step_four():
    a = decoder_flops(PAPER, PAPER_BEAMS)
    b = decoder_flops(PAPER, (1, 512, 1024, 2048))
    assert a.steps[:3] == b.steps[:3]
    assert a.once == b.once
    for term in DECODER_TERMS:
        assert b.steps[3][term] == 2 * a.steps[3][term]


def test_cross_kv_is_independent_of_beams_and_scales_with_layers():
    small = decoder_flops(PAPER, (1, 1, 1, 1)).once[CROSS_KV]
    assert decoder_flops(PAPER, (1, 2048, 2048, 2048)).once[CROSS_KV] == small
    deeper = replace(PAPER, decoder_layers=2 * PAPER.decoder_layers)
    assert decoder_flops(deeper, (1, 1, 1, 1)).once[CROSS_KV] == 2 * small


def test_total_is_the_sum_of_the_terms():
    r = decoder_flops(PAPER, PAPER_BEAMS)
    assert r.total == sum(r.term_total(t) for t in (*DECODER_TERMS, CROSS_KV))
    assert r.total == sum(r.step_total(t) for t in range(1, 5)) + r.once[CROSS_KV]


def test_table_lists_every_term_and_the_total():
    r = decoder_flops(PAPER, PAPER_BEAMS)
    text = r.table()
    for term in (*DECODER_TERMS, CROSS_KV, "total"):
        assert term in text
    assert f"{r.total / 1e9:.3f}" in text


def test_bad_beams_are_refused():
    with pytest.raises(ValueError, match="beams"):
        decoder_flops(PAPER, (1, 512, 1024))


def test_encoder_estimate_grows_with_history_up_to_max_history():
    c = PROFILES["tiny"]
    short, long = encoder_flops(c, 8), encoder_flops(c, c.max_history)
    assert 0 < short < long
    assert encoder_flops(c, 10 * c.max_history) == long
