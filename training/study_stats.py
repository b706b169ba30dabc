"""The statistics of the effectiveness study (`training/study.py`, `grace eval`): recall@K
and NDCG@K of each user's held-out next interaction from the rank it was returned at (its
0-based position in the returned list, -1 when not returned; one relevant item per user,
so the ideal DCG is 1), and percentile-bootstrap confidence intervals over users — of one
variant's mean, and of the paired difference between two variants decoded for the same
users (the resampled users are the same on both sides, so the users' own spread cancels);
and the pass-rate tables: the generated ads passing each check and removed by each rule
kind, pooled over users and per bucket of ads generated (the paper's Table 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 1000
CHECKS = ("bitmask", "bloom", "location", "final")  # what `training/study.py` checks
# `PostResult.ads_removed`'s kinds but not_live (the study applies no live changes)
REMOVED = ("block", "targeting", "exclusion")


def recall(ranks: np.ndarray, k: int) -> np.ndarray:
    """Per user: 1.0 when the held-out ad came back in the top k, else 0.0."""
    return ((ranks >= 0) & (ranks < k)).astype(np.float64)


def ndcg(ranks: np.ndarray, k: int) -> np.ndarray:
    """Per user: 1 / log2(rank + 2) for a hit in the top k, else 0.0."""
    hit = (ranks >= 0) & (ranks < k)
    return np.where(hit, 1.0 / np.log2(np.maximum(ranks, 0) + 2.0), 0.0)


METRICS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {"recall": recall, "ndcg": ndcg}


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """int64 [resamples, n]: user positions drawn with replacement, one row per resample;
    the same rows for every variant and metric of a study."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def interval(per_user: np.ndarray, draws: np.ndarray) -> dict[str, float]:
    """The mean of `per_user` and its CONFIDENCE percentile-bootstrap interval over `draws`."""
    if len(per_user) == 0:
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    means = per_user[draws].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return {"mean": float(per_user.mean()), "lo": float(lo), "hi": float(hi)}


def metric_table(
    ranks: np.ndarray, ks: Sequence[int], draws: np.ndarray
) -> dict[str, dict[str, float]]:
    """{"recall@K" | "ndcg@K": interval} for one variant."""
    return {
        f"{name}@{k}": interval(fn(ranks, k), draws) for name, fn in METRICS.items() for k in ks
    }


def paired_difference(
    ranks: np.ndarray, base: np.ndarray, ks: Sequence[int], draws: np.ndarray
) -> dict[str, dict[str, float]]:
    """{"recall@K" | "ndcg@K": interval of (variant - base)} over the same users; the
    difference is resolved when its interval excludes 0."""
    out = {}
    for name, fn in METRICS.items():
        for k in ks:
            diff = interval(fn(ranks, k) - fn(base, k), draws)
            out[f"{name}@{k}"] = {**diff, "resolved": bool(diff["lo"] > 0 or diff["hi"] < 0)}
    return out


def sids_kept(
    got: Sequence[np.ndarray], base: Sequence[np.ndarray], ks: Sequence[int], draws: np.ndarray
) -> dict[str, dict[str, float]]:
    """{"@K": interval of the per-user share of base's top-K SIDs that `got`'s top K
    holds too}: each entry one user's generated SIDs, best first; users whose base is
    empty count as 1 (nothing to lose)."""
    out = {}
    for k in ks:
        share = np.ones(len(base))
        for i, (a, b) in enumerate(zip(got, base, strict=True)):
            top = b[:k]
            if len(top):
                share[i] = np.isin(top, a[:k]).mean()
        out[f"@{k}"] = interval(share, draws)
    return out


def bucket_label(bounds: Sequence[int], i: int) -> str:
    """The paper's labels: '<5k' for the first bucket, '5k-9.9k' between, '10k+' last."""
    if i == len(bounds) - 1:
        return f"{_k(bounds[i])}+"
    if i == 0 and bounds[0] == 0:
        return f"<{_k(bounds[1])}"
    return f"{_k(bounds[i])}-{_k(bounds[i + 1] - 1)}"


def _k(n: int) -> str:
    """1000 -> '1k', 9999 -> '9.9k' (the paper's truncation), 499 -> '499'."""
    if n < 1000:
        return str(n)
    return f"{n // 100 / 10:g}k"


def pooled(counts: dict[str, np.ndarray], users: np.ndarray, total_users: int) -> dict[str, Any]:
    """Pass rates pooled over the ads of `users` (a bool mask over all users)."""
    generated = int(counts["generated"][users].sum())
    sums = {c: int(counts[c][users].sum()) for c in CHECKS}
    removed = {k: int(counts[f"removed_{k}"][users].sum()) for k in REMOVED}
    n = int(users.sum())
    return {
        "users": n,
        "users_share": n / max(total_users, 1),
        "ads_generated_per_user": generated / max(n, 1),
        **{f"{c}_pass": sums[c] / max(generated, 1) for c in CHECKS},
        # the share of the generated ads the post stage removed, by rule kind
        "removed_share": {k: v / max(generated, 1) for k, v in removed.items()},
        "counts": {
            "generated": generated,
            **sums,
            **{f"removed_{k}": v for k, v in removed.items()},
        },
    }


def bucket_table(counts: dict[str, np.ndarray], bounds: Sequence[int]) -> dict[str, Any]:
    """`pooled` per bucket of ads generated per user (only buckets holding users)."""
    g, total = counts["generated"], len(counts["generated"])
    out = {}
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else np.iinfo(np.int64).max
        users = (g >= lo) & (g < hi)
        if users.any():
            out[bucket_label(bounds, i)] = pooled(counts, users, total)
    return out


def by_launch(ranks: np.ndarray, fresh: np.ndarray, ks: Sequence[int]) -> dict[str, Any]:
    """recall@K apart for the users whose held-out ad was logged before and for those whose
    ad launched after the log (`fresh`, bool per user: worlds with `fresh_share` > 0)."""
    out: dict[str, Any] = {}
    for name, sel in (("logged", ~fresh), ("fresh", fresh)):
        out[name] = {"users": int(sel.sum())}
        for k in ks:
            out[name][f"recall@{k}"] = float(recall(ranks[sel], k).mean()) if sel.any() else 0.0
    return out
