"""The FP8 step's pieces at the paper decoder's shapes (docs/FP8.md, issue #22), against the
bf16 ops they replace, measured in one run: where the FP8 decode loop gains and loses.

Per linear layer of a decoder layer (QKV, self-attention out, cross-attention query and
out, FFN up and down) at R rows (8 192: one part of a split step; 16 384: one batch of 16
at 1 024 beams), with the GEMM's median time and TFLOP/s:
  * bf16: what the served bf16 step runs (`addmm`: the bias, or the residual with beta 1);
  * fp8_rowwise: `torch._scaled_mm` with a scale per row and per output channel (what the
    FP8 step runs but in the FFN down projection), bf16 out; `+bias` with the bias given
    to `_scaled_mm`;
  * fp8_tensorwise: one scale per operand (coarser numbers, the GEMM's speed of light);
  * fp8_blockwise: `torch._scaled_mm` with a scale per row and 128 columns of the input
    (1 x 128) and per 128 x 128 block of the weight (`kernels.fp8.block_fp8_gemm`: the
    served FFN down projection); its error against the fp32 product of the dequantised
    operands says the scales were read as meant;
  * the FP8 step's per-layer extras: the residual add after the GEMM (no beta in
    `_scaled_mm`), the separate quantise pass of the attention outputs.
And the producers: the LayerNorm kernel writing bf16 vs e4m3 + scale; the served FFN up
GEMM with bias + GELU + 1 x 128 quantisation in its epilogue (`kernels._triton_fp8_ffn`)
vs the bf16 step's GELU in the GEMM's epilogue and vs the rowwise FFN served before it
(a rowwise GEMM, then the bias + GELU + quantise kernel, `bench/baselines/gelu_fp8.py`);
the down GEMMs reading those codes (block-scaled, served; Triton, rowwise: baselines).

GPU times are `triton.testing.do_bench` medians (L2 flushed between calls).

    python bench/bench_fp8_gemm.py          # H200 -> bench/results/fp8_gemm_h200.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.gelu_fp8 import gelu_fp8
from bench.common import write_result
from kernels.fp8 import Fp8Weight, quantize_rows
from kernels.layer_norm import add_layer_norm_fp8, layer_norm, layer_norm_fp8
from service.model.config import profile

ROWS = (8192, 16384)
DEVICE = "cuda"  # a CPU smoke test of the arithmetic sets "cpu"


def ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def first_line(e: Exception) -> str:
    """A failed row's error, as the result file keeps it: its first line, 200 characters."""
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def layers(d_model: int, d_attn: int, d_ff: int) -> list[tuple[str, int, int, str]]:
    """(name, K, N, what the bf16 step adds: "bias" or "residual")."""
    return [("qkv", d_model, 3 * d_attn, "bias"), ("self_out", d_attn, d_model, "residual"),
            ("cross_q", d_model, d_attn, "bias"), ("cross_out", d_attn, d_model, "residual"),
            ("ffn_up", d_model, d_ff, "bias"), ("ffn_down", d_ff, d_model, "residual")]  # fmt: skip


def blockwise_operands(x: torch.Tensor, w: torch.Tensor):
    """(x codes, x scales [R, K/128] M-major, w in 128 x 128 blocks): each 1 x 128 block
    of x (`quantize_row_blocks`, the served up kernel's layout) and each 128 x 128 block
    of w (`Fp8BlockWeight`), as `block_fp8_gemm` hands them to cuBLASLt (K and N
    multiples of 128)."""
    from kernels.fp8 import Fp8BlockWeight, quantize_row_blocks

    xq, xs = quantize_row_blocks(x)
    return (xq, xs.t().contiguous().t(), Fp8BlockWeight.of(w))


def blockwise_row(x: torch.Tensor, w: torch.Tensor) -> dict:
    """The 1 x 128 / 128 x 128 GEMM's time (`block_fp8_gemm`) and its error against the
    dequantised operands' fp32 product."""
    from kernels.fp8 import block_fp8_gemm, block_fp8_reference

    operands = blockwise_operands(x, w)
    try:
        got = block_fp8_gemm(*operands).float()
    except (RuntimeError, ValueError) as e:  # a torch, a cuBLASLt or a device without it
        return {"fp8_blockwise_error": first_line(e)}
    want = block_fp8_reference(*operands)
    err = float((got - want).norm() / want.norm())
    return {"fp8_blockwise_ms": ms(lambda: block_fp8_gemm(*operands)),
            "fp8_blockwise_rel_err": err}  # fmt: skip


