"""Decoder loop, the paper's Table 6 in one run (docs/PERFORMANCE.md; ARCHITECTURE.md §9:
P50 ≤ 12 ms, P99 ≤ 13 ms on an H200, GTM ≤ 0.3 ms).

B = 16 requests, beams (1, 512, 1024, 1024), 64 locations per request, the paper profile
with random weights. The rows, each one change from the row above:

    naive eager     the textbook loop (bench/baselines/ladder.py): per-beam cross K/V,
                    torch SDPA self-attention, dense KV (a reorder copies bytes), 1,024
                    rows every step, no mask
    + beam-as-query cross-attention K/V per request, beams as the query sequence
    + coalesced     gathered prefix, the coalesced self-attention kernel
    + fused         write + gather + attend in one kernel
    + paged KV      a reorder copies block ids, not KV bytes
    + dynamic beams (1, 512, 1024, 1024) rows instead of 1,024 at every step
    + CD, + bitmask GTM, + Bloom GTM   the catalog mask, then the targeting matchers
    served, eager   the served `DecodeEngine` (fused decoder step, 2 parts on 2 streams,
                    one-pass mask + log-softmax + score, one-launch bookkeeping), its
                    plans not captured
    served CD / + bitmask   CUDA graphs, CD only / CD + bitmask (one zero Bloom row)
    served          CD + bitmask + Bloom: what the server runs
    served FP8      the served engine on the model made FP8 at load (setting dtype = fp8)

GTM cost = served − served CD. Each row: P50/P99 over `--batches` batches (CUDA events
around each call, the GPU idle before it; `--naive-batches` for the naive row), cycling
through 8 distinct batches; the graph rows also `back_to_back_*` (the calls queued without
a sync: GPU time per batch). MFU = decoder FLOPs of the row's schedule × B / P50 / a bf16
8192³ matmul's rate after `--sustain-s` seconds of load (an H200 at its power limit lowers
its clock, as it does under the timed batches). A last row times the full compute stage
for one batch: features + encoder + decode loop. `--trace`: the kernels of the served
engine (and its FP8 twin), eager, 5 batches.

Requests: world users (`--world DIR`) or built from the index (`bench/indexes.py`). Index:
`--index ROOT` (a published root or version directory), else a synthetic one.

    python3 bench/bench_decoder_loop.py --index /data/index --out bench/results/decoder_loop.json
    .venv/bin/python bench/bench_decoder_loop.py --device cpu --profile tiny --small   # /tmp
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "cpu" in sys.argv or not torch.cuda.is_available():  # before any kernel module loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.baselines.ladder import Rung, TextbookSearch, bitmask_only
from bench.common import percentiles, timed, write_result
from bench.indexes import SCHEMAS, load_index, requests_for, synthetic_index
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import codec
from contracts.tensors import RequestTensors
from service.decode.engine import DecodeEngine
from service.index.loaded import LoadedIndex
from service.model.config import PROFILES, ModelConfig
from service.model.features import FeatureBatch, UserFeatures, prepare_features
from service.model.flops import decoder_flops
from service.model.precision import quantize_decoder
from service.model.retriever import GenerativeRetriever

CD, GTM = FilterMode.CD_ONLY, FilterMode.CD_GTM
NAIVE = Rung(cross="per_beam", self_attn="sdpa", kv="dense", fixed_beams=True, mask="none")
LADDER = [  # (key, label, the change to the rung above)
    ("naive", "naive eager", {}),
    ("bqa", "+ beam-as-query cross-attn", {"cross": "beam_as_query"}),
    ("coalesced", "+ coalesced self-attn", {"self_attn": "gather"}),
    ("fused", "+ fused self-attn", {"self_attn": "fused"}),
    ("paged", "+ paged KV", {"kv": "paged"}),
    ("dynamic", "+ dynamic beams", {"fixed_beams": False}),
    ("cd", "+ CD", {"mask": "cd"}),
    ("bitmask", "+ bitmask GTM", {"mask": "bitmask"}),
    ("bloom", "+ Bloom GTM", {"mask": "bloom"}),
]
SERVED = [  # (key, label, mode, bitmask only, FP8, CUDA graphs)
    ("served_eager", "served engine, eager", GTM, False, False, False),
    ("graph_cd", "served, CD", CD, False, False, True),
    ("graph_bitmask", "served, + bitmask GTM", GTM, True, False, True),
    ("served", "served: CD + bitmask + Bloom", GTM, False, False, True),
    ("served_fp8", "served, FP8", GTM, False, True, True),
]
ROWS = [k for k, *_ in LADDER] + [k for k, *_ in SERVED]


@dataclasses.dataclass
class Batch:
    features: FeatureBatch  # on the device, history width = max_history
    requests: RequestTensors  # on the device
    ctx: torch.Tensor  # [B, T_ctx, d_model]: the encoder's output for these features


def make_batches(index: LoadedIndex, model, a: argparse.Namespace, n: int) -> list[Batch]:
    config, rng = model.config, np.random.default_rng(a.seed)
    world = None
    if a.world:
        from index_builder.synth import load_world

        world = load_world(a.world)
    out = []
    for i in range(n):
        if world is not None:
            us = rng.choice(world.n_users, a.batch, replace=False).tolist()
            users = [UserFeatures(int(world.user_ids[u]), world.targeting[u], *world.history(u))
                     for u in us]  # fmt: skip
        else:
            ts = requests_for(index.arrays, a.batch, a.locations, a.seed + i, index.schema)
            users = [synthetic_user(index, t, config, rng) for t in ts]
        f = prepare_features(users, index.lookup, config, width=config.max_history).to(a.device)
        enc = codec(index.schema).encode_requests([u.targeting.values() for u in users])
        reqs = RequestTensors.from_encoded(enc, a.device)
        with torch.no_grad():
            out.append(Batch(f, reqs, model.encode(f)))
    return out


def synthetic_user(index: LoadedIndex, t: Targeting, config: ModelConfig, rng) -> UserFeatures:
    """A full history (max_history events) of random ads of the index."""
    n = config.max_history
    ads = index.lookup.ad_ids[rng.integers(0, len(index.lookup), n)]
    ts = 1_700_000_000_000 + np.sort(rng.integers(0, 30 * 86_400_000, n))
    return UserFeatures(int(rng.integers(1, 2**62)), t, ads, rng.integers(1, 4, n), ts)


def times_ms(fn: Callable[[int], object], n: int, cuda: bool, back_to_back: bool = False):
    """Milliseconds of fn(i) for i < n, after 2 warm-up calls. On GPU, CUDA events around
    each call: the device idles before each one, or with `back_to_back` the calls queue
    without a sync (each pair of events brackets one call's GPU work, host time hidden)."""
    for i in range(2):
        fn(i)
    if not cuda:
        calls = iter(range(n))
        return timed(lambda: fn(next(calls)), n, warmup=0)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]  # fmt: skip
    torch.cuda.synchronize()
    for i, (start, end) in enumerate(events):
        if not back_to_back:
            torch.cuda.synchronize()
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def stats(xs: list[float]) -> dict[str, float]:
    return {**percentiles(xs), "mean_ms": round(statistics.fmean(xs), 3), "batches": len(xs)}


