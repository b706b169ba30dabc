"""Decoder loop, the paper's Table 6 in one run (ARCHITECTURE.md §9: P50 ≤ 12 ms, P99 ≤ 13 ms on
an H200; the GTM rows together ≤ 0.5 ms).

B = 16 requests, beams (1, 512, 1024, 1024), 64 locations per request, the paper profile
with random bf16 weights. Each row adds one optimisation to the row above — all of them
`DecodeOptions` switches (`bench/baselines/decode_variants.py`) of the one engine
(`service/decode/engine.py`; the final row runs the served `DecodeEngine` itself):

    naive eager      per-beam cross K/V, torch SDPA self-attention, dense KV (reorder
                     copies bytes), fixed beams (1024 rows every step), no mask
    + beam-as-query  cross-attention K/V per request, beams as the query sequence
    + coalesced      gather + `prefix_self_attention` kernel
    + fused          `fused_self_attention` (write + gather + attend in one kernel)
    + paged KV       reorder copies block ids, not KV bytes
    + dynamic beams  (1, 512, 1024, 1024) instead of 1024 rows at every step
    + CD             catalog mask (CD_ONLY)
    + bitmask GTM    CD + bitmask targeting
    + Bloom GTM      CD + bitmask + Bloom (the serving mode), still eager
    CUDA graph rows  the last three again, each loop captured as one CUDA graph
    + fused layers   `FusedDecoderStep`: layer-0 QKV table, residual adds inside the
                     matmuls, shifted LayerNorm kernel, GELU in the matmul epilogue
    + 2 streams      the batch decoded as 2 halves on 2 CUDA streams inside the one graph:
                     one half's memory-bound kernels run beside the other's matmuls
    + one-pass tail  mask + log-softmax + score in the mask kernel (no cast, softmax,
                     add and fill passes over [R, V]); layer 0's QKV table read by the
                     self-attention kernel instead of gathered into a copy first
    + one launch     each step's bookkeeping after top-k (parents, tokens, liveness,
                     child nodes) in one Triton kernel instead of ~10 torch launches
    comparisons      the final row with one switch changed (not served): the Triton
                     GELU-epilogue GEMM, no stream split, 4 parts on 4 streams, the
                     bookkeeping through torch.compile instead of the kernel

Each row: P50/P99 over `--batches` batches (CUDA events around `engine.run`, inputs
already on the device, the GPU idle before each call; `--naive-batches` for the slow
naive row), cycling through 8 distinct batches (2 with `--small`); the CUDA graph rows
also report `back_to_back_p50_ms` / `back_to_back_p99_ms`, the same calls queued without
a synchronisation in between (GPU time per batch, host jitter hidden); MFU = decoder
FLOPs of the row's schedule (service/model/flops.py) × B / P50 / a bf16 matmul ceiling
(8192³) measured in the same run, as a short burst (`mfu`) and after `--sustain-s`
seconds of load (`mfu_vs_sustained`: an H200 at its 700 W limit lowers its clock, as it
does under the decode loop's timed batches); the graph rows' `tail` / `back_to_back_tail`
say which samples made the tail and which batches they ran. A last row times the full
compute stage for one batch: features (embedding) + encoder + decode loop.

`--ab ROW,ROW,...` times the given rows interleaved instead — round i runs each row once
on batch i, in an order rotated every round — and reports each row's paired difference
from the first (median, P10/P90, share of rounds faster) and whether its SIDs equal the
first's: under a power-capped clock, rows timed one after the other differ by more than
the ~0.1 ms changes worth measuring (`bench/results/decoder_loop_ab.json` on CUDA).

Requests: world users (`--world DIR`) or built from the index: each copies one ad's rules
and carries exactly `--locations` locations of the index's vocabulary (bench_gtm_mask's
`requests_for`). Index: `--index ROOT` (a published root or version directory), else a
synthetic one built here (bench_gtm_mask's `synthetic_index`).

    .venv/bin/python bench/bench_decoder_loop.py --index /data/index   # -> bench/results
    .venv/bin/python bench/bench_decoder_loop.py --device cpu --profile tiny --small  # /tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

from bench.baselines.decode_variants import DecodeOptions, VariantEngine
from bench.bench_gtm_mask import load_index, requests_for, synthetic_index
from bench.common import header, percentiles, write_result
from contracts.request import FilterMode
from contracts.targeting import Targeting, encode_requests
from contracts.tensors import RequestTensors
from service.decode.engine import DecodeEngine
from service.index.loaded import LoadedIndex
from service.model.config import PROFILES, ModelConfig
from service.model.features import FeatureBatch, UserFeatures, prepare_features
from service.model.flops import decoder_flops
from service.model.retriever import GenerativeRetriever

CD, GTM = FilterMode.CD_ONLY, FilterMode.CD_GTM
NAIVE = DecodeOptions(
    cross="per_beam", self_attn="sdpa", kv="dense", fixed_beams=True, mask=False,
    cuda_graph=False, fused_layers=False, streams=1, fused_tail=False, advance="eager",
)  # fmt: skip


def _rows() -> list[tuple[str, str, DecodeOptions, FilterMode]]:
    """(key, label, options, mode): each row one switch away from the one above."""
    steps = [
        ("naive", "naive eager", {}, CD),
        ("bqa", "+ beam-as-query cross-attn", {"cross": "beam_as_query"}, CD),
        ("coalesced", "+ coalesced self-attn", {"self_attn": "gather"}, CD),
        ("fused", "+ fused self-attn", {"self_attn": "fused"}, CD),
        ("paged", "+ paged KV", {"kv": "paged"}, CD),
        ("dynamic", "+ dynamic beams", {"fixed_beams": False}, CD),
        ("cd", "+ CD", {"mask": True}, CD),
        ("bitmask", "+ bitmask GTM", {"bloom": False}, GTM),
        ("bloom", "+ Bloom GTM", {"bloom": True}, GTM),
        ("graph_cd", "CUDA graph, CD", {"cuda_graph": True}, CD),
        ("graph_bitmask", "CUDA graph, + bitmask GTM", {"bloom": False}, GTM),
        ("graph_bloom", "CUDA graph, + Bloom GTM", {"bloom": True}, GTM),
        ("graph_fused", "+ fused layer ops", {"fused_layers": True}, GTM),
        ("graph_streams", "+ 2 parts on 2 streams", {"streams": 2}, GTM),
        ("graph_tail", "+ one-pass tail", {"fused_tail": True}, GTM),
        ("graph_advance", "+ one-launch bookkeeping (final)", {"advance": "kernel"}, GTM),
    ]
    # comparisons, not served: each changes one switch of the final row
    comparisons = [
        # cuBLASLt's GELU epilogue is faster (PERFORMANCE.md)
        ("graph_triton_ffn", "final, Triton GELU-epilogue GEMM", {"ffn_up": "triton"}, GTM),
        ("graph_one_part", "final, 1 part (no stream split)", {"streams": 1}, GTM),
        ("graph_four_parts", "final, 4 parts on 4 streams", {"streams": 4}, GTM),
        ("graph_compiled", "final, torch.compile'd bookkeeping", {"advance": "compiled"}, GTM),
        # the opt-in FP8 step (docs/FP8.md): the served engine with fp8=True
        ("graph_fp8", "final, FP8 linear layers", {"fp8": True}, GTM),
        # ... its FFN as served until the 1 x 128 one: rowwise GEMMs, a GELU pass between
        ("graph_fp8_rowwise", "final, FP8, rowwise FFN", {"fp8": True, "fp8_ffn": "rowwise"}, GTM),
        # ... its GELU's tanh from exp and a division, not tanh.approx.f32 (docs/FP8.md)
        (
            "graph_fp8_exp_tanh",
            "final, FP8, exp tanh GELU",
            {"fp8": True, "fp8_ffn": "exp_tanh"},
            GTM,
        ),
        # ... its FFN's down GEMM in Triton, not cuBLASLt's block-scaled one
        (
            "graph_fp8_triton_down",
            "final, FP8, Triton down GEMM",
            {"fp8": True, "fp8_ffn": "triton_down"},
            GTM,
        ),
        # ... with the up GEMM's K steps added in fp32 (cuBLASLt's accumulation; its cost)
        (
            "graph_fp8_promoted",
            "final, FP8, up GEMM promoted",
            {"fp8": True, "fp8_ffn": "promoted"},
            GTM,
        ),
        # ... with the up GEMM one program per tile, loading by pointers (not persistent)
        (
            "graph_fp8_pointer_up",
            "final, FP8, up GEMM not persistent",
            {"fp8": True, "fp8_ffn": "pointer_up"},
            GTM,
        ),
    ]
    out, options = [], NAIVE
    for key, label, change, mode in steps:
        options = dataclasses.replace(options, **change)
        out.append((key, label, options, mode))
    for key, label, change, mode in comparisons:
        out.append((key, label, dataclasses.replace(options, **change), mode))
    return out


ROWS = _rows()
FINAL_ROW = "graph_advance"  # the served configuration; rows after it are comparisons
# the FP8 rows whose FFN is not the served one: SIDs compared with graph_fp8's, traced eagerly
FP8_VARIANT_ROWS = ("graph_fp8_rowwise", "graph_fp8_exp_tanh", "graph_fp8_triton_down",
                    "graph_fp8_promoted", "graph_fp8_pointer_up")  # fmt: skip


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Batch:
    features: FeatureBatch  # on the device, history width = max_history
    requests: RequestTensors  # on the device
    ctx: torch.Tensor  # [B, T_ctx, d_model]: the encoder's output for these features


def make_batches(
    index: LoadedIndex, model: GenerativeRetriever, a: argparse.Namespace, n: int
) -> list[Batch]:
    config, rng = model.config, np.random.default_rng(a.seed)
    world = None
    if a.world:
        from index_builder.synth import load_world

        world = load_world(a.world)
    out = []
    for i in range(n):
        if world is not None:
            us = rng.choice(world.n_users, a.batch, replace=False).tolist()
            users = [
                UserFeatures(int(world.user_ids[u]), world.targeting[u], *world.history(u))
                for u in us
            ]
        else:
            ts = requests_for(index.arrays, a.batch, a.locations, a.seed + i)
            users = [synthetic_user(index, t, config, rng) for t in ts]
        f = prepare_features(users, index.lookup, config, width=config.max_history)
        f = f.to(a.device)
        targeting = [u.targeting for u in users]
        reqs = RequestTensors.from_encoded(encode_requests(targeting), a.device)
        with torch.no_grad():
            ctx = model.encode(f)
        out.append(Batch(f, reqs, ctx))
    return out


def synthetic_user(
    index: LoadedIndex, t: Targeting, config: ModelConfig, rng: np.random.Generator
) -> UserFeatures:
    """A full history (max_history events) of random ads of the index."""
    n = config.max_history
    ads = index.lookup.ad_ids[rng.integers(0, len(index.lookup), n)]
    ts = 1_700_000_000_000 + np.sort(rng.integers(0, 30 * 86_400_000, n))
    return UserFeatures(int(rng.integers(1, 2**62)), t, ads, rng.integers(1, 4, n), ts)


# --------------------------------------------------------------------------- timing


def times_ms(
    fn: Callable[[int], object], n: int, cuda: bool, warmup: int, back_to_back: bool = False
) -> list[float]:
    """Milliseconds of fn(i) for i < n. On GPU, CUDA events around each call: by default
    the device idles before each one (launch-bound eager rows are charged their host time
    too); `back_to_back` queues the calls without a sync in between, so each pair of
    events brackets one call's GPU work and host time (Python, the launch, a GC pause)
    stays hidden while the host keeps ahead — as the server's compute thread does under
    load."""
    for i in range(warmup):
        fn(i)
    if cuda:
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
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    return {**percentiles(xs), "mean_ms": round(statistics.fmean(xs), 3), "batches": len(xs)}


def tail_spread(xs: list[float], distinct: int, over_ms: float = 1.0) -> dict[str, list]:
    """Where a row's tail comes from: sample i ran batch i % `distinct`. Per batch its
    median and worst time, and the samples slower than the row's median + `over_ms` (their
    positions in the run: clustered in time, or always the same batch?). A tail made by
    the data shows as one batch slow every time; a tail made by the GPU or the host as
    scattered samples of every batch. A run shorter than `distinct` samples (`--batches 2`
    under Nsight Compute) lists only the batches it ran."""
    med = statistics.median(xs)
    per = [xs[j::distinct] for j in range(min(distinct, len(xs)))]
    slow = [i for i, x in enumerate(xs) if x > med + over_ms]
    return {
        "per_batch_p50_ms": [round(statistics.median(p), 3) for p in per],
        "per_batch_max_ms": [round(max(p), 3) for p in per],
        f"samples_over_p50_plus_{over_ms:g}_ms": slow,
        "their_batches": [i % distinct for i in slow],
        "their_ms": [round(xs[i], 3) for i in slow],
    }


def matmul_ceiling(device: str, dtype: torch.dtype, n: int, sustain_s: float = 0.0) -> float:
    """FLOP/s of one n³ matmul (median of 20), the MFU denominator. With `sustain_s`, the
    20 timed products follow `sustain_s` seconds of back-to-back ones: the ceiling of a
    GPU that has reached its power limit (an H200 lowers its clock there), as the decode
    loop's timed batches do, instead of a short burst at the boost clock."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    cuda = device.startswith("cuda")
    warmup = 5
    if sustain_s > 0:
        per = statistics.median(times_ms(lambda _: a @ b, 5, cuda, warmup=2))
        warmup = max(5, round(sustain_s * 1e3 / per))
    ms = times_ms(lambda _: a @ b, 20, cuda, warmup=warmup, back_to_back=sustain_s > 0)
    return 2 * n**3 / (statistics.median(ms) / 1e3)


