"""CD+GTM mask benchmark (docs/ARCHITECTURE.md §7, §9 "GTM cost ≤ 0.5 ms"): the Triton kernel
(`kernels.gtm_mask`) against the torch reference (`kernels.gtm_mask.lookup`) on the rows of
one decode loop — 16 requests × 64 locations, beams (1, 512, 1024, 1024), so
(1, 512, 1024, 1024)·16 rows per step — for CD_ONLY, CD + bitmask and CD + bitmask +
Bloom. The GTM cost is (CD + GTM) − CD_ONLY summed over the 4 steps (paper: +8.4 ms).

Rows sit on realistic nodes: a beam search with random logits under the reference
CD + GTM mask picks each step's nodes, so every row is a prefix its request may reach
(dead rows parked on a leaf, as the decode engine does). Kernel and reference outputs are
checked identical before timing. GPU times are CUDA events per call, medians and P99 of
one run, with the L2 cache flushed before each call (the decoder's weights evict the
tables between two mask calls in the real loop; `--no-flush` for warm-cache numbers).

The index is synthetic unless `--index ROOT` names a published index (a root, whose
CURRENT version is read, or a version directory, as `grace build-index` writes them):
ads with realistic targeting mixes (country / age / gender rules, hierarchical location
rules) on random SIDs.

    .venv/bin/python bench/bench_gtm_mask.py                # -> bench/results/gtm_mask.json
    .venv/bin/python bench/bench_gtm_mask.py --index ROOT   # a published index
    .venv/bin/python bench/bench_gtm_mask.py --device cpu --small   # smoke run -> /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _wants_cpu(argv: list[str]) -> bool:
    if "--device=cpu" in argv:
        return True
    i = argv.index("--device") if "--device" in argv else -1
    return not torch.cuda.is_available() or (0 <= i < len(argv) - 1 and argv[i + 1] == "cpu")


if _wants_cpu(sys.argv):  # Triton's interpreter must be chosen before kernels import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import RESULTS, header, percentiles, timed  # noqa: E402
from contracts.index_format import VOCAB_SIZE, IndexArrays, read_index_dir  # noqa: E402
from contracts.request import FilterMode  # noqa: E402
from contracts.targeting import (  # noqa: E402
    AGE,
    AGE_BUCKETS,
    COUNTRY,
    GENDER,
    GENDERS,
    Ragged,
    Targeting,
    ad_bitmasks,
    country_index,
    encode_requests,
)
from contracts.tensors import GtmTables, RequestTensors  # noqa: E402
from index_builder.build import build_arrays  # noqa: E402
from index_builder.catalog import Catalog  # noqa: E402
from index_builder.publish import resolve  # noqa: E402
from kernels._triton_gtm_mask import _gtm_mask_autotuned, gtm_mask_triton  # noqa: E402
from kernels.gtm_mask import masked_logits_reference  # noqa: E402

HOME_COUNTRIES = ("US", "GB", "DE", "FR", "BR", "IN", "JP", "CA", "MX", "AU", "ES", "IT")
REGIONS, CITIES = 20, 25  # per country, per region
# variant name -> (mode, bloom)
VARIANTS = {
    "cd_only": (FilterMode.CD_ONLY, True),
    "cd_bitmask": (FilterMode.CD_GTM, False),
    "cd_bitmask_bloom": (FilterMode.CD_GTM, True),
}


# --------------------------------------------------------------------------- the index


def _ragged(counts: np.ndarray, values: np.ndarray) -> Ragged:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Ragged(offsets, values.astype(np.int32))


def synthetic_catalog(
    n_ads: int, ads_per_sid: int = 2, first_tokens: int = 32, seed: int = 0
) -> tuple[Catalog, np.ndarray]:
    """Ads with a realistic mix of targeting rules on random SIDs: (catalog, sids [N, 4])."""
    rng = np.random.default_rng(seed)
    weight = 1.0 / np.arange(1, len(HOME_COUNTRIES) + 1)  # Zipf: the US market is largest
    home = rng.choice(len(HOME_COUNTRIES), n_ads, p=weight / weight.sum())
    home_idx = np.array([country_index(c) for c in HOME_COUNTRIES])
    # countries: 15 % global, 70 % the home market, 15 % the home market and 1-3 more
    n_c = np.where(rng.random(n_ads) < 0.15, 0, 1)
    extra = np.where(rng.random(n_ads) < 0.15 / 0.85, rng.integers(1, 4, n_ads), 0) * n_c
    n_c = n_c + extra
    c_vals = home_idx[rng.integers(0, len(home_idx), n_c.sum())]
    ruled = n_c > 0
    c_vals[(np.cumsum(n_c) - n_c)[ruled]] = home_idx[home[ruled]]  # the home market first
    # ages: 60 % no rule, else a run of 1-4 consecutive buckets
    n_a = np.where(rng.random(n_ads) < 0.6, 0, rng.integers(1, 5, n_ads))
    lo = rng.integers(0, len(AGE_BUCKETS) - n_a + 1)
    a_vals = np.repeat(lo, n_a) + (np.arange(n_a.sum()) - np.repeat(np.cumsum(n_a) - n_a, n_a))
    # genders: 85 % no rule
    n_g = (rng.random(n_ads) < 0.15).astype(np.int64)
    g_vals = rng.integers(0, len(GENDERS), n_g.sum())
    bitmask = ad_bitmasks(_ragged(n_c, c_vals), _ragged(n_a, a_vals), _ragged(n_g, g_vals))
    # locations "CC", "CC/Rr", "CC/Rr/Cc": 55 % none, 25 % 1-2 regions, 20 % 1-10 cities
    names = [
        s
        for c in HOME_COUNTRIES
        for r in range(REGIONS)
        for s in (c, f"{c}/R{r}", *(f"{c}/R{r}/C{k}" for k in range(CITIES)))
    ]
    vocab = np.array(sorted(set(names)), dtype=object)
    ids = {s: i for i, s in enumerate(vocab)}
    regions = np.array([[ids[f"{c}/R{r}"] for r in range(REGIONS)] for c in HOME_COUNTRIES])
    cities = np.array(
        [[ids[f"{c}/R{r}/C{k}"] for r in range(REGIONS) for k in range(CITIES)]
         for c in HOME_COUNTRIES]
    )  # fmt: skip
    kind = rng.random(n_ads)
    n_l = np.where(kind < 0.55, 0, np.where(kind < 0.8, rng.integers(1, 3, n_ads), 0))
    n_l = np.where(kind >= 0.8, rng.integers(1, 11, n_ads), n_l)
    owner = np.repeat(np.arange(n_ads), n_l)
    is_city = np.repeat(kind >= 0.8, n_l)
    h = home[owner]
    l_vals = np.where(
        is_city,
        cities[h, rng.integers(0, REGIONS * CITIES, len(owner))],
        regions[h, rng.integers(0, REGIONS, len(owner))],
    )
    key = np.unique(owner.astype(np.int64) * len(vocab) + l_vals)  # sorted, unique per ad
    owner, l_vals = key // len(vocab), key % len(vocab)
    locs = _ragged(np.bincount(owner, minlength=n_ads), l_vals)
    # SIDs: the first token from `first_tokens` values only, so that a 1 M-SID trie has
    # the fan-out per level of the paper's 30 M SIDs over 512 first tokens (512, 512,
    # ~60, ~1 children for the nodes of steps 1..4), the rest uniform
    n_sids = max(1, n_ads // ads_per_sid)
    rest = rng.choice(VOCAB_SIZE**3, size=n_sids, replace=False)
    codes = np.unique(rng.integers(0, first_tokens, n_sids) * VOCAB_SIZE**3 + rest)
    digits = (codes[:, None] // VOCAB_SIZE ** np.arange(3, -1, -1)) % VOCAB_SIZE
    sids = digits[rng.integers(0, len(digits), n_ads)]
    catalog = Catalog(
        ad_id=np.arange(n_ads, dtype=np.int64),
        sid=sids.astype(np.int32),
        embedding=None,
        bitmask=bitmask,
        loc_offsets=locs.offsets,
        loc_ids=locs.values,
        locations=vocab,
        source="<synthetic>",
    )
    return catalog, sids


def synthetic_index(
    n_ads: int, ads_per_sid: int = 2, first_tokens: int = 32, seed: int = 0
) -> IndexArrays:
    catalog, sids = synthetic_catalog(n_ads, ads_per_sid, first_tokens, seed)
    return build_arrays(catalog, sids)


def load_index(root: Path) -> IndexArrays:
    _, arrays = read_index_dir(resolve(root), verify_checksums=False)
    return arrays


# --------------------------------------------------------------------------- requests


def _set_bits(words: np.ndarray, lo: int, n: int) -> list[int]:
    bits = np.arange(lo, lo + n)
    on = ((words[bits // 64] >> (bits % 64).astype(np.uint64)) & np.uint64(1)) == 1
    return bits[on].tolist()


def requests_for(index: IndexArrays, batch: int, n_loc: int, seed: int) -> list[Targeting]:
    """Requests that some ad of the index is eligible for: each copies a random ad's
    rules (one allowed country, age bucket and gender) and carries n_loc locations —
    the ad's own, then ones of the same country, then any."""
    rng = np.random.default_rng(seed)
    ads = index.ads
    vocab = ads.location_strings()
    by_country: dict[str, list[str]] = {}
    for s in vocab:
        by_country.setdefault(s.split("/")[0], []).append(s)
    out = []
    for ad in rng.choice(ads.num_ads, batch, replace=False).tolist():
        words = ads.ad_bitmask[ad]
        countries = _set_bits(words, COUNTRY.offset, len(COUNTRY.values))
        ages = _set_bits(words, AGE.offset, len(AGE.values))
        genders = _set_bits(words, GENDER.offset, len(GENDER.values))
        lo, hi = ads.ad_loc_offsets[ad], ads.ad_loc_offsets[ad + 1]
        own = [vocab[i] for i in ads.ad_loc_ids[lo:hi].tolist()]
        country = COUNTRY.values[rng.choice(countries) - COUNTRY.offset] if countries else ""
        if len(countries) == len(COUNTRY.values):  # no country rule: where its places are
            home = own[0].split("/")[0] if own else ""
            country = home if country_index(home) is not None else "US"
        age = 0
        if ages:
            bucket = AGE.values[rng.choice(ages) - AGE.offset]
            age = int(bucket.rstrip("+").split("-")[0])
        gender = GENDER.values[rng.choice(genders) - GENDER.offset] if genders else ""
        near = by_country.get(own[0].split("/")[0] if own else country, [])
        picks = list(dict.fromkeys(own))
        for pool in (near, vocab):
            extra = [pool[i] for i in rng.permutation(len(pool))[: 2 * n_loc]]
            picks += [s for s in extra if s not in picks][: n_loc - len(picks)]
        out.append(Targeting(country, age, gender, tuple(picks[:n_loc])))
    return out