def matmul_ceiling(device: str, dtype: torch.dtype, sustain_s: float) -> float:
    """FLOP/s of one n³ matmul (n = 8192 on CUDA, 1024 elsewhere), the median of 20 after
    `sustain_s` seconds of back-to-back ones (a GPU at its power limit)."""
    n = 8192 if device.startswith("cuda") else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    cuda = device.startswith("cuda")
    per = statistics.median(times_ms(lambda _: a @ b, 5, cuda))
    for _ in range(round(sustain_s * 1e3 / per)):
        a @ b
    ms = times_ms(lambda _: a @ b, 20, cuda, back_to_back=cuda)
    return 2 * n**3 / (statistics.median(ms) / 1e3)


def runner(decoder, fp8_decoder, index, key: str, bucket: int):
    """Row `key`'s search as run(batch, beams) -> DecodeResult, a call that counts its
    CUDA graphs, and the searcher (a `TextbookSearch` or the served `DecodeEngine`)."""
    if key in dict((k, c) for k, _, c in LADDER):
        rung = NAIVE
        for _, _, change in LADDER[: ROWS.index(key) + 1]:
            rung = dataclasses.replace(rung, **change)
        search = TextbookSearch(decoder, rung, index.tables, index.level_offsets)
        return (lambda b, beams: search.run(b.ctx, b.requests, beams)), lambda: 0, search
    _, _, mode, bitmask, fp8, graphs = next(r for r in SERVED if r[0] == key)
    engine = DecodeEngine(fp8_decoder if fp8 else decoder, batch_buckets=(bucket,))
    engine.cuda_graphs = engine.cuda_graphs and graphs  # the eager row: plans not captured
    plans = engine.plan(index.tables, index.level_offsets)

    def run(b: Batch, beams):
        reqs = bitmask_only(b.requests) if bitmask else b.requests
        return engine.run(plans, b.ctx, reqs, beams, mode)

    return run, lambda: plans.graphs, engine


