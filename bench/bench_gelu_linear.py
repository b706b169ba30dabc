"""The FFN up-projection with its bias + tanh-GELU epilogue (`kernels.gelu_linear`), the
largest matmul of the decode loop (docs/PERFORMANCE.md, Table 6's trace): cuBLASLt's
GELU_BIAS epilogue (served) vs our persistent Triton GEMM, with two references measured
in the same run — the same GEMM with a plain bias epilogue (`addmm`: what the shape costs
without the GELU) and the bias GEMM followed by a separate GELU pass.

Shapes: the paper decoder's 1 024 → 7 680 at a part's rows per step (4 096 at step 2,
8 192 at steps 3–4; 16 384: one unsplit batch) and the encoder's 1 024 → 4 096 at 16 × 128
rows. Every variant is checked against the fp32 reference before timing. GPU times are
`triton.testing.do_bench` medians (L2 flushed between calls).

    python bench/bench_gelu_linear.py            # H200 -> bench/results/gelu_linear.json
    python bench/bench_gelu_linear.py --small    # CPU smoke run (interpreter) -> /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not torch.cuda.is_available():  # Triton's interpreter must be chosen before kernels import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from bench.baselines._triton_gelu_linear import triton_gelu_linear
from bench.common import header, timed, write_result
from kernels.gelu_linear import gelu_linear_reference

SHAPES = [(4096, 1024, 7680), (8192, 1024, 7680), (16384, 1024, 7680), (2048, 1024, 4096)]
SMALL = [(64, 64, 96), (37, 48, 80)]


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, cuda: bool) -> dict:
    out = {"triton": lambda: triton_gelu_linear(x, w, b)}
    if cuda:
        out["cublaslt_gelu_epilogue"] = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)
        out["addmm_then_gelu"] = lambda: F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")
        out["addmm_bias_only"] = lambda: torch.addmm(b, x, w.t())  # no GELU: the floor
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="smoke run: tiny shapes, no JSON")
    ap.add_argument("--out", type=Path, help="result JSON (default: bench/results)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.small
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.bfloat16)
    rows = []
    for m, k, n in SMALL if a.small or not cuda else SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, k, generator=g, device=dev).to(dtype)
        w = (torch.randn(n, k, generator=g, device=dev) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g, device=dev).to(dtype)
        want = gelu_linear_reference(x.float(), w.float(), b.float())
        flop = 2 * m * n * k
        row: dict = {"m": m, "k": k, "n": n, "gflop": round(flop / 1e9, 2)}
        for name, fn in variants(x, w, b, cuda).items():
            got = fn().float()
            if name != "addmm_bias_only":
                err = (got - want).abs().max().item()
                assert err < 0.1, f"{name} at {(m, k, n)}: max error {err}"
            if cuda:
                from triton.testing import do_bench

                ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            else:
                ms = sorted(timed(fn, 3, warmup=1))[1]
            row[name] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    figures = {"dtype": str(dtype), "rows": rows}
    if a.out or not cuda:
        out = a.out or Path("/tmp/gelu_linear_smoke.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**header(), "figures": figures}, indent=1) + "\n")
    else:
        out = write_result("gelu_linear", figures)
    print(out)


if __name__ == "__main__":
    main()
