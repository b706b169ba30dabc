"""The decoder step with its elementwise work folded into the matmuls — what the fixed-shape
decode loop (`static_engine.StaticBeamSearch`, pipeline stage 3) runs by default.

Same weights and the same function as `SIDDecoder.step`, computed with fewer passes over
the `[R, d_model]` activations (docs/ARCHITECTURE.md §7, "fewer kernels per step"):

1. Layer 0's QKV is a table. Layer 0 sees only the token embedding, and its QKV
   projection `qkv(LN(tok_emb[t, token]))` depends on (t, token) alone, so it is computed
   once per model for the sid_length × (vocab + 1) pairs, and the self-attention reads
   each row's entry straight from the table (`KVCache.attend(..., rows=tokens)`: 3 MB per
   position, L2-resident) — the layer 0 QKV matmul (7 % of the decoder's FLOPs) and the
   copy of its output both disappear.
2. Residual adds go into the matmul: `x.addmm_(a, W.t())` (cuBLAS `beta = 1`) adds the
   projection to the residual stream in place. The bias is left out and carried as a
   pending constant: every LayerNorm normalises `x + shift`, where `shift` is the sum of
   the biases added so far (`kernels.layer_norm`, one pass, fp32), so no separate add
   kernel runs, ever.
3. The FFN's GELU is the up-projection's epilogue on CUDA when the model was trained with
   "gelu_tanh" (`kernels.gelu_linear`: cuBLASLt's GELU_BIAS epilogue, or our persistent
   Triton GEMM with the same epilogue — `ffn_up`); an erf-GELU model (older checkpoints)
   keeps the separate activation.

Inference only (no autograd): build one per loaded decoder; the table and the shifts are
snapshots of its weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cross_attention import cross_attention
from kernels.gelu_linear import BACKENDS, gelu_linear
from kernels.layer_norm import layer_norm
from service.decode.kv_cache import KVCache
from service.model.decoder import CrossAttention, CrossKV, SIDDecoder


def _ln(x: torch.Tensor, norm: nn.LayerNorm, shift: torch.Tensor | None) -> torch.Tensor:
    return layer_norm(x, norm.weight, norm.bias, norm.eps, shift)


def _bias(linear: nn.Linear) -> torch.Tensor:
    assert linear.bias is not None
    return linear.bias.detach().float().clone()  # a snapshot, never the parameter itself


class FusedDecoderStep:
    """`SIDDecoder.step` with the layer-0 QKV table, residuals in the matmuls and shifted
    LayerNorms; call it like the decoder's `step`."""

    @torch.no_grad()
    def __init__(
        self, decoder: SIDDecoder, *, table_in_attention: bool = True, ffn_up: str = "cublaslt"
    ) -> None:
        if ffn_up not in BACKENDS:
            raise ValueError(f"ffn_up must be one of {BACKENDS}, got {ffn_up!r}")
        self.decoder = decoder
        self.table_in_attention = table_in_attention  # False: gather the rows' QKV first
        self.ffn_up = ffn_up  # the gelu_linear backend of the up-projection
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
            pending = after_cross + _bias(layer.ffn[2])
        assert pending is not None
        self.final_shift = pending
        self.gelu_epilogue = c.ffn_activation == "gelu_tanh" and first.qkv.weight.is_cuda

    def _ffn_up(self, h: torch.Tensor, up: nn.Linear, act: nn.Module) -> torch.Tensor:
        if self.gelu_epilogue:  # one GEMM: bias + tanh-GELU in its epilogue
            return gelu_linear(h, up.weight, up.bias, self.ffn_up)
        return act(up(h))

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,  # int64 [R]: previous tokens (BOS at t = 0)
        t: int,
        cross: CrossKV,
        cache: KVCache,
        cross_attn: CrossAttention = cross_attention,
    ) -> torch.Tensor:  # logits [R, V]
        d = self.decoder
        x = d.tok_emb[t, tokens]  # [R, d_model]: a fresh tensor, updated in place below
        r = x.shape[0]
        for i, (layer, kv) in enumerate(zip(d.layers, cross, strict=True)):
            at_self, at_cross, at_ffn = self.shifts[i]
            if i == 0 and self.table_in_attention:  # row r reads table entry (t, tokens[r])
                a = cache.attend(0, t, self.qkv0[t], rows=tokens)  # [R, H, d_h]
            elif i == 0:
                a = cache.attend(0, t, self.qkv0[t, tokens])
            else:
                a = cache.attend(i, t, layer.qkv(_ln(x, layer.norm_self, at_self)))
            x.addmm_(a.reshape(r, -1), layer.self_out.weight.t())
            q = layer.cross_q(_ln(x, layer.norm_cross, at_cross)).view(r, layer.h, layer.dh)
            x.addmm_(cross_attn(q, *kv).reshape(r, -1), layer.cross_out.weight.t())
            up, act, down = layer.ffn
            x.addmm_(self._ffn_up(_ln(x, layer.norm_ffn, at_ffn), up, act), down.weight.t())
        return d.head(_ln(x, d.norm, self.final_shift))
