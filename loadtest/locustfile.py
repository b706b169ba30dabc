"""Locust load test of grace.v1.AdRetrieval/Retrieve (docs/ops/loadtest.md).

    locust -f loadtest/locustfile.py --headless -H localhost:50051 -u 4 -r 4 -t 30s \\
        --grace-p99-ms 500 --grace-fail-ratio 0.01 --grace-rps 20 --csv out/grace

Requests: the first --world-users users of a synthetic world (--world, default the demo's
data/world), or every line of a replay file (--replay: `grace record` output or the
server's request log), sent as recorded.

Closed loop (default): each of the -u users sends a request, waits for its answer, waits
--think-time seconds, and sends the next. Open loop (--arrival-rate R): R requests per
second in total, split evenly over the -u users and started on a clock whatever the
answers do (loadtest/open_loop.py); one or two users suffice.

With any --check-* option the run exits 0 when every threshold holds and 3 when one is
missed (named in the log); without them locust's own rule applies (1 on any failure).
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
from pathlib import Path

# locust puts the working directory on sys.path, not this file's parent: make the
# `loadtest` package importable when locust runs from anywhere.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import gevent  # noqa: E402
import gevent.event  # noqa: E402
import grpc  # noqa: E402
from gevent.pool import Group  # noqa: E402
from locust import events, task  # noqa: E402
from locust.runners import MasterRunner, WorkerRunner  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC, StatsEntry  # noqa: E402

from loadtest import sources  # noqa: E402
from loadtest.grpc_user import GrpcUser, RpcFailure  # noqa: E402  (patches gRPC first)
from loadtest.open_loop import OpenLoopStats, arrival_times, run_arrivals  # noqa: E402
from loadtest.thresholds import EXIT_THRESHOLD_MISSED, RunSummary, Thresholds, check  # noqa: E402
from service.rpc.grace.v1 import retrieval_pb2_grpc  # noqa: E402

log = logging.getLogger("grace.loadtest")
METHOD = "grace.v1.AdRetrieval/Retrieve"
_requests: list = []  # this process's request pool, built once at init
_open_loop = OpenLoopStats()
_workers_open_loop: dict[str, OpenLoopStats] = {}  # master (--processes): latest per worker
_by_outcome: dict[str, StatsEntry] = {}  # "OK", a status code or "CLIENT" -> its times


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    add = parser.add_argument
    add("--world", default="data/world", help="GRACE: synthetic world to take users from")
    add("--world-users", type=int, default=100, help="GRACE: how many of its users (first N)")
    add("--replay", default="", help="GRACE: JSON Lines of RetrieveRequest to send instead")
    add("--max-ads", type=int, default=100, help="GRACE: options.max_ads (world requests)")
    add("--filter-mode", choices=["cd_gtm", "cd_only"], default="cd_gtm",
        help="GRACE: options.filter_mode (world requests)")  # fmt: skip
    add("--request-timeout", type=float, default=5.0, help="GRACE: per-call deadline, seconds")
    add("--think-time", type=float, default=0.0, help="GRACE: closed loop: pause after answers")
    add("--arrival-rate", type=float, default=0.0,
        help="GRACE: open loop: requests/s in total over all users (0 = closed loop)")  # fmt: skip
    add("--poisson", action="store_true", help="GRACE: open loop: Poisson, not even, arrivals")
    add("--max-inflight", type=int, default=1000,
        help="GRACE: open loop: calls in flight per user; arrivals past it fail")  # fmt: skip
    add("--grace-p99-ms", type=float, default=None, help="GRACE: fail if P99 exceeds this (ms)")
    add("--grace-fail-ratio", type=float, default=None,
        help="GRACE: fail if failures/requests exceed this (0.01 = 1 %%)")  # fmt: skip
    add("--grace-rps", type=float, default=None, help="GRACE: fail if req/s is below this")


_loaded = gevent.event.Event()  # set once this process holds its request pool


@events.init.add_listener
def _load_requests(environment, **_kw) -> None:
    if isinstance(environment.runner, MasterRunner):
        return  # workers send; each loads its own pool (same files on every worker)
    o = environment.parsed_options

    def load() -> list:
        if o.replay:
            return sources.from_replay(Path(o.replay))
        return sources.from_world(Path(o.world), o.world_users, o.max_ads, o.filter_mode)

    try:
        # on a real thread: a worker's heartbeats to the master run on this gevent loop,
        # and a load of several seconds would have the master declare the worker missing
        pool = gevent.get_hub().threadpool.apply(load)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"loadtest: cannot load requests: {exc}") from None
    _requests[:] = pool
    _loaded.set()
    log.info("%d requests from %s", len(pool), o.replay or o.world)


@events.request.add_listener
def _split_by_outcome(response_time, response_length, exception, **_kw) -> None:
    # Locust's totals mix fast refusals with slow answers; under overload the split is
    # what tells them apart (printed at quit).
    if exception is None:
        key = "OK"
    else:
        key = exception.code.name if isinstance(exception, RpcFailure) else "CLIENT"
    if key not in _by_outcome:
        _by_outcome[key] = StatsEntry(None, key, "grpc")
    _by_outcome[key].log(response_time, response_length)


class RetrieveUser(GrpcUser):
    """Sends Retrieve: closed loop by default, open loop with --arrival-rate."""

    stub_class = retrieval_pb2_grpc.AdRetrievalStub
    host = "localhost:50051"

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time

    def on_start(self) -> None:
        self.options = self.environment.parsed_options
        _loaded.wait()  # a worker may be told to spawn before its pool has loaded
        self.rng = random.Random()
        self.requests = sources.cycle_from_random_offset(_requests, self.rng)
        self.inflight = Group()  # open loop: calls not yet answered

    @task
    def retrieve(self) -> None:
        if self.options.arrival_rate > 0:
            self._open_loop()  # returns only when the user is stopped
        else:
            self._send()

    def _send(self) -> None:
        # .future(): completions arrive on the channel's one polling thread. Under gevent
        # a blocking call waits for its answer on one of the hub's 10 pool threads, taken
        # in call order, so past 10 in flight a fast answer (a refusal) is reported only
        # after the slow calls ahead of it (docs/ops/loadtest.md, "The gRPC user").
        call = self.stub.Retrieve.future(next(self.requests), timeout=self.options.request_timeout)
        with contextlib.suppress(grpc.RpcError):  # the interceptor has reported it
            call.result()

    def _open_loop(self) -> None:
        o = self.options
        rate = o.arrival_rate / max(o.num_users or 1, 1)
        arrivals = arrival_times(rate, time.monotonic(), self.rng, o.poisson)
        run_arrivals(arrivals, self._send, self._refuse, self.inflight, o.max_inflight,
                     _open_loop)  # fmt: skip

    def _refuse(self, in_flight: int) -> None:
        self.environment.events.request.fire(
            request_type="grpc",
            name=METHOD,
            response_time=0.0,
            response_length=0,
            response=None,
            context={},
            exception=RuntimeError(f"client: {in_flight} calls in flight (--max-inflight)"),
        )

    def on_stop(self) -> None:
        self.inflight.kill(block=False)  # unanswered calls are not counted, as in closed loop
        super().on_stop()


@events.report_to_master.add_listener
def _report_open_loop(client_id, data, **_kw) -> None:
    s = _open_loop  # cumulative, so the master keeps each worker's latest report
    data["grace_open_loop"] = (s.dispatched, s.refused, s.max_lag_s)


@events.worker_report.add_listener
def _collect_open_loop(client_id, data, **_kw) -> None:
    if "grace_open_loop" in data:
        _workers_open_loop[client_id] = OpenLoopStats(*data["grace_open_loop"])


def _open_loop_totals() -> OpenLoopStats:
    """This process's dispatchers, or on a master the sum of its workers' (max lag)."""
    if not _workers_open_loop:
        return _open_loop
    ws = list(_workers_open_loop.values())
    return OpenLoopStats(sum(w.dispatched for w in ws), sum(w.refused for w in ws),
                         max(w.max_lag_s for w in ws))  # fmt: skip


@events.quitting.add_listener
def _verdict(environment, **_kw) -> None:
    o = environment.parsed_options
    open_loop = o.arrival_rate > 0
    if open_loop:
        s = _open_loop_totals()
        log.info("open loop: %d arrivals sent, %d refused (in-flight cap), dispatch lag "
                 "max %.0f ms", s.dispatched, s.refused, 1000 * s.max_lag_s)  # fmt: skip
    if _by_outcome:
        log.info("by outcome: %s", "; ".join(
            f"{k} {e.num_requests} (P50 {e.get_response_time_percentile(0.5):.0f} ms, "
            f"P99 {e.get_response_time_percentile(0.99):.0f} ms)"
            for k, e in sorted(_by_outcome.items())
        ))  # fmt: skip
    if isinstance(environment.runner, WorkerRunner):
        return  # the master judges the aggregated stats
    total = environment.stats.total
    summary = RunSummary(
        requests=total.num_requests,
        failures=total.num_failures,
        rps=total.total_rps,
        p50_ms=total.get_response_time_percentile(0.5) or 0.0,
        p99_ms=total.get_response_time_percentile(0.99) or 0.0,
        generator_lag_s=_open_loop_totals().max_lag_s if open_loop else None,
    )
    limits = Thresholds(o.grace_p99_ms, o.grace_fail_ratio, o.grace_rps)
    log.info("grace loadtest: %s", summary.describe())
    if o.csv_prefix:
        # The users have stopped; give locust's CSV writer (it rewrites the files every
        # CSV_STATS_INTERVAL_SEC) one more turn so the files hold the final totals.
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)
    misses = check(summary, limits)
    for miss in misses:
        log.error("threshold missed: %s", miss)
    if misses:
        environment.process_exit_code = EXIT_THRESHOLD_MISSED
    elif limits.any:
        log.info("thresholds met")
        environment.process_exit_code = 0