def blockwise_only_row(r: int, name: str, k: int, n: int, adds: str) -> dict:
    """The probe alone (`--blockwise`): the rowwise GEMM beside the block-scaled one."""
    x = torch.randn(r, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    fw = Fp8Weight.of(w)
    xq, xs = quantize_rows(x)
    row = {"rows": r, "layer": name, "k": k, "n": n, "fp8_rowwise_ms": ms(
        lambda: torch._scaled_mm(xq, fw.q.t(), scale_a=xs, scale_b=fw.scale,
                                 out_dtype=torch.bfloat16))}  # fmt: skip
    return row | blockwise_row(x, w)


def gemm_rows(r: int, name: str, k: int, n: int, adds: str) -> dict:
    dev, bf = DEVICE, torch.bfloat16
    x = torch.randn(r, k, device=dev, dtype=bf)
    w = (torch.randn(n, k, device=dev) / k**0.5).to(bf)
    b = torch.randn(n, device=dev, dtype=bf)
    res = torch.randn(r, n, device=dev, dtype=bf)
    fw = Fp8Weight.of(w)
    xq, xs = quantize_rows(x)
    wq_t = w.float().abs().amax().div(448.0).reshape(())  # tensorwise scales
    xq_t = (x.float() / x.float().abs().amax().div(448.0)).to(torch.float8_e4m3fn)
    wq8_t = (w.float() / wq_t).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)

    def rowwise(bias=None):
        return torch._scaled_mm(xq, fw.q.t(), scale_a=xs, scale_b=fw.scale, bias=bias,
                                out_dtype=bf)  # fmt: skip

    flops = 2.0 * r * k * n
    row = {"rows": r, "layer": name, "k": k, "n": n}
    if adds == "bias":
        row["bf16_ms"] = ms(lambda: torch.addmm(b, x, w.t()))
    else:
        row["bf16_ms"] = ms(lambda: res.addmm_(x, w.t()))
    row["fp8_rowwise_ms"] = ms(rowwise)
    try:
        row["fp8_rowwise_bias_ms"] = ms(lambda: rowwise(b))
    except RuntimeError as e:  # a torch without bias on the rowwise path
        row["fp8_rowwise_bias_error"] = first_line(e)
    row["fp8_tensorwise_ms"] = ms(lambda: torch._scaled_mm(
        xq_t, wq8_t.t(), scale_a=one, scale_b=wq_t, out_dtype=bf))  # fmt: skip
    if k % 128 == 0 and n % 128 == 0:
        row.update(blockwise_row(x, w))
    out = rowwise()
    if adds == "bias":
        row["bias_add_ms"] = ms(lambda: out + b)
    else:
        row["residual_add_ms"] = ms(lambda: res.add_(out))
        row["quantise_input_ms"] = ms(lambda: quantize_rows(x))
    for key in ("bf16_ms", "fp8_rowwise_ms", "fp8_tensorwise_ms", "fp8_blockwise_ms"):
        if key not in row:
            continue
        row[key.replace("_ms", "_tflops")] = round(flops / row[key] / 1e9, 1)
    return row


def producer_rows(r: int, d_model: int, d_ff: int) -> list[dict]:
    from bench.baselines._triton_gelu_fp8 import triton_gelu_fp8
    from kernels.gelu_linear import gelu_linear

    dev, bf = DEVICE, torch.bfloat16
    x = torch.randn(r, d_model, device=dev, dtype=bf)
    g, beta = torch.ones(d_model, device=dev, dtype=bf), torch.zeros(d_model, device=dev, dtype=bf)
    shift = torch.zeros(d_model, device=dev)
    h = torch.randn(r, d_ff, device=dev, dtype=bf)
    bias = torch.randn(d_ff, device=dev, dtype=bf)
    w = (torch.randn(d_ff, d_model, device=dev) / d_model**0.5).to(bf)
    fw = Fp8Weight.of(w)
    xq, xs = quantize_rows(x)
    return [
        {"rows": r, "op": "layer_norm bf16", "ms": ms(lambda: layer_norm(x, g, beta, 1e-5, shift))},
        {"rows": r, "op": "layer_norm -> e4m3 + scale",
         "ms": ms(lambda: layer_norm_fp8(x, g, beta, 1e-5, shift))},
        {"rows": r, "op": "residual add (bf16, torch), separate",
         "ms": ms(lambda: x.add(x))},
        {"rows": r, "op": "residual add + layer_norm -> stream + e4m3 + scale (served FP8)",
         "ms": ms(lambda: add_layer_norm_fp8(x, x, g, beta, 1e-5, shift))},
        {"rows": r, "op": "ffn_up bf16 GEMM + bias + GELU epilogue (served bf16)",
         "ms": ms(lambda: gelu_linear(x, w, bias))},
        {"rows": r, "op": "ffn_up FP8 GEMM (bf16 out)",
         "ms": ms(lambda: torch._scaled_mm(xq, fw.q.t(), scale_a=xs, scale_b=fw.scale,
                                            out_dtype=bf))},
        {"rows": r, "op": "bias + GELU -> e4m3 + scale (gelu_fp8, autotuned; rowwise FFN)",
         "ms": ms(lambda: gelu_fp8(h, bias, True))},
        {"rows": r, "op": "... the same, tanh from exp and a division (no tanh.approx.f32)",
         "ms": ms(lambda: triton_gelu_fp8(h, bias, True))},
        *ffn_rows(r, xq, xs, fw, bias, d_model, d_ff),
        *(gelu_config_row(r, h, bias, rows, block, warps)
          for rows, block, warps in ((1, 8192, 8), (1, 8192, 16), (2, 1024, 4), (4, 1024, 4),
                                     (2, 2048, 8))),
    ]  # fmt: skip


