"""The context encoder at fixed shapes, one CUDA graph per batch bucket: the first half of
pipeline stage 3 on GPU (DESIGN.md §2, §7), next to the decode loop's graphs.

Eager, the encoder launches ~150 small kernels per batch from the compute thread, and
under load that Python dispatch competes for the GIL with the gRPC event loop and the
other stage threads (docs/PERFORMANCE.md, "Served throughput"); a replay is one launch.
Inputs are padded to (bucket, max_history): padding requests carry zeros with only their
non-sequence keys set, history positions past the batch's width are masked. The encoder
treats every request on its own and masked positions never reach unmasked ones, so the
padding changes nothing (tested against the eager encoder). On CPU the same padded body
runs eagerly; wider or larger inputs than the plans hold take the eager encoder.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from service.capture import capture
from service.model.embeddings import NUM_NONSEQ_TOKENS, EmbeddedFeatures
from service.model.encoder import ContextEncoder


@dataclass
class _Plan:
    inputs: EmbeddedFeatures  # static [bucket, ...] buffers
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the graph's output [bucket, t_ctx, d_model]


class StaticEncoder:
    """`ContextEncoder` over fixed-shape buffers; call it like the encoder."""

    def __init__(
        self,
        encoder: ContextEncoder,
        batch_buckets: tuple[int, ...] = (4, 16),
        warmup_runs: int = 2,
    ) -> None:
        self.encoder = encoder
        self.buckets = tuple(sorted(batch_buckets))
        self.width = encoder.config.max_history
        self.warmup_runs = warmup_runs
        param = next(encoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._plans: dict[int, _Plan] = {}
        self._pool = None
        self._lock = threading.Lock()

    @property
    def graphs(self) -> int:
        return sum(p.graph is not None for p in self._plans.values())

    @torch.no_grad()
    def warm(self) -> None:
        """Build (on CUDA: capture) every bucket's plan; call before serving."""
        with self._lock:
            for b in self.buckets:
                self._plan(b)

    @torch.no_grad()
    def __call__(self, x: EmbeddedFeatures) -> torch.Tensor:  # [b, t_ctx, d_model]
        b, w = x.seq.shape[:2]
        if b > self.buckets[-1] or w > self.width:
            return self.encoder(x)
        bucket = next(k for k in self.buckets if k >= b)
        with self._lock:
            plan = self._plan(bucket)
            _load(plan.inputs, x)
            if plan.graph is not None:
                plan.graph.replay()
                out = plan.out
            else:
                out = self.encoder(plan.inputs)
            assert out is not None
            return out[:b].clone()  # before the next replay overwrites it

    def _plan(self, bucket: int) -> _Plan:
        if bucket in self._plans:
            return self._plans[bucket]
        c, n = self.encoder.config, NUM_NONSEQ_TOKENS
        kw = {"device": self.device}
        inputs = EmbeddedFeatures(
            torch.zeros(bucket, n, c.d_model, dtype=self.dtype, **kw),
            torch.zeros(bucket, self.width, c.d_model, dtype=self.dtype, **kw),
            torch.zeros(bucket, n + self.width, dtype=torch.bool, **kw),
        )
        inputs.keys[:, :n] = True  # what a padding request looks like: no history
        plan = _Plan(inputs)
        if self.device.type == "cuda":
            self._capture(plan)
        self._plans[bucket] = plan
        return plan

    def _capture(self, plan: _Plan) -> None:
        """Warm up (cuBLAS/cuDNN plans), then capture one forward (`service/capture.py`)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        plan.out = capture(
            graph,
            lambda: self.encoder(plan.inputs),
            device=self.device,
            pool=self._pool,
            warmup_runs=self.warmup_runs,
        )
        plan.graph = graph


def _load(dst: EmbeddedFeatures, x: EmbeddedFeatures) -> None:
    """Copy a batch into the static buffers: rows past it become padding requests and
    positions past its width masked padding (stale rows of earlier batches are wiped)."""
    b, w = x.seq.shape[:2]
    n = NUM_NONSEQ_TOKENS
    dst.nonseq.zero_()
    dst.seq.zero_()
    dst.keys[:, n:] = False
    dst.nonseq[:b].copy_(x.nonseq, non_blocking=True)
    dst.seq[:b, :w].copy_(x.seq, non_blocking=True)
    dst.keys[:b, : n + w].copy_(x.keys, non_blocking=True)
