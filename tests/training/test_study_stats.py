"""`training/study_stats.py`: recall and NDCG from ranks, bootstrap intervals that hold
the mean and narrow with more users, paired differences that resolve a real gap and not
a null one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from training.study_stats import (
    interval,
    ndcg,
    paired_difference,
    recall,
    resample_indices,
    sids_kept,
)


def test_recall_and_ndcg_of_hand_made_ranks() -> None:
    ranks = np.array([0, 1, 9, 10, -1])
    assert recall(ranks, 10).tolist() == [1, 1, 1, 0, 0]
    assert ndcg(ranks, 10) == pytest.approx([1.0, 1 / np.log2(3), 1 / np.log2(11), 0, 0])
    assert recall(ranks, 1).tolist() == [1, 0, 0, 0, 0]


@given(st.lists(st.integers(-1, 50), min_size=1, max_size=60), st.integers(1, 60))
def test_ndcg_never_exceeds_recall_and_both_grow_with_k(ranks, k) -> None:
    r = np.asarray(ranks)
    assert (ndcg(r, k) <= recall(r, k)).all()
    assert recall(r, k).sum() <= recall(r, k + 1).sum()
    assert ndcg(r, k).sum() <= ndcg(r, k + 1).sum() + 1e-12


def test_an_interval_holds_the_mean_and_narrows_with_more_users() -> None:
    rng = np.random.default_rng(1)
    widths = []
    for n in (200, 5000):
        x = (rng.random(n) < 0.3).astype(float)
        ci = interval(x, resample_indices(n, 500, seed=2))
        assert ci["lo"] <= ci["mean"] <= ci["hi"]
        widths.append(ci["hi"] - ci["lo"])
    assert widths[1] < widths[0] / 3  # ~ 1 / sqrt(n): 5x narrower for 25x the users


def test_a_paired_difference_resolves_a_real_gap_and_not_a_null_one() -> None:
    rng = np.random.default_rng(3)
    n = 3000
    base = np.where(rng.random(n) < 0.3, rng.integers(0, 100, n), -1)
    better = np.where(rng.random(n) < 0.1, 0, base)  # 10 % of users moved to rank 0
    draws = resample_indices(n, 500)
    same = paired_difference(base, base, (10, 100), draws)
    assert all(d["mean"] == 0 and not d["resolved"] for d in same.values())
    gap = paired_difference(better, base, (10,), draws)
    assert gap["recall@10"]["mean"] > 0 and gap["recall@10"]["resolved"]
    assert gap["ndcg@10"]["lo"] > 0


def test_sid_overlap_is_the_share_of_the_base_top_k_kept() -> None:
    got = [np.array([1, 2, 3]), np.array([9, 8]), np.array([5])]
    base = [np.array([1, 2, 4]), np.array([7, 6]), np.array([], np.int64)]
    draws = resample_indices(3, 50)
    out = sids_kept(got, base, (1, 3), draws)
    # user 0: top 1 kept (1/1), top 3 two of three; user 1: none; user 2: nothing to lose
    assert out["@1"]["mean"] == pytest.approx((1 + 0 + 1) / 3)
    assert out["@3"]["mean"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert sids_kept(base, base, (3,), draws)["@3"] == {"mean": 1.0, "lo": 1.0, "hi": 1.0}
