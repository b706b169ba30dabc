"""The decode engine's per-index state (pipeline stage 3): one `IndexPlans` per loaded index
version — its trie tables and every `Plan` (static buffers and, on CUDA, the captured
graph) made for it, kept by the model runtime and freed with the index. Plans share their
inputs (per bucket) and KV caches (per bucket and schedule); calls are serialised (`lock`),
and on CUDA every call must come from the same stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from contracts.request import FilterMode
from contracts.tensors import GtmTables, RequestTensors
from service.decode.kv_cache import PagedKVCache

PlanKey = tuple[int, tuple[int, ...], FilterMode, int]  # (bucket, beams, mode, L)


@dataclass(frozen=True)
class DecodeResult:
    """Per request, the top M_4 complete SIDs (best first); dead slots have score −inf."""

    leaves: torch.Tensor  # int64 [B, M_4]: leaf position (node − first leaf node), −1 dead
    scores: torch.Tensor  # float32 [B, M_4]: accumulated log-probability
    sids: torch.Tensor  # int64 [B, M_4, sid_length]
    rows_per_step: tuple[int, ...]  # beam rows that entered each decoder step (B · W_t)

    def valid(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(leaves, scores) of request b's live SIDs."""
        keep = self.leaves[b] >= 0
        return self.leaves[b][keep], self.scores[b][keep]


@dataclass
class Plan:
    """Static buffers and the graph of one plan key; inputs are shared per bucket."""

    bucket: int  # B: requests the buffers hold
    beams: tuple[int, ...]  # M_t: rows per request at step t
    mode: FilterMode
    ctx: torch.Tensor  # [B, T_ctx, d_model]: encoder output, real requests first
    live: torch.Tensor  # bool [B]: real (not padding) requests of the current run
    requests: RequestTensors | None  # bitmask int64 [B, W_bm], blooms int64 [B, L, W_bl]
    cache: PagedKVCache
    row_request: list[torch.Tensor]  # int64 [B·M_t]: request of each row
    graph: torch.cuda.CUDAGraph | None = None
    out: tuple[torch.Tensor, ...] = field(default=())  # the graph's leaves, scores, sids
    # requests split into parts (views of the inputs above, own caches), each decoded on
    # its own stream; empty: the plan is decoded whole
    parts: list[Plan] = field(default_factory=list)


class IndexPlans:
    """One index version's tables and plans (made by `DecodeEngine.plan`)."""

    def __init__(
        self, tables: GtmTables, level_offsets: torch.Tensor, device: torch.device
    ) -> None:
        self.tables = tables
        self.first_leaf = int(level_offsets[-2])
        self.dead_node = int(level_offsets[-1]) - 1  # a leaf: nothing is ever allowed below it
        self.device = device
        self.plans: dict[PlanKey, Plan] = {}
        self.caches: dict[tuple, PagedKVCache] = {}  # shared per (bucket, beams, part)
        self.pool = None  # one graph memory pool for every plan: replays never overlap
        self.lock = threading.RLock()
        self._inputs: dict[tuple, torch.Tensor] = {}  # shared static inputs, by shape

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far."""
        return sum(p.graph is not None for p in self.plans.values())

    def static(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The shared input buffer `key` (zeros when first made)."""
        if key not in self._inputs:
            self._inputs[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._inputs[key]
