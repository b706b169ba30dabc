"""Self-attention micro-benchmark, the paper's Table 5 analogue (§4.2–4.3, docs/ARCHITECTURE.md §9).

One decode step at t = 0..3 for R = B·M rows (paper shape: 16 × 1024 rows, H 16, d_h 128,
bf16), each form checked against the torch reference (output and cache write) before it is
timed: `sdpa_flash` (write k/v into a dense cache, then SDPA pinned to flash with one query
per row: the FA2/FA3 baseline), `reference` (`fused_self_attention_reference` on the paged
cache), `coalesced` (the Triton kernel alone on gathered k/v `[R, t+1, H, d_h]`), `fused`
(`fused_self_attention` on the dense cache), `paged` (the same through an int32 block table
as after beam reorder: the served form) and at t = 3 `paged_no_store` (`store=False`: no
later step reads the last position's k/v). Bytes: what each form must move (`step_bytes`;
the baselines are charged the fused step's), against the H200's 4.8 TB/s. GPU times:
`triton.testing.do_bench` (L2 flushed between runs; the kernels autotune in its warm-up).
On a CPU the kernels' rows run their references.

    .venv/bin/python bench/bench_self_attention.py    # H200 -> bench/results/self_attention.json
    .venv/bin/python bench/bench_self_attention.py --device cpu --small   # smoke -> /tmp
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.kv_cache import coalesced_self_attention
from bench.common import percentiles, timed, write_result
from kernels.self_attention import fused_self_attention, fused_self_attention_reference

PEAK_GBPS = 4800.0  # H200 HBM3e
L_SID = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
COLS = ("p50_ms", "p99_ms", "mbytes", "gbps", "pct_peak", "floor_ms")  # printed per row


def step_bytes(form: str, rows: int, heads: int, d_h: int, t: int, elem: int) -> int:
    """Bytes one step must move (HD = heads · d_h elements of `elem` bytes)."""
    hd = heads * d_h * elem
    if form == "coalesced":  # read q and k, v of tokens 0..t; write out
        return rows * hd * (1 + 2 * (t + 1) + 1)
    # read q, k, v from qkv; write k, v into the cache (unless no_store); read k, v of
    # tokens 0..t-1; write out; paged: read the int32 block ids too
    store = 0 if form.endswith("no_store") else 2
    ids = t + (store > 0)
    return rows * hd * (3 + store + 2 * t + 1) + (rows * ids * 4 if "paged" in form else 0)


class Step:
    """Inputs of one step at position t, in every layout the forms need."""

    def __init__(self, rows: int, heads: int, d_h: int, t: int, dtype, device: str) -> None:
        g = torch.Generator(device).manual_seed(t)  # drawn on the device: ~0.5 G values

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        self.rows, self.heads, self.d_h, self.t = rows, heads, d_h, t
        self.qkv = randn(rows, 3 * heads * d_h)  # [R, 3·H·d_h]
        # paged as PagedKVCache lays it out: step j's blocks are j·R + row; reorder made
        # row i continue a random parent, so children share their parents' old blocks
        self.k_pool = randn(L_SID * rows, heads, d_h)  # [L·R, H, d_h]
        self.v_pool = randn(L_SID * rows, heads, d_h)
        table = torch.arange(L_SID, device=device).repeat(rows, 1) * rows
        table += torch.arange(rows, device=device)[:, None]
        table[:, :t] = table[torch.randint(rows, (rows,), generator=g, device=device), :t]
        self.table = table.to(torch.int32)  # [R, L], as PagedKVCache keeps it
        # the dense cache holds the same tokens per row: every form sees one prefix
        self.k_dense = self.k_pool[self.table]  # [R, L, H, d_h]
        self.v_dense = self.v_pool[self.table]
        self.q, k, v = self.qkv.view(rows, 3, heads, d_h).unbind(1)  # [R, H, d_h] views
        # the gathered prefix of the coalesced kernel: tokens 0..t, the new one at t
        self.k_prefix = torch.cat([self.k_dense[:, :t], k[:, None]], 1).contiguous()
        self.v_prefix = torch.cat([self.v_dense[:, :t], v[:, None]], 1).contiguous()


def forms(s: Step) -> dict[str, Callable[[], torch.Tensor]]:
    t = s.t

    def sdpa_flash() -> torch.Tensor:
        q, k, v = s.qkv.view(s.rows, 3, s.heads, s.d_h).unbind(1)
        s.k_dense[:, t], s.v_dense[:, t] = k, v
        kc = s.k_dense[:, : t + 1].transpose(1, 2)  # [R, H, t+1, d_h]
        vc = s.v_dense[:, : t + 1].transpose(1, 2)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc).squeeze(2)

    paged = (s.qkv, s.k_pool, s.v_pool, t, s.table)
    fns = {
        "sdpa_flash": sdpa_flash,
        "reference": lambda: fused_self_attention_reference(*paged),
        "coalesced": lambda: coalesced_self_attention(s.q, s.k_prefix, s.v_prefix),
        "fused": lambda: fused_self_attention(s.qkv, s.k_dense, s.v_dense, t),
        "paged": lambda: fused_self_attention(*paged),
    }
    if t == L_SID - 1:  # the last position: its k/v are never read again
        fns["paged_no_store"] = lambda: fused_self_attention(*paged, store=False)
    return fns


def check(s: Step, fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, str]:
    """Every form's output against the reference on the same inputs; raises on a mismatch.
    Before each form that writes a cache its step-t slots are poisoned with NaN, so the
    cache compared afterwards proves that form's own write."""
    want_pool = (s.k_pool.clone(), s.v_pool.clone())
    want = fused_self_attention_reference(s.qkv, *want_pool, s.t, s.table)
    _, k_new, v_new = s.qkv.view(s.rows, 3, s.heads, s.d_h).unbind(1)
    want_dense = (s.k_dense.clone(), s.v_dense.clone())
    want_dense[0][:, s.t], want_dense[1][:, s.t] = k_new, v_new
    dense = ((s.k_dense, s.v_dense), want_dense, (slice(None), s.t))
    pool = ((s.k_pool, s.v_pool), want_pool, (s.table[:, s.t],))
    caches = {"sdpa_flash": dense, "fused": dense, "reference": pool, "paged": pool}
    status, tol = {}, TOL[want.dtype]
    for name, fn in fns.items():
        written, expected, slot = caches.get(name, ((), (), None))
        for c in written:
            c[slot] = float("nan")
        try:
            got = fn()
        except RuntimeError as e:  # e.g. no flash backend for this device/dtype
            status[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
            for c, w in zip(written, expected, strict=True):
                c.copy_(w)
            continue
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
        for c, w in zip(written, expected, strict=True):
            torch.testing.assert_close(c, w, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        status[name] = "ok"
    return status


def run(args: argparse.Namespace) -> dict[str, object]:
    dtype = DTYPES[args.dtype]
    rows, elem = args.batch * args.beams, torch.finfo(dtype).bits // 8
    results = []
    measure = partial(timed, repeat=args.repeat)
    if args.device == "cuda":  # L2 flushed between runs
        from triton.testing import do_bench

        measure = partial(do_bench, warmup=25, rep=max(args.repeat, 100), return_mode="all")
    for t in range(L_SID):
        s = Step(rows, args.heads, args.d_head, t, dtype, args.device)
        fns = forms(s)
        status, base_ms = check(s, fns), None
        for name, fn in fns.items():
            row: dict[str, object] = {"t": t, "variant": name, "check": status[name]}
            if status[name] == "ok":
                ms = measure(fn)
                nbytes = step_bytes(name, rows, args.heads, args.d_head, t, elem)
                med = statistics.median(ms)
                base_ms = med if name == "sdpa_flash" else base_ms
                row |= {
                    **percentiles(ms, 4),
                    "mbytes": round(nbytes / 1e6, 2),
                    "gbps": round(nbytes / med / 1e6, 1),
                    "pct_peak": round(100 * nbytes / med / 1e6 / PEAK_GBPS, 1),
                    "floor_ms": round(nbytes / PEAK_GBPS / 1e6, 4),
                    "speedup_vs_sdpa": round(base_ms / med, 1) if base_ms else None,
                }
            results.append(row)
            cells = [f"{row[c]:>10.4g}" for c in COLS] if "p50_ms" in row else [row["check"]]
            print(f"{t:>3} {name:<15}", *cells, f"{row.get('speedup_vs_sdpa') or '':>8}")
    tri = sys.modules.get("kernels._triton_self_attention")  # absent without triton
    tuned = getattr(getattr(tri, "_self_attn_tuned", None), "cache", {})
    return {
        "shape": {"B": args.batch, "M": args.beams, "R": rows, "H": args.heads},
        **{"d_h": args.d_head, "L": L_SID, "dtype": args.dtype, "device": args.device},
        "peak_gbps": PEAK_GBPS,
        "target_t3_ms": 0.17,
        "rows": results,
        "autotuned": [f"{k} -> {v}" for k, v in tuned.items()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="3 × 11 rows, H=2, d_h=32 (smoke)")
    for name, default in (("batch", 16), ("beams", 1024), ("heads", 16), ("d-head", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--repeat", type=int, default=100, help="CPU: timed calls; GPU: min ms")
    p.add_argument("--out", type=Path, help="JSON path (default: bench/results on full GPU runs)")
    args = p.parse_args()
    if args.small:
        args.batch, args.beams, args.heads, args.d_head = 3, 11, 2, 32
        args.repeat = min(args.repeat, 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --small")
    print(f"{'t':>3} {'variant':<15}", *(f"{c:>10}" for c in COLS), " vs sdpa")
    figures = run(args)
    smoke = Path("/tmp") / f"self_attention_{args.device}_small.json"  # never the GPU figures
    path = args.out or (None if args.device == "cuda" and not args.small else smoke)
    print(f"-> {write_result('self_attention', figures, path)}")


if __name__ == "__main__":
    main()