def ffn_rows(r: int, xq, xs, fw: Fp8Weight, bias, d_model: int, d_ff: int) -> list:
    """The FFN with 1 x 128 activation scales: the served up GEMM with bias + GELU +
    quantise in its epilogue (`kernels._triton_fp8_ffn`; against the rowwise GEMM plus the
    bias + GELU kernel above), the down GEMMs reading those codes: cuBLASLt's block-scaled
    one (served), Triton's (`bench/baselines/_triton_fp8_down.py`), and the rowwise one on
    rowwise codes."""
    from bench.baselines._triton_fp8_down import triton_fp8_down
    from kernels._triton_fp8_ffn import triton_fp8_up_gelu
    from kernels.fp8 import Fp8BlockWeight, block_fp8_gemm
    from kernels.fp8_ffn import fp8_up_gelu

    w = torch.randn(d_model, d_ff, device=DEVICE) / d_ff**0.5
    w_down, w_blocks = Fp8Weight.of(w), Fp8BlockWeight.of(w)
    rq, rs = quantize_rows(torch.randn(r, d_ff, device=DEVICE, dtype=torch.bfloat16))
    try:  # a kernel that does not compile here must not cost the rest of the table
        hq, hs = triton_fp8_up_gelu(xq, xs, fw, bias, True)
        mq, mqs = fp8_up_gelu(xq, xs, fw, bias, True)  # M-major scales, as served
        return [
            {"rows": r, "op": "ffn_up FP8 Triton GEMM + bias + GELU + 1x128 quantise epilogue "
             "(served)", "ms": ms(lambda: fp8_up_gelu(xq, xs, fw, bias, True))},
            {"rows": r, "op": "ffn_up ... the same, each K step's product added in fp32",
             "ms": ms(lambda: triton_fp8_up_gelu(xq, xs, fw, bias, True, promote=True))},
            {"rows": r, "op": "ffn_down FP8 GEMM, 1x128 / 128x128 block-scaled (served)",
             "ms": ms(lambda: block_fp8_gemm(mq, mqs, w_blocks))},
            {"rows": r, "op": "ffn_down FP8 Triton GEMM, 1x128 input scales (baseline)",
             "ms": ms(lambda: triton_fp8_down(hq, hs, w_down))},
            {"rows": r, "op": "ffn_down FP8 GEMM, rowwise (rowwise FFN)",
             "ms": ms(lambda: torch._scaled_mm(rq, w_down.q.t(), scale_a=rs,
                                                scale_b=w_down.scale, out_dtype=torch.bfloat16))},
        ]  # fmt: skip
    except Exception as e:
        traceback.print_exc()
        return [{"rows": r, "op": "FFN with 1x128 scales", "error": first_line(e)}]


