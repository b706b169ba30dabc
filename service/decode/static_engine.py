"""Fixed-shape constrained beam search: pipeline stage 3's decode loop as one CUDA graph
per plan (docs/ARCHITECTURE.md §2, §7).

The same search as `engine.BeamSearch` (its oracle: the same `DecodeResult`), run on
buffers whose shapes are fixed by a plan key — (batch-size bucket B, beam schedule, filter
mode, request-location bucket L) — so the whole 4-step loop (cross K/V, decoder steps,
CD+GTM mask, log-softmax, per-request top-k, paged-KV reorder, SID backtrack) is captured
once as one CUDA graph and each batch is: copy inputs into the plan's static buffers,
`replay()`, clone the outputs. On CPU the same body runs eagerly with the references. The
decoder steps run through `FusedDecoderStep` (layer-0 QKV table, residual adds inside the
matmuls, shifted LayerNorms, GELU epilogue): the same function as `SIDDecoder.step`.

Rows are request-major (row b·W_t + j), as in `BeamSearch`. A row is dead — score −inf,
parked on a leaf node with no children, never emitted — when it has no allowed
continuation, when top-k could not fill it, when its slot is beyond M_t (`fixed_beams`),
or when its request is padding (a batch smaller than its bucket). Requests never interact
(attention and top-k are per request), so padding rows cannot change real ones.

`DecodeOptions` holds the benchmark's ablation switches (bench/bench_decoder_loop.py);
the defaults are the serving path. Calls are serialised (one lock; the plans share static
buffers), and on CUDA every call must come from the same stream. Captures go through
`service/capture.py` (reserved streams, one capture at a time in the process); a plan
split into parts (`DecodeOptions.streams`) records them as parallel branches of its
graph, and runs them one after the other when it runs eagerly.

An engine is bound to one decoder and one index's tables (its graphs hold their
addresses): build one per index version and `warm(beams)` it — capture every plan —
before that version serves; a key first seen in `run` is captured there, on the spot.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from index_builder.lookup import FilterMode, GtmTables, RequestTensors
from index_builder.targeting import MAX_REQUEST_LOCATIONS
from kernels.beam_advance import beam_advance, beam_advance_reference
from kernels.cross_attention import cross_attention, cross_attention_per_beam
from kernels.gtm_mask import candidates, masked_candidates, masked_logits
from service.capture import bucket_of, capture, part_streams
from service.decode.engine import NEG_INF, DecodeResult, check_schedule, top_k
from service.decode.fused_step import FusedDecoderStep
from service.decode.kv_cache import ATTENTION_MODES, DenseKVCache, KVCache, PagedKVCache
from service.model.decoder import SIDDecoder


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
    fused_layers: bool = True  # FusedDecoderStep (False: the decoder's reference `step`)
    streams: int = 2  # buckets >= SPLIT_MIN_BUCKET run as this many parts (graph branches)
    # one kernel for mask + log-softmax + score, layer 0's QKV table read by the attention
    # kernel (False: masked_logits, then candidates; the table gathered first)
    fused_tail: bool = True
    # the FFN up-projection's GEMM + GELU epilogue (kernels.gelu_linear): "cublaslt" or
    # "triton" (the persistent TMA kernel); fused_layers only
    ffn_up: str = "cublaslt"
    # each step's bookkeeping after top-k (parents, tokens, liveness, child nodes):
    # "kernel" — kernels.beam_advance, one Triton launch on CUDA (the reference on CPU);
    # "eager" — the torch reference, ~10 small launches; "compiled" — the reference
    # through torch.compile (a comparison: it adds Inductor's compile to start-up)
    advance: str = "kernel"

    def __post_init__(self) -> None:
        for name, value, known in (
            ("cross", self.cross, ("beam_as_query", "per_beam")),
            ("self_attn", self.self_attn, ATTENTION_MODES),
            ("kv", self.kv, ("paged", "dense")),
            ("ffn_up", self.ffn_up, ("cublaslt", "triton")),
            ("advance", self.advance, ("kernel", "eager", "compiled")),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {known}, got {value!r}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")


SPLIT_MIN_BUCKET = 8  # smaller buckets are latency-bound: splitting them only adds work


@dataclass
class _Plan:
    """Static buffers and the graph of one plan key; inputs are shared per bucket."""

    bucket: int  # B: requests the buffers hold
    beams: tuple[int, ...]  # M_t: live slots per request at step t
    widths: tuple[int, ...]  # W_t >= M_t: rows per request the decoder computes at step t
    mode: FilterMode
    ctx: torch.Tensor  # [B, T_ctx, d_model]: encoder output, real requests first
    live: torch.Tensor  # bool [B]: real (not padding) requests of the current run
    requests: RequestTensors | None  # bitmask int64 [B, W_bm], blooms int64 [B, L, W_bl]
    cache: KVCache
    row_request: list[torch.Tensor]  # int64 [B·W_t]: request of each row
    slot_dead: list[torch.Tensor]  # bool [B·W_t]: slot j >= M_t (fixed_beams only)
    graph: torch.cuda.CUDAGraph | None = None
    out: tuple[torch.Tensor, ...] = field(default=())  # the graph's leaves, scores, sids
    # requests split into parts (views of the inputs above, own caches), each decoded on
    # its own stream; empty: the plan is decoded whole
    parts: list[_Plan] = field(default_factory=list)


class StaticBeamSearch:
    """Fixed-shape beam search over one index's tables, one plan (and graph) per key."""

    def __init__(
        self,
        decoder: SIDDecoder,
        tables: GtmTables,
        level_offsets: torch.Tensor,  # int64 [sid_length + 2] from the index
        *,
        options: DecodeOptions | None = None,
        batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16),
        location_buckets: tuple[int, ...] = (1, 4, 16, MAX_REQUEST_LOCATIONS),
        warmup_runs: int = 2,
    ) -> None:
        self.decoder = decoder
        self.tables = tables
        self.options = options or DecodeOptions()
        self.first_leaf = int(level_offsets[-2])
        self.dead_node = int(level_offsets[-1]) - 1  # a leaf: nothing is ever allowed below it
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.location_buckets = tuple(sorted(location_buckets))
        self.warmup_runs = warmup_runs
        param = next(decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        per_beam = self.options.cross == "per_beam"
        self._cross = cross_attention_per_beam if per_beam else cross_attention
        self._step = (
            FusedDecoderStep(
                decoder, table_in_attention=self.options.fused_tail, ffn_up=self.options.ffn_up
            )
            if self.options.fused_layers
            else decoder.step
        )
        self._advance = beam_advance
        if self.options.advance == "eager":
            self._advance = beam_advance_reference
        elif self.options.advance == "compiled":
            # dynamic shapes: 3 compiled variants cover every served bucket and step (and
            # later engines over the same shapes); they compile while plans warm up, and
            # the graphs replay the kernels Inductor generated
            self._advance = torch.compile(beam_advance_reference, dynamic=True)
        self._plans: dict[tuple, _Plan] = {}
        self._inputs: dict[tuple, torch.Tensor] = {}  # shared static inputs, by shape
        self._caches: dict[tuple, KVCache] = {}  # shared per (bucket, widths)
        self._pool = None  # one graph memory pool for every plan: replays never overlap
        self._lock = threading.RLock()

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far."""
        return sum(p.graph is not None for p in self._plans.values())

    def bucket(self, batch: int) -> int:
        return bucket_of(self.batch_buckets, batch)

    def _location_key(self, mode: FilterMode, n: int) -> int:
        """L of the plan: 0 without GTM, 1 for bitmask-only, else the bucket holding n."""
        if not self.options.mask or mode == FilterMode.CD_ONLY:
            return 0
        if mode == FilterMode.CD_GTM and not self.options.bloom:
            return 1  # bitmask-only: the Bloom rows are never read
        for b in self.location_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} request locations exceed the largest bucket")

    @torch.no_grad()
    def warm(
        self,
        beams: tuple[int, ...],
        modes: tuple[FilterMode, ...] = (FilterMode.CD_GTM, FilterMode.CD_ONLY),
        batch_sizes: tuple[int, ...] | None = None,
        locations: tuple[int, ...] | None = None,
    ) -> int:
        """Build every plan a server may hit (on CUDA: capture its graph); returns how many
        plans exist. Report SERVING only after this returns."""
        keys = {
            (b, mode, self._location_key(mode, n))
            for b in batch_sizes or self.batch_buckets
            for mode in modes
            for n in locations or self.location_buckets
        }
        with self._lock:
            # largest batches first: the kernels tune on their rows rounded up to a power of
            # two (a shared key), so the busiest bucket's own shapes pick the configs
            for b, mode, n_loc in sorted(keys, key=lambda k: (-k[0], k[1:])):
                plan = self._plan(b, tuple(beams), mode, n_loc)
                if plan.graph is None and self.device.type == "cuda":
                    plan.live.fill_(True)
                    self._decode(plan)  # eager plans: autotune the kernels now, not in a request
            return len(self._plans)

    @torch.no_grad()
    def run(
        self,
        ctx: torch.Tensor,  # [b, T_ctx, d_model] from the encoder, b <= the largest bucket
        requests: RequestTensors | None,  # None only for CD_ONLY (or mask off)
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
    ) -> DecodeResult:
        b = ctx.shape[0]
        gtm = self.options.mask and mode != FilterMode.CD_ONLY
        if gtm and requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        n_loc = requests.blooms.shape[1] if gtm and requests is not None else 0
        with self._lock:
            plan = self._plan(b, tuple(beams), mode, self._location_key(mode, n_loc))
            self._load(plan, ctx, requests if gtm else None)
            if plan.graph is not None:
                plan.graph.replay()
                out = plan.out
            else:
                out = self._decode(plan)
            # clone before the next replay overwrites the graph's outputs
            leaves, scores, sids = (x[:b].clone() for x in out)
        return DecodeResult(leaves, scores, sids, tuple(b * w for w in plan.widths))

    # ----------------------------------------------------------------- plans and inputs

    def _static(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key not in self._inputs:
            self._inputs[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._inputs[key]

    def _plan(self, batch: int, beams: tuple[int, ...], mode: FilterMode, n_loc: int) -> _Plan:
        bucket = self.bucket(batch)
        key = (bucket, beams, mode, n_loc)
        if key in self._plans:
            return self._plans[key]
        c = self.decoder.config
        check_schedule(beams, c.sid_length, c.vocab_size)
        widths = (max(beams),) * len(beams) if self.options.fixed_beams else beams
        reqs = None
        if n_loc:
            bm, bl = self.tables.bitmask_table.shape[1], self.tables.bloom_table.shape[1]
            reqs = RequestTensors(
                self._static(("bitmask", bucket), (bucket, bm), torch.int64),
                self._static(("blooms", bucket, n_loc), (bucket, n_loc, bl), torch.int64),
            )
        ctx = self._static(("ctx", bucket), (bucket, c.t_ctx, c.d_model), self.dtype)
        live = self._static(("live", bucket), (bucket,), torch.bool)
        n = self.options.streams
        if bucket < SPLIT_MIN_BUCKET or bucket % n:
            n = 1
        size = bucket // n
        parts = [
            self._part(
                size, beams, widths, mode, ctx[i * size : (i + 1) * size],
                live[i * size : (i + 1) * size],
                None if reqs is None else RequestTensors(
                    reqs.bitmask[i * size : (i + 1) * size], reqs.blooms[i * size : (i + 1) * size]
                ),
                cache_key=(size, widths, i if n > 1 else -1),
            )
            for i in range(n)
        ]  # fmt: skip
        plan = parts[0] if n == 1 else dataclasses.replace(
            parts[0], bucket=bucket, ctx=ctx, live=live, requests=reqs, parts=parts
        )  # fmt: skip
        gtm_kway = mode == FilterMode.CD_GTM_KWAY and self.options.mask  # reference: not capturable
        if self.options.cuda_graph and self.device.type == "cuda" and not gtm_kway:
            self._capture(plan)
        self._plans[key] = plan
        return plan

    def _part(
        self,
        bucket: int,
        beams: tuple[int, ...],
        widths: tuple[int, ...],
        mode: FilterMode,
        ctx: torch.Tensor,
        live: torch.Tensor,
        reqs: RequestTensors | None,
        cache_key: tuple,
    ) -> _Plan:
        """A plan (or one part of a split plan) over the given input views."""
        c = self.decoder.config
        if cache_key not in self._caches:
            cls = PagedKVCache if self.options.kv == "paged" else DenseKVCache
            self._caches[cache_key] = cls(
                c.decoder_layers, c.n_heads, c.d_head, [bucket * w for w in widths],
                dtype=self.dtype, device=self.device, attention=self.options.self_attn,
            )  # fmt: skip
        slots = [torch.arange(bucket * w, device=self.device) % w for w in widths]
        requests_of = torch.arange(bucket, device=self.device)
        return _Plan(
            bucket=bucket,
            beams=beams,
            widths=widths,
            mode=mode,
            ctx=ctx,
            live=live,
            requests=reqs,
            cache=self._caches[cache_key],
            row_request=[requests_of.repeat_interleave(w) for w in widths],
            slot_dead=[s >= m for s, m in zip(slots, beams, strict=True)],
        )

    def _load(self, plan: _Plan, ctx: torch.Tensor, requests: RequestTensors | None) -> None:
        """Copy a batch into the plan's static inputs; padding requests are marked dead."""
        b = ctx.shape[0]
        plan.ctx[:b].copy_(ctx, non_blocking=True)
        torch.lt(torch.arange(plan.bucket, device=self.device), b, out=plan.live)
        if requests is None or plan.requests is None:
            return
        plan.requests.bitmask[:b].copy_(requests.bitmask, non_blocking=True)
        if self.options.bloom or plan.mode != FilterMode.CD_GTM:
            blooms, n = plan.requests.blooms, requests.blooms.shape[1]
            blooms[:b, :n].copy_(requests.blooms, non_blocking=True)
            # padding locations repeat location 0: ANY-of-many is unchanged
            blooms[:b, n:].copy_(requests.blooms[:, :1].expand(-1, blooms.shape[1] - n, -1))

    def _capture(self, plan: _Plan) -> None:
        """Warm up, then capture the whole loop (`service/capture.py`: reserved streams, one
        capture at a time); intermediates live in the graph pool shared by all plans."""
        plan.live.fill_(True)  # warm up on live rows, so autotuning sees real work
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        plan.out = capture(
            graph,
            lambda: self._decode(plan, parallel=True),
            device=self.device,
            pool=self._pool,
            warmup_runs=self.warmup_runs,
        )
        plan.graph = graph

    # ----------------------------------------------------------------------- the loop

    def _candidates(
        self, plan: _Plan, logits: torch.Tensor, node: torch.Tensor, score: torch.Tensor, t: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CD+GTM mask, log-softmax and accumulated score: one kernel on CUDA (`fused_tail`)."""
        bloom = self.options.bloom or plan.mode != FilterMode.CD_GTM
        args = (logits, self.tables, node, plan.row_request[t], plan.requests)
        if self.options.fused_tail:
            return masked_candidates(*args, score, plan.mode, bloom=bloom)
        masked, child = masked_logits(logits.float(), *args[1:], plan.mode, bloom=bloom)
        return candidates(score, masked, child >= 0), child

    def _decode(
        self, plan: _Plan, parallel: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole plan. A split plan's parts run one after the other, or with
        `parallel` (only inside `capture`, which owns the reserved streams) each on its
        own stream, forked from and joined back to the current one, so the graph records
        them as parallel branches."""
        if not plan.parts:
            return self._body(plan)
        if not parallel:
            outs = [self._body(part) for part in plan.parts]
        else:
            current = torch.cuda.current_stream(self.device)
            streams = part_streams(self.device, len(plan.parts))
            outs = []
            for part, stream in zip(plan.parts, streams, strict=True):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    outs.append(self._body(part))
            for stream in streams:
                current.wait_stream(stream)
        return tuple(torch.cat(xs) for xs in zip(*outs, strict=True))  # type: ignore[return-value]

    def _body(self, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 4-step loop on the plan's buffers: fixed shapes, no host syncs."""
        c, steps, bsz = self.decoder.config, len(plan.beams), plan.bucket
        cross = self.decoder.cross_kv(plan.ctx)  # per request, once: K, V [B, H, T_ctx, d_h]
        # fills with scalars, never `where(.., python scalar)`: no host tensors in the graph
        dead = plan.slot_dead[0] | ~plan.live[plan.row_request[0]]
        score = torch.zeros(dead.shape, device=self.device).masked_fill(dead, NEG_INF)
        node = torch.zeros_like(score, dtype=torch.int64).masked_fill(dead, self.dead_node)
        tokens = torch.full_like(node, self.decoder.bos)
        parents, picked = [], []
        for t in range(steps):
            w, last = plan.widths[t], t + 1 == steps
            logits = self._step(tokens, t, cross, plan.cache, self._cross)  # model dtype
            child = None
            if self.options.mask:
                cand, child = self._candidates(plan, logits, node, score, t)  # [R, V] each
            else:
                cand = score[:, None] + torch.log_softmax(logits.float(), dim=-1)
            keep = plan.beams[-1] if last else plan.widths[t + 1]
            past_m = not last and plan.widths[t + 1] > plan.beams[t + 1]  # slots >= M_{t+1}
            # the kept beams' order matters only after the last step (and where slots
            # past M_{t+1} are killed): elsewhere top-k skips its sort of the winners
            # (one small block per request, ~22 µs per step on the H200)
            top, flat = top_k(cand.view(bsz, -1), keep, ordered=last or past_m)
            score, parent, token, live, next_node = self._advance(
                top, flat, child, plan.slot_dead[t + 1] if past_m else None,
                w, c.vocab_size, self.dead_node,
            )  # fmt: skip
            if next_node is not None:
                node = next_node
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
        if self.options.mask:
            leaves = (node - self.first_leaf).masked_fill(~live, -1)
        else:
            leaves = torch.full_like(token, -1)
        m = plan.beams[-1]
        return leaves.view(bsz, m), score.view(bsz, m), sids.view(bsz, m, steps)
