"""CUDA graph capture for the whole process: reserved streams and one lock (pipeline
stage 3: the decode engines' plans and the encoder's buckets).

`torch.cuda.Stream()` hands out one of a small per-device pool of streams in rotation, so
a stream drawn for a capture may be the very stream another pipeline stage is using on
its own thread — and that thread's copies would be recorded into the graph instead of
running. Captures here use streams drawn once per process from the high-priority pool
(the pipeline's streams, the watcher's and torch's own come from the default one), and
run one at a time (`LOCK`), since every capture shares them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

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