def beam_nodes(
    tables: GtmTables,
    requests: RequestTensors,
    beams: tuple[int, ...],
    dead_node: int,
    seed: int,
) -> list[torch.Tensor]:
    """Each step's row nodes (int64 [B·M_t]) from a beam search with random logits under
    the reference CD + GTM mask; rows without a live candidate park on `dead_node`."""
    dev = requests.bitmask.device
    b = requests.bitmask.shape[0]
    gen = torch.Generator(device=dev).manual_seed(seed)
    node = torch.zeros(b, dtype=torch.int64, device=dev)
    steps = []
    for t, m in enumerate(beams):
        steps.append(node)
        if t + 1 == len(beams):
            break
        req = torch.arange(b, device=dev).repeat_interleave(m)
        logits = torch.randn(b * m, VOCAB_SIZE, generator=gen, device=dev)
        masked, child = masked_logits_reference(logits, tables, node, req, requests)
        top, flat = masked.view(b, -1).topk(beams[t + 1], dim=1)
        parent = (flat // VOCAB_SIZE + torch.arange(b, device=dev)[:, None] * m).view(-1)
        token = (flat % VOCAB_SIZE).view(-1)
        live = torch.isfinite(top).view(-1)
        node = torch.where(live, child[parent, token].long(), dead_node)
    return steps


# --------------------------------------------------------------------------- timing


def gpu_times(fn: Callable[[], object], repeat: int, warmup: int, flush: bool) -> list[float]:
    """Milliseconds of `repeat` calls, CUDA events around each; L2 flushed before each."""
    scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if flush else None
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeat)]  # fmt: skip
    for start, end in events:
        if scratch is not None:
            scratch.zero_()  # 256 MB > the H200's 50 MB L2
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def stats(xs: list[float]) -> dict[str, float]:
    return percentiles(xs, digits=4)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--index", type=Path, help="a published index (root or version dir)")
    ap.add_argument("--ads", type=int, default=2_000_000, help="synthetic index size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--locations", type=int, default=64)
    ap.add_argument("--beams", type=int, nargs=4, default=[1, 512, 1024, 1024])
    ap.add_argument("--repeat", type=int, default=200, help="timed calls of the kernel")
    ap.add_argument("--ref-repeat", type=int, default=20, help="timed calls of the reference")
    ap.add_argument("--no-flush", action="store_true", help="keep the L2 warm between calls")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="result JSON (default: bench/results or /tmp)")
    a = ap.parse_args()
    if a.small:
        a.ads, a.batch, a.beams = min(a.ads, 4000), min(a.batch, 2), [1, 8, 16, 16]
        a.repeat, a.ref_repeat = min(a.repeat, 5), min(a.ref_repeat, 5)
    cuda = a.device.startswith("cuda")
    out = a.out or (
        RESULTS / "gtm_mask.json" if cuda and not a.small else Path("/tmp/gtm_mask_smoke.json")
    )
    t0 = time.perf_counter()
    index = load_index(a.index) if a.index else synthetic_index(a.ads, seed=a.seed)
    build_s = time.perf_counter() - t0
    tables = GtmTables.from_arrays(index.trie, device=a.device)
    lo = index.trie.level_offsets
    dead_node = int(lo[-1]) - 1
    targeting = requests_for(index, a.batch, a.locations, a.seed)
    requests = RequestTensors.from_encoded(encode_requests(targeting), device=a.device)
    beams = tuple(a.beams)
    steps = beam_nodes(tables, requests, beams, dead_node, a.seed)
    gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
    flush = cuda and not a.no_flush

    def times(fn: Callable[[], object], repeat: int) -> list[float]:
        if cuda:
            return gpu_times(fn, repeat, warmup=3, flush=flush)
        return timed(fn, repeat, warmup=1)

    rows_out, calls = [], {}
    for t, node in enumerate(steps):
        r = node.shape[0]
        req = torch.arange(a.batch, device=a.device).repeat_interleave(beams[t])
        logits = torch.randn(r, VOCAB_SIZE, generator=gen, device=a.device)
        children = tables.node_offsets[node + 1] - tables.node_offsets[node]
        row = {
            "step": t + 1,
            "rows": r,
            "dead_rows": int((node == dead_node).sum()),
            "children_per_row": round(float(children.float().mean()), 2),
        }
        for name, (mode, bloom) in VARIANTS.items():
            args = (logits, tables, node, req, requests)
            gtm = mode == FilterMode.CD_GTM

            def ref(args=args, mode=mode, bloom=bloom):
                return masked_logits_reference(*args, mode, bloom=bloom)

            def kernel(args=args, gtm=gtm, bloom=bloom):
                return gtm_mask_triton(*args, gtm=gtm, bloom=bloom)

            want, got = ref(), kernel()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (t, name)
            calls[(t, name)] = kernel
            ref_ms, ker_ms = times(ref, a.ref_repeat), times(kernel, a.repeat)
            row[name] = {
                "allowed_per_row": round(float(torch.isfinite(want[0]).sum(1).float().mean()), 2),
                "reference": stats(ref_ms),
                "kernel": stats(ker_ms),
                "speedup": round(statistics.median(ref_ms) / statistics.median(ker_ms), 1),
            }
            best = getattr(_gtm_mask_autotuned, "best_config", None) if cuda else None
            if best is not None:  # what autotuning picked for this step's key
                row[name]["kernel_config"] = {**best.kwargs, "num_warps": best.num_warps}
        rows_out.append(row)

    # the whole loop's masks back to back, one timed unit per variant
    loop = {}
    for name in VARIANTS:
        fns = [calls[(t, name)] for t in range(len(steps))]
        loop[name] = stats(times(lambda fns=fns: [f() for f in fns], a.repeat))

    def summed(impl: str, name: str) -> float:
        return sum(row[name][impl]["p50_ms"] for row in rows_out)

    cost = {
        impl: {
            v: round(summed(impl, v) - summed(impl, "cd_only"), 4)
            for v in ("cd_bitmask", "cd_bitmask_bloom")
        }
        for impl in ("reference", "kernel")
    }
    cost["kernel_loop"] = {
        v: {k: round(loop[v][k] - loop["cd_only"][k], 4) for k in ("p50_ms", "p99_ms")}
        for v in ("cd_bitmask", "cd_bitmask_bloom")
    }
    figures = {
        "index": str(a.index)
        if a.index
        else f"synthetic, {a.ads} ads, 2 ads per SID, 32 first tokens",
        "index_seconds": round(build_s, 1),
        "sids": len(index.ads.leaf_sids),
        "nodes": index.trie.num_nodes,
        "child_entries": index.trie.num_entries,
        "batch": a.batch,
        "locations": int(requests.blooms.shape[1]),
        "beams": list(beams),
        "l2_flushed": flush,
        "kernel": "triton" if cuda else "triton interpreter (TRITON_INTERPRET=1)",
        "repeat": {"kernel": a.repeat, "reference": a.ref_repeat},
        "steps": rows_out,
        "loop": loop,
        "gtm_cost_ms": cost,
        "target_gtm_cost_ms": 0.5,
        "paper_gtm_cost_ms": 8.4,
    }
    print_table(figures)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header(), "figures": figures}, indent=1) + "\n")
    print(out)


