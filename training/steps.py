"""What `grace train`'s step loop (training/train.py) runs on besides the model: the
precision it computes in, the batches it is fed ahead of time, and the progress it
reports when no bar is shown.

    Examples.batch on a background thread (`prefetch`, `depth` batches ahead)
        ─► forward and loss under `autocast(device, precision)` ─► backward, AdamW
           (fused on CUDA), the loss left on the device (read back every 50 steps)
        ─► `ProgressLog` lines (step, loss, steps/s, ETA) each tenth of the run

A batch's features are built in Python and numpy, time a GPU would otherwise idle, so the
next is built while the previous step runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from service.model.retriever import GenerativeRetriever
    from training.data import Examples

PRECISIONS = ("fp32", "bf16")
Precision = Literal["fp32", "bf16"]
X = TypeVar("X")
Y = TypeVar("Y")


class Diverged(ValueError):
    """The loss turned NaN or inf: `grace train` stops on one line and saves nothing."""


def check_precision(precision: str) -> None:
    """Raise on a precision not in PRECISIONS."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def autocast(device: str, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """The context a forward pass and its loss run in: none for fp32; for bf16, autocast
    (matmuls in bf16; weights, optimizer state and the loss stay fp32)."""
    import torch  # here, so that `grace --help` (cli/model.py) loads no torch

    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def prefetch(items: Iterable[X], make: Callable[[X], Y], depth: int = 2) -> Iterator[Y]:
    """`make(item)` for each item, in order, computed on a background thread up to `depth`
    items ahead of the consumer. An exception in `make` is raised here, at its item; when
    the consumer stops early (break, exception, close) the thread stops too."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="grace-train-batches")
    ahead: deque[Future[Y]] = deque()
    try:
        for item in items:
            ahead.append(pool.submit(make, item))
            if len(ahead) > depth:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)  # waits for the one `make` running, if any


def cosine_lr(step: int, total: int, lr: float, warmup_steps: int) -> float:
    """The learning rate at `step` of `total`: linear warm-up, then cosine decay to 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    return lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def validation_loss(
    model: GenerativeRetriever, examples: Examples, batch_size: int, device: str,
    precision: Precision,
) -> float:  # fmt: skip
    """Mean teacher-forced cross-entropy over the validation events."""
    import torch

    model.eval()
    total, n = 0.0, 0
    users = examples.validation_users
    with torch.no_grad():
        for i in range(0, len(users), batch_size):
            batch = examples.validation(users[i : i + batch_size])
            target = batch.target_sid.to(device)
            with autocast(device, precision):
                logits = model.forward_train(batch.features.to(device), target)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                    reduction="sum",
                )  # fmt: skip
            total, n = total + float(loss), n + target.numel()
    model.train()
    return total / n


class ProgressLog:
    """Ten log lines over a run (step, mean loss, validation loss, steps/s, ETA), at the
    first step past each tenth of it, for runs without a progress bar (`--no-progress`,
    a pod's log). A run resumed at `first` logs the tenths it has still to pass."""

    def __init__(self, log: logging.Logger, first: int, total: int, enabled: bool) -> None:
        self.log, self.first, self.total, self.enabled = log, first, total, enabled
        self.t0 = time.perf_counter()
        self.tenths = 10 * first // total if total else 10  # tenths already passed

    def due(self, step: int) -> bool:
        """Whether `step` logs a line (the caller reads its losses back first)."""
        return self.enabled and 10 * step >= (self.tenths + 1) * self.total

    def __call__(self, step: int, loss: float | None, validation: float | None) -> None:
        if not self.due(step):
            return
        self.tenths = 10 * step // self.total
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
