"""The decoder step of the decode loop (pipeline stage 3): one SID token for R beam rows.

`DecoderStep(decoder)` computes the function of `SIDDecoder.forward_train` at one position,
with its elementwise work folded into the matmuls — fewer passes over the `[R, d_model]`
activations (docs/ARCHITECTURE.md §7, "fewer kernels per step"):

1. Layer 0's QKV is a table. Layer 0 sees only the token embedding, and its QKV
   projection `qkv(LN(tok_emb[t, token]))` depends on (t, token) alone, so it is computed
   once per model for the sid_length × (vocab + 1) pairs, and the self-attention reads
   each row's entry straight from the table (`PagedKVCache.attend(..., rows=tokens)`: 3 MB
   per position, L2-resident) — the layer 0 QKV matmul (7 % of the decoder's FLOPs) and
   the copy of its output both disappear.
2. Residual adds go into the matmul: `x.addmm_(a, W.t())` (cuBLAS `beta = 1`) adds the
   projection to the residual stream in place. The bias is left out and carried as a
   pending constant: every LayerNorm normalises `x + shift`, where `shift` is the sum of
   the biases added so far (`kernels.layer_norm`, one pass, fp32), so no separate add
   kernel runs, ever.
3. The FFN's GELU is the up-projection's epilogue on CUDA when the model was trained with
   "gelu_tanh" (`kernels.gelu_linear`: cuBLASLt's GELU_BIAS epilogue); an erf-GELU model
   (older checkpoints) keeps the separate activation.

With `fp8=True` the linear layers of the loop (QKV of layers >= 1, both attention output
projections, the cross-attention query, the FFN) multiply in FP8 e4m3 (`kernels.fp8`:
weights quantised once here per output channel, activations per row at each call; the
FFN's hidden activation per 128 columns by the up GEMM's epilogue, `kernels.fp8_ffn`,
for a down GEMM whose weight has one scale per 128 x 128 block); the
layer-0 table, the cross K/V, the LayerNorms, the residual stream and the logits head stay
in the model's dtype. An FP8 GEMM cannot add into the stream (`torch._scaled_mm` has no
`beta`), so each output projection is handed on as a pending `residual`, and the
LayerNorm that reads the stream next adds it (`kernels.layer_norm.add_layer_norm_fp8`:
one pass writes the new stream and the next GEMM's FP8 input; the final norm adds the
last one) — no separate add kernel runs in FP8 either. The self-attention kernel writes
its output quantised for the out projection (`PagedKVCache.attend(..., fp8_out=True)`);
the cross-attention output takes a quantising pass of its own (`kernels.fp8.fp8_matmul`).

Self-attention's "write + attend" belongs to the KV cache (`service/decode/kv_cache.py`);
cross-attention runs beam-as-query over the per-request K/V of `SIDDecoder.cross_kv`
(`kernels.cross_attention`). On CPU the same code runs the kernels' torch references.
Inference only (no autograd): build one per loaded decoder; the table and the shifts are
snapshots of its weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cross_attention import cross_attention
from kernels.fp8 import (
    Fp8BlockWeight,
    Fp8Weight,
    block_fp8_gemm,
    check_fp8_device,
    fp8_gemm,
    fp8_matmul,
)
from kernels.fp8_ffn import fp8_up_gelu
from kernels.gelu_linear import gelu_linear
from kernels.layer_norm import add_layer_norm_fp8, layer_norm
from service.decode.kv_cache import PagedKVCache
from service.model.decoder import CrossKV, DecoderLayer, SIDDecoder

# the linear layers an FP8 step multiplies in e4m3 with rowwise scales (layer 0's QKV is
# the table: never); the FFN down projection's weight is quantised in 128 x 128 blocks
_FP8_LINEARS = ("qkv", "self_out", "cross_q", "cross_out", "ffn_up")


def _ln(
    x: torch.Tensor,
    norm: nn.LayerNorm,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    return layer_norm(x, norm.weight, norm.bias, norm.eps, shift, residual)


def _bias(linear: nn.Linear) -> torch.Tensor:
    assert linear.bias is not None
    return linear.bias.detach().float().clone()  # a snapshot, never the parameter itself


class DecoderStep:
    """One decode step of `decoder`: tokens [R] at position t -> logits [R, V]."""

    @torch.no_grad()
    def __init__(self, decoder: SIDDecoder, *, fp8: bool = False) -> None:
        self.decoder = decoder
        # per layer, the FP8 weights of its linear layers by name (None: the model's dtype)
        self.fp8: list[dict[str, Fp8Weight]] | None = None
        self.fp8_down: list[Fp8BlockWeight] = []  # per layer, the FFN down weight's blocks
        if fp8:
            check_fp8_device(decoder.tok_emb.device)
            self.fp8 = [
                {n: Fp8Weight.of(getattr(layer, n).weight) for n in _FP8_LINEARS
                 if not (i == 0 and n == "qkv")}  # layer 0's QKV is the table above
                for i, layer in enumerate(decoder.layers)
            ]  # fmt: skip
            self.fp8_down = [Fp8BlockWeight.of(layer.ffn_down.weight) for layer in decoder.layers]
        c = decoder.config
        first = decoder.layers[0]
        # [sid_length, vocab + 1, 3·H·d_h]: layer 0's QKV for every (position, token)
        self.qkv0 = first.qkv(first.norm_self(decoder.tok_emb)).contiguous()
        # the biases not yet in the residual stream at each LayerNorm: (self, cross, ffn)
        # per layer, then the final norm's
        self.shifts: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
        pending: torch.Tensor | None = None
        for layer in decoder.layers:
            at_self = pending
            after_self = (
                _bias(layer.self_out) if pending is None else pending + _bias(layer.self_out)
            )
            after_cross = after_self + _bias(layer.cross_out)
            self.shifts.append((at_self, after_self, after_cross))
            pending = after_cross + _bias(layer.ffn_down)
        assert pending is not None
        self.final_shift = pending
        self.gelu_epilogue = c.ffn_activation == "gelu_tanh" and first.qkv.weight.is_cuda

    def attend_first(
        self, cache: PagedKVCache, t: int, tokens: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [R, H, d_h], or in FP8
        """Layer 0's self-attention: row r reads table entry (t, tokens[r])."""
        return cache.attend(0, t, self.qkv0[t], rows=tokens, fp8_out=self.fp8 is not None)

    def cross(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cross_attention(q, k, v)

    def ffn_up(self, x: torch.Tensor, layer: DecoderLayer, shift: torch.Tensor) -> torch.Tensor:
        """The FFN's activated up-projection of LN(x + shift) (not in FP8: `ffn_fp8`)."""
        h = _ln(x, layer.norm_ffn, shift)
        if self.gelu_epilogue:  # one GEMM: bias + tanh-GELU in its epilogue
            return gelu_linear(h, layer.ffn_up.weight, layer.ffn_up.bias)
        return layer.ffn_hidden(h)

    def ffn_fp8(
        self,
        x: torch.Tensor,
        pending: torch.Tensor,
        i: int,
        layer: DecoderLayer,
        shift: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, the FFN's output) in FP8: the LayerNorm kernel adds the pending
        projection and quantises the up projection's input; the up GEMM adds its bias,
        applies GELU and quantises the down projection's input per 128 columns in its
        epilogue (`kernels.fp8_ffn`); the down GEMM is block-scaled. The FFN's output is
        pending in turn, its bias in the next LN's shift."""
        assert self.fp8 is not None
        n, tanh = layer.norm_ffn, self.decoder.config.ffn_activation == "gelu_tanh"
        x, q, scale = add_layer_norm_fp8(x, pending, n.weight, n.bias, n.eps, shift)
        hq, hs = fp8_up_gelu(q, scale, self.fp8[i]["ffn_up"], layer.ffn_up.bias, tanh)
        return x, block_fp8_gemm(hq, hs, self.fp8_down[i], x.dtype)

    def normed_linear(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        norm: nn.LayerNorm,
        shift: torch.Tensor | None,
        i: int,
        name: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, layer i's linear layer `name` of LN(x + pending + shift)); in FP8
        the LayerNorm kernel adds the pending projection and writes its rows quantised,
        for the FP8 GEMM to read. Without FP8 nothing is ever pending."""
        linear: nn.Linear = getattr(self.decoder.layers[i], name)
        if self.fp8 is None:
            assert pending is None
            return x, linear(_ln(x, norm, shift))
        assert pending is not None  # every FP8 LayerNorm follows a projection
        x, q, scale = add_layer_norm_fp8(x, pending, norm.weight, norm.bias, norm.eps, shift)
        return x, fp8_gemm(q, scale, self.fp8[i][name], x.dtype, bias=linear.bias)

    def project(
        self,
        x: torch.Tensor,
        a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        i: int,
        name: str,
        linear: nn.Linear,
    ) -> torch.Tensor | None:
        """a @ W.T of layer i's `name` (its bias is pending in the next LN's shift): added
        to x in place inside the matmul (None), or in FP8 returned, pending. `a`: the
        attention output [R, H, d_h], or (FP8) already quantised by the kernel that made it
        (e4m3 [R, H·d_h], scales)."""
        if isinstance(a, tuple):
            assert self.fp8 is not None
            return fp8_gemm(*a, self.fp8[i][name], x.dtype)
        a = a.reshape(len(x), -1)
        if self.fp8 is None:
            x.addmm_(a, linear.weight.t())  # the add inside the matmul (cuBLAS beta = 1)
            return None
        return fp8_matmul(a, self.fp8[i][name], x.dtype)

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,  # int64 [R]: previous tokens (BOS at t = 0)
        t: int,
        cross: CrossKV,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # logits [R, V]
        d = self.decoder
        # [R, d_model]: a fresh tensor, updated in place below (in FP8: replaced by each
        # LayerNorm that adds a pending projection)
        x = d.tok_emb[t, tokens]
        r = x.shape[0]
        pending: torch.Tensor | None = None  # FP8: a projection the next LN adds to x
        for i, (layer, kv) in enumerate(zip(d.layers, cross, strict=True)):
            at_self, at_cross, at_ffn = self.shifts[i]
            if i == 0:
                a = self.attend_first(cache, t, tokens)
            else:
                x, qkv = self.normed_linear(x, pending, layer.norm_self, at_self, i, "qkv")
                a = cache.attend(i, t, qkv, fp8_out=self.fp8 is not None)
            pending = self.project(x, a, i, "self_out", layer.self_out)
            x, q = self.normed_linear(x, pending, layer.norm_cross, at_cross, i, "cross_q")
            a = self.cross(q.view(r, layer.h, layer.dh), *kv)
            pending = self.project(x, a, i, "cross_out", layer.cross_out)
            if self.fp8 is not None:
                assert pending is not None
                x, pending = self.ffn_fp8(x, pending, i, layer, at_ffn)
            else:
                x.addmm_(self.ffn_up(x, layer, at_ffn), layer.ffn_down.weight.t())
        return d.head(_ln(x, d.norm, self.final_shift, pending))
