"""Self-attention micro-benchmark, the paper's Table 5 analogue (§4.2–4.3, docs/ARCHITECTURE.md §9).

One decode step of the SID self-attention at t = 0..3 for R = B·M rows (paper shape: 16 ×
1024 rows, H = 16, d_h = 128, bf16), five ways, each checked against the torch reference
on the same inputs before it is timed:
- sdpa_flash: the per-row layout — split qkv, write k/v into the dense cache, then
  `scaled_dot_product_attention` (flash backend) with batch R, query length 1 and key
  length t + 1 (the FA2/FA3 baseline of Table 5);
- reference: `fused_self_attention_reference` on the paged cache (write, gather, einsum);
- coalesced: the coalesced kernel alone, on already-gathered k/v `[R, t+1, H, d_h]`;
- fused: the fused kernel on the dense cache `[R, 4, H, d_h]`;
- paged: the fused kernel through an int32 block table as after beam reorder (children
  share their parents' blocks), as `PagedKVCache` builds it;
- fused_no_store, paged_no_store (t = 3 only): the same with `store=False`, as the last
  SID position allows (no later step reads its k/v): the step's bytes drop to the
  coalesced kernel's.
Bytes are the ones each variant must move (see `step_bytes`); the baselines are charged
the fused step's bytes, so their GB/s is effective bandwidth. GB/s is compared with the
H200's 4.8 TB/s HBM peak. GPU times: `triton.testing.do_bench` (L2 flushed between runs),
median and P99; the kernels autotune during the warm-up.

    .venv/bin/python bench/bench_self_attention.py    # H200 -> bench/results/self_attention.json
    .venv/bin/python bench/bench_self_attention.py --device cpu --small   # interpreter smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, timed, write_result

PEAK_GBPS = 4800.0  # H200 HBM3e
L_SID = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def step_bytes(variant: str, rows: int, heads: int, d_h: int, t: int, elem: int) -> int:
    """Bytes one step must move, per variant (e = elem bytes, HD = heads · d_h)."""
    hd = heads * d_h * elem
    if variant == "coalesced":  # read q and k, v of tokens 0..t; write out
        return rows * hd * (1 + 2 * (t + 1) + 1)
    # read q, k, v from qkv; write k, v into the cache (unless no_store); read k, v of
    # tokens 0..t-1; write out
    store = 0 if variant.endswith("no_store") else 2
    fused = rows * hd * (3 + store + 2 * t + 1)
    ids = t + (store > 0)  # int32 block ids read per row
    return fused + (rows * ids * 4 if variant.startswith("paged") else 0)


class Step:
    """Inputs of one step at position t, in every layout the variants need."""

    def __init__(self, rows: int, heads: int, d_h: int, t: int, dtype, device: str) -> None:
        g = torch.Generator(device).manual_seed(t)  # drawn on the device: ~0.5 G values

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        self.rows, self.heads, self.d_h, self.t = rows, heads, d_h, t
        self.qkv = randn(rows, 3 * heads * d_h)  # [R, 3·H·d_h]
        # paged as PagedKVCache lays it out: step j's blocks are j·R + row; reorder made
        # row i continue a random parent, so children share their parents' old blocks
        self.k_pool = randn(L_SID * rows, heads, d_h)
        self.v_pool = randn(L_SID * rows, heads, d_h)
        table = torch.arange(L_SID, device=device).repeat(rows, 1) * rows
        table += torch.arange(rows, device=device)[:, None]
        parent = torch.randint(rows, (rows,), generator=g, device=device)
        table[:, :t] = table[parent, :t]
        self.table = table.to(torch.int32)  # [R, L], as PagedKVCache keeps it
        # the dense cache holds the same tokens per row: every variant sees one prefix
        self.k_dense = self.k_pool[self.table]  # [R, L, H, d_h]
        self.v_dense = self.v_pool[self.table]
        q, k, v = self.qkv.view(rows, 3, heads, d_h).unbind(1)
        self.q = q  # [R, H, d_h] view into qkv
        # gathered prefix for the coalesced kernel: tokens 0..t with the new one at t
        self.k_prefix = torch.cat([self.k_dense[:, :t], k[:, None]], 1).contiguous()
        self.v_prefix = torch.cat([self.v_dense[:, :t], v[:, None]], 1).contiguous()


def variant_fns(s: Step, kernels) -> dict[str, Callable[[], torch.Tensor]]:
    sa, tri = kernels
    t = s.t

    def sdpa_flash() -> torch.Tensor:
        q, k, v = s.qkv.view(s.rows, 3, s.heads, s.d_h).unbind(1)
        s.k_dense[:, t] = k
        s.v_dense[:, t] = v
        kc = s.k_dense[:, : t + 1].transpose(1, 2)  # [R, H, t+1, d_h]
        vc = s.v_dense[:, : t + 1].transpose(1, 2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc).squeeze(2)

    fns = {
        "sdpa_flash": sdpa_flash,
        "reference": lambda: sa.fused_self_attention_reference(
            s.qkv, s.k_pool, s.v_pool, t, s.table
        ),
        "coalesced": lambda: tri.prefix_self_attention_triton(s.q, s.k_prefix, s.v_prefix),
        "fused": lambda: tri.fused_self_attention_triton(s.qkv, s.k_dense, s.v_dense, t),
        "paged": lambda: tri.fused_self_attention_triton(s.qkv, s.k_pool, s.v_pool, t, s.table),
    }
    if t == L_SID - 1:  # the last position: its k/v are never read again
        fns["fused_no_store"] = lambda: tri.fused_self_attention_triton(
            s.qkv, s.k_dense, s.v_dense, t, store=False
        )
        fns["paged_no_store"] = lambda: tri.fused_self_attention_triton(
            s.qkv, s.k_pool, s.v_pool, t, s.table, store=False
        )
    return fns


def check(s: Step, fns: dict[str, Callable[[], torch.Tensor]], sa) -> dict[str, str]:
    """Every variant's output vs the reference on the same inputs; raises on a mismatch.

    Before each variant that writes a cache, the step-t slots are poisoned with NaN, so
    the cache compared afterwards proves that variant's own write.
    """
    want_pool = (s.k_pool.clone(), s.v_pool.clone())
    want = sa.fused_self_attention_reference(s.qkv, *want_pool, s.t, s.table)
    _, k_new, v_new = s.qkv.view(s.rows, 3, s.heads, s.d_h).unbind(1)
    want_dense = (s.k_dense.clone(), s.v_dense.clone())
    want_dense[0][:, s.t], want_dense[1][:, s.t] = k_new, v_new
    new_blocks = s.table[:, s.t]
    caches = {
        "sdpa_flash": ((s.k_dense, s.v_dense), want_dense, (slice(None), s.t)),
        "fused": ((s.k_dense, s.v_dense), want_dense, (slice(None), s.t)),
        "reference": ((s.k_pool, s.v_pool), want_pool, (new_blocks,)),
        "paged": ((s.k_pool, s.v_pool), want_pool, (new_blocks,)),
    }
    status = {}
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
        tol = TOL[want.dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
        for c, w in zip(written, expected, strict=True):
            torch.testing.assert_close(c, w, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        status[name] = "ok"
    return status


def measure(fn: Callable[[], object], device: str, repeat: int) -> list[float]:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(repeat, 100), return_mode="all")
    return timed(fn, repeat)


def load_kernels(device: str):
    if device != "cuda":  # read when a kernel is decorated: set before the import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import kernels._triton_self_attention as tri
    import kernels.self_attention as sa

    return sa, tri


def run(args: argparse.Namespace) -> dict[str, object]:
    kernels = load_kernels(args.device)
    sa, tri = kernels
    dtype = DTYPES[args.dtype]
    rows, elem = args.batch * args.beams, torch.finfo(dtype).bits // 8
    results = []
    for t in range(L_SID):
        s = Step(rows, args.heads, args.d_head, t, dtype, args.device)
        fns = variant_fns(s, kernels)
        status = check(s, fns, sa)
        base_ms = None
        for name in fns:
            row: dict[str, object] = {"t": t, "variant": name, "check": status[name]}
            if status[name] == "ok":
                ms = measure(fns[name], args.device, args.repeat)
                nbytes = step_bytes(name, rows, args.heads, args.d_head, t, elem)
                med = statistics.median(ms)
                base_ms = med if name == "sdpa_flash" else base_ms
                row |= {
                    "p50_ms": round(med, 4),
                    "p99_ms": round(float(np.percentile(ms, 99)), 4),
                    "mbytes": round(nbytes / 1e6, 2),
                    "gbps": round(nbytes / med / 1e6, 1),
                    "pct_peak": round(100 * nbytes / med / 1e6 / PEAK_GBPS, 1),
                    "floor_ms": round(nbytes / PEAK_GBPS / 1e6, 4),
                    "speedup_vs_sdpa": round(base_ms / med, 1) if base_ms else None,
                }
            results.append(row)
            print_row(row)
    t3 = {r["variant"]: r.get("p50_ms") for r in results if r["t"] == L_SID - 1}
    print(
        f"t = 3 (target ≤ 0.17 ms): paged {t3['paged']} ms, paged_no_store"
        f" {t3['paged_no_store']} ms, coalesced {t3['coalesced']} ms; SDPA flash"
        f" {t3['sdpa_flash']} ms"
    )
    tuned = getattr(tri._self_attn_tuned, "cache", {})
    return {
        "shape": {"B": args.batch, "M": args.beams, "R": rows, "H": args.heads},
        "d_h": args.d_head,
        "L": L_SID,
        "dtype": args.dtype,
        "peak_gbps": PEAK_GBPS,
        "target_t3_ms": 0.17,
        "rows": results,
        "autotuned": [f"{k} -> {v}" for k, v in tuned.items()],
    }


COLS = ("t", "variant", "p50_ms", "p99_ms", "mbytes", "gbps", "pct_peak", "floor_ms")


def print_row(row: dict[str, object]) -> None:
    if row["check"] != "ok":
        print(f"{row['t']:>3} {row['variant']:<14} {row['check']}")
        return
    cells = [f"{row['t']:>3}", f"{row['variant']:<14}"]
    cells += [f"{row[c]:>10.4g}" for c in COLS[2:]]
    speedup = row["speedup_vs_sdpa"]
    cells.append(f"{'' if speedup is None else speedup:>8}")
    print(" ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="3 × 11 rows, H=2, d_h=32 (smoke)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--beams", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--d-head", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--repeat", type=int, default=100, help="CPU: timed calls; GPU: min ms")
    p.add_argument("--out", type=Path, help="JSON path (default: bench/results on full GPU runs)")
    args = p.parse_args()
    if args.small:
        args.batch, args.beams, args.heads, args.d_head = 3, 11, 2, 32
        args.repeat = min(args.repeat, 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --small")
    print(f"{'t':>3} {'variant':<14}" + "".join(f" {c:>10}" for c in COLS[2:]) + "  vs sdpa")
    figures = run(args)
    if args.out is None and args.device == "cuda" and not args.small:
        path = write_result("self_attention", figures)
    else:
        path = args.out or Path("/tmp") / f"self_attention_{args.device}_small.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**header(), "figures": figures}, indent=1) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
