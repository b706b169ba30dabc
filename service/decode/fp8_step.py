"""The decoder step of a model whose linear layers are FP8 (pipeline stage 3; docs/FP8.md):
`DecoderStep`'s loop with its linear layers in e4m3 (`kernels.fp8.Fp8Linear`, made at load
by `service/model/precision.py`). An FP8 GEMM cannot add into the residual stream
(`torch._scaled_mm` has no `beta`), so each output projection is handed on as a pending
`residual` that the next LayerNorm kernel adds (`add_layer_norm_fp8`, which also quantises
the next GEMM's input per row). The self-attention kernel writes its output quantised
(`fp8_out`); the FFN's up GEMM adds its bias, applies GELU and quantises per row and 128
columns in its epilogue (`kernels.fp8_ffn`) for a down GEMM with 128 x 128 weight blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8 import block_fp8_gemm, fp8_gemm, fp8_matmul
from kernels.fp8_ffn import fp8_up_gelu
from kernels.layer_norm import add_layer_norm_fp8
from service.decode.step import DecoderStep
from service.model.decoder import DecoderLayer, SIDDecoder
from service.model.precision import is_fp8


def decoder_step(decoder: SIDDecoder) -> DecoderStep:
    """The step that runs `decoder` as it was loaded: FP8 or not."""
    return (FP8DecoderStep if is_fp8(decoder) else DecoderStep)(decoder)


class FP8DecoderStep(DecoderStep):
    fp8_out = True

    def normed_linear(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        norm: nn.LayerNorm,
        shift: torch.Tensor | None,
        linear: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The LayerNorm kernel adds the pending projection and writes its rows quantised
        for the FP8 GEMM, which adds the bias in its epilogue."""
        assert pending is not None  # every FP8 LayerNorm follows a projection
        x, q, scale = add_layer_norm_fp8(x, pending, norm.weight, norm.bias, norm.eps, shift)
        return x, fp8_gemm(q, scale, linear.weight, x.dtype, bias=linear.bias)

    def project(
        self,
        x: torch.Tensor,
        a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        linear: nn.Module,
    ) -> torch.Tensor:
        """a @ W.T, pending. `a`: already quantised by the kernel that made it (e4m3
        [R, H·d_h], scales), or the cross-attention output, quantised here."""
        if isinstance(a, tuple):
            return fp8_gemm(*a, linear.weight, x.dtype)
        return fp8_matmul(a.reshape(len(x), -1), linear.weight, x.dtype)

    def ffn(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        layer: DecoderLayer,
        shift: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, the FFN's output, pending in turn; its bias in the next shift)."""
        assert pending is not None
        n, tanh = layer.norm_ffn, self.decoder.config.ffn_activation == "gelu_tanh"
        x, q, scale = add_layer_norm_fp8(x, pending, n.weight, n.bias, n.eps, shift)
        hq, hs = fp8_up_gelu(q, scale, layer.ffn_up.weight, layer.ffn_up.bias, tanh)
        return x, block_fp8_gemm(hq, hs, layer.ffn_down.weight, x.dtype)
