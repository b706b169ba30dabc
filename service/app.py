"""Assembly and lifecycle of one serving process (`grace serve`), in start-up order:

    settings -> first (model, index) pair (verified, validated) -> pipeline threads
    -> batcher -> grpc.aio server (AdRetrieval + grpc.health.v1 + reflection) + metrics
    HTTP port -> rollout (model and index hot swap) -> one warm-up request -> SERVING
    (+ stall watchdog) ... SIGTERM -> NOT_SERVING, drain, exit

Model, GPU and C++ work run on the pipeline threads, never on the event loop. SIGTERM
always ends the process: a drain unfinished `DRAIN_SLACK_SECONDS` after `drain_seconds`
exits 1. Several such processes on one port: `service/workers.py`. The start-up order is
read top to bottom in `start`, so the assembly stays one module, past the house's ~300
lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from service import stackdump
from service.batcher import Batcher
from service.beam_ladder import Ladder
from service.board import HEARTBEAT_SECONDS, Board
from service.errors import StartupError
from service.grpc_server import (
    DRAIN_NOTICE_SECONDS,
    SERVICE,
    HealthServicer,
    add_health_and_reflection,
    add_retrieval,
    bind,
    max_connections,
    server_options,
    set_health,
    tcp_connections,
)
from service.logs import AccessLog
from service.metrics import Metrics
from service.model import precision
from service.mps import mps_client
from service.pipeline.records import Batch, group_key
from service.pipeline.runner import Pipeline
from service.pipeline.runtime import ServingHolder
from service.pipeline.stages import Stages
from service.request_log import RequestLog
from service.rollout.assembly import build_rollout
from service.rollout.rollout import Rollout
from service.server import RetrievalServicer
from service.settings import ServerSettings
from service.tracing import Tracing
from service.validation import Limits, ValidatedRequest
from service.watchdog import Watchdog, wedged

log = logging.getLogger("grace.serve")
DRAIN_SLACK_SECONDS = 5.0  # beyond drain_seconds for the threads and the metrics port
TRACING_FLUSH_SECONDS = 2.0  # of that slack, for exporting the last spans


@dataclass
class App:
    """A running server; `port` and `metrics` are what tests and `grace serve` read."""

    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: HealthServicer
    servicer: RetrievalServicer
    batcher: Batcher
    pipeline: Pipeline
    rollout: Rollout
    metrics: Metrics
    settings: ServerSettings
    watchdog: Watchdog | None  # None: stall_seconds = 0
    tracing: Tracing
    heartbeat: asyncio.Task[None] | None = None  # a worker of several: its beats

    async def drain(self) -> None:
        """Stop accepting, finish what is in flight, stop the threads. Watch streams end
        with the server's grace period (they are cancelled like any call)."""
        if self.watchdog is not None:
            self.watchdog.stop()  # a drain may take its time; it has its own deadline
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for good
        self.metrics.serving.set(0)
        await asyncio.sleep(DRAIN_NOTICE_SECONDS)  # let health checkers and balancers see it
        self.servicer.draining = True
        await self.server.stop(self.settings.drain_seconds)
        await self.batcher.stop()
        self.rollout.stop()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.pipeline.stop, DRAIN_SLACK_SECONDS)
        if self.servicer.request_log is not None:
            await loop.run_in_executor(None, self.servicer.request_log.close)
        # the last spans: a collector that does not answer must not turn the drain into a kill
        if not await loop.run_in_executor(None, self.tracing.shutdown, TRACING_FLUSH_SECONDS):
            log.warning("tracing: the last spans were not exported within %.0f s",
                        TRACING_FLUSH_SECONDS)  # fmt: skip
        self.metrics.close()


