"""Several serving processes on one host (`grace serve --workers N`; docs/SERVICE.md
"Settings", "Several GPUs"): N full servers per GPU (service/placement.py), as one
process's GIL, not the GPU, caps its rate.

They share one port through SO_REUSEPORT and open it together once every one is warm (a
barrier), or, with `balance = "request"`, listen on private unix sockets behind a front in
this process (service/balancer.py). Worker i serves metrics on `metrics_port + i`. This
supervisor forwards SIGTERM/SIGINT (each worker drains; the front first) and SIGUSR1, and
when one worker exits on its own stops the others and exits non-zero, so the pod restarts.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from multiprocessing.synchronize import Barrier

from service.balancer import FrontThread
from service.logs import configure_logging
from service.mps import MpsError, check_mps, gpu_ordinal, mps_daemon, resolve_mps
from service.placement import PlacementError, Slot, place, visible_ids
from service.settings import ServerSettings

log = logging.getLogger("grace.workers")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, with its terminating NUL
# how long a warm worker waits for the others before giving up (the barrier breaks, every
# worker exits, the supervisor fails): a worker that hangs while loading stops the start
GATE_SECONDS = 1800.0


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


def _worker(settings: ServerSettings, i: int, level: int, parent: int, address: str | None,
            env: dict[str, str], gpu: str, gate: Barrier | None) -> None:  # fmt: skip
    os.environ.update(env)  # its GPU and that GPU's MPS daemon, before CUDA starts here
    configure_logging(level, settings.log_format, worker=i)  # each line says which worker
    _die_with(parent)
    from service.app import run

    # on the shared port a worker opens it only once SERVING; behind the front it binds
    # its socket at once (NOT_SERVING while loading) and the front polls its health
    wait = functools.partial(gate.wait, GATE_SECONDS) if gate is not None else None
    raise SystemExit(run(settings, bind_when_ready=address is None, address=address,
                         placed=(i, gpu), gate=wait))  # fmt: skip


def _die_with(parent: int) -> None:
    """SIGTERM this worker when the supervisor dies, however it dies (Linux
    PR_SET_PDEATHSIG): an orphaned worker would keep serving an old model and index on
    the shared port next to its successor."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def supervise(settings: ServerSettings, placed: list[Slot] | None = None) -> int:
    """Run a worker per slot (`slots`) until they stop: 0 when all stopped cleanly, else 1
    (one that exits on its own stops the others). With MPS (`resolve_mps`) a private daemon
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
    """Start a worker per address (None: the shared public port) and, for private
    addresses, the request front (service/balancer.py); watch them until they stop.
    The signal handler only raises a flag (it takes no lock the interrupted main thread
    might hold); the loops below turn it into a stop: ask the front to drain, then, once
    it has finished (or after drain_seconds + 10 s), tell the workers to drain, so no
    call reaches a stopped worker."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state crosses a fork
    level = logging.getLogger().getEffectiveLevel()
    procs: list[mp.process.BaseProcess] = []
    stopping = threading.Event()
    asked = [False]  # set by the signal handler
    signalled: set[int] = set()
    front_deadline = [0.0]
    front = None
    gate = ctx.Barrier(len(placed)) if addresses[0] is None else None
    gate_broken = threading.Event()
    if addresses[0] is not None:
        front = FrontThread(settings, [a for a in addresses if a], lambda: stop_all())

    def on_signal(signum: int, _frame: object) -> None:
        asked[0] = True

    def stop_all() -> None:
        if gate is not None and not gate_broken.is_set():  # workers waiting there stop
            gate_broken.set()  # once, and off this thread: a worker killed inside wait()
            threading.Thread(target=gate.abort, name="grace-gate-abort", daemon=True).start()
        if not stopping.is_set():
            front_deadline[0] = time.monotonic() + settings.drain_seconds + 10
        stopping.set()
        if front is not None:
            front.stop()

    def signal_workers() -> None:
        for p in procs:
            if p.pid is not None and p.pid not in signalled and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)  # each worker drains, then exits
                signalled.add(p.pid)

    def front_done() -> bool:
        return front is None or not front.is_alive() or time.monotonic() > front_deadline[0]

    dumps: list[list[int]] = []  # the pids each SIGUSR1 reached, logged by the loop below

    def dump_stacks(signum: int, _frame: object) -> None:  # SIGUSR1: every worker's stacks
        reached = []
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
                reached.append(p.pid)
        dumps.append(reached)  # logged off the handler: logging takes locks

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, dump_stacks)
    failed = False
    try:
        for i, slot in enumerate(placed):
            if asked[0]:  # told to stop while starting: start no more
                break
            args = (worker_settings(settings, slot), i, level, os.getpid(), addresses[i],
                    envs[slot.worker], slot.label, gate)  # fmt: skip
            p = ctx.Process(target=_worker, args=args, name=f"grace-worker-{i}")
            procs.append(p)
            p.start()
        if front is not None and not asked[0]:
            front.start()
        gpus = sorted({s.gpu for s in placed if s.gpu is not None})
        where = f" on GPU {', '.join(map(str, gpus))}" if gpus else ""
        log.info("started %d workers%s on port %d%s: pids %s", len(procs), where, settings.port,
                 " behind the request front" if front else "", [p.pid for p in procs])  # fmt: skip
        while any(p.is_alive() for p in procs):
            while dumps:
                log.info("SIGUSR1: stack dumps asked of workers %s", dumps.pop(0))
            if asked[0] and not stopping.is_set():
                stop_all()
            if stopping.is_set() and front_done():
                signal_workers()
            for i, p in enumerate(procs):
                p.join(0.05)
                if p.exitcode is not None and front is not None:
                    front.front.mark_down(i)  # no more calls to it
                if p.exitcode is not None and not stopping.is_set():
                    log.error("%s exited with %s: stopping the others", p.name, p.exitcode)
                    failed = True
                    stop_all()
    except BaseException:
        stop_all()  # never leave started workers behind
        if front is not None and front.is_alive():
            front.join(settings.drain_seconds + 10)
        signal_workers()
        for p in procs:
            if p.pid is not None:
                p.join(30)
            if p.is_alive():
                p.kill()
        raise
    finally:
        if front is not None:
            front.stop()
            if front.is_alive():
                front.join(settings.drain_seconds + 10)
        for sig, handler in previous.items():  # after the front: a late signal is still ours
            signal.signal(sig, handler)
    clean = (0, -signal.SIGTERM, -signal.SIGINT)  # stopped before its own handler was in
    failed = failed or any(p.exitcode not in clean for p in procs)
    failed = failed or (front is not None and front.failed)
    log.info("workers stopped (exit codes %s)", [p.exitcode for p in procs])
    return 1 if failed else 0
