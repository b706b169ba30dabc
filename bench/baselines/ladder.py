"""The textbook decode loop: the unserved rows of the decode ladder (the paper's Table 6,
bench/bench_decoder_loop.py), each `Rung` switch one optimisation the served engine
(`service/decode/engine.py`) has and this loop may leave out. None of this is served.

The loop is the plain beam search, eager, one step at a time: the decoder layer by layer
(LN → QKV → attend → add, LN → cross → add, LN → FFN → add: no layer-0 table, no folded
biases), the mask and scores through the served mask kernel's dispatcher
(`kernels.gtm_mask.masked_candidates`), top-k, and the bookkeeping as torch ops. Its
switches: the cross-attention layout (K/V per beam row, eq. 10, or per request with beams
as the query), the self-attention (torch SDPA over a gathered prefix, the coalesced
kernel over it, or the fused write + gather + attend kernel), the KV cache (dense: a
reorder copies bytes; paged: it copies block ids), fixed widths (max M_t rows every step)
and the mask (none, CD, CD + bitmask, CD + bitmask + Bloom).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.baselines.cross_attention import cross_attention_per_beam
from bench.baselines.kv_cache import ATTENTION_MODES, DenseKVCache, GatherPagedKVCache
from contracts.request import FilterMode
from contracts.tensors import GtmTables, RequestTensors
from kernels.beam_advance import parents_and_tokens
from kernels.cross_attention import cross_attention
from kernels.gtm_mask import NEG_INF, masked_candidates
from service.decode.kv_cache import PagedKVCache
from service.decode.plans import DecodeResult
from service.model.decoder import SIDDecoder

MASKS = ("none", "cd", "bitmask", "bloom")


@dataclass(frozen=True)
class Rung:
    """One row's switches; the defaults are everything this loop can do."""

    cross: str = "beam_as_query"  # or "per_beam": K/V materialised per beam row
    self_attn: str = "fused"  # or "gather" (the coalesced kernel), "sdpa" (torch)
    kv: str = "paged"  # or "dense"
    fixed_beams: bool = False  # max(beams) rows at every step
    mask: str = "bloom"  # one of MASKS

    def __post_init__(self) -> None:
        for name, value, known in (
            ("cross", self.cross, ("beam_as_query", "per_beam")),
            ("self_attn", self.self_attn, ATTENTION_MODES),
            ("kv", self.kv, ("paged", "dense")),
            ("mask", self.mask, MASKS),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {known}, got {value!r}")


def bitmask_only(requests: RequestTensors) -> RequestTensors:
    """The same requests with one all-zero Bloom row each: an all-zero query is contained
    in every matcher, so only the bitmask decides."""
    b, _, w = requests.blooms.shape
    return RequestTensors(requests.bitmask, requests.blooms.new_zeros(b, 1, w))


class TextbookSearch:
    """The textbook loop over one index's tables, with `rung`'s switches."""

    def __init__(
        self, decoder: SIDDecoder, rung: Rung, tables: GtmTables, level_offsets: torch.Tensor
    ) -> None:
        self.decoder, self.rung, self.tables = decoder, rung, tables
        self.first_leaf = int(level_offsets[-2])
        self.dead_node = int(level_offsets[-1]) - 1  # a leaf: nothing is allowed below it
        param = next(decoder.parameters())
        self.device, self.dtype = param.device, param.dtype

    @torch.no_grad()
    def run(
        self, ctx: torch.Tensor, requests: RequestTensors | None, beams: tuple[int, ...]
    ) -> DecodeResult:
        c, r, dev = self.decoder.config, self.rung, self.device
        b, v = ctx.shape[0], c.vocab_size
        widths = (max(beams),) * len(beams) if r.fixed_beams else beams  # W_t >= M_t
        rows = [b * w for w in widths]
        cache_cls = PagedKVCache if r.kv == "paged" and r.self_attn == "fused" else (
            GatherPagedKVCache if r.kv == "paged" else DenseKVCache
        )  # fmt: skip
        kwargs = {} if cache_cls is PagedKVCache else {"attention": r.self_attn}
        cache = cache_cls(c.decoder_layers, c.n_heads, c.d_head, rows, dtype=self.dtype,
                          device=dev, **kwargs)  # fmt: skip
        mode = FilterMode.CD_ONLY if r.mask == "cd" else FilterMode.CD_GTM
        if r.mask == "bitmask" and requests is not None:
            requests = bitmask_only(requests)
        cross = self.decoder.cross_kv(ctx)
        slot = torch.arange(rows[0], device=dev) % widths[0]
        score = torch.zeros(rows[0], device=dev).masked_fill(slot >= beams[0], NEG_INF)
        node = torch.zeros(rows[0], dtype=torch.int64, device=dev)
        tokens = torch.full_like(node, self.decoder.bos)
        prefix = torch.zeros(rows[0], 0, dtype=torch.int64, device=dev)
        for t in range(len(beams)):
            logits = self._step(tokens, t, cross, cache)
            if r.mask == "none":
                cand, child = score[:, None] + torch.log_softmax(logits.float(), dim=-1), None
            else:
                row_request = torch.arange(b, device=dev).repeat_interleave(widths[t])
                cand, child = masked_candidates(logits, self.tables, node, row_request,
                                                requests, score, mode)  # fmt: skip
            last = t + 1 == len(beams)
            top, flat = cand.view(b, -1).topk(beams[-1] if last else widths[t + 1], dim=1)
            parent, tokens = parents_and_tokens(flat, widths[t], v)
            score = top.reshape(-1)
            if not last:  # fixed widths: the slots past M_{t+1} are dead
                kept = torch.arange(len(score), device=dev) % widths[t + 1]
                score = score.masked_fill(kept >= beams[t + 1], NEG_INF)
            live = torch.isfinite(score)
            if child is not None:
                node = child[parent, tokens].long().masked_fill(~live, self.dead_node)
            prefix = torch.cat([prefix[parent], tokens[:, None]], dim=1)
            if not last:
                cache.reorder(t, parent)
        if r.mask == "none":  # no trie: no leaves
            leaves = torch.full_like(score, -1, dtype=torch.int64)
        else:
            leaves = (node - self.first_leaf).masked_fill(~live, -1)
        m = beams[-1]
        return DecodeResult(leaves.view(b, m), score.view(b, m), prefix.view(b, m, -1),
                            tuple(rows))  # fmt: skip

    def _step(self, tokens, t, cross, cache) -> torch.Tensor:
        """Layer by layer, as `SIDDecoder.forward_train` at one position."""
        d = self.decoder
        attend = cross_attention_per_beam if self.rung.cross == "per_beam" else cross_attention
        x = d.tok_emb[t, tokens]
        for i, (layer, kv) in enumerate(zip(d.layers, cross, strict=True)):
            n = x.shape[0]
            a = cache.attend(i, t, layer.qkv(layer.norm_self(x)))  # [R, H, d_h]
            x = x + layer.self_out(a.reshape(n, -1))
            q = layer.cross_q(layer.norm_cross(x)).view(n, layer.h, layer.dh)
            x = x + layer.cross_out(attend(q, *kv).reshape(n, -1))
            x = x + layer.ffn(layer.norm_ffn(x))
        return d.head(d.norm(x))
