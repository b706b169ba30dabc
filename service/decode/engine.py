"""Constrained beam search over SIDs: pipeline stage 3's decode loop (docs/ARCHITECTURE.md §2).

For t = 1..4: the decoder step on M_t beam rows per request gives logits; the CD+GTM mask
(`index_builder.lookup`: trie children ∧ bitmask ∧ Bloom) sets disallowed tokens to −inf;
log-softmax; each request keeps its top M_{t+1} (after the last step: its top M_4
complete SIDs) by accumulated log-probability; the KV cache is reordered by parent row.

Shapes stay fixed — every request has exactly M_t rows at step t, request-major — so the
loop can later be captured in a CUDA graph and cross-attention can use the beam-as-query
layout. A row with no allowed continuation, or one that top-k could not fill, is dead:
score −inf, parked on a leaf node (no children), never emitted. Requests never interact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from index_builder.lookup import FilterMode, GtmTables, RequestTensors, lookup
from kernels.beam_advance import parents_and_tokens
from kernels.gtm_mask import NEG_INF, candidates
from service.decode.kv_cache import DenseKVCache, PagedKVCache
from service.model.decoder import SIDDecoder


@dataclass(frozen=True)
class DecodeResult:
    """Per request, the top M_4 complete SIDs (best first); dead slots have score −inf."""

    leaves: torch.Tensor  # int64 [B, M_4]: leaf position (node − first leaf node), −1 dead
    scores: torch.Tensor  # float32 [B, M_4]: accumulated log-probability
    sids: torch.Tensor  # int64 [B, M_4, sid_length]
    rows_per_step: tuple[int, ...]  # beam rows that entered each decoder step (B · M_t)

    def valid(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(leaves, scores) of request b's live SIDs."""
        keep = self.leaves[b] >= 0
        return self.leaves[b][keep], self.scores[b][keep]


def check_schedule(beams: tuple[int, ...], sid_length: int, vocab: int) -> None:
    if len(beams) != sid_length or beams[0] != 1 or min(beams) < 1:
        raise ValueError(f"beam schedule needs {sid_length} positive widths starting at 1: {beams}")
    for t in range(1, sid_length):
        if beams[t] > beams[t - 1] * vocab:
            raise ValueError(f"M_{t + 1}={beams[t]} exceeds M_{t}·{vocab} candidates")


def select(
    cand: torch.Tensor,  # float32 [B, M·V]: request b's candidates, row-major by beam row
    keep: int,
    rows_per_request: int,  # M
    vocab: int,
    *,
    ordered: bool = True,  # False: any order within a request (no sort after the select)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's best `keep` extensions, best first (with `ordered`), request-major:
    their scores float32 [B·keep], parent rows int64 [B·keep] (among the B·M rows) and
    tokens."""
    top, flat = top_k(cand, keep, ordered)
    return (top.reshape(-1), *parents_and_tokens(flat, rows_per_request, vocab))


def top_k(cand: torch.Tensor, keep: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's best `keep` candidates: scores float32 [B, keep] and their positions
    in the request's row int64 [B, keep]; best first with `ordered`, else in any order."""
    return cand.topk(keep, dim=1, sorted=ordered)


class BeamSearch:
    """Runs the decode loop for one batch against one index (tables stay fixed)."""

    def __init__(
        self,
        decoder: SIDDecoder,
        tables: GtmTables,
        level_offsets: torch.Tensor,  # int64 [sid_length + 2] from the index
        *,
        paged: bool = True,
    ) -> None:
        self.decoder = decoder
        self.tables = tables
        self.first_leaf = int(level_offsets[-2])
        self.dead_node = int(level_offsets[-1]) - 1  # a leaf: nothing is ever allowed below it
        self.paged = paged

    @torch.no_grad()
    def run(
        self,
        ctx: torch.Tensor,  # [B, T_ctx, d_model] from the encoder
        requests: RequestTensors | None,
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
    ) -> DecodeResult:
        c = self.decoder.config
        check_schedule(beams, c.sid_length, c.vocab_size)
        b, dev = ctx.shape[0], ctx.device
        rows = [b * m for m in beams]
        cache_cls = PagedKVCache if self.paged else DenseKVCache
        cache = cache_cls(c.decoder_layers, c.n_heads, c.d_head, rows, dtype=ctx.dtype, device=dev)
        cross = self.decoder.cross_kv(ctx)
        node = torch.zeros(rows[0], dtype=torch.int64, device=dev)  # every row at the root
        tokens = torch.full_like(node, self.decoder.bos)
        score = torch.zeros(rows[0], dtype=torch.float32, device=dev)
        prefix = torch.zeros(rows[0], 0, dtype=torch.int64, device=dev)
        for t in range(c.sid_length):
            m = beams[t]
            request = torch.arange(b, device=dev).repeat_interleave(m)  # request-major rows
            logits = self.decoder.step(tokens, t, cross, cache).float()  # [R, V]
            allowed, child = lookup(self.tables, node, request, requests, mode)
            cand = candidates(score, logits.masked_fill(~allowed, NEG_INF), allowed)
            keep = beams[t + 1] if t + 1 < c.sid_length else beams[-1]
            score, parent, token = select(cand.view(b, -1), keep, m, c.vocab_size)
            live = torch.isfinite(score)
            node = torch.where(live, child[parent, token].long(), self.dead_node)
            prefix = torch.cat([prefix[parent], token[:, None]], dim=1)
            tokens = token
            if t + 1 < c.sid_length:
                cache.reorder(t, parent)
        leaves = torch.where(live, node - self.first_leaf, -1)
        return DecodeResult(
            leaves=leaves.view(b, -1),
            scores=score.view(b, -1),
            sids=prefix.view(b, beams[-1], c.sid_length),
            rows_per_step=tuple(rows),
        )
