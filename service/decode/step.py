"""The decoder step of the decode loop (pipeline stage 3): one SID token for R beam rows,
`SIDDecoder.forward_train` at one position with fewer passes over the `[R, d_model]`
activations (docs/MODEL.md "Decode engine"):

1. layer 0's QKV is a per-model table over (position, token) — layer 0 sees only the token
   embedding — read straight by the self-attention (3 MB per position, L2-resident);
2. residual adds run inside the matmuls (`x.addmm_(a, W.t())`, cuBLAS `beta = 1`), the
   biases carried as a pending `shift` each LayerNorm adds, so no add kernel ever runs;
3. on CUDA a "gelu_tanh" model's GELU is the up-projection's cuBLASLt epilogue.

`FP8DecoderStep` (`fp8_step.py`) is the same loop for a model made FP8 at load. Build one
per loaded decoder: the table and the shifts are snapshots of its weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cross_attention import cross_attention
from kernels.gelu_linear import gelu_linear
from kernels.layer_norm import layer_norm
from service.decode.kv_cache import PagedKVCache
from service.model.decoder import CrossKV, DecoderLayer, SIDDecoder


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

    # the self-attention kernel's output: [R, H, d_h], or (FP8) e4m3 rows and their scales
    fp8_out = False

    @torch.no_grad()
    def __init__(self, decoder: SIDDecoder) -> None:
        self.decoder = decoder
        c = decoder.config
        first = decoder.layers[0]
        # [sid_length, vocab + 1, 3·H·d_h]: layer 0's QKV for every (position, token)
        self.qkv0 = first.qkv(first.norm_self(decoder.tok_emb)).contiguous()
        # per layer the biases not yet in the stream at its (self, cross, ffn) LayerNorms
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

    def normed_linear(
        self,
        x: torch.Tensor,  # [R, d_model]: the residual stream
        pending: torch.Tensor | None,  # a projection not yet added to x (FP8 only)
        norm: nn.LayerNorm,
        shift: torch.Tensor | None,
        linear: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, linear(LN(x + pending + shift))); nothing is ever pending here."""
        assert pending is None
        return x, linear(_ln(x, norm, shift))

    def project(
        self,
        x: torch.Tensor,
        a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        linear: nn.Module,
    ) -> torch.Tensor | None:
        """a @ W.T (its bias is pending in the next LN's shift), added to x in place inside
        the matmul (cuBLAS beta = 1): nothing left pending. `a`: the attention output."""
        assert isinstance(a, torch.Tensor)
        x.addmm_(a.reshape(len(x), -1), linear.weight.t())
        return None

    def ffn(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        layer: DecoderLayer,
        shift: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x + pending + FFN(LN(x + pending + shift)), what is left pending): the up
        projection with its activation (the GELU as cuBLASLt's epilogue on CUDA for a
        "gelu_tanh" model), the down projection added in place."""
        h = _ln(x, layer.norm_ffn, shift)
        if self.gelu_epilogue:  # one GEMM: bias + tanh-GELU in its epilogue
            up = gelu_linear(h, layer.ffn_up.weight, layer.ffn_up.bias)
        else:
            up = layer.ffn_hidden(h)
        x.addmm_(up, layer.ffn_down.weight.t())
        return x, None

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,  # int64 [R]: previous tokens (BOS at t = 0)
        t: int,
        cross: CrossKV,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # logits [R, V]
        d = self.decoder
        x = d.tok_emb[t, tokens]  # [R, d_model]: a fresh tensor, updated in place below
        r = x.shape[0]
        pending: torch.Tensor | None = None  # a projection the next LN adds to x (FP8)
        for i, (layer, kv) in enumerate(zip(d.layers, cross, strict=True)):
            at_self, at_cross, at_ffn = self.shifts[i]
            if i == 0:  # row r reads table entry (t, tokens[r])
                a = cache.attend(0, t, self.qkv0[t], rows=tokens, fp8_out=self.fp8_out)
            else:
                x, qkv = self.normed_linear(x, pending, layer.norm_self, at_self, layer.qkv)
                a = cache.attend(i, t, qkv, fp8_out=self.fp8_out)
            pending = self.project(x, a, layer.self_out)
            x, q = self.normed_linear(x, pending, layer.norm_cross, at_cross, layer.cross_q)
            a = cross_attention(q.view(r, layer.h, layer.dh), *kv)
            pending = self.project(x, a, layer.cross_out)
            x, pending = self.ffn(x, pending, layer, at_ffn)
        return d.head(_ln(x, d.norm, self.final_shift, pending))