def run_row(run, graphs, batches, beams, n: int, cuda: bool, graphed: bool) -> dict:
    t0 = time.perf_counter()
    results = [run(b, beams) for b in batches]  # plans and graphs made here
    row: dict = {"warm_s": round(time.perf_counter() - t0, 2)}

    def call(i: int) -> None:
        run(batches[i % len(batches)], beams)

    row.update(stats(times_ms(call, n, cuda)))
    if cuda and graphed:
        b2b = stats(times_ms(call, n, cuda, back_to_back=True))
        row.update(back_to_back_p50_ms=b2b["p50_ms"], back_to_back_p99_ms=b2b["p99_ms"])
    live = [float((r.leaves >= 0).sum(1).float().mean()) for r in results]
    row.update(graphs=graphs(), live_sids_per_request=round(statistics.fmean(live), 1),
               rows_per_step=list(results[0].rows_per_step))  # fmt: skip
    return row | {"_first": results[0]}


def sid_overlap(a, b) -> float:
    """Mean over requests of |a's SIDs ∩ b's SIDs| / |a's SIDs| (live leaves only)."""
    shares = []
    for la, lb in zip(a.leaves.tolist(), b.leaves.tolist(), strict=True):
        sa, sb = {x for x in la if x >= 0}, {x for x in lb if x >= 0}
        shares.append(len(sa & sb) / max(1, len(sa)))
    return round(statistics.fmean(shares), 4)


def full_compute(model, run, batches, beams, n: int, cuda: bool) -> dict:
    """Stages 2-3 for one batch: embedding + encoder + the served (graphed) decode loop."""

    def encode(i: int) -> torch.Tensor:
        with torch.no_grad():
            return model.encoder(model.embed(batches[i % len(batches)].features))

    def whole(i: int) -> None:
        b = batches[i % len(batches)]
        run(dataclasses.replace(b, ctx=encode(i)), beams)

    return {"features_encoder": stats(times_ms(encode, n, cuda)),
            "total": stats(times_ms(whole, n, cuda))}  # fmt: skip


