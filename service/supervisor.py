"""The supervisor of `grace serve --workers N` (service/workers.py places the workers and
starts it; docs/RELIABILITY.md "Workers"): it runs one worker process per slot and keeps
them serving.

- Start: every worker loads and warms; a worker that exits before all of them first
  served stops the start (exit 1): a start that fails is a setting or data to fix.
- Serving: a worker that exits, or whose heartbeat (service/board.py) is older than
  `worker_heartbeat_seconds` (frozen, its event loop blocked; it is killed), is restarted
  while the others serve on; at once when it had served `STABLE_SECONDS`, else after a
  backoff of 1 s doubling (to `MAX_BACKOFF_SECONDS`). A restart not serving after
  `GATE_SECONDS` is killed, a failed restart. At the `MAX_FAILED_RESTARTS`-th exit in a
  row without `STABLE_SECONDS` of serving (after 4 restarts), the supervisor stops them
  all and exits 1, so the pod restarts.
- Stop: SIGTERM/SIGINT asks the request front (if any) to drain, then every worker; one
  still there `STOP_SLACK_SECONDS` past its drain (frozen) is killed. SIGUSR1 is
  forwarded (each worker dumps its stacks).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier

from service.balancer import FrontThread
from service.board import Board
from service.logs import configure_logging
from service.settings import ServerSettings

log = logging.getLogger("grace.workers")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# how long a warm worker waits for the others before giving up (the barrier breaks, every
# worker exits, the supervisor fails): a worker that hangs while loading stops the start
GATE_SECONDS = 1800.0
STABLE_SECONDS = 60.0  # a worker that served this long restarts at once when it fails
MAX_BACKOFF_SECONDS = 30.0
MAX_FAILED_RESTARTS = 5
POLL_SECONDS = 0.05
# past drain_seconds, beyond a worker's own limit (the drain notice, drain_seconds, then
# service/app.py's DRAIN_SLACK_SECONDS), after which a worker that has not exited is killed
STOP_SLACK_SECONDS = 10.0


@dataclass
class Worker:
    """What the supervisor launches for one slot, and what it knows of the running one."""

    settings: ServerSettings
    env: dict[str, str]  # its GPU and that GPU's MPS daemon
    gpu: str  # its label in grace_worker_info
    address: str | None  # None: the shared public port; else its private unix socket
    proc: BaseProcess | None = None
    started: float = 0.0
    serving_since: float | None = None
    failures: int = 0  # restarts in a row that did not serve STABLE_SECONDS
    restart_at: float | None = None  # it exited: when the next one starts
    frozen: bool = False  # the supervisor killed it for its silence


def _worker(settings: ServerSettings, i: int, level: int, parent: int, address: str | None,
            env: dict[str, str], gpu: str, gate: Barrier | None, board: Board) -> None:  # fmt: skip
    os.environ.update(env)  # its GPU and that GPU's MPS daemon, before CUDA starts here
    configure_logging(level, settings.log_format, worker=i)  # each line says which worker
    _die_with(parent)
    from service.app import run

    # on the shared port a worker opens it only once SERVING; behind the front it binds
    # its socket at once (NOT_SERVING while loading) and the front polls its health
    wait = functools.partial(gate.wait, GATE_SECONDS) if gate is not None else None
    raise SystemExit(run(settings, bind_when_ready=address is None, address=address,
                         placed=(i, gpu), gate=wait, board=board))  # fmt: skip


def _die_with(parent: int) -> None:
    """SIGTERM this worker when the supervisor dies, however it dies (Linux
    PR_SET_PDEATHSIG): an orphaned worker would keep serving an old model and index on
    the shared port next to its successor."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"status {code}"


