"""FP8 (e4m3) linear layers for the decoder step (`service/decode/step.py`, pipeline
stage 3), opt-in (`DecoderStep(..., fp8=True)`; docs/FP8.md).

    weight [N, K] ── once, at load ──► `Fp8Weight`: e4m3 [N, K] + fp32 scale per output
                                       channel (its row's amax / 448)
    activation [R, K] ── per call ───► e4m3 [R, K] + fp32 scale per row (`quantize_rows`)
    `torch._scaled_mm` (rowwise scales) ─► [R, N] in bf16 (or the asked dtype)

x ≈ q · scale row by row, with q = x · (1 / scale) rounded to nearest-even on the e4m3 grid and
clamped to ±448 (e4m3's largest finite value), so no value saturates to NaN; a row of
zeros gets scale 1. The LayerNorm kernel quantises its own output the same way
(`kernels.layer_norm.add_layer_norm_fp8`), so the QKV, cross-attention query and FFN up
projections read FP8 straight from it (`fp8_gemm`), and so does the FFN down projection
from the bias + GELU kernel (`kernels.gelu_fp8`), and the self-attention output
projection from the self-attention kernel (`kernels.self_attention`, `fp8_out`); the
cross-attention output is still quantised here, in a pass of its own (`fp8_matmul`; on
CUDA one Triton kernel, `_triton_fp8.triton_quantize_rows`). The same
`torch._scaled_mm` call runs on CPU (the numerics CI checks) and on CUDA (cuBLASLt FP8 on
Hopper); a K or N that is not a multiple of 16 (which cuBLASLt refuses) takes the
reference: the same quantised numbers multiplied in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from kernels._triton_fp8 import MAX_K, triton_quantize_rows
except ImportError:  # no triton on this machine: the reference serves every call
    MAX_K, triton_quantize_rows = 0, None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_ALIGN = 16  # cuBLASLt FP8: K and N multiples of 16 (any row count)
_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32


def check_fp8_device(device: torch.device) -> None:
    """Raise, in one line, on a GPU without FP8 (compute capability below 8.9: before Ada
    and Hopper); a CPU runs the same call, slowly (the numerics CI checks)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"dtype fp8 needs a GPU with FP8 (compute capability 8.9 or newer: "
                         f"Ada, Hopper); {name} is not one")  # fmt: skip


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], fp32 scale [R, 1]) with x ≈ q · scale per row: one
    Triton pass on CUDA (`_triton_fp8.triton_quantize_rows`), the reference elsewhere."""
    if triton_quantize_rows is not None and x.is_cuda and x.dim() == 2 and x.shape[1] <= MAX_K:
        return triton_quantize_rows(x if x.stride(-1) == 1 else x.contiguous())
    return quantize_rows_reference(x)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch: amax, scale, divide, clamp, cast."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # a row of zeros: scale 1; a row of fp32 denormals must not underflow the scale to 0
    # divided by a tensor, not the Python float: on CUDA torch turns a CPU-scalar divisor
    # into a multiply by its reciprocal (1 ulp off now and then), and the kernels divide
    per_code = amax / torch.full_like(amax, E4M3_MAX)
    scale = torch.where(amax > 0, per_code.clamp_min(_TINY), torch.ones_like(amax))
    # times the reciprocal: one division per row, a multiply per element (the kernels too)
    inv = torch.ones_like(scale) / scale
    q = (xf * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight [N, K] in e4m3 with one fp32 scale per output channel."""

    q: torch.Tensor  # e4m3 [N, K], row-major
    scale: torch.Tensor  # fp32 [1, N]

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(weight.detach())
        return cls(q.contiguous(), scale.reshape(1, -1).contiguous())

    def dequantized(self) -> torch.Tensor:  # fp32 [N, K]
        return self.q.float() * self.scale.reshape(-1, 1)


def fp8_matmul(
    x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [R, K] @ w.T -> [R, N] in `out_dtype`: x quantised per row, one FP8 GEMM."""
    return fp8_gemm(*quantize_rows(x), w, out_dtype)


def fp8_gemm(
    xq: torch.Tensor,  # e4m3 [R, K]
    xs: torch.Tensor,  # fp32 [R, 1]
    w: Fp8Weight,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,  # [N], added in the GEMM's epilogue
) -> torch.Tensor:
    """(xq · xs) @ w.T (+ bias) -> [R, N] for activations quantised already (by the
    kernel that made them: `kernels.layer_norm.add_layer_norm_fp8`). The bias rides in the
    GEMM (cuBLASLt's epilogue on CUDA): a separate add would be one more pass over the
    output, which costs more than the bias epilogue at the decoder's shapes
    (docs/FP8.md)."""
    k, n = xq.shape[1], w.q.shape[0]
    if k % _ALIGN or n % _ALIGN:  # any row count is fine; K and N must be multiples of 16
        out = _reference(xq, xs, w)
        return (out if bias is None else out + bias.float()).to(out_dtype)
    # cuBLASLt's rowwise-scaled FP8 GEMM writes bf16: other dtypes are cast from it there
    gemm_dtype = torch.bfloat16 if xq.is_cuda else out_dtype
    if bias is not None:
        bias = bias.to(gemm_dtype)  # _scaled_mm takes the bias in its output dtype
    # mat2 must be column-major: w.q is [N, K] row-major, so w.q.t() is [K, N] column-major
    out = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale, bias=bias,
                           out_dtype=gemm_dtype)  # fmt: skip
    return out.to(out_dtype)


def fp8_matmul_reference(
    x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """What `fp8_matmul` computes, in fp32 from the dequantised operands."""
    xq, xs = quantize_rows(x)
    return _reference(xq, xs, w).to(out_dtype)


def _reference(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    return (xq.float() * xs) @ w.dequantized().t()