# --------------------------------------------------------------------------- main


class Bound:
    """One row's engine bound to the index's plans: the served `DecodeEngine` for the
    served options, else `VariantEngine` with the row's switches."""

    def __init__(self, model, index, options: DecodeOptions, bucket: int) -> None:
        self.options = options
        served = options.fp8_ffn == "block" and dataclasses.replace(options, fp8=False)
        if served == DecodeOptions():  # the served engine, in bf16 or FP8
            self.engine = DecodeEngine(model.decoder, batch_buckets=(bucket,), fp8=options.fp8)
        else:
            self.engine = VariantEngine(model.decoder, options, batch_buckets=(bucket,))
        self.plans = self.engine.plan(index.tables, index.level_offsets)

    @property
    def graphs(self) -> int:
        return self.plans.graphs

    def run(self, ctx, requests, beams, mode):
        return self.engine.run(self.plans, ctx, requests, beams, mode)


def warm_engine(model, index, batches, options, mode, beams) -> tuple:
    """One row's engine, run once on every batch (its plans and graphs made): the engine,
    those results, and a call that runs it on batch i % len(batches)."""
    engine = Bound(model, index, options, len(batches[0].ctx))
    results = [engine.run(b.ctx, b.requests, beams, mode) for b in batches]

    def call(i: int) -> None:
        b = batches[i % len(batches)]
        engine.run(b.ctx, b.requests, beams, mode)

    return engine, results, call