def kernel_profile(decoder, index, batches, beams) -> list[dict]:
    """CUDA time per kernel over 5 eager batches of the served engine on `decoder`."""
    from torch.profiler import ProfilerActivity, profile

    engine = DecodeEngine(decoder, batch_buckets=(len(batches[0].ctx),))
    engine.cuda_graphs = False  # eager: the profiler names every kernel
    plans = engine.plan(index.tables, index.level_offsets)
    for b in batches[:2]:
        engine.run(plans, b.ctx, b.requests, beams, GTM)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches[:5]:
            engine.run(plans, b.ctx, b.requests, beams, GTM)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                    key=lambda e: e.device_time_total, reverse=True)  # fmt: skip
    total = sum(e.device_time_total for e in events)
    print(f"kernel time per batch: {total / 5e3:.3f} ms")
    out = []
    for e in events[:25]:
        out.append({"kernel": e.key[:90], "ms_per_batch": round(e.device_time_total / 5e3, 3),
                    "share": round(e.device_time_total / total, 3),
                    "calls_per_batch": e.count // 5})  # fmt: skip
        print(f"  {out[-1]['ms_per_batch']:8.3f} ms {out[-1]['share']:6.1%} "
              f"x{out[-1]['calls_per_batch']:<4} {out[-1]['kernel']}")  # fmt: skip
    return out


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['label']:<32} ERROR {r['error']}", flush=True)
        return
    b2b = (f", back to back {r['back_to_back_p50_ms']:.3f} / {r['back_to_back_p99_ms']:.3f}"
           if "back_to_back_p50_ms" in r else "")  # fmt: skip
    print(f"{r['label']:<32} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['batches']:>5} "
          f"{r['gflops_per_request']:>8.1f} {100 * r['mfu']:>6.1f}%  graphs {r['graphs']}, "
          f"warm {r['warm_s']} s, live SIDs/req {r['live_sids_per_request']}{b2b}",
          flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default="paper", choices=sorted(PROFILES))
    ap.add_argument("--index", type=Path, help="a published index (root or version dir)")
    ap.add_argument("--world", type=Path, help="a generated world: its users are the requests")
    ap.add_argument("--ads", type=int, default=1_000_000, help="synthetic index size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", type=int, nargs=4, help="default: the profile's schedule")
    ap.add_argument("--locations", type=int, default=64)
    ap.add_argument("--schema", choices=list(SCHEMAS), default="default",
                    help="targeting schema of the synthetic index: the default's four "
                    "attributes, or 'rich' (two more enums, 256 audiences and 32 interests "
                    "a request)")  # fmt: skip
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on CUDA")
    ap.add_argument("--batches", type=int, default=200, help="timed batches per row")
    ap.add_argument("--naive-batches", type=int, default=20, help="timed batches, naive row")
    ap.add_argument("--rows", help=f"comma list of rows to run, of {ROWS}")
    ap.add_argument("--no-full", action="store_true", help="skip the full compute stage row")
    ap.add_argument("--small", action="store_true", help="smoke run: small index, few batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sustain-s", type=float, default=None,
                    help="seconds of matmuls before the ceiling (default 3 on CUDA)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="result JSON (default: bench/results or /tmp)")
    ap.add_argument("--trace", action="store_true", help="the served engines' top CUDA kernels")
    a = ap.parse_args()
    distinct = 8  # batches cycled through by every row
    if a.small:
        a.ads, a.batch, a.batches, a.naive_batches, distinct = min(a.ads, 3000), 4, 3, 2, 2
    wanted = a.rows.split(",") if a.rows else ROWS
    if set(wanted) - set(ROWS):
        ap.error(f"unknown rows {sorted(set(wanted) - set(ROWS))}; rows are {ROWS}")
    cuda = a.device.startswith("cuda")
    config = PROFILES[a.profile]
    beams = tuple(a.beams or config.beams)
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    t0 = time.perf_counter()
    if a.index:
        arrays, schema = load_index(a.index)
    else:
        schema = SCHEMAS[a.schema]
        arrays = synthetic_index(a.ads, seed=a.seed, schema=schema)
    index = LoadedIndex.from_arrays(arrays, a.device, schema=schema)
    index_s = time.perf_counter() - t0
    torch.manual_seed(a.seed)
    with torch.device(a.device):  # initialise on the device: the paper tables are GBs
        model = GenerativeRetriever(config).to(dtype).eval()
    fp8_decoder = None
    if "served_fp8" in wanted:  # a second decoder, made FP8 as a load makes it
        fp8_decoder = quantize_decoder(copy.deepcopy(model.decoder))
    batches = make_batches(index, model, a, n=distinct)
    sustain = a.sustain_s if a.sustain_s is not None else 3.0 if cuda else 0.0
    ceiling = matmul_ceiling(a.device, dtype, sustain)
    print(f"{a.profile} profile, B={a.batch}, beams {beams}, {dtype}; index "
          f"{len(arrays.ads.leaf_sids):,} SIDs ({index_s:.0f} s); matmul ceiling "
          f"{ceiling / 1e12:.3f} TFLOP/s after {sustain:g} s of load", flush=True)  # fmt: skip
    rows, first = [], {}
    labels = {k: label for k, label, *_ in (*LADDER, *SERVED)}
    for key in (k for k in ROWS if k in wanted):
        fixed = key in ("naive", "bqa", "coalesced", "fused", "paged")
        flops = decoder_flops(config, (max(beams),) * 4 if fixed else beams).total
        row: dict = {"row": key, "label": labels[key],
                     "gflops_per_request": round(flops / 1e9, 1)}  # fmt: skip
        try:
            run, graphs, _ = runner(model.decoder, fp8_decoder, index, key, a.batch)
            graphed = key.startswith(("graph_", "served")) and key != "served_eager"
            n = a.naive_batches if key == "naive" else a.batches
            row |= run_row(run, graphs, batches, beams, n, cuda, graphed)
            first[key] = row.pop("_first")
            row["mfu"] = round(flops * a.batch / (row["p50_ms"] / 1e3) / ceiling, 3)
            if key == "served" and not a.no_full:
                row["full_compute"] = full_compute(model, run, batches, beams, a.batches, cuda)
        except Exception as exc:  # keep the other rows of a costly GPU run
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print_row(row)
        if cuda:
            torch.cuda.empty_cache()
    by = {r["row"]: r for r in rows if "p50_ms" in r}
    figures: dict = {
        "profile": a.profile, "batch": a.batch, "beams": list(beams), "dtype": str(dtype),
        "locations": a.locations if not a.world else "world users",
        "schema": a.schema if not a.index else "the index's",
        "index": str(a.index) if a.index else f"synthetic, {a.ads} ads (bench/indexes.py)",
        "sids": len(arrays.ads.leaf_sids), "matmul_ceiling_tflops": round(ceiling / 1e12, 3),
        "sustain_s": sustain, "rows": rows,
    }  # fmt: skip
    for name, base, top in (("eager", "cd", "bloom"), ("graph", "graph_cd", "served")):
        if base in by and top in by:
            figures[f"gtm_cost_{name}_ms"] = {
                k: round(by[top][k] - by[base][k], 3) for k in ("p50_ms", "p99_ms")
            }
    if "served" in first:  # the same search: equal, or (bf16 rounding) how many SIDs shared
        ref = first["served"]
        if "served_eager" in first:
            figures["graph_equals_eager"] = torch.equal(ref.leaves, first["served_eager"].leaves)
        for key in ("bloom", "served_fp8"):
            if key in first:
                figures[f"{key}_vs_served_sid_overlap"] = sid_overlap(first[key], ref)
    if a.trace and cuda:
        figures["trace"] = kernel_profile(model.decoder, index, batches, beams)
        if fp8_decoder is not None:
            figures["trace_fp8"] = kernel_profile(fp8_decoder, index, batches, beams)
    figures["targets"] = {"served_p50_ms": 12, "served_p99_ms": 13, "gtm_cost_ms": 0.3}
    print({k: v for k, v in figures.items() if k not in ("rows", "trace", "trace_fp8")})
    smoke = Path(f"/tmp/decoder_loop_{a.profile}_smoke.json") if a.small or not cuda else None
    print(write_result("decoder_loop", figures, a.out or smoke))


if __name__ == "__main__":
    main()