class Supervisor:
    """Runs `workers` until told to stop, or until one cannot be kept serving."""

    def __init__(self, settings: ServerSettings, workers: list[Worker]) -> None:
        self.settings, self.workers = settings, workers
        self.ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state crosses a fork
        self.level = logging.getLogger().getEffectiveLevel()
        self.board = Board(self.ctx, len(workers), settings.worker_heartbeat_seconds)
        shared = workers[0].address is None
        self.gate = self.ctx.Barrier(len(workers)) if shared else None
        self.gate_broken = threading.Event()
        self.front: FrontThread | None = None
        if not shared:
            addresses = [w.address for w in workers if w.address]
            self.front = FrontThread(settings, addresses, lambda: self.stop_all())
        self.stopping = threading.Event()
        self.asked = False  # set by the signal handler, turned into a stop by the loop
        self.signalled: set[int] = set()
        self.signalled_at = 0.0  # when the workers were first told to drain
        self.front_deadline = 0.0
        self.all_served = False  # every worker served once: the start is over
        self.failed = False
        self.dumps: list[list[int]] = []  # the pids each SIGUSR1 reached

    def run(self) -> int:
        """0 when every worker stopped cleanly when told to, else 1. The signal handlers
        only raise a flag (they take no lock the interrupted main thread might hold)."""
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._dump_stacks)
        try:
            self._start_all()
            while any(w.proc is not None and w.proc.is_alive() for w in self.workers) or (
                not self.stopping.is_set() and not self.failed
            ):
                self._tick()
        except BaseException:
            self.stop_all()  # never leave started workers behind
            if self.front is not None and self.front.is_alive():
                self.front.join(self.settings.drain_seconds + 10)
            self._signal_workers()
            for w in self.workers:
                if w.proc is not None and w.proc.pid is not None:
                    w.proc.join(30)
                    if w.proc.is_alive():
                        w.proc.kill()
            raise
        finally:
            if self.front is not None:
                self.front.stop()
                if self.front.is_alive():
                    self.front.join(self.settings.drain_seconds + 10)
            for sig, handler in previous.items():  # after the front: a late signal is ours
                signal.signal(sig, handler)
        clean = (0, -signal.SIGTERM, -signal.SIGINT)  # stopped before its own handler was in
        # a worker waiting out its restart backoff exited earlier: that exit is handled
        codes = [w.proc.exitcode if w.proc is not None and w.restart_at is None else None
                 for w in self.workers]  # fmt: skip
        failed = self.failed or any(c not in clean for c in codes if c is not None)
        failed = failed or (self.front is not None and self.front.failed)
        log.info("workers stopped (exit codes %s, restarts %s)", codes, list(self.board.restarts))
        return 1 if failed else 0

    def _start_all(self) -> None:
        for i in range(len(self.workers)):
            if self.asked:  # told to stop while starting: start no more
                break
            self._launch(i, self.gate)
        if self.front is not None and not self.asked:
            self.front.start()
        gpus = sorted({w.gpu for w in self.workers if w.gpu != "cpu"})
        where = f" on GPU {', '.join(gpus)}" if gpus else ""
        log.info("started %d workers%s on port %d%s: pids %s", len(self.workers), where,
                 self.settings.port, " behind the request front" if self.front else "",
                 [w.proc.pid for w in self.workers if w.proc])  # fmt: skip

    def _launch(self, i: int, gate: Barrier | None) -> None:
        w = self.workers[i]
        self.board.clear(i)
        args = (w.settings, i, self.level, os.getpid(), w.address, w.env, w.gpu, gate,
                self.board)  # fmt: skip
        w.proc = self.ctx.Process(target=_worker, args=args, name=f"grace-worker-{i}")
        w.proc.start()
        w.started, w.serving_since, w.restart_at, w.frozen = time.monotonic(), None, None, False

    def _tick(self) -> None:
        while self.dumps:
            log.info("SIGUSR1: stack dumps asked of workers %s", self.dumps.pop(0))
        if self.asked and not self.stopping.is_set():
            self.stop_all()
        if self.stopping.is_set():
            if self._front_done():
                self._signal_workers()
            late = self.signalled_at and time.monotonic() > (
                self.signalled_at + self.settings.drain_seconds + STOP_SLACK_SECONDS
            )
            for i, w in enumerate(self.workers):
                if w.proc is not None:
                    if late and w.proc.is_alive():  # frozen: its own drain limit cannot act
                        log.error("worker %d (pid %d) did not stop after its drain: killing it",
                                  i, w.proc.pid)  # fmt: skip
                        w.proc.kill()
                    w.proc.join(POLL_SECONDS)
                    if w.proc.exitcode is not None and self.front is not None:
                        self.front.mark(i, up=False)
            return
        now = time.monotonic()
        for i, w in enumerate(self.workers):
            self._watch(i, w, now)
        if not self.all_served and all(w.serving_since is not None for w in self.workers):
            self.all_served = True
        time.sleep(POLL_SECONDS)

    def _watch(self, i: int, w: Worker, now: float) -> None:
        """One look at worker i: serving yet? silent too long? exited? due to restart?"""
        p = w.proc
        if p is None or p.exitcode is not None:
            if w.restart_at is None:
                self._exited(i, w, now)
            elif now >= w.restart_at and not self.stopping.is_set():
                self._launch(i, None)  # a restart joins the others past the gate
            return
        if w.serving_since is None:
            if self.board.restarts[i] and now - w.started > GATE_SECONDS and not w.frozen:
                log.error("worker %d (pid %d) restarted %.0f s ago and is not serving: "
                          "killing it", i, p.pid, now - w.started)  # fmt: skip
                w.frozen = True  # its exit is then a failed restart, as any other
                p.kill()
            elif self.board.fresh(i, now):
                w.serving_since = now
                if self.front is not None:
                    self.front.mark(i, up=True)
                if self.board.restarts[i]:
                    log.info("worker %d serving again (pid %d), %.1f s after its restart",
                             i, p.pid, now - w.started)  # fmt: skip
        elif not self.board.fresh(i, now) and not w.frozen:
            log.error("worker %d (pid %d) sent no heartbeat for %.1f s (frozen, or its event "
                      "loop blocked): killing it", i, p.pid, now - self.board.beats[i])  # fmt: skip
            w.frozen = True
            if self.front is not None:
                self.front.mark(i, up=False)
            p.kill()  # SIGKILL ends a stopped process too

    def _exited(self, i: int, w: Worker, now: float) -> None:
        assert w.proc is not None
        code = w.proc.exitcode
        self.board.clear(i)
        if self.front is not None:
            self.front.mark(i, up=False)  # no more calls to it
        if not self.all_served:  # still starting: a worker that cannot start stops all
            log.error("%s exited with %s while starting: stopping the others", w.proc.name,
                      _status(code))  # fmt: skip
            self._fail()
            return
        stable = w.serving_since is not None and now - w.serving_since >= STABLE_SECONDS
        w.failures = 0 if stable else w.failures + 1
        if w.failures >= MAX_FAILED_RESTARTS:
            log.error("worker %d exited with %s; %d restarts in a row failed to serve %.0f s: "
                      "stopping the others", i, _status(code), w.failures,
                      STABLE_SECONDS)  # fmt: skip
            self._fail()
            return
        delay = min(MAX_BACKOFF_SECONDS, 2.0 ** (w.failures - 1)) if w.failures else 0.0
        why = "killed for its silence" if w.frozen else f"exited with {_status(code)}"
        log.error("worker %d (pid %d) %s; the others serve on; restarting it in %.0f s",
                  i, w.proc.pid, why, delay)  # fmt: skip
        self.board.restarts[i] += 1
        w.restart_at = now + delay

    def _fail(self) -> None:
        self.failed = True
        self.stop_all()

    def stop_all(self) -> None:
        if self.gate is not None and not self.gate_broken.is_set():  # waiting workers stop
            self.gate_broken.set()  # once, and off this thread: a worker killed inside wait()
            threading.Thread(target=self.gate.abort, name="grace-gate-abort", daemon=True).start()
        if not self.stopping.is_set():
            self.front_deadline = time.monotonic() + self.settings.drain_seconds + 10
        self.stopping.set()
        if self.front is not None:
            self.front.stop()

    def _signal_workers(self) -> None:
        self.signalled_at = self.signalled_at or time.monotonic()
        for w in self.workers:
            p = w.proc
            if p is not None and p.pid is not None and p.pid not in self.signalled and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)  # each worker drains, then exits
                self.signalled.add(p.pid)

    def _front_done(self) -> bool:
        f = self.front
        return f is None or not f.is_alive() or time.monotonic() > self.front_deadline

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.asked = True

    def _dump_stacks(self, signum: int, _frame: object) -> None:
        reached = []
        for w in self.workers:
            if w.proc is not None and w.proc.pid is not None and w.proc.is_alive():
                os.kill(w.proc.pid, signal.SIGUSR1)
                reached.append(w.proc.pid)
        self.dumps.append(reached)  # logged off the handler: logging takes locks
