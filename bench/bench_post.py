"""Post stage benchmark (pipeline stage 4): the C++ extension (`service.post`) against the
Python reference (`tests/helpers/reference_post.py`) on one batch of 16 requests
with ~10,000 expanded ads each. Medians of repeated runs in this one process; the
results are checked identical before timing. Results: bench/results/post_stage.json.

The index comes from a generated `demo` world's catalog (realistic targeting: Zipf
advertisers, national/regional/local rules, users with up to 64 locations) with random
SIDs, ~10 ads per SID; each request is a world user with 1,024 generated leaves (the
paper's M_4) and descending beam scores, cut to max_ads = 1,000. A second timing runs the
same batch with per-request blocks (`exclude_ad_ids`: 2,000 ads of the index;
`exclude_advertiser_ids`: 20 of its advertisers), checked to let none of them through.
Two catalog sizes by default: 50 k ads (the index fits in the L2/L3 caches) and 200 k
(a batch touches more than the caches hold, as a real index does).

    .venv/bin/python bench/bench_post.py                # -> bench/results/post_stage.json
    .venv/bin/python bench/bench_post.py --ads 50000 --repeat 20   # one size, quick
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timed, write_result
from contracts.index_arrays import AdArrays
from contracts.targeting import Targeting
from index_builder.build import build_arrays
from index_builder.catalog import read_catalog
from index_builder.synth import generate_world, load_world
from service.post import LocationVocabulary, PostRequest, PostResult, PostStage
from tests.helpers.reference_post import expand_and_filter

BATCH = 16
BEAMS = 1024  # leaves per request (M_4)
MAX_ADS = 1000
BLOCKED_ADS, BLOCKED_ADVERTISERS = 2000, 20  # per request, in the timing with blocks


def make_index(n_ads: int, seed: int) -> tuple[AdArrays, list[Targeting]]:
    with tempfile.TemporaryDirectory() as tmp:
        generate_world("demo", seed, Path(tmp) / "w", n_ads=n_ads, n_users=2000, progress=False)
        world = load_world(Path(tmp) / "w")
        catalog = read_catalog(world.catalog_parquet, progress=False)
    rng = np.random.default_rng(seed)
    # ~10 ads per SID: draw n/10 distinct SIDs, give every ad one of them
    codes = rng.choice(512**4, size=n_ads // 10, replace=False)
    digits = (codes[:, None] // 512 ** np.arange(3, -1, -1)) % 512
    sids = digits[rng.integers(0, len(digits), size=n_ads)]
    return build_arrays(catalog, sids).ads, list(world.targeting)


def make_batch(
    ads: AdArrays, users: list[Targeting], rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray, Targeting]]:
    out = []
    for u in rng.choice(len(users), BATCH, replace=False).tolist():
        leaves = rng.choice(len(ads.leaf_sids), BEAMS, replace=False)
        # beam log-probabilities, best first, rounded so that ties occur
        scores = np.round(-np.cumsum(rng.exponential(0.01, BEAMS)), 2).astype(np.float32)
        out.append((leaves, scores, users[u]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[50_000, 200_000])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    results = [measure(n, a.repeat, a.seed) for n in a.ads]
    print(write_result("post_stage", {"runs": results}))


def measure(n_ads: int, repeat: int, seed: int) -> dict[str, object]:
    """One catalog size: check C++ == Python, then time both on the same batch."""
    ads, users = make_index(n_ads, seed)
    vocab = LocationVocabulary(ads)
    batch = make_batch(ads, users, np.random.default_rng(seed + 1))

    def python_ref() -> list[PostResult]:
        return [expand_and_filter(ads, vocab, lv, sc, t, MAX_ADS) for lv, sc, t in batch]

    def encode() -> list[PostRequest]:
        return [PostRequest.from_targeting(lv, sc, t, vocab, MAX_ADS) for lv, sc, t in batch]

    want, requests = python_ref(), encode()
    cpus = os.cpu_count() or 1
    stages = {n: PostStage(ads, threads=n) for n in sorted({1, 2, cpus})}
    for stage in stages.values():
        for g, w in zip(stage.run(requests), want, strict=True):
            assert np.array_equal(g.ad_ids, w.ad_ids) and np.array_equal(g.scores, w.scores)
            assert np.array_equal(g.sids, w.sids)
            assert (g.ads_expanded, g.ads_eligible) == (w.ads_expanded, w.ads_eligible)

    rng = np.random.default_rng(seed + 2)
    owners = np.unique(ads.ad_advertiser_ids)
    blocked = [
        dataclasses.replace(r, exclude_ad_ids=rng.choice(ads.ad_ids, BLOCKED_ADS, replace=False),
                            exclude_advertiser_ids=rng.choice(owners, BLOCKED_ADVERTISERS))
        for r in requests
    ]  # fmt: skip
    for g, r in zip(stages[2].run(blocked), blocked, strict=True):
        at = np.searchsorted(ads.ad_ids, g.ad_ids, sorter=np.argsort(ads.ad_ids))
        owner = ads.ad_advertiser_ids[np.argsort(ads.ad_ids)[at]]
        assert not np.isin(g.ad_ids, r.exclude_ad_ids).any()
        assert not np.isin(owner, r.exclude_advertiser_ids).any()
    blocks_ms = statistics.median(timed(lambda: stages[2].run(blocked), repeat))
    ref_ms = statistics.median(timed(python_ref, repeat))
    encode_ms = statistics.median(timed(encode, repeat))
    rows = []
    for n, stage in stages.items():
        run_ms = statistics.median(timed(lambda s=stage: s.run(requests), repeat))
        rows.append(
            {
                "threads": n,
                "run_ms": round(run_ms, 3),
                "with_encode_ms": round(run_ms + encode_ms, 3),
                "speedup_run": round(ref_ms / run_ms, 1),
                "speedup_with_encode": round(ref_ms / (run_ms + encode_ms), 1),
            }
        )
    expanded = [w.ads_expanded for w in want]
    figures = {
        "ads": ads.num_ads,
        "leaves": len(ads.leaf_sids),
        "batch_size": BATCH,
        "leaves_per_request": BEAMS,
        "max_ads": MAX_ADS,
        "repeat": repeat,
        "expanded_per_request_mean": round(float(np.mean(expanded)), 1),
        "eligible_share": round(sum(w.ads_eligible for w in want) / sum(expanded), 4),
        "python_reference_ms": round(ref_ms, 3),
        "cpp_2_threads_with_blocks_ms": round(blocks_ms, 3),
        "encode_requests_ms": round(encode_ms, 3),
        "cpp": rows,
    }
    print(
        f"{ads.num_ads:,} ads: batch {BATCH} x "
        f"{figures['expanded_per_request_mean']:.0f} expanded ads "
        f"({figures['eligible_share']:.1%} eligible), medians of {repeat}"
    )
    print(f"  python reference          {ref_ms:9.3f} ms")
    print(f"  request encoding (Python) {encode_ms:9.3f} ms")
    print(f"  C++ 2 threads, with blocks {blocks_ms:8.3f} ms")
    for r in rows:
        print(
            f"  C++ {r['threads']} thread(s)            {r['run_ms']:9.3f} ms  "
            f"x{r['speedup_run']:<6} (with encoding {r['with_encode_ms']:.3f} ms, "
            f"x{r['speedup_with_encode']})"
        )
    return figures


if __name__ == "__main__":
    main()
