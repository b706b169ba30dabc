"""All Prometheus metrics of the server, in one place (served on their own HTTP port).

The standard go-grpc-prometheus names (`grpc_server_started_total`,
`grpc_server_handled_total{grpc_code}`, `grpc_server_handling_seconds`) keep existing
dashboards working; everything of our own is prefixed `grace_` with a unit suffix.
Latency buckets are ms-scale with an edge at the 100 ms SLO. One module past the house's
~300 lines: every series' name and help text in one place is what dashboards, alerts and
docs/SERVICE.md are checked against.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from service.board import Board
    from service.request_log import RequestLog


class _RequestLogCollector:
    def __init__(self, request_log: RequestLog) -> None:
        self._log = request_log

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("grace_request_log_lines", "Requests written to the request "
                                  "log.", value=self._log.written)  # fmt: skip
        yield CounterMetricFamily("grace_request_log_dropped", "Requests not written to the "
                                  "request log: its writer was behind, or a write failed.",
                                  value=self._log.dropped)  # fmt: skip
        yield CounterMetricFamily("grace_request_log_rotations", "Request log files rotated "
                                  "(request_log_max_mb).", value=self._log.rotations)  # fmt: skip


class _BoardCollector:
    """The host's workers as the supervisor's board (service/board.py) has them."""

    def __init__(self, board: Board, worker: int) -> None:
        self._board, self._worker = board, worker

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        b = self._board
        yield GaugeMetricFamily(
            "grace_workers", "Workers this host's supervisor runs (--workers).", value=b.workers
        )
        yield GaugeMetricFamily(
            "grace_workers_serving",
            "Of them, those serving now (a fresh heartbeat): fewer while one restarts.",
            value=b.serving(),
        )
        restarts = CounterMetricFamily(
            "grace_worker_restarts",
            "Times the supervisor restarted this worker (it exited, or froze).",
            labels=["worker"],
        )
        restarts.add_metric([str(self._worker)], b.restarts[self._worker])
        yield restarts


SLO_SECONDS = 0.1
LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, SLO_SECONDS,
                   0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # fmt: skip
_GRPC = ("grpc_type", "grpc_service", "grpc_method")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._created: float | None = None
        if registry is None:  # the process: memory, CPU, open files, GC, the interpreter
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        histogram = functools.partial(Histogram, registry=r)
        info = functools.partial(Info, registry=r)
        self.started = counter("grpc_server_started_total", "RPCs started on the server.", _GRPC)
        self.handled = counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            (*_GRPC, "grpc_code"),
        )
        self.handling = histogram(
            "grpc_server_handling_seconds",
            "Response latency of RPCs handled by the server.",
            _GRPC,
            buckets=LATENCY_BUCKETS,
        )
        self.stage = histogram(
            "grace_stage_duration_seconds",
            "Wall time of one batch in one pipeline stage.",
            ("stage",),
            buckets=LATENCY_BUCKETS,
        )
        self.batch_size = histogram(
            "grace_batch_size", "Requests per batch.", buckets=(1, 2, 4, 6, 8, 10, 12, 14, 16, 32)
        )
        self.padding = counter(
            "grace_batch_padding_total",
            "Requests' worth of padding the GPU decoded: each decode group of a batch (one "
            "beam schedule and filter mode) runs at its graph bucket's size (graph_buckets), "
            "so a part-full group costs the GPU a full bucket. Stays 0 on CPU.",
        )
        self.queue_depth = gauge("grace_queue_depth", "Requests waiting for a batch.")
        self.refused = counter(
            "grace_admission_refused_total",
            "Retrieve calls refused at the door, before parsing, by reason: 'overloaded' "
            "(the deadline does not leave room for the predicted wait: RESOURCE_EXHAUSTED), "
            "'queue_full' (RESOURCE_EXHAUSTED), 'hopeless' (the deadline is shorter than "
            "the service itself: DEADLINE_EXCEEDED).",
            ("reason",),
        )
        self.queue_expired = counter(
            "grace_queue_expired_total",
            "Requests dropped from the queue before batching: their deadline had passed "
            "or could no longer be met (answered DEADLINE_EXCEEDED).",
        )
        self.dropped = counter(
            "grace_stage_dropped_total",
            "Requests dropped at a pipeline stage hand-off, before that stage's work: "
            "reason 'deadline' (answered DEADLINE_EXCEEDED) or 'cancelled' (the client "
            "went away).",
            ("stage", "reason"),
        )
        for reason in ("overloaded", "queue_full", "hopeless"):  # series exist from the start
            self.refused.labels(reason)
        for stage in ("input", "features", "compute", "post"):
            for reason in ("deadline", "cancelled"):
                self.dropped.labels(stage, reason)
        self.predicted_wait = gauge(
            "grace_admission_predicted_seconds",
            "Predicted time to answer a request arriving now, behind the work queued and "
            "in flight (what admission compares each deadline with).",
        )
        self.serving = gauge(
            "grace_serving",
            "1 from the moment this process says SERVING with its gRPC port open until it "
            "starts to drain, else 0: with several workers on one port a health probe "
            "reaches any one of them, this says it of each.",
        )
        self.pipeline_batches = gauge(
            "grace_pipeline_batches",
            "Batches in the four-stage pipeline (dispatched, not yet through post).",
        )
        self.inflight = gauge("grace_inflight_requests", "Requests accepted and not yet answered.")
        self.index_info = info("grace_index", "The index version being served.")
        self.index_loaded = gauge(
            "grace_index_loaded_timestamp_seconds", "When the served index was loaded."
        )
        self.index_created = gauge(
            "grace_index_created_timestamp_seconds", "When the served index was built."
        )
        self.index_age = gauge(
            "grace_index_age_seconds", "Age of the served index since it was built."
        )
        self.index_age.set_function(self._index_age)
        self.swaps = counter(
            "grace_index_swaps_total", "Index hot swaps (the first load is not one)."
        )
        self.swap_failures = counter(
            "grace_index_swap_failures_total",
            "Index versions refused: reason 'invalid' (an attempt to load, validate or "
            "prepare it failed; retried with backoff) or 'incompatible' (its SID space "
            "fits no model: counted once per model it was tried with).",
            ("reason",),
        )
        self.index_behind = gauge(
            "grace_index_behind_current",
            "1 while the served index is not the version CURRENT names (that one was "
            "refused, waits for a model of its SID space, or its directory has not "
            "appeared yet; also after a start-up fallback), else 0.",
        )
        self.model_info = info(
            "grace_model",
            "The model being served: version (what the repository's CURRENT names, or the "
            "checkpoint directory's name), model_version (the checkpoint's own name, which "
            "responses carry), sid_space and dtype (what it serves in: fp8, bfloat16 or "
            "float32; with dtype auto, FP8 where its quality record passes: docs/FP8.md).",
        )
        self.model_loaded = gauge(
            "grace_model_loaded_timestamp_seconds", "When the served model was loaded."
        )
        self.model_swaps = counter(
            "grace_model_swaps_total", "Model hot swaps (the first load is not one)."
        )
        self.model_swap_failures = counter(
            "grace_model_swap_failures_total",
            "Model versions refused: reason 'invalid' (an attempt to load, verify or "
            "prepare it failed; retried with backoff) or 'incompatible' (its SID space "
            "fits no index: counted once per index it was tried with).",
            ("reason",),
        )
        self.model_behind = gauge(
            "grace_model_behind_current",
            "1 while the served model is not the version the model repository's CURRENT "
            "names (that one was refused, waits for an index of its SID space, or has not "
            "appeared yet; also after a start-up fallback), else 0.",
        )
        for reason in ("invalid", "incompatible"):
            self.swap_failures.labels(reason)
            self.model_swap_failures.labels(reason)
        self.sids = counter("grace_sids_generated_total", "SIDs the decoder emitted.")
        self.expanded = counter("grace_ads_expanded_total", "Ads behind the generated SIDs.")
        self.eligible = counter(
            "grace_ads_eligible_total", "Expanded ads passing the exact filter."
        )
        self.removed = counter(
            "grace_ads_removed_total",
            "Expanded ads the exact filter removed, by rule kind: block (the request's "
            "exclude_*_ids), targeting (an include rule), exclusion (an ad's exclude list), "
            "not_live (paused, deleted or waiting for a rebuild at the reply's catalog_seq).",
            ["rule"],
        )
        self.catalog_seq = gauge(
            "grace_catalog_seq",
            "The last live catalog change applied to the served index (the catalog_seq of "
            "its replies; 0: the index as built).",
        )
        self.live_ads = gauge(
            "grace_live_ads",
            "Ads of the served index not served because of live changes, by state: paused, "
            "deleted, waiting (upserted: served from the next full build).",
            ["state"],
        )
        self.live_new_waiting = gauge(
            "grace_live_new_ads_waiting",
            "Ads upserted that the served index does not hold: served from the next full build.",
        )
        self.beam_rung = gauge(
            "grace_beam_rung",
            "The beam ladder rung batches of requests without beam_widths get now: 0 the "
            "full schedule, higher ones narrower under load (service/beam_ladder.py).",
        )
        self.rung_batches = counter(
            "grace_beam_rung_batches_total",
            "Batches of requests without beam_widths, by the ladder rung they decoded at.",
            ["rung"],
        )
        self.live_placed = gauge(
            "grace_live_placed_ads",
            "Upserted ads the served index serves in place (new targeting, or a new ad into "
            "a SID it holds), live at its catalog_seq; their old rows count as not live.",
        )
        self.live_spare_rows = gauge(
            "grace_live_spare_matcher_rows",
            "Spare GTM matcher rows left for the upserts served in place on the served "
            "index; at 0 a place that needs a wider row waits for the next full build.",
        )
        self.live_pruned = gauge(
            "grace_live_pruned_subtrees",
            "Trie entries of the served index below which no ad is live (all paused, "
            "deleted or waiting): barred in decoding, no beam spent on them.",
        )
        self.live_bytes = gauge(
            "grace_live_state_bytes",
            "Memory the served index's live changes take: one byte per ad once any changed, "
            "plus the upserted ids it does not hold and ~2 KB per ad served in place.",
        )
        self.live_applied = counter(
            "grace_live_changes_applied_total",
            "Live catalog changes this process's live follower applied to the served "
            "index, by op (a version's replay when it loads or catches up before its swap "
            "is not counted: grace_catalog_seq and grace_live_ads show its state).",
            ["op"],
        )
        self.empty_answers = counter(
            "grace_empty_answers_total",
            "Retrieve calls answered OK with no ads (a model that answers nothing shows "
            "here: GraceEmptyAnswers watches their share of the OK answers).",
        )
        self.gpu_memory = gauge(  # on every device, so a CPU server reads 0, not "No data"
            "grace_gpu_memory_bytes", "GPU memory allocated by the server; 0 on a CPU (no GPU)."
        )
        self.connections = gauge(  # beside process_open_fds / process_max_fds
            "grace_grpc_connections", "Client connections this process holds on its gRPC port."
        )
        self.connections_max = gauge(
            "grace_grpc_connections_max", "The cap on them (max_connections); 0: none."
        )
        self.mps_client = gauge(
            "grace_mps_client",
            "1 when this process reaches its GPU through a CUDA MPS daemon, else 0 "
            "(several workers on one GPU without it time-slice: GraceGpuWorkersWithoutMps).",
        )

    def track_request_log(self, request_log: RequestLog) -> None:
        """Export the request log's lines written, dropped and rotations (the setting
        `request_log`), read from it at each scrape."""
        self.registry.register(_RequestLogCollector(request_log))

    def set_index(self, version: str, created_iso: str | None, loaded_at: float) -> None:
        """Record the index now being served."""
        self.index_info.info({"version": version})
        self.index_loaded.set(loaded_at)
        self._created = datetime.fromisoformat(created_iso).timestamp() if created_iso else None
        if self._created is not None:
            self.index_created.set(self._created)

    def set_model(
        self, version: str, model_version: str, sid_space: str, loaded_at: float, dtype: str
    ) -> None:
        """Record the model now being served."""
        self.model_info.info(
            {"version": version, "model_version": model_version, "sid_space": sid_space,
             "dtype": dtype}
        )  # fmt: skip
        self.model_loaded.set(loaded_at)

    def _index_age(self) -> float:
        return time.time() - self._created if self._created else 0.0

    def place(self, worker: int, gpu: str, board: Board | None = None) -> None:
        """`grace_worker_info{worker, gpu}`, for a worker of several only (a metric never
        set would still export one unlabelled sample); with the supervisor's `board`, the
        host's workers serving and this one's restarts."""
        if board is not None:
            self.registry.register(_BoardCollector(board, worker))
        Info(
            "grace_worker",
            "Which worker of `grace serve` this process is (its metrics port is metrics_port "
            "+ worker) and its GPU, as an ordinal of the GPUs the supervisor sees ('cpu' on a "
            "CPU). Join it to any series by instance to group by GPU (docs/SERVICE.md, "
            "'Several GPUs').",
            registry=self.registry,
        ).info({"worker": str(worker), "gpu": gpu})

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Expose /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        self._httpd, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        httpd = getattr(self, "_httpd", None)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
