"""The decode engine: pipeline stage 3's constrained beam search over SIDs, one engine on
CPU and GPU (the steps, `scoring` and plan/run: docs/MODEL.md "Decode engine").

`plan` makes one index version's `IndexPlans`; `run` decodes a batch on the fixed-shape
buffers of its `PlanKey`, on CUDA one captured graph per key (copy inputs in, `replay()`,
clone the outputs), on CPU the same body eagerly. `warm` makes every plan a server may
hit before the version serves. A plan of a bucket ≥ `SPLIT_MIN_BUCKET` runs as `streams`
parts, parallel branches of its graph: one half's memory-bound kernels run beside the
other's matmuls. Rows are request-major (row b·M_t + j); a dead row (no allowed
continuation, unfilled by top-k, or a padding request) has score −inf and sits on a leaf
node with no children, so it is never emitted and padding never changes real rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from contracts.request import SCORINGS, FilterMode, Scoring, check_schedule
from contracts.targeting import MAX_REQUEST_LOCATIONS
from contracts.tensors import GtmTables, RequestTensors
from kernels.beam_advance import beam_advance
from kernels.gtm_mask import NEG_INF, masked_candidates
from service.capture import bucket_of, capture, part_streams
from service.decode.fp8_step import decoder_step
from service.decode.kv_cache import PagedKVCache
from service.decode.plans import DecodeResult, IndexPlans, Plan
from service.model.decoder import SIDDecoder

SPLIT_MIN_BUCKET = 8  # smaller buckets are latency-bound: splitting them only adds work
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # leaves, scores, sids


class DecodeEngine:
    """Fixed-shape beam search with one decoder; plans per index version."""

    def __init__(
        self,
        decoder: SIDDecoder,
        *,
        batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16),
        location_buckets: tuple[int, ...] = (1, 4, 16, MAX_REQUEST_LOCATIONS),
        streams: int = 2,  # parts of a split plan (graph branches)
        warmup_runs: int = 2,
        scoring: Scoring = "masked",  # every step's log-softmax (contracts.request.Scoring)
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        # fixed per engine: the plans' CUDA graphs are captured with it
        self.scoring: Scoring = scoring
        self.decoder = decoder
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.location_buckets = tuple(sorted(location_buckets))
        self.streams = streams
        self.warmup_runs = warmup_runs
        param = next(decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda_graphs = self.device.type == "cuda"  # False: every plan runs eagerly
        self.step = decoder_step(decoder)

    def bucket(self, batch: int) -> int:
        return bucket_of(self.batch_buckets, batch)

    def plan(self, tables: GtmTables, level_offsets: torch.Tensor) -> IndexPlans:
        """An index version's plans (none made yet: `warm` or `run` make them)."""
        return IndexPlans(tables, level_offsets, self.device)

    def location_key(self, mode: FilterMode, n: int) -> int:
        """L of the plan: 0 without GTM, else the bucket holding n rows of a Bloom family
        (past the largest bucket: the power of two holding them, for a schema whose set
        attributes take more values than the default's 64 locations)."""
        if mode == FilterMode.CD_ONLY:
            return 0
        for b in self.location_buckets:
            if b >= n:
                return b
        return 1 << (n - 1).bit_length()

    @torch.no_grad()
    def warm(
        self,
        plans: IndexPlans,
        beams: tuple[int, ...],
        modes: tuple[FilterMode, ...] = (FilterMode.CD_GTM, FilterMode.CD_ONLY),
        batch_sizes: tuple[int, ...] | None = None,
        locations: tuple[int, ...] | None = None,
        pace: Callable[[], None] | None = None,
    ) -> int:
        """Build every plan a server may hit (on CUDA: capture its graph); returns how many
        plans exist. `pace` is called after each plan, outside the plans' lock."""
        keys = {
            (b, mode, self.location_key(mode, n))
            for b in batch_sizes or self.batch_buckets
            for mode in modes
            for n in locations or self.location_buckets
        }
        # largest batches first: the kernels tune on their rows rounded up to a power of
        # two (a shared key), so the busiest bucket's own shapes pick the configs
        for b, mode, n_loc in sorted(keys, key=lambda k: (-k[0], k[1:])):
            with plans.lock:
                plan = self._plan(plans, b, tuple(beams), mode, n_loc)
                if plan.graph is None and self.device.type == "cuda":
                    plan.live.fill_(True)
                    self._decode(plans, plan)  # eager plans: autotune now, not in a request
            if pace is not None:
                pace()
        with plans.lock:
            return len(plans.plans)

    @torch.no_grad()
    def run(
        self,
        plans: IndexPlans,
        ctx: torch.Tensor,  # [b, T_ctx, d_model] from the encoder, b <= the largest bucket
        requests: RequestTensors | None,  # None only for CD_ONLY
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
    ) -> DecodeResult:
        b = ctx.shape[0]
        gtm = mode != FilterMode.CD_ONLY
        if gtm and requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        n_loc = requests.blooms.shape[1] if gtm and requests is not None else 0
        with plans.lock:
            plan = self._plan(plans, b, tuple(beams), mode, self.location_key(mode, n_loc))
            self._load(plan, ctx, requests if gtm else None)
            if plan.graph is not None:
                plan.graph.replay()
                out = plan.out
            else:
                out = self._decode(plans, plan)
            # clone before the next replay overwrites the graph's outputs
            leaves, scores, sids = (x[:b].clone() for x in out)
        return DecodeResult(leaves, scores, sids, tuple(b * m for m in plan.beams))

    def _load(self, plan: Plan, ctx: torch.Tensor, requests: RequestTensors | None) -> None:
        """Copy a batch into the plan's static inputs; padding requests are marked dead."""
        b = ctx.shape[0]
        plan.ctx[:b].copy_(ctx, non_blocking=True)
        torch.lt(torch.arange(plan.bucket, device=self.device), b, out=plan.live)
        if requests is None or plan.requests is None:
            return
        plan.requests.bitmask[:b].copy_(requests.bitmask, non_blocking=True)
        blooms, n = plan.requests.blooms, requests.blooms.shape[1]
        blooms[:b, :n].copy_(requests.blooms, non_blocking=True)
        # padding locations repeat location 0: ANY-of-many is unchanged
        blooms[:b, n:].copy_(requests.blooms[:, :1].expand(-1, blooms.shape[1] - n, -1))
        counts = plan.requests.n_blooms
        assert counts is not None  # every GTM plan has them
        if requests.n_blooms is None:  # every row of every family
            counts[:b].fill_(n)
        else:
            counts[:b].copy_(requests.n_blooms, non_blocking=True)

    def _plan(
        self, plans: IndexPlans, batch: int, beams: tuple[int, ...], mode: FilterMode, n_loc: int
    ) -> Plan:
        bucket = self.bucket(batch)
        key = (bucket, beams, mode, n_loc)
        if key in plans.plans:
            return plans.plans[key]
        c = self.decoder.config
        check_schedule(beams, c.sid_length, c.vocab_size)
        reqs = None
        if n_loc:
            bm, bl = plans.tables.bitmask_table.shape[1], plans.tables.bloom_table.shape[1]
            k = len(plans.tables.families)
            reqs = RequestTensors(
                plans.static(("bitmask", bucket), (bucket, bm), torch.int64),
                plans.static(("blooms", bucket, n_loc), (bucket, n_loc, bl), torch.int64),
                # rows of each family: the mask reads no padding row (a padding request
                # keeps what an earlier batch left, at most L read: it is dead anyway)
                plans.static(("n_blooms", bucket), (bucket, k), torch.int32),
            )
        ctx = plans.static(("ctx", bucket), (bucket, c.t_ctx, c.d_model), self.dtype)
        live = plans.static(("live", bucket), (bucket,), torch.bool)
        n = self.streams if bucket >= SPLIT_MIN_BUCKET and bucket % self.streams == 0 else 1
        size = bucket // n
        parts = []
        for i in range(n):
            at = slice(i * size, (i + 1) * size)
            part_reqs = None if reqs is None else reqs.rows(at)
            cache_key = (size, beams, i if n > 1 else -1)
            if cache_key not in plans.caches:
                plans.caches[cache_key] = PagedKVCache(
                    c.decoder_layers, c.n_heads, c.d_head, [size * m for m in beams],
                    dtype=self.dtype, device=self.device,
                )  # fmt: skip
            parts.append(self._part(size, beams, mode, ctx[at], live[at], part_reqs,
                                    plans.caches[cache_key]))  # fmt: skip
        plan = parts[0] if n == 1 else dataclasses.replace(
            parts[0], bucket=bucket, ctx=ctx, live=live, requests=reqs, parts=parts
        )  # fmt: skip
        if self.cuda_graphs and mode != FilterMode.CD_GTM_KWAY:  # k-way: the reference
            self._capture(plans, plan)
        plans.plans[key] = plan
        return plan

    def _part(self, bucket, beams, mode, ctx, live, reqs, cache) -> Plan:
        """A plan (or one part of a split plan) over the given input views."""
        requests_of = torch.arange(bucket, device=self.device)
        return Plan(
            bucket=bucket, beams=beams, mode=mode, ctx=ctx, live=live, requests=reqs,
            cache=cache, row_request=[requests_of.repeat_interleave(m) for m in beams],
        )  # fmt: skip

    def _capture(self, plans: IndexPlans, plan: Plan) -> None:
        """Warm up, then capture the whole loop (`service/capture.py`: reserved streams, one
        capture at a time); intermediates live in the graph pool shared by all plans."""
        plan.live.fill_(True)  # warm up on live rows, so autotuning sees real work
        if plans.pool is None:
            plans.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        plan.out = capture(graph, lambda: self._decode(plans, plan, parallel=True),
                           device=self.device, pool=plans.pool,
                           warmup_runs=self.warmup_runs)  # fmt: skip
        plan.graph = graph

    def _decode(self, plans: IndexPlans, plan: Plan, parallel: bool = False) -> Outputs:
        """The whole plan. A split plan's parts run one after the other, or with
        `parallel` (only inside `capture`, which owns the reserved streams) each on a
        stream forked from and joined back to the current one: parallel graph branches."""
        if not plan.parts:
            return self._body(plans, plan)
        if not parallel:
            outs = [self._body(plans, part) for part in plan.parts]
        else:
            current = torch.cuda.current_stream(self.device)
            streams = part_streams(self.device, len(plan.parts))
            outs = []
            for part, stream in zip(plan.parts, streams, strict=True):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    outs.append(self._body(plans, part))
            for stream in streams:
                current.wait_stream(stream)
        return tuple(torch.cat(xs) for xs in zip(*outs, strict=True))  # type: ignore[return-value]

    def _body(self, plans: IndexPlans, plan: Plan) -> Outputs:
        """The 4-step loop on the plan's buffers: fixed shapes, no host syncs."""
        c, steps, bsz = self.decoder.config, len(plan.beams), plan.bucket
        cross = self.decoder.cross_kv(plan.ctx)  # per request, once: K, V [B, H, T_ctx, d_h]
        # fills with scalars, never `where(.., python scalar)`: no host tensors in the graph
        dead = ~plan.live[plan.row_request[0]]
        score = torch.zeros(dead.shape, device=self.device).masked_fill(dead, NEG_INF)
        node = torch.zeros_like(score, dtype=torch.int64).masked_fill(dead, plans.dead_node)
        tokens = torch.full_like(node, self.decoder.bos)
        parents, picked = [], []
        for t in range(steps):
            last = t + 1 == steps
            logits = self.step(tokens, t, cross, plan.cache)  # model dtype
            # CD+GTM mask, log-softmax (per `scoring`) and the accumulated score, one
            # kernel on CUDA: candidate scores float32 [R, V], child nodes int32 [R, V]
            cand, child = masked_candidates(
                logits, plans.tables, node, plan.row_request[t], plan.requests, score,
                plan.mode, scoring=self.scoring,
            )  # fmt: skip
            keep = plan.beams[-1] if last else plan.beams[t + 1]
            # the kept beams' order matters only after the last step: elsewhere top-k
            # skips sorting the winners
            top, flat = cand.view(bsz, -1).topk(keep, dim=1, sorted=last)
            score, parent, token, live, node = beam_advance(
                top, flat, child, plan.beams[t], c.vocab_size, plans.dead_node
            )
            parents.append(parent)
            picked.append(token)
            tokens = token
            if not last:
                plan.cache.reorder(t, parent)
        # SIDs by backtracking the parent pointers: column t of final row i
        cols, row = [picked[-1]], parents[-1]
        for t in range(steps - 2, -1, -1):
            cols.append(picked[t][row])
            row = parents[t][row]
        sids = torch.stack(cols[::-1], dim=1)  # int64 [B·M_L, L_SID]
        leaves = (node - plans.first_leaf).masked_fill(~live, -1)
        m = plan.beams[-1]
        return leaves.view(bsz, m), score.view(bsz, m), sids.view(bsz, m, steps)
