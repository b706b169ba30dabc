"""The reference constrained beam search, the oracle of the served decode engine
(`service/decode/engine.py`): the same search written the plain way.

For t = 1..4 each live beam row's logits come from `SIDDecoder.forward_train` over the
row's whole prefix (teacher forcing, no KV cache, no fused kernels); the CD+GTM mask is
the torch reference `kernels.gtm_mask.lookup`; log-softmax (over the allowed tokens, or
with `scoring="unmasked"` over the whole row); each request keeps its top
M_{t+1} (after the last step its top M_4 complete SIDs) by accumulated log-probability.
Rows are request-major; a row with no allowed continuation, or one top-k could not fill,
is dead: score −inf, parked on a leaf node (no children), never emitted.
"""

from __future__ import annotations

import torch

from contracts.request import FilterMode, Scoring, check_schedule
from contracts.tensors import GtmTables, RequestTensors
from kernels.gtm_mask import NEG_INF, candidates, lookup
from service.decode.plans import DecodeResult
from service.model.decoder import SIDDecoder


class ReferenceBeamSearch:
    """Decodes one batch against one index's tables."""

    def __init__(self, decoder: SIDDecoder, tables: GtmTables, level_offsets: torch.Tensor) -> None:
        self.decoder = decoder
        self.tables = tables
        self.first_leaf = int(level_offsets[-2])
        self.dead_node = int(level_offsets[-1]) - 1  # a leaf: nothing is allowed below it

    @torch.no_grad()
    def run(
        self,
        ctx: torch.Tensor,  # [B, T_ctx, d_model] from the encoder
        requests: RequestTensors | None,
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
        scoring: Scoring = "masked",
    ) -> DecodeResult:
        c = self.decoder.config
        check_schedule(beams, c.sid_length, c.vocab_size)
        b, dev, v = ctx.shape[0], ctx.device, c.vocab_size
        rows = [b * m for m in beams]
        node = torch.zeros(rows[0], dtype=torch.int64, device=dev)  # every row at the root
        score = torch.zeros(rows[0], dtype=torch.float32, device=dev)
        prefix = torch.zeros(rows[0], 0, dtype=torch.int64, device=dev)
        for t in range(c.sid_length):
            m = beams[t]
            request = torch.arange(b, device=dev).repeat_interleave(m)  # request-major rows
            pad = torch.zeros(len(request), c.sid_length - t, dtype=torch.int64, device=dev)
            sid = torch.cat([prefix, pad], dim=1)  # position t's logits read tokens < t only
            logits = self.decoder.forward_train(ctx[request], sid)[:, t].float()  # [R, V]
            allowed, child = lookup(self.tables, node, request, requests, mode)
            cand = candidates(score, logits.masked_fill(~allowed, NEG_INF), allowed,
                              scoring=scoring, logits=logits)  # fmt: skip
            keep = beams[t + 1] if t + 1 < c.sid_length else beams[-1]
            top, flat = cand.view(b, -1).topk(keep, dim=1)
            score = top.reshape(-1)
            base = torch.arange(b, device=dev)[:, None] * m
            parent, token = (flat // v + base).view(-1), (flat % v).view(-1)
            live = torch.isfinite(score)
            node = torch.where(live, child[parent, token].long(), self.dead_node)
            prefix = torch.cat([prefix[parent], token[:, None]], dim=1)
        leaves = torch.where(live, node - self.first_leaf, -1)
        return DecodeResult(
            leaves=leaves.view(b, -1),
            scores=score.view(b, -1),
            sids=prefix.view(b, beams[-1], c.sid_length),
            rows_per_step=tuple(rows),
        )
