"""`grace eval`: the paper's effectiveness study (§6, Table 3) on a synthetic world, plus
retrieval quality, a comparison at a fixed number of generated ads and the scoring question
(docs/EVALUATION.md: the study, its variants and its report). Each `Variant` decodes every
evaluated user's request with the same model, beams and index (`training/offline.py`); the
generated SIDs are expanded to ads in score order and each ad is checked exactly by the
index's targeting schema (`CHECKS`: bitmask — enum and bucket rules —, Bloom — the paper's
conservative test of the set attributes —, location — the exact test of the set
attributes, the default schema's locations —, and final: all of them and the request's
blocks); the post stage's removals are counted by rule kind. The report pools the per-user
counts, with bootstrap intervals
(`training/study_stats.py`); `training/study_plots.py` draws it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from contracts.index_arrays import IndexArrays
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import (
    AdRules,
    RequestRules,
    blooms_pass,
    codec,
    contains,
    exact_eligible,
)
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder.build import index_blooms
from service.index.loaded import LoadedIndex
from service.model.precision import quantize_decoder
from service.model.retriever import GenerativeRetriever
from service.post.expand import expand_leaves, rules_of
from training.data import Examples
from training.offline import OfflineRetriever
from training.study_stats import (
    CHECKS,
    REMOVED,
    bucket_table,
    by_launch,
    interval,
    metric_table,
    paired_difference,
    pooled,
    recall,
    resample_indices,
    sids_kept,
)

PAPER_BUCKETS = (0, 5000, 10000)  # the paper's Table 3: < 5k, 5k–9.9k, 10k+ ads generated
BUCKETS = (0, 100, 500, 1000, 2000, 5000, 10000)  # finer lower bounds, for small worlds
CURVE_KS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass(frozen=True)
class Variant:
    """One decoding of every user: the index's arrays (k-way partitions differ), the
    filter mode, the scoring and whether the model serves in FP8."""

    name: str
    arrays: IndexArrays
    mode: FilterMode
    scoring: str = "masked"
    fp8: bool = False


def _checks(
    schema: TargetingSchema,
    index: LoadedIndex,
    rules: AdRules,  # of the generated ads, in order
    blooms: np.ndarray,  # uint64 [n, bloom_words]: their Bloom rows
    ad_ids: np.ndarray,  # int64 [n]
    t: Targeting,
) -> dict[str, np.ndarray]:
    """Each of `CHECKS` for the generated ads of one request: bool [n] each."""
    request = index.request_rules(t)
    sets_only = AdRules(np.full_like(rules.bitmask, np.iinfo(np.uint64).max), rules.include,
                        rules.exclude)  # fmt: skip
    return {
        "bitmask": contains(rules.bitmask, request.bitmask),
        "bloom": blooms_pass(schema, blooms, codec(schema).request_blooms(t.values())),
        "location": exact_eligible(
            schema, ad_ids, sets_only, RequestRules(request.bitmask, request.ids)
        ),
        "final": exact_eligible(schema, ad_ids, rules, request),
    }


def sample_users(n_users: int, count: int, seed: int) -> np.ndarray:
    """The users a study evaluates, in id order: the same for every tool given the seed."""
    return np.sort(np.random.default_rng(seed).permutation(n_users)[:count])


@dataclass
class _PerUser:
    """What one variant found for each user, in user order."""

    generated: list[int] = field(default_factory=list)
    passed: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in CHECKS})
    removed: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in REMOVED})
    eligible_returned: list[int] = field(default_factory=list)
    # returned ads outside this module's own exact check of the generated ads: must be 0
    ineligible_returned: list[int] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)  # of the held-out ad; -1 when not returned
    final_first: dict[int, list[int]] = field(default_factory=dict)  # N -> finals in first N
    sids: list[np.ndarray] = field(default_factory=list)  # generated SID leaves, best first

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "generated": np.asarray(self.generated, np.int64),
            **{c: np.asarray(v, np.int64) for c, v in self.passed.items()},
            **{f"removed_{k}": np.asarray(v, np.int64) for k, v in self.removed.items()},
        }


def _summary(
    v: Variant,
    u: _PerUser,
    ks: Sequence[int],
    draws: np.ndarray,
    buckets: Sequence[int],
    fresh: np.ndarray | None = None,
) -> dict[str, Any]:
    counts = u.arrays()
    n = len(u.generated)
    ranks = np.asarray(u.rank, np.int64)
    overall = pooled(counts, np.ones(n, bool), n)
    overall.pop("users_share")
    curve = {k: float(recall(ranks, k).mean()) if n else 0.0 for k in sorted({*CURVE_KS, *ks})}
    return {
        "variant": v.name,
        "mode": v.mode.name.lower(),
        "scoring": v.scoring,
        "fp8": v.fp8,
        **overall,
        "eligible_ads_per_user": float(np.mean(u.eligible_returned)) if n else 0.0,
        "ineligible_returned": int(sum(u.ineligible_returned)),
        **{f"recall@{k}": curve[k] for k in ks},
        "metrics": metric_table(ranks, ks, draws),
        "recall_curve": {str(k): v for k, v in curve.items() if k <= max(ks)},
        "buckets": bucket_table(counts, buckets),
        "paper_buckets": bucket_table(counts, PAPER_BUCKETS),
        **({"recall_by_launch": by_launch(ranks, fresh, ks)} if fresh is not None else {}),
    }


def fixed_generation(found: Sequence[_PerUser], resamples: int, seed: int) -> list[dict]:
    """Per variant, per N: the final pass rate and eligible ads among the first N ads
    generated, over the users with at least N in *every* variant (the same users for all,
    so a variant that generates fewer ads does not pick its own subset), and for every
    variant after the first the paired difference in eligible ads to the first."""
    out: list[dict[str, Any]] = [{} for _ in found]
    if not found:
        return out
    for size in sorted(found[0].final_first):
        enough = np.logical_and.reduce([np.asarray(u.generated) >= size for u in found])
        draws = resample_indices(int(enough.sum()), resamples, seed)
        finals = [np.asarray(u.final_first[size], np.int64)[enough] for u in found]
        for i, f in enumerate(finals):
            row: dict[str, Any] = {
                "users": int(enough.sum()),
                "final_pass": float(f.sum() / max(size * len(f), 1)),
                "eligible_ads_per_user": float(f.mean()) if len(f) else 0.0,
            }
            if i:
                diff = interval((f - finals[0]).astype(np.float64), draws)
                row["vs_first"] = {**diff, "resolved": bool(diff["lo"] > 0 or diff["hi"] < 0)}
            out[i][str(size)] = row
    return out


def run_study(
    model: GenerativeRetriever,
    examples: Examples,
    variants: Sequence[Variant],
    users: np.ndarray,
    beams: tuple[int, ...],
    ks: Sequence[int] = (10, 100, 1000),
    *,
    fixed: Sequence[int] = (),
    buckets: Sequence[int] = BUCKETS,
    device: str = "cpu",
    batch_size: int = 16,
    resamples: int = 1000,
    seed: int = 0,
    progress: bool = True,
    schema: TargetingSchema = DEFAULT,
) -> list[dict[str, Any]]:
    """One summary per variant (in order); every variant after the first also carries
    `vs_first`: its paired differences in recall@K and NDCG@K to the first variant.
    `buckets`: the lower bounds of the `buckets` table (the paper's are always there);
    `schema`: the targeting schema the variants' index was built with."""
    model.eval()
    draws = resample_indices(len(users), resamples, seed)
    bloom_rows: dict[int, np.ndarray] = {}  # per-ad Bloom rows, once per ad arrays
    found: list[_PerUser] = []
    bases = {i: _full_precision(variants, v) for i, v in enumerate(variants) if v.fp8}
    # the FP8 variants' model: a copy, made FP8 as the server makes it at load
    fp8_model = None
    if bases:
        fp8_model = copy.deepcopy(model)
        quantize_decoder(fp8_model.decoder)
    kept = set(bases) | set(bases.values())  # whose SIDs the FP8 comparison reads
    for vi, v in enumerate(variants):
        index = LoadedIndex.from_arrays(v.arrays, device, schema=schema)
        retriever = OfflineRetriever(fp8_model if v.fp8 else model, index, batch_size,
                                     scoring=v.scoring)  # fmt: skip
        ads = v.arrays.ads
        if id(ads) not in bloom_rows:  # k-way variants share the plain index's ad arrays
            bloom_rows[id(ads)] = index_blooms(ads, schema)
        ad_bloom, rules = bloom_rows[id(ads)], ads.rules()
        per_user = _PerUser(final_first={size: [] for size in fixed})
        bar = tqdm(total=len(users), desc=f"eval {v.name}", disable=not progress)
        for s in range(0, len(users), batch_size):
            batch = examples.heldout(users[s : s + batch_size])
            targeting = [examples.world.targeting[u] for u in batch.users.tolist()]
            res = retriever.decode(batch.features, targeting, beams, v.mode)
            for b, (t, target) in enumerate(zip(targeting, batch.target_ad.tolist(), strict=True)):
                leaves, scores = (x.cpu().numpy() for x in res.valid(b))
                by_score = np.argsort(-scores, kind="stable")  # generated ads, best SID first
                if vi in kept:
                    per_user.sids.append(leaves[by_score])
                rows, _ = expand_leaves(ads, leaves[by_score])
                checks = _checks(schema, index, rules_of(rules, rows), ad_bloom[rows],
                                 ads.ad_ids[rows], t)  # fmt: skip
                per_user.generated.append(len(rows))
                for c, ok in checks.items():
                    per_user.passed[c].append(int(ok.sum()))
                for size, finals in per_user.final_first.items():
                    finals.append(int(checks["final"][:size].sum()))
                (post,) = retriever.post([(leaves, scores)], [t], max(ks))
                for kind in REMOVED:  # offline: no live changes, nothing is not_live
                    per_user.removed[kind].append(post.ads_removed[kind])
                per_user.eligible_returned.append(post.ads_eligible)
                passed = ads.ad_ids[rows[checks["final"]]]  # numpy's verdict, not the C++ one
                per_user.ineligible_returned.append(int((~np.isin(post.ad_ids, passed)).sum()))
                rank = np.flatnonzero(post.ad_ids == target)
                per_user.rank.append(int(rank[0]) if len(rank) else -1)
            bar.update(len(batch.users))
        bar.close()
        found.append(per_user)
    # per user, whether its held-out ad launched after the log (docs/SYNTH.md); None: unknown
    flags = getattr(examples.world, "heldout_fresh", None)
    fresh = None if flags is None else np.asarray(flags, bool)[users]
    out = [_summary(v, u, ks, draws, buckets, fresh) for v, u in zip(variants, found, strict=True)]
    for row, fixed in zip(out, fixed_generation(found, resamples, seed), strict=True):
        row["fixed_generation"] = fixed
    for i, b in bases.items():
        out[i]["vs_full_precision"] = {
            "variant": variants[b].name,
            "sid_overlap": sids_kept(found[i].sids, found[b].sids,
                                       sorted({min(100, beams[-1]), beams[-1]}), draws),
            **paired_difference(np.asarray(found[i].rank, np.int64),
                                np.asarray(found[b].rank, np.int64), ks, draws),
        }  # fmt: skip
    base = np.asarray(found[0].rank, np.int64) if found else None
    for row, u in zip(out[1:], found[1:], strict=True):
        assert base is not None
        row["vs_first"] = {
            "variant": out[0]["variant"],
            **paired_difference(np.asarray(u.rank, np.int64), base, ks, draws),
        }
    return out


def _full_precision(variants: Sequence[Variant], fp8: Variant) -> int:
    """The position of the variant an FP8 variant is compared with: the same index,
    filter and scoring in the model's own dtype."""
    for i, v in enumerate(variants):
        if not v.fp8 and v.arrays is fp8.arrays and (v.mode, v.scoring) == (fp8.mode, fp8.scoring):
            return i
    raise ValueError(f"variant {fp8.name!r} has no full-precision twin to compare with")
