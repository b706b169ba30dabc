"""Where the workers of `grace serve` run: `workers` processes on each GPU the settings
name (`gpus`; default every visible GPU when `device` is `cuda` or `auto`), or on the CPU
(docs/SERVICE.md "Several GPUs"). On one GPU every worker sees all devices; on several,
each sees only its own (`CUDA_VISIBLE_DEVICES`) and serves on `cuda:0`.

    settings (device, gpus, workers) + the GPUs this process sees ─► [Slot] (GPU-major)
        ─► service/workers.py starts one process per slot (and one MPS daemon per GPU)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from service.settings import ServerSettings


class PlacementError(ValueError):
    """Settings that name GPUs this host does not have (one line, for the CLI)."""


@dataclass(frozen=True)
class Slot:
    """One worker: its index among all workers, its GPU, and what it must see."""

    worker: int
    gpu: int | None  # ordinal among this process's visible GPUs; None on the CPU
    visible: str | None  # the worker's CUDA_VISIBLE_DEVICES; None: inherit this process's
    device: str | None = None  # the worker's device setting; None: the settings' own

    @property
    def serves_on(self) -> str | None:
        """The device the worker serves on, where it is not the settings' own: `cuda:0`
        when it sees only its GPU."""
        return "cuda:0" if self.visible is not None else self.device

    @property
    def label(self) -> str:
        """The `gpu` label of the worker's metrics ("cpu" on the CPU)."""
        return "cpu" if self.gpu is None else str(self.gpu)


def visible_ids(count: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The ids of the `count` GPUs this process sees, as CUDA_VISIBLE_DEVICES names them
    (indices, UUIDs or MIG ids), or 0..count-1 when it is unset."""
    listed = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    return ids[:count]


def place(settings: ServerSettings, device: str, ids: list[str]) -> list[Slot]:
    """The slots of `settings.workers` per GPU on `device` (resolved: 'cpu', 'cuda' or
    'cuda:N'), `ids` the visible GPUs' ids (`visible_ids`)."""
    n = settings.workers
    if not device.startswith("cuda"):
        return [Slot(i, None, None) for i in range(n)]
    _, _, ordinal = device.partition(":")
    if ordinal:
        gpus = [int(ordinal)]
    elif settings.gpus is not None:
        gpus = list(settings.gpus)
    else:
        gpus = list(range(len(ids)))
    if not ids:
        raise PlacementError(f"device {device!r}, but this process sees no GPU "
                             "(CUDA_VISIBLE_DEVICES decides which it sees)")  # fmt: skip
    missing = [g for g in gpus if g >= len(ids)]
    if missing:
        raise PlacementError(
            f"GPU {', '.join(map(str, missing))} asked for, but this process sees "
            f"{len(ids)} GPU(s): {', '.join(ids)} (CUDA_VISIBLE_DEVICES decides which)"
        )
    if len(gpus) == 1:  # one GPU: every worker sees every device, as on a one-GPU host
        picked = f"cuda:{gpus[0]}" if settings.gpus is not None else None
        return [Slot(i, gpus[0], None, picked) for i in range(n)]
    return [Slot(k * n + j, g, ids[g]) for k, g in enumerate(gpus) for j in range(n)]