def run_row(model, index, batches, options, mode, beams, n, cuda) -> tuple[dict, Bound]:
    t0 = time.perf_counter()
    engine, results, call = warm_engine(model, index, batches, options, mode, beams)
    warm_s = time.perf_counter() - t0
    xs = times_ms(call, n, cuda, warmup=2)
    row = stats(xs)
    if cuda and options.cuda_graph:  # the same calls queued back to back: GPU time alone
        ys = times_ms(call, n, cuda, warmup=2, back_to_back=True)
        b2b = stats(ys)
        row.update(back_to_back_p50_ms=b2b["p50_ms"], back_to_back_p99_ms=b2b["p99_ms"])
        nb = len(batches)
        row.update(tail=tail_spread(xs, nb), back_to_back_tail=tail_spread(ys, nb))
    live = [float((r.leaves >= 0).sum(1).float().mean()) for r in results]
    row.update(
        warm_s=round(warm_s, 2),
        graphs=engine.graphs,
        live_sids_per_request=round(statistics.fmean(live), 1) if options.mask else None,
        rows_per_step=list(results[0].rows_per_step),
    )
    return row, engine


def times_interleaved(
    calls: list[Callable[[int], object]], n: int, cuda: bool
) -> list[list[float]]:
    """Milliseconds of n rounds: in round i every call runs once on batch i, the GPU idle
    before each (as `times_ms`), in an order rotated by one each round. Rows compared this
    way share the GPU's clock and thermal state round by round; rows run one after the
    other do not (an H200 at its power limit moves its clock by 15-30 %)."""
    out: list[list[float]] = [[] for _ in calls]
    k = len(calls)
    for i in range(n + 2):  # two warm-up rounds
        for j in range(k):
            c = (i + j) % k
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                calls[c](i)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t = time.perf_counter()
                calls[c](i)
                ms = (time.perf_counter() - t) * 1e3
            if i >= 2:
                out[c].append(ms)
    return out