def print_table(f: dict) -> None:
    print(
        f"{f['sids']:,} SIDs, {f['nodes']:,} nodes; batch {f['batch']} x {f['locations']} "
        f"locations; beams {f['beams']}; {f['kernel']}; L2 flushed: {f['l2_flushed']}"
    )
    print(f"{'step':>4} {'rows':>6} {'kids':>6} {'variant':<17} {'allowed':>8} "
          f"{'ref p50':>9} {'ref p99':>9} {'ker p50':>9} {'ker p99':>9} {'x':>7}")  # fmt: skip
    for row in f["steps"]:
        for name in VARIANTS:
            v = row[name]
            print(
                f"{row['step']:>4} {row['rows']:>6} {row['children_per_row']:>6} {name:<17} "
                f"{v['allowed_per_row']:>8} {v['reference']['p50_ms']:>9.3f} "
                f"{v['reference']['p99_ms']:>9.3f} {v['kernel']['p50_ms']:>9.3f} "
                f"{v['kernel']['p99_ms']:>9.3f} {v['speedup']:>7}"
            )
    for name, s in f["loop"].items():
        print(f"loop, kernel, {name:<17} p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms")
    c = f["gtm_cost_ms"]
    k, ref = c["kernel"], c["reference"]
    print(
        f"GTM cost (with - without, p50 summed over the steps): kernel bitmask "
        f"{k['cd_bitmask']:.3f} ms, bitmask+Bloom {k['cd_bitmask_bloom']:.3f} ms "
        f"(target <= {f['target_gtm_cost_ms']} ms; paper {f['paper_gtm_cost_ms']} ms); "
        f"reference bitmask+Bloom {ref['cd_bitmask_bloom']:.3f} ms"
    )


if __name__ == "__main__":
    main()