async def start(
    settings: ServerSettings,
    *,
    bind_when_ready: bool = False,
    address: str | None = None,
    placed: tuple[int, str] | None = None,
    gate: Callable[[], None] | None = None,
    board: Board | None = None,
) -> App:
    """Load, warm and serve. `bind_when_ready` (a worker of several): open the gRPC port
    only once SERVING, so the kernel never hands a connection to a worker still loading.
    `address` (a worker behind the request front): listen there, not on host:port.
    `placed`: (worker, gpu) of a worker of several, for `grace_worker_info`. `gate`:
    returns once every worker of the host is warm (they open the shared port together).
    `board`: the supervisor's (service/board.py), beaten on from the event loop once
    SERVING, so a frozen process or a blocked loop is seen."""
    t0 = time.perf_counter()
    instance = {"service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}
    # first: a tracing setting that cannot work fails now, not after minutes of loading
    tracing = Tracing.from_settings(settings.tracing, settings.tracing_sample_ratio, **instance)
    device = settings.resolve_device()
    metrics = Metrics()
    if placed is not None:
        metrics.place(*placed, board)
    health_servicer = HealthServicer()
    await set_health(health_servicer, serving=False)
    serving = ServingHolder()
    precision.check(settings.dtype, device)  # before any model loads
    stages = Stages(device, settings.max_batch, settings.graph_buckets, scoring=settings.scoring)
    rollout = build_rollout(settings, stages, serving, metrics, device)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, rollout.check_once)
    if not serving.ready:
        raise StartupError(
            f"no model and index under {settings.model_dir} and {settings.index_root} that "
            f"serve together (grace train, grace build-index): {rollout.why_none()}"
        )
    # a model is named by its checkpoint's own version, as replies carry it
    log.info("model %s and index %s loaded on %s in %.1f s", serving.current.model.model_version,
             serving.current.index.version, device, time.perf_counter() - t0)  # fmt: skip

    batcher: Batcher

    def dispatched(batch: Batch) -> None:
        metrics.batch_size.observe(len(batch.pending))
        metrics.padding.inc(stages.padding(batch.groups))
        if batch.rung_beams is not None and batch.adaptive:
            metrics.rung_batches.labels(str(batch.rung)).inc()

    ladder = Ladder.priced(settings.ladder(), serving.current.model.config, *settings.rung_bounds())
    pipeline = Pipeline(
        stages,
        serving,
        lambda *done: batcher.batch_done(*done),  # the batcher is made below
        lambda stage, seconds: metrics.stage.labels(stage).observe(seconds),
        lambda stage, reason, n: metrics.dropped.labels(stage, reason).inc(n),
        dispatched,
        tracing,
        ladder.rungs,
    )

    batcher = Batcher(
        pipeline.dispatch,
        max_batch=settings.max_batch,
        max_wait=settings.max_wait_ms / 1e3,
        max_wait_busy=max(settings.max_wait_ms, settings.max_wait_busy_ms) / 1e3,
        capacity=settings.queue_capacity,
        busy_batches=settings.resolve_busy_batches(device),
        max_groups=settings.max_decode_groups,
        group_key=group_key,
        on_expired=metrics.queue_expired.inc,
        ladder=ladder if len(ladder.rungs) > 1 else None,
        adaptive=lambda request: request.adaptive,
    )
    batcher.start()
    metrics.beam_rung.set_function(lambda: ladder.current)
    metrics.queue_depth.set_function(lambda: batcher.depth)
    metrics.pipeline_batches.set_function(lambda: pipeline.in_flight)
    metrics.predicted_wait.set_function(
        lambda: batcher.admission.predicted_ms(batcher.depth, batcher.inflight_requests) / 1e3
    )
    metrics.index_behind.set_function(lambda: int(rollout.index_behind))
    metrics.model_behind.set_function(lambda: int(rollout.model_behind))
    if device.startswith("cuda"):
        metrics.gpu_memory.set_function(torch.cuda.memory_allocated)
    metrics.mps_client.set(int(mps_client(device)))
    request_log = None
    if settings.request_log:
        request_log = RequestLog(settings.request_log,
                                 max_bytes=int(settings.request_log_max_mb * 2**20))  # fmt: skip
        metrics.track_request_log(request_log)
    servicer = RetrievalServicer(
        batcher, Limits.from_settings(settings), serving, metrics, request_log,
        AccessLog(settings.access_log_sample), tracing,
    )  # fmt: skip
    # connection ageing rebalances clients over replicas; the front's private hop to a
    # worker has nothing to rebalance
    options = server_options(settings, servicer.max_request_bytes)
    if address is not None:
        options = [o for o in options if not o[0].startswith("grpc.max_connection_age")]
    # only a supervisor's own workers share a port: a second server on it is refused
    options.append(("grpc.so_reuseport", int(bind_when_ready and address is None)))
    server = grpc.aio.server(options=options)
    metrics.connections_max.set(max_connections(settings))
    add_retrieval(server, servicer.Retrieve)
    add_health_and_reflection(server, health_servicer)
    address = address or f"{settings.host}:{settings.port}"
    port = 0 if bind_when_ready else _bind(server, address, settings)
    if not bind_when_ready:
        await server.start()  # health answers NOT_SERVING while loading
    try:
        metrics_port = metrics.serve(settings.metrics_port, settings.metrics_host)
    except OSError as exc:
        await server.stop(0)
        raise StartupError(f"metrics port {settings.metrics_host}:{settings.metrics_port}: "
                           f"{exc.strerror or exc} (--metrics-port)") from exc  # fmt: skip
    rollout.start()
    await _warm_up(batcher, settings)  # first batch pays one-time costs, not a client
    app = App(server, port, metrics_port, health_servicer, servicer, batcher, pipeline, rollout,
              metrics, settings, None, tracing)  # fmt: skip
    if gate is not None and not await _passed(gate):
        await app.drain()  # never served: stop the threads, then say why
        raise StartupError("another worker of this host failed to start, or took too long")
    await set_health(health_servicer, serving=True)
    if bind_when_ready:
        port = app.port = _bind(server, address, settings)
        await server.start()
    metrics.serving.set(1)  # SERVING and listening
    metrics.connections.set_function(lambda: tcp_connections(port))
    if settings.stall_seconds > 0:  # from now on a stalled pipeline is a wedged process
        app.watchdog = Watchdog(pipeline.stalled_for, settings.stall_seconds, on_stall=wedged)
        app.watchdog.start()
    if board is not None and placed is not None:
        app.heartbeat = asyncio.create_task(_beat(board, placed[0]))
    log.info(
        "serving %s on %s (model %s, index %s, %s), ready in %.1f s",
        SERVICE, address if address.startswith("unix:") else f"{settings.host}:{port}",
        serving.current.model.model_version, serving.current.index.version, device,
        time.perf_counter() - t0,
    )  # fmt: skip
    return app


