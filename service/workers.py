"""Several serving processes on one host (`grace serve --workers N`; docs/SERVICE.md
"Settings", "Several GPUs"): N full servers per GPU (service/placement.py), as one
process's GIL, not the GPU, caps its rate.

They share one port through SO_REUSEPORT and open it together once every one is warm (a
barrier), or, with `balance = "request"`, listen on private unix sockets behind a front in
this process (service/balancer.py). Worker i serves metrics on `metrics_port + i`. This
module places them and starts their MPS daemons; service/supervisor.py runs them, restarts
one that exits or freezes, and forwards SIGTERM/SIGINT and SIGUSR1.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile

from service.mps import MpsError, check_mps, gpu_ordinal, mps_daemon, resolve_mps
from service.placement import PlacementError, Slot, place, visible_ids
from service.settings import ServerSettings
from service.supervisor import Supervisor, Worker

log = logging.getLogger("grace.workers")
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, with its terminating NUL


def slots(settings: ServerSettings) -> list[Slot]:
    """Every worker this host runs for `settings` (service/placement.py). The GPUs are
    counted through NVML (`torch.cuda.device_count` before CUDA is initialised): the
    supervisor never initialises CUDA itself."""
    ids: list[str] = []
    if settings.device != "cpu":
        import torch

        ids = visible_ids(torch.cuda.device_count())
    device = settings.device if settings.device != "auto" else ("cuda" if ids else "cpu")
    if settings.gpus is not None and not device.startswith("cuda"):
        log.warning("gpus %s ignored: no GPU is visible, serving on the CPU", settings.gpus)
    placed = place(settings, device, ids)
    if len(placed) > 1 and settings.port == 0:
        raise PlacementError(f"{len(placed)} workers share one port: give a fixed port, not 0")
    top = settings.metrics_port + len(placed) - 1
    if settings.metrics_port and settings.metrics_port <= settings.port <= top:
        raise PlacementError(f"port {settings.port} is among the {len(placed)} workers' "
                             f"metrics ports {settings.metrics_port}..{top}")  # fmt: skip
    return placed


def worker_settings(settings: ServerSettings, slot: Slot) -> ServerSettings:
    """A worker's settings: a single server, with its own metrics port; on one GPU of
    several, `cuda:0` (the only device it sees)."""
    metrics = settings.metrics_port + slot.worker if settings.metrics_port else 0
    update: dict[str, object] = {"workers": 1, "metrics_port": metrics, "gpus": None}
    if slot.serves_on is not None:
        update["device"] = slot.serves_on
    return settings.model_copy(update=update)


def supervise(settings: ServerSettings, placed: list[Slot] | None = None) -> int:
    """Run a worker per slot (`slots`) until they stop: 0 when all stopped cleanly, else 1
    (service/supervisor.py says when it gives up). With MPS (`resolve_mps`) a private daemon
    per GPU (service/mps.py) outlives its workers."""
    placed = slots(settings) if placed is None else placed
    plain = {s.worker: {} if s.visible is None else {"CUDA_VISIBLE_DEVICES": s.visible}
             for s in placed}  # fmt: skip
    envs = dict(plain)
    with contextlib.ExitStack() as stack:
        if resolve_mps(settings):
            check_mps(settings)
            try:
                if all(s.visible is None for s in placed):  # one GPU: one daemon, inherited
                    gpu = placed[0].gpu
                    ordinal = gpu_ordinal(settings) if gpu is None else gpu
                    stack.enter_context(mps_daemon(ordinal=ordinal))
                for visible in dict.fromkeys(s.visible for s in placed if s.visible is not None):
                    env = stack.enter_context(mps_daemon(visible=visible, export=False))
                    for s in placed:
                        if s.visible == visible:
                            envs[s.worker] = env
            except MpsError as exc:
                if settings.mps:  # asked for: the CLI reports it as bad input
                    raise
                # an error, not a warning: serving goes on, much slower in the tail under load
                log.error("MPS did not start, the workers time-slice the GPU: %s", exc)
                stack.close()  # the daemons started so far: the workers use none of them
                envs = plain
        return _supervise(settings, placed, envs)


def _supervise(
    settings: ServerSettings, placed: list[Slot], envs: dict[int, dict[str, str]]
) -> int:
    if settings.balance == "connection":
        return _run_workers(settings, placed, envs, [None] * len(placed))
    # each worker on a private socket, the front on the public port
    with tempfile.TemporaryDirectory(prefix="grace-") as sockets:
        addresses = [f"{sockets}/worker-{i}.sock" for i in range(len(placed))]
        if len(addresses[-1]) > MAX_SOCKET_PATH:
            raise OSError(
                f"unix socket path {addresses[-1]!r} is too long (> {MAX_SOCKET_PATH} "
                "bytes): set TMPDIR to a shorter directory"
            )
        return _run_workers(settings, placed, envs, [f"unix:{a}" for a in addresses])


def _run_workers(
    settings: ServerSettings,
    placed: list[Slot],
    envs: dict[int, dict[str, str]],
    addresses: list[str | None],
) -> int:
    """A worker per address (None: the shared public port), supervised until stopped."""
    workers = [Worker(worker_settings(settings, s), envs[s.worker], s.label, a)
               for s, a in zip(placed, addresses, strict=True)]  # fmt: skip
    return Supervisor(settings, workers).run()