def ffn_up_rows(r: int, d_model: int, d_ff: int) -> list[dict]:
    """`--ffn-up`: the FFN up kernel's two forms (autotuned) beside cuBLASLt's bare FP8
    GEMM at the same shape (what a GEMM without the epilogue costs), each with its tuned
    config, and how far the persistent kernel's dequantised output is from the per-tile
    one's."""
    from kernels._triton_fp8_ffn import _TUNED, _TUNED_TMA, triton_fp8_up_gelu

    dev, bf = DEVICE, torch.bfloat16
    xq, xs = quantize_rows(torch.randn(r, d_model, device=dev, dtype=bf))
    fw = Fp8Weight.of(torch.randn(d_ff, d_model, device=dev) / d_model**0.5)
    bias = torch.randn(d_ff, device=dev, dtype=bf)
    flops = 2.0 * r * d_model * d_ff
    out = [{"rows": r, "op": "cuBLASLt FP8 GEMM, rowwise, bf16 out (no epilogue)",
            "ms": ms(lambda: torch._scaled_mm(xq, fw.q.t(), scale_a=xs, scale_b=fw.scale,
                                               out_dtype=bf))}]  # fmt: skip
    got = {}
    forms = (("per tile", False, _TUNED), ("persistent TMA", True, _TUNED_TMA))
    for name, persistent, tuned in forms:

        def up(p=persistent):
            return triton_fp8_up_gelu(xq, xs, fw, bias, True, m_major=True, persistent=p)

        try:
            got[name] = up()
            t = ms(up)
        except Exception as e:  # a kernel that does not compile must not cost the others
            traceback.print_exc()
            out.append({"rows": r, "op": f"up kernel, {name}", "error": first_line(e)})
            continue
        best = getattr(tuned, "best_config", None)
        out.append({"rows": r, "op": f"up kernel + bias + GELU + 1x128 quantise, {name}",
                    "ms": t, "config": str(best) if best else None})  # fmt: skip
    for row in out:
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
    if len(got) == 2:
        (aq, as_), (bq, bs) = got.values()
        ha = aq.float() * as_.repeat_interleave(128, 1)[:, :d_ff]
        hb = bq.float() * bs.repeat_interleave(128, 1)[:, :d_ff]
        out.append({"rows": r, "op": "persistent vs per tile, relative error",
                    "rel_err": float((hb - ha).norm() / ha.norm()),
                    "codes_equal": float((aq.view(torch.uint8) == bq.view(torch.uint8))
                                         .float().mean())})  # fmt: skip
    return out


def gelu_config_row(r: int, h, bias, rows: int, block: int, warps: int) -> dict:
    """The bias + GELU + quantise kernel at one config: whole rows (BLOCK_N >= N) or chunks."""
    import triton

    from bench.baselines._triton_gelu_fp8 import triton_gelu_fp8

    config = triton.Config({"ROWS": rows, "BLOCK_N": block}, num_warps=warps)
    return {"rows": r, "op": f"gelu_fp8, ROWS {rows}, BLOCK_N {block}, {warps} warps",
            "ms": ms(lambda: triton_gelu_fp8(h, bias, True, config, hw_tanh=True))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="paper")
    ap.add_argument("--out", type=Path, help="result JSON (default: bench/results)")
    ap.add_argument("--blockwise", action="store_true",
                    help="only cuBLASLt's 1 x 128 / 128 x 128 block-scaled GEMM beside the "
                    "rowwise one, at every shape (a quick probe; no producer table)")  # fmt: skip
    ap.add_argument(
        "--ffn-up",
        action="store_true",
        help="only the FFN up kernel's two forms (per tile, persistent TMA) beside "
        "cuBLASLt's bare FP8 GEMM, at 16, 8,192 and 16,384 rows (a quick probe)",
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm: needs a CUDA GPU with FP8 (Ada, Hopper)")
    c = profile(a.profile)
    if a.ffn_up:
        rows = [row for r in (16, 8192, 16384) for row in ffn_up_rows(r, c.d_model, c.d_ff)]
        for row in rows:
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)  # fmt: skip
        print(write_result("fp8_ffn_up", {"profile": a.profile, "ffn_up": rows}, a.out))
        return
    gemms, producers = [], []
    for r in ROWS:
        for name, k, n, adds in layers(c.d_model, c.d_attn, c.d_ff):
            try:
                row = (blockwise_only_row if a.blockwise else gemm_rows)(r, name, k, n, adds)
            except Exception:  # one failing shape must not cost the others
                traceback.print_exc()
                continue
            gemms.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)  # fmt: skip
        if a.blockwise:
            continue
        try:
            for row in producer_rows(r, c.d_model, c.d_ff):
                producers.append(row)
                took = f"{row['ms']:.4f} ms" if "ms" in row else row["error"]
                print(f"{r:>6} {row['op']:<58} {took}", flush=True)
        except Exception:
            traceback.print_exc()
    figures = {"profile": a.profile, "gemms": gemms, "producers": producers}
    print(write_result("fp8_gemm_h200", figures, a.out))


if __name__ == "__main__":
    main()
