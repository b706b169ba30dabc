"""FP8 (e4m3) linear layers for the decoder step (pipeline stage 3; docs/FP8.md, "What runs
in FP8", states the numbers): the GEMMs and `Fp8Linear`, the layer a model's `nn.Linear`
becomes once at load (`service/model/precision.py`), which `service/decode/fp8_step.py`
runs. Weights carry one fp32 scale per output channel (`Fp8Weight`) or, for the FFN down
projection, per 128 x 128 block (`Fp8BlockWeight`); activations one per row
(`quantize_rows`; the LayerNorm and self-attention kernels write theirs, read by
`fp8_gemm`) or per row and 128 columns (`quantize_row_blocks`: the layout the FFN's up
kernel writes, `kernels.fp8_ffn`). The same `torch._scaled_mm` call runs on CPU (the
numerics CI checks) and on CUDA (cuBLASLt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:
    from kernels._triton_fp8 import MAX_K, triton_quantize_rows
except ImportError:  # no triton on this machine: the reference serves every call
    MAX_K, triton_quantize_rows = 0, None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_ALIGN = 16  # cuBLASLt FP8: K and N multiples of 16 (any row count)
_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32
SCALE_BLOCK = 128  # the FFN down projection's scales: 1 x 128 (input), 128 x 128 (weight)
# cuBLASLt's block-scaled GEMM refuses some row counts (1, 2, 3, 6: step 0 of a small
# batch) and runs multiples of this: other counts are padded with zero rows
BLOCK_GEMM_ROWS = 4


def lacks_fp8(device: torch.device) -> str | None:
    """The GPU's name when `device` is a GPU without FP8 (compute capability below 8.9:
    before Ada and Hopper), else None; a CPU runs the same calls, slowly (the numerics CI
    checks)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return torch.cuda.get_device_name(device)
    return None


def check_fp8_device(device: torch.device) -> None:
    """Raise, in one line, where `lacks_fp8`."""
    if (name := lacks_fp8(device)) is not None:
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
    GEMM's epilogue: a separate add would be one more pass over the output."""
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


def _blocks(n: int) -> int:
    return -(-n // SCALE_BLOCK)


def quantize_row_blocks(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y [R, N] -> (e4m3 [R, N], fp32 scales [R, ceil(N / 128)]): `quantize_rows` of each
    row's 128-column blocks (the last one may be short), the layout the FFN's up kernel
    writes (`kernels.fp8_ffn`)."""
    r, n = y.shape
    nb = _blocks(n)
    padded = F.pad(y, (0, nb * SCALE_BLOCK - n)).reshape(r * nb, SCALE_BLOCK)
    q, s = quantize_rows(padded)
    return q.reshape(r, nb * SCALE_BLOCK)[:, :n].contiguous(), s.reshape(r, nb)


@dataclass(frozen=True)
class Fp8BlockWeight:
    """A linear layer's weight [N, K] in e4m3 with one fp32 scale per 128 x 128 block (the
    last row or column of blocks may be short): the FFN down projection's."""

    q: torch.Tensor  # e4m3 [N, K], row-major
    scale: torch.Tensor  # fp32 [ceil(N / 128), ceil(K / 128)], row-major

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8BlockWeight:
        """Each block quantised on its own (`quantize_rows` of its values; zero padding
        to whole blocks does not move an amax)."""
        n, k = weight.shape
        nb, kb = _blocks(n), _blocks(k)
        w = F.pad(weight.detach(), (0, kb * SCALE_BLOCK - k, 0, nb * SCALE_BLOCK - n))
        blocks = w.reshape(nb, SCALE_BLOCK, kb, SCALE_BLOCK).transpose(1, 2)
        q, s = quantize_rows(blocks.reshape(nb * kb, SCALE_BLOCK * SCALE_BLOCK))
        q = q.view(torch.uint8).reshape(nb, kb, SCALE_BLOCK, SCALE_BLOCK).transpose(1, 2)
        q = q.reshape(nb * SCALE_BLOCK, kb * SCALE_BLOCK)[:n, :k]
        return cls(q.contiguous().view(E4M3), s.reshape(nb, kb).contiguous())

    def dequantized(self) -> torch.Tensor:  # fp32 [N, K]
        n, k = self.q.shape
        s = self.scale.repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
        return self.q.float() * s[:n, :k]


def block_fp8_gemm(
    hq: torch.Tensor,  # e4m3 [R, K]
    hs: torch.Tensor,  # fp32 [R, ceil(K / 128)]: one scale per row and 128 columns
    w: Fp8BlockWeight,  # [N, K]
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [R, N]
    """(hq · hs per 1 x 128) @ (w.q · w.scale per 128 x 128).T: cuBLASLt's block-scaled
    GEMM on CUDA where N and K are whole blocks (its input scales M-major, strides
    (1, R); the weight's the transpose of the row-major grid, as ATen's check asks), else
    `block_fp8_reference`."""
    n, k = w.q.shape
    if not hq.is_cuda or n % SCALE_BLOCK or k % SCALE_BLOCK:
        return block_fp8_reference(hq, hs, w).to(out_dtype)
    r = hq.shape[0]
    pad = -r % BLOCK_GEMM_ROWS
    if pad:  # step 0 of a small batch: cuBLASLt has no block-scaled kernel for it
        hq = F.pad(hq.view(torch.uint8), (0, 0, 0, pad)).view(E4M3)
        hs = F.pad(hs, (0, 0, 0, pad), value=1.0)
    if hs.stride(0) != 1:  # the up kernel writes them M-major already
        hs = hs.t().contiguous().t()
    out = torch._scaled_mm(hq, w.q.t(), scale_a=hs, scale_b=w.scale.t(), out_dtype=out_dtype)
    return out[:r] if pad else out


def block_fp8_reference(hq: torch.Tensor, hs: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """What `block_fp8_gemm` computes, in fp32 from the dequantised operands."""
    k = hq.shape[1]
    return (hq.float() * hs.repeat_interleave(SCALE_BLOCK, 1)[:, :k]) @ w.dequantized().t()


class Fp8Linear(nn.Module):
    """An `nn.Linear` with its weight quantised once (`of`): per output channel, or per
    128 x 128 block (`block=True`: the FFN down projection). The bias stays in the model's
    dtype. `forward` quantises its input itself; the FP8 decoder step hands the GEMMs
    inputs that the kernels before them quantised already."""

    def __init__(self, weight: Fp8Weight | Fp8BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, *, block: bool = False) -> Fp8Linear:
        w = (Fp8BlockWeight if block else Fp8Weight).of(linear.weight.detach())
        return cls(w, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N], x's dtype
        rows = x.reshape(-1, x.shape[-1])
        if isinstance(self.weight, Fp8BlockWeight):
            y = block_fp8_gemm(*quantize_row_blocks(rows), self.weight, x.dtype)
        else:
            y = fp8_matmul(rows, self.weight, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)
