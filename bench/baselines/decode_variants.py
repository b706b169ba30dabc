"""The decode engine with served optimisations switched off one at a time: the baselines of
bench/bench_decoder_loop.py's ladder (the paper's Table 6). None of this is served.

`DecodeOptions` names each switch; its defaults are the served engine, and
`VariantEngine(decoder, options, ...)` is `service.decode.engine.DecodeEngine` with the
seams the options touch replaced: the per-beam cross-attention layout, torch SDPA or
gather + attend self-attention, the dense KV cache, fixed beam widths, no mask, bitmask-only
GTM, eager (uncaptured) plans, the layer-by-layer decoder step, the unfused mask tail,
a different stream split, the Triton GELU GEMM, the bookkeeping as torch launches or
through torch.compile, and (with FP8) other forms of the FP8 FFN: the rowwise one served
before, the GELU's tanh from exp, the down GEMM in Triton, the up GEMM's sums promoted,
the up GEMM one program per tile (not persistent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.baselines._triton_fp8_down import triton_fp8_down
from bench.baselines.cross_attention import cross_attention_per_beam
from bench.baselines.gelu_fp8 import gelu_fp8
from bench.baselines.gelu_linear import gelu_linear_triton
from bench.baselines.kv_cache import ATTENTION_MODES, DenseKVCache, GatherPagedKVCache
from contracts.request import FilterMode
from kernels._triton_fp8_ffn import tma_loadable, triton_fp8_up_gelu
from kernels.beam_advance import beam_advance_reference
from kernels.cross_attention import cross_attention
from kernels.fp8 import Fp8Weight, block_fp8_gemm, fp8_gemm
from kernels.gtm_mask import bitmask_only, candidates, masked_candidates, masked_logits
from kernels.layer_norm import add_layer_norm_fp8, layer_norm
from service.decode.engine import DecodeEngine
from service.decode.step import DecoderStep

# DecodeOptions.fp8_ffn
FP8_FFNS = ("block", "rowwise", "exp_tanh", "triton_down", "promoted", "pointer_up")


@dataclass(frozen=True)
class DecodeOptions:
    """Ablation switches; the defaults are what the server runs."""

    cross: str = "beam_as_query"  # "per_beam": K/V materialised per beam row (naive)
    self_attn: str = "fused"  # "gather": gather + prefix_self_attention; "sdpa": + torch SDPA
    kv: str = "paged"  # "dense": per-row KV whose reorder copies bytes
    fixed_beams: bool = False  # compute max(beams) rows per request at every step
    mask: bool = True  # False: no CD/GTM at all (latency ablation: no leaves, all −1)
    bloom: bool = True  # False: GTM tests the bitmask only
    cuda_graph: bool = True  # capture each plan on CUDA (CPU always runs eagerly)
    fused_layers: bool = True  # DecoderStep (False: the layer-by-layer step below)
    streams: int = 2  # buckets >= SPLIT_MIN_BUCKET run as this many parts (graph branches)
    # one kernel for mask + log-softmax + score, layer 0's QKV table read by the attention
    # kernel (False: masked_logits, then candidates; the table gathered first)
    fused_tail: bool = True
    ffn_up: str = "cublaslt"  # "triton": the persistent TMA GEMM (fused_layers only)
    # the step's bookkeeping after top-k: "kernel" (served), "eager" (the torch
    # reference, ~10 launches), "compiled" (the reference through torch.compile)
    advance: str = "kernel"
    fp8: bool = False  # the served step's linear layers in FP8 (setting dtype = fp8)
    # with fp8: "block" (served: bias + GELU + 1 x 128 quantisation in the up GEMM's
    # epilogue, cuBLASLt's block-scaled down GEMM); "rowwise": served until then, both
    # GEMMs cuBLASLt's rowwise ones with a bias + GELU + per-row quantise pass between
    # (bench/baselines/gelu_fp8.py); "exp_tanh": the served FFN, the GELU's tanh from exp
    # and a division, not tanh.approx.f32; "triton_down": the served up GEMM, the down one
    # in Triton (bench/baselines/_triton_fp8_down.py); "promoted": the served FFN with the
    # up GEMM adding each K step's product in fp32 (`promote`, cuBLASLt's accumulation;
    # not persistent); "pointer_up": the served FFN with the up GEMM's first form, one
    # program per tile loading by pointers (not the persistent TMA kernel)
    fp8_ffn: str = "block"

    def __post_init__(self) -> None:
        for name, value, known in (
            ("cross", self.cross, ("beam_as_query", "per_beam")),
            ("self_attn", self.self_attn, ATTENTION_MODES),
            ("kv", self.kv, ("paged", "dense")),
            ("ffn_up", self.ffn_up, ("cublaslt", "triton")),
            ("advance", self.advance, ("kernel", "eager", "compiled")),
            ("fp8_ffn", self.fp8_ffn, FP8_FFNS),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {known}, got {value!r}")
        if self.fp8_ffn != "block" and not (self.fp8 and self.fused_layers):
            raise ValueError("fp8_ffn applies to the fused FP8 step: set fp8 (and fused_layers)")


class VariantStep(DecoderStep):
    """The served step with its table read, cross layout, FFN GEMM or FP8 FFN changed."""

    def __init__(self, decoder, options: DecodeOptions) -> None:
        super().__init__(decoder, fp8=options.fp8)
        self.options = options
        # rowwise, triton_down: each layer's FFN down weight per output channel, once here
        self.down_rows = [
            Fp8Weight.of(layer.ffn_down.weight)
            for layer in (decoder.layers if options.fp8_ffn in ("rowwise", "triton_down") else ())
        ]

    def attend_first(self, cache, t, tokens):
        if self.options.fused_tail:
            return super().attend_first(cache, t, tokens)
        return cache.attend(0, t, self.qkv0[t, tokens])  # gathered into a copy first

    def cross(self, q, k, v):
        per_beam = self.options.cross == "per_beam"
        return cross_attention_per_beam(q, k, v) if per_beam else cross_attention(q, k, v)

    def ffn_up(self, x, layer, shift):
        if self.gelu_epilogue and self.options.ffn_up == "triton":
            h = layer_norm(x, layer.norm_ffn.weight, layer.norm_ffn.bias, layer.norm_ffn.eps, shift)
            return gelu_linear_triton(h, layer.ffn_up.weight, layer.ffn_up.bias)
        return super().ffn_up(x, layer, shift)

    def ffn_fp8(self, x, pending, i, layer, shift):
        ffn = self.options.fp8_ffn
        if ffn == "block":
            return super().ffn_fp8(x, pending, i, layer, shift)
        assert self.fp8 is not None
        n, tanh = layer.norm_ffn, self.decoder.config.ffn_activation == "gelu_tanh"
        x, q, scale = add_layer_norm_fp8(x, pending, n.weight, n.bias, n.eps, shift)
        up = self.fp8[i]["ffn_up"]
        if ffn == "rowwise":  # rowwise up GEMM, bias + GELU + per-row quantise, rowwise down
            hq, hs = gelu_fp8(fp8_gemm(q, scale, up, x.dtype), layer.ffn_up.bias, tanh)
            return x, fp8_gemm(hq, hs, self.down_rows[i], x.dtype)
        # the served kernel choice (kernels.fp8_ffn.fp8_up_gelu) but for the two variants
        # that are the per-tile kernel: "pointer_up" and "promoted" (which only it runs)
        persistent = ffn not in ("pointer_up", "promoted") and tma_loadable(*up.q.shape[::-1])
        hq, hs = triton_fp8_up_gelu(q, scale, up, layer.ffn_up.bias, tanh,
                                    m_major=ffn != "triton_down", promote=ffn == "promoted",
                                    hw_tanh=False if ffn == "exp_tanh" else None,
                                    persistent=persistent)  # fmt: skip
        if ffn == "triton_down":
            return x, triton_fp8_down(hq, hs, self.down_rows[i], x.dtype)
        return x, block_fp8_gemm(hq, hs, self.fp8_down[i], x.dtype)


class LayerByLayerStep:
    """The textbook step: per layer LN -> QKV -> attend -> add, LN -> cross -> add,
    LN -> FFN -> add; no table, no folded biases (the ladder's unfused rows)."""

    def __init__(self, decoder, options: DecodeOptions) -> None:
        self.decoder = decoder
        self.per_beam = options.cross == "per_beam"

    @torch.no_grad()
    def __call__(self, tokens, t, cross, cache):
        d = self.decoder
        x = d.tok_emb[t, tokens]
        attend_cross = cross_attention_per_beam if self.per_beam else cross_attention
        for i, (layer, kv) in enumerate(zip(d.layers, cross, strict=True)):
            r = x.shape[0]
            a = cache.attend(i, t, layer.qkv(layer.norm_self(x)))  # [R, H, d_h]
            x = x + layer.self_out(a.reshape(r, -1))
            q = layer.cross_q(layer.norm_cross(x)).view(r, layer.h, layer.dh)
            x = x + layer.cross_out(attend_cross(q, *kv).reshape(r, -1))
            x = x + layer.ffn(layer.norm_ffn(x))
        return d.head(d.norm(x))


class VariantEngine(DecodeEngine):
    """`DecodeEngine` with `options` applied at its seams."""

    def __init__(self, decoder, options: DecodeOptions | None = None, **kwargs) -> None:
        self.options = options = options or DecodeOptions()
        super().__init__(decoder, streams=options.streams, **kwargs)
        self.cuda_graphs = self.cuda_graphs and options.cuda_graph
        step_cls = VariantStep if options.fused_layers else LayerByLayerStep
        self.step = step_cls(decoder, options)
        if options.advance == "eager":
            self.advance = beam_advance_reference
        elif options.advance == "compiled":
            # dynamic shapes: 3 compiled variants cover every bucket and step; they
            # compile while plans warm up, and the graphs replay Inductor's kernels
            self.advance = torch.compile(beam_advance_reference, dynamic=True)

    def widths(self, beams):
        return (max(beams),) * len(beams) if self.options.fixed_beams else beams

    def new_cache(self, rows_per_step):
        c, o = self.decoder.config, self.options
        cls = GatherPagedKVCache if o.kv == "paged" else DenseKVCache
        return cls(c.decoder_layers, c.n_heads, c.d_head, rows_per_step, dtype=self.dtype,
                   device=self.device, attention=o.self_attn)  # fmt: skip

    def location_key(self, mode, n):
        if not self.options.mask or mode == FilterMode.CD_ONLY:
            return 0
        if mode == FilterMode.CD_GTM and not self.options.bloom:
            return 1  # bitmask-only: one all-zero Bloom row per request
        return super().location_key(mode, n)

    def load(self, plan, ctx, requests):
        if requests is not None and not self.options.bloom and plan.mode == FilterMode.CD_GTM:
            requests = bitmask_only(requests)
        super().load(plan, ctx, requests if self.options.mask else None)

    def candidates(self, plans, plan, logits, node, score, t):
        if not self.options.mask:
            return score[:, None] + torch.log_softmax(logits.float(), dim=-1), None
        args = (plans.tables, node, plan.row_request[t], plan.requests)
        bloom = self.options.bloom  # False: the kernel skips the (all-zero) Bloom rows
        if self.options.fused_tail:
            return masked_candidates(logits, *args, score, plan.mode, bloom=bloom,
                                     scoring=self.scoring)  # fmt: skip
        masked, child = masked_logits(logits.float(), *args, plan.mode, bloom=bloom)
        return candidates(score, masked, child >= 0, scoring=self.scoring, logits=logits), child

    def run(self, plans, ctx, requests, beams, mode=FilterMode.CD_GTM):
        if not self.options.mask:
            requests = None
            mode = FilterMode.CD_ONLY if mode != FilterMode.CD_ONLY else mode
        return super().run(plans, ctx, requests, beams, mode)