def paired(base: list[float], other: list[float]) -> dict[str, float]:
    """`other` − `base` round by round: the median difference, its 10th and 90th
    percentiles, and the share of rounds where `other` was faster."""
    d = np.asarray(other) - np.asarray(base)
    return {
        "median_diff_ms": round(float(np.median(d)), 3),
        "p10_diff_ms": round(float(np.percentile(d, 10)), 3),
        "p90_diff_ms": round(float(np.percentile(d, 90)), 3),
        "faster_share": round(float((d < 0).mean()), 3),
    }


def ab_compare(model, index, batches, keys: list[str], beams, n: int, cuda: bool) -> dict:
    """The rows `keys` (the first is the baseline) timed interleaved, round by round, on
    the same batches: per row P50/P99, and each other row's paired difference from the
    baseline; and whether each row returned the baseline's SIDs (where not, as bf16 rows
    that round differently may, the SID overlap of the first batch)."""
    by_key = {r[0]: r for r in ROWS}
    calls, results, warm_s = [], [], []
    for key in keys:
        _, _, options, mode = by_key[key]
        t0 = time.perf_counter()
        _, warm, call = warm_engine(model, index, batches, options, mode, beams)
        warm_s.append(round(time.perf_counter() - t0, 2))  # plans, graphs, compiles
        calls.append(call)
        results.append(warm)
    times = times_interleaved(calls, n, cuda)
    rows = []
    for j, key in enumerate(keys):
        row = {"row": key, "label": by_key[key][1], **stats(times[j]), "warm_s": warm_s[j]}
        if j:
            row["vs_baseline"] = paired(times[0], times[j])
            pairs = zip(results[0], results[j], strict=True)
            same = all(torch.equal(x.sids, y.sids) for x, y in pairs)
            row["equals_baseline"] = same
            if not same:
                row["sid_overlap_with_baseline"] = sid_overlap(results[j][0], results[0][0])
        rows.append(row)
    return {"baseline": keys[0], "rounds": n, "rows": rows}


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
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on CUDA")
    ap.add_argument("--batches", type=int, default=200, help="timed batches per row")
    ap.add_argument("--naive-batches", type=int, default=50, help="timed batches, naive row")
    ap.add_argument("--rows", help=f"comma list of rows to run, of {[r[0] for r in ROWS]}")
    ap.add_argument("--ab", help="comma list of rows to time interleaved round by round "
                    "instead (the first is the baseline of the paired differences)")  # fmt: skip
    ap.add_argument("--no-full", action="store_true", help="skip the full compute stage row")
    ap.add_argument("--small", action="store_true", help="smoke run: small index, few batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sustain-s", type=float, default=None,
                    help="seconds of back-to-back matmuls before the second (sustained, "
                    "power-limited) ceiling; default 3 on CUDA, 0 (a burst like the "
                    "first) on the CPU")  # fmt: skip
    ap.add_argument("--out", type=Path, help="result JSON (default: bench/results or /tmp)")
    ap.add_argument("--trace", action="store_true",
                    help="also profile the final configuration (eager; with the graph_fp8 and "
                    "other graph_fp8_* rows their FP8 twins too) and print the top CUDA kernels: "
                    "where the milliseconds go")  # fmt: skip
    a = ap.parse_args()
    distinct = 8  # batches cycled through by every row
    if a.small:
        a.ads, a.batch, a.batches, a.naive_batches = min(a.ads, 3000), min(a.batch, 4), 3, 2
        distinct = 2
    cuda = a.device.startswith("cuda")
    config = PROFILES[a.profile]
    beams = tuple(a.beams or config.beams)
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    t0 = time.perf_counter()
    arrays = load_index(a.index) if a.index else synthetic_index(a.ads, seed=a.seed)
    index = LoadedIndex.from_arrays(arrays, a.device)
    index_s = time.perf_counter() - t0
    torch.manual_seed(a.seed)
    with torch.device(a.device):  # initialise on the device: the paper tables are GBs
        model = GenerativeRetriever(config).to(dtype).eval()
    batches = make_batches(index, model, a, n=distinct)
    ceiling = matmul_ceiling(a.device, dtype, 8192 if cuda else 1024)
    if a.sustain_s is None:
        a.sustain_s = 3.0 if cuda else 0.0
    sustained = matmul_ceiling(a.device, dtype, 8192 if cuda else 1024, a.sustain_s)
    print(f"{a.profile} profile, B={a.batch}, beams {beams}, {dtype}; index "
          f"{len(arrays.ads.leaf_sids):,} SIDs ({index_s:.0f} s); matmul ceiling "
          f"{ceiling / 1e12:.3f} TFLOP/s, after {a.sustain_s:g} s of load "
          f"{sustained / 1e12:.3f}", flush=True)  # fmt: skip
    wanted = set(a.rows.split(",")) if a.rows else {r[0] for r in ROWS}
    ab = a.ab.split(",") if a.ab else []
    figures_ab = None
    if (wanted | set(ab)) - {r[0] for r in ROWS}:
        ap.error(f"unknown rows {sorted((wanted | set(ab)) - {r[0] for r in ROWS})}")
    if ab:
        if len(ab) < 2 or len(set(ab)) < len(ab):
            ap.error("--ab needs two or more distinct rows")
        figures_ab = ab_compare(model, index, batches, ab, beams, a.batches, cuda)
        for r in figures_ab["rows"]:
            print(f"{r['label']:<40} P50 {r['p50_ms']:.3f}  P99 {r['p99_ms']:.3f}"
                  + (f"  vs baseline {r['vs_baseline']}, same SIDs {r['equals_baseline']}"
                     if "vs_baseline" in r else "  (baseline)"), flush=True)  # fmt: skip
        wanted = set()  # the A/B run replaces the table's rows
    rows: list[dict] = []
    final = eager_bloom = unfused = triton_ffn = fp8 = None
    fp8_forms: dict[str, object] = {}  # the other FP8 FFNs' results, compared below
    same_arithmetic = {}  # rows that must return exactly the final row's result
    for key, label, options, mode in ROWS:
        if key not in wanted:
            continue
        widths = (max(beams),) * 4 if options.fixed_beams else beams
        flops = decoder_flops(config, widths).total
        n = a.naive_batches if key == "naive" else a.batches
        row: dict = {"row": key, "label": label, "options": dataclasses.asdict(options),
                     "mode": mode.name, "gflops_per_request": round(flops / 1e9, 1)}  # fmt: skip
        try:
            timing, engine = run_row(model, index, batches, options, mode, beams, n, cuda)
            row.update(timing)
            row["mfu"] = round(flops * a.batch / (row["p50_ms"] / 1e3) / ceiling, 3)
            row["mfu_vs_sustained"] = round(flops * a.batch / (row["p50_ms"] / 1e3) / sustained, 3)
            if key == "bloom":
                eager_bloom = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key == "graph_bloom":
                unfused = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key == "graph_triton_ffn":  # not served: compared with the final row below
                triton_ffn = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key == "graph_fp8":  # opt-in: its SIDs compared with the final row's below
                fp8 = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key in FP8_VARIANT_ROWS:  # not served: compared with the rows above
                fp8_forms[key] = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key in ("graph_tail", "graph_compiled"):  # other bookkeeping, same arithmetic
                same_arithmetic[key] = engine.run(batches[0].ctx, batches[0].requests, beams, mode)
            if key == FINAL_ROW:
                final = engine
            else:
                del engine
        except Exception as exc:  # keep the other rows of a costly GPU run
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print_row(row, flush=True)
        if cuda:
            torch.cuda.empty_cache()
    figures: dict = {
        "profile": a.profile,
        "batch": a.batch,
        "beams": list(beams),
        "locations": a.locations if not a.world else "world users",
        "dtype": str(dtype),
        "index": str(a.index) if a.index else f"synthetic, {a.ads} ads (bench_gtm_mask)",
        "sids": len(arrays.ads.leaf_sids),
        "matmul_ceiling_tflops": round(ceiling / 1e12, 3),
        "matmul_ceiling_sustained_tflops": round(sustained / 1e12, 3),
        "sustain_s": a.sustain_s,
        "cuda_graph": cuda,
        "rows": rows,
    }
    if figures_ab is not None:
        figures["ab"] = figures_ab
    by = {r["row"]: r for r in rows if "p50_ms" in r}
    for name, base, top in (("eager", "cd", "bloom"), ("graph", "graph_cd", "graph_bloom")):
        if base in by and top in by:
            figures[f"gtm_cost_{name}_ms"] = {
                k: round(by[top][k] - by[base][k], 3) for k in ("p50_ms", "p99_ms")
            }
    if final is not None:
        b0 = batches[0]
        again = final.run(b0.ctx, b0.requests, beams, GTM)
        eager_options = dataclasses.replace(final.options, cuda_graph=False)
        eager = Bound(model, index, eager_options, len(b0.ctx)).run(b0.ctx, b0.requests, beams, GTM)
        figures["graph_equals_eager"] = bool(torch.equal(again.leaves, eager.leaves))
        others = [("unfused_graph", unfused), ("unfused_eager", eager_bloom)]
        for name, other in others:
            if other is not None:  # bf16 rounding differs: how many SIDs both return
                figures[f"fused_vs_{name}_sid_overlap"] = sid_overlap(again, other)
        if triton_ffn is not None:  # bf16 rounding differs between the two GEMMs
            figures["triton_ffn_vs_final_sid_overlap"] = sid_overlap(triton_ffn, again)
        if fp8 is not None:  # random weights: the trained model's overlap is grace eval's
            figures["fp8_vs_final_sid_overlap"] = sid_overlap(fp8, again)
        for key, result in fp8_forms.items():
            name = key.removeprefix("graph_")
            figures[f"{name}_vs_final_sid_overlap"] = sid_overlap(result, again)
            if fp8 is not None:
                figures[f"{name}_vs_fp8_sid_overlap"] = sid_overlap(result, fp8)
        for key, other in same_arithmetic.items():
            figures[f"{key}_equals_final"] = all(
                torch.equal(x, y)
                for x, y in ((other.sids, again.sids), (other.scores, again.scores),
                             (other.leaves, again.leaves))
            )  # fmt: skip
    if final is not None and not a.no_full:
        figures["full_compute"] = full_compute(model, final, batches, beams, a.batches, cuda)
    if a.trace and cuda:
        figures["trace"] = kernel_profile(model, index, batches, beams)
        if "graph_fp8" in wanted:
            figures["trace_fp8"] = kernel_profile(model, index, batches, beams, fp8=True)
        for key in FP8_VARIANT_ROWS:
            if key in wanted:  # eager: the profiler names every kernel
                variant = next(o for k, _, o, _ in ROWS if k == key)
                variant = dataclasses.replace(variant, cuda_graph=False)
                figures[f"trace_{key.removeprefix('graph_')}"] = kernel_profile(
                    model, index, batches, beams, variant=variant
                )
    figures["targets"] = {"final_p50_ms": 12, "final_p99_ms": 13, "gtm_cost_ms": 0.5}
    print_summary(figures)
    if a.out or a.small or not cuda:
        out = a.out or Path(f"/tmp/decoder_loop_{a.profile}_smoke.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**header(), "figures": figures}, indent=1) + "\n")
    else:  # an A/B run never overwrites the table's figures
        out = write_result("decoder_loop_ab" if ab else "decoder_loop", figures)
    print(out)


def kernel_profile(
    model, index, batches, beams, fp8: bool = False, variant: DecodeOptions | None = None
) -> list[dict]:
    """CUDA time per kernel over 5 eager batches of the served engine (FP8 or not), or of
    the variant engine with the switches `variant` (an FP8 FFN row that is not served)."""
    from torch.profiler import ProfilerActivity, profile

    bucket = (len(batches[0].ctx),)
    if variant is None:
        engine = DecodeEngine(model.decoder, batch_buckets=bucket, fp8=fp8)
        engine.cuda_graphs = False  # eager: the profiler names every kernel
    else:
        engine = VariantEngine(model.decoder, variant, batch_buckets=bucket)
    plans = engine.plan(index.tables, index.level_offsets)
    for b in batches[:2]:
        engine.run(plans, b.ctx, b.requests, beams, GTM)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches[:5]:
            engine.run(plans, b.ctx, b.requests, beams, GTM)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    out = [
        {"kernel": e.key[:90], "ms_per_batch": round(e.device_time_total / 5e3, 3),
         "share": round(e.device_time_total / total, 3), "calls_per_batch": e.count // 5}
        for e in events[:25]  # the top 25
    ]  # fmt: skip
    name = f" ({variant.fp8_ffn} FP8 FFN)" if variant else " (FP8)" if fp8 else ""
    print(f"kernel time per batch{name}: {total / 5e3:.3f} ms")
    for r in out:
        print(f"  {r['ms_per_batch']:8.3f} ms {r['share']:6.1%} x{r['calls_per_batch']:<4} "
              f"{r['kernel']}")  # fmt: skip
    return out


def sid_overlap(a, b) -> float:
    """Mean over requests of |a's SIDs ∩ b's SIDs| / |a's SIDs| (live leaves only)."""
    shares = []
    for la, lb in zip(a.leaves.tolist(), b.leaves.tolist(), strict=True):
        sa, sb = {x for x in la if x >= 0}, {x for x in lb if x >= 0}
        shares.append(len(sa & sb) / max(1, len(sa)))
    return round(statistics.fmean(shares), 4)


def full_compute(model, engine, batches, beams, n, cuda) -> dict:
    """Stages 2-3 for one batch: embedding + encoder + the (graphed) decode loop."""

    def encode(i: int) -> torch.Tensor:
        with torch.no_grad():
            return model.encoder(model.embed(batches[i % len(batches)].features))

    def whole(i: int) -> None:
        engine.run(encode(i), batches[i % len(batches)].requests, beams, GTM)

    return {
        "features_encoder": stats(times_ms(encode, n, cuda, warmup=3)),
        "total": stats(times_ms(whole, n, cuda, warmup=3)),
    }


def print_row(r: dict, flush: bool = False) -> None:
    if "error" in r:
        print(f"{r['label']:<34} ERROR {r['error']}", flush=flush)
        return
    b2b = (f", back to back {r['back_to_back_p50_ms']:.3f} / {r['back_to_back_p99_ms']:.3f}"
           if "back_to_back_p50_ms" in r else "")  # fmt: skip
    if "tail" in r:
        t = r["tail"]
        b2b += (f", {len(t['their_batches'])} samples > P50 + 1 ms (batches "
                f"{t['their_batches']}; per-batch P50 {min(t['per_batch_p50_ms']):.3f}.."
                f"{max(t['per_batch_p50_ms']):.3f})")  # fmt: skip
    print(
        f"{r['label']:<34} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['batches']:>5} "
        f"{r['gflops_per_request']:>8.1f} {100 * r['mfu']:>6.1f}%  graphs {r['graphs']}, "
        f"warm {r['warm_s']} s, live SIDs/req {r['live_sids_per_request']}{b2b}",
        flush=flush,
    )


def print_summary(f: dict) -> None:
    if f["rows"]:
        print(f"\n{'row':<34} {'P50 ms':>9} {'P99 ms':>9} {'n':>5} {'GF/req':>8} {'MFU':>7}")
    for r in f["rows"]:
        print_row(r)
    for name in ("eager", "graph"):
        if f"gtm_cost_{name}_ms" in f:
            print(f"GTM cost ({name}: CD + bitmask + Bloom − CD): {f[f'gtm_cost_{name}_ms']}")
    if "graph_equals_eager" in f:
        print(f"graph result == eager result: {f['graph_equals_eager']}")
    for key in sorted(k for k in f if k.endswith("_equals_final")):
        print(f"{key.removesuffix('_equals_final')} row's result == final row's: {f[key]}")
    for key in sorted(k for k in f if k.endswith("_sid_overlap")):
        print(f"{key}: {f[key]}")
    if "full_compute" in f:
        fc = f["full_compute"]
        print(f"full compute stage (features + encoder + decode): total {fc['total']}; "
              f"features + encoder {fc['features_encoder']}")  # fmt: skip
    print(f"targets: {f['targets']}")


if __name__ == "__main__":
    main()