async def _beat(board: Board, worker: int) -> None:
    while True:
        board.beat(worker)
        await asyncio.sleep(HEARTBEAT_SECONDS)


async def _passed(gate: Callable[[], None]) -> bool:
    """Wait at the workers' gate off the event loop; False when it broke (a worker of the
    host failed, and the supervisor is stopping them all)."""
    try:
        await asyncio.get_running_loop().run_in_executor(None, gate)
    except threading.BrokenBarrierError:
        return False
    return True


def _bind(server: grpc.aio.Server, address: str, settings: ServerSettings) -> int:
    """Listen on `address` (TLS as the settings say: grpc_server.bind); a taken port is a
    one-line StartupError."""
    try:
        return bind(server, address, settings)
    except StartupError:  # TLS files that do not load (a RuntimeError too)
        raise
    except RuntimeError as exc:
        raise StartupError(
            f"cannot listen on {address}: the port is taken (another grace serve?) or the "
            "address is not this host's (--port, --host)"
        ) from exc


async def _warm_up(batcher: Batcher, settings: ServerSettings) -> None:
    """One request through every stage before SERVING (allocations, lazy inits, kernels)."""
    import numpy as np

    empty = np.zeros(0, dtype=np.int64)
    request = ValidatedRequest(
        request_id="warm-up",
        user_id=0,
        targeting=Targeting(),
        history_ad_ids=empty,
        history_types=empty,
        history_ts_ms=empty,
        max_ads=1,
        beams=tuple(settings.beams),
        filter_mode=FilterMode.CD_GTM,
        include_sids=False,
    )
    await batcher.submit(request)


async def serve_forever(settings: ServerSettings, **how: Any) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully; `how`: `start`'s keywords."""
    app = await start(settings, **how)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining")
    limit = DRAIN_NOTICE_SECONDS + settings.drain_seconds + DRAIN_SLACK_SECONDS
    try:
        await asyncio.wait_for(app.drain(), limit)
    except TimeoutError:
        log.error("drain did not finish in %.1f s: exiting without it", limit)
        logging.shutdown()
        os._exit(1)  # a thread that will not stop must not keep the process alive
    log.info("stopped")


def run(settings: ServerSettings, **how: Any) -> int:
    """Serve one process until stopped (`how`: `start`'s keywords) on one event loop
    (uvloop when available); returns the exit status. SIGUSR1 dumps every thread's stack
    (service/stackdump.py)."""
    stackdump.install()
    main = serve_forever(settings, **how)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0
