"""What `grace train`'s step loop (training/train.py) runs on besides the model: the
precision it computes in, the batches it is fed ahead of time, and the progress it
reports when no bar is shown.

    Examples.batch on a background thread (`prefetch`, `depth` batches ahead)
        ─► forward and loss under `autocast(device, precision)` ─► backward, AdamW
        ─► `ProgressLog` lines (step, loss, steps/s, ETA) each tenth of the run

A batch's features are built in Python and numpy (~5 ms for 256 pairs of the demo
profile); on a GPU that is time the device would otherwise idle, so it is built while
the previous step runs.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, TypeVar

PRECISIONS = ("auto", "fp32", "bf16")
Precision = Literal["auto", "fp32", "bf16"]
X = TypeVar("X")
Y = TypeVar("Y")


def resolved_precision(device: str, precision: Precision) -> Literal["fp32", "bf16"]:
    """The precision a run computes in; "auto": bf16 mixed precision on CUDA (matmuls in
    bf16; weights, optimizer and loss in fp32), fp32 elsewhere (a CPU runs bf16 matmuls
    no faster)."""
    import torch  # here, so that `grace --help` (cli/model.py) loads no torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision


def autocast(device: str, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """The context a forward pass and its loss run in."""
    import torch

    if resolved_precision(device, precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def prefetch(items: Iterable[X], make: Callable[[X], Y], depth: int = 2) -> Iterator[Y]:
    """`make(item)` for each item, in order, computed on a background thread up to `depth`
    items ahead of the consumer. An exception in `make` is raised here, at its item; when
    the consumer stops early (break, exception, close) the thread stops too."""
    ready: queue.Queue[tuple[bool, object]] = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():  # the consumer may be gone: never block for good
            try:
                ready.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((True, make(item))):
                    return
            put((True, end))
        except BaseException as e:  # handed to the consumer, raised there
            put((False, e))

    thread = threading.Thread(target=work, name="grace-train-batches", daemon=True)
    thread.start()
    try:
        while True:
            ok, value = ready.get()
            if not ok:
                assert isinstance(value, BaseException)
                raise value
            if value is end:
                return
            yield value  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()


class ProgressLog:
    """One log line per tenth of the run (step, mean loss, steps/s, ETA), for runs
    without a progress bar (`--no-progress`, a pod's log)."""

    def __init__(self, log: logging.Logger, first: int, total: int, enabled: bool) -> None:
        self.log, self.first, self.total, self.enabled = log, first, total, enabled
        self.t0 = time.perf_counter()
        self.next = self._after(first)

    def _after(self, step: int) -> int:
        tenth = max(1, self.total // 10)
        return (step // tenth + 1) * tenth

    def __call__(self, step: int, loss: float | None, validation: float | None) -> None:
        if not self.enabled or (step < self.next and step < self.total):
            return
        self.next = self._after(step)
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        parts = [f"step {step}/{self.total} ({100 * step / self.total:.0f} %)"]
        if loss is not None:
            parts.append(f"loss {loss:.3f}")
        if validation is not None:
            parts.append(f"validation loss {validation:.3f}")
        parts.append(f"{rate:.1f} steps/s, {elapsed:.0f} s elapsed, ETA {eta:.0f} s")
        self.log.info("train: %s", ", ".join(parts))
