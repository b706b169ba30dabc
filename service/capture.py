"""CUDA graph capture for the whole process: reserved streams and one lock (pipeline
stages 2 and 3), and `BucketGraphs`, the bucketed-module pattern the embedder and encoder
share.

`torch.cuda.Stream()` hands out streams of a small per-device pool in rotation, so a stream
drawn for a capture may be one another stage's thread is using, and that thread's copies
would be recorded into the graph. Captures here use streams drawn once per process from
the high-priority pool, one capture at a time (`LOCK`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

LOCK = threading.RLock()  # held for every capture (and its warm-up runs)
_reserved: dict[torch.device, list[torch.cuda.Stream]] = {}
_T = TypeVar("_T")
SIDE, CAPTURE, FIRST_PART = 0, 1, 2  # roles of the reserved streams


def streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """The first n reserved streams of `device`: the same ones on every call."""
    with LOCK:
        got = _reserved.setdefault(device, [])
        while len(got) < n:
            got.append(torch.cuda.Stream(device, priority=-1))
        return got[:n]


def part_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """Streams for n parallel branches of one capture (use them only inside `capture`)."""
    return streams(device, FIRST_PART + n)[FIRST_PART:]


def capture(
    graph: torch.cuda.CUDAGraph,
    fn: Callable[[], _T],
    *,
    device: torch.device,
    pool: object,
    warmup_runs: int,
) -> _T:
    """Run fn `warmup_runs` times on the reserved side stream (Triton autotuning, cuBLAS
    and cuDNN plans), then capture one run into `graph`; returns that run's outputs."""
    with LOCK:
        side, stream = streams(device, 2)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn()
        current.wait_stream(side)
        # thread_local: other stage threads may keep using CUDA while this captures
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            return fn()


_B = TypeVar("_B")  # a batch as the module's callers pass it
_I = TypeVar("_I")  # a bucket's static inputs
_O = TypeVar("_O")  # the module's outputs over a whole bucket


def bucket_of(buckets: tuple[int, ...], size: int) -> int:
    """The smallest of the (sorted) `buckets` that holds a batch of `size`: the shape it
    runs at, its rows past `size` padding."""
    for b in buckets:
        if b >= size:
            return b
    raise ValueError(f"batch of {size} exceeds the largest bucket {buckets[-1]}")


@dataclass
class _BucketPlan(Generic[_I, _O]):
    inputs: _I
    graph: torch.cuda.CUDAGraph | None = None
    out: _O | None = None  # the graph's outputs (CUDA)


class BucketGraphs(ABC, Generic[_B, _I, _O]):
    """A module at fixed shapes, one CUDA graph per batch-size bucket (pipeline stages 2
    and 3: `StaticFeatures`, `StaticEncoder`). A batch is copied into its bucket's static
    inputs (rows past it become padding), the bucket's graph replays, and the batch's rows
    are copied out before the next replay overwrites them. Off CUDA the same padded body
    runs eagerly. Subclasses say how to allocate (`_inputs`), fill (`_load`) and run
    (`_body`) a bucket, and cut a batch out of its outputs (`_take`)."""

    def __init__(self, buckets: tuple[int, ...], device: torch.device, warmup_runs: int) -> None:
        self.buckets = tuple(sorted(buckets))
        self.device = device
        self.warmup_runs = warmup_runs
        self._plans: dict[int, _BucketPlan[_I, _O]] = {}
        self._pool = None  # one graph memory pool per module: its replays never overlap
        self._lock = threading.Lock()

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far."""
        return sum(p.graph is not None for p in self._plans.values())

    @torch.no_grad()
    def warm(self, pace: Callable[[], None] | None = None) -> None:
        """Build (on CUDA: capture) every bucket's plan; call before serving. `pace` is
        called after each bucket (`service/pace.py`), outside the lock."""
        for b in self.buckets:
            with self._lock:
                self._plan(b)
            if pace is not None:
                pace()

    def _run(self, batch: _B, size: int) -> _O:
        """`batch` of `size` requests (at most the largest bucket) through its bucket."""
        bucket = bucket_of(self.buckets, size)
        with self._lock:
            plan = self._plan(bucket)
            self._load(plan.inputs, batch)
            if plan.graph is not None:
                plan.graph.replay()
                out = plan.out
            else:
                out = self._body(plan.inputs)
            assert out is not None
            return self._take(out, size)

    def _plan(self, bucket: int) -> _BucketPlan[_I, _O]:
        if bucket not in self._plans:
            plan = _BucketPlan[_I, _O](self._inputs(bucket))
            if self.device.type == "cuda":
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                plan.out = capture(
                    graph,
                    lambda: self._body(plan.inputs),
                    device=self.device,
                    pool=self._pool,
                    warmup_runs=self.warmup_runs,
                )
                plan.graph = graph
            self._plans[bucket] = plan
        return self._plans[bucket]

    @abstractmethod
    def _inputs(self, bucket: int) -> _I:
        """A bucket's static inputs, allocated once (zeros: padding requests)."""

    @abstractmethod
    def _load(self, inputs: _I, batch: _B) -> None:
        """Copy a batch into a bucket's inputs; everything past it becomes padding."""

    @abstractmethod
    def _body(self, inputs: _I) -> _O:
        """The module on a bucket's inputs (what is captured)."""

    @abstractmethod
    def _take(self, out: _O, size: int) -> _O:
        """The batch's first `size` rows of the outputs, as copies."""
