"""The rollout of one serving process, wired from its settings (`service/app.py` calls
`build_rollout` at start-up): the followers of the model repository and the index root
(`sources.py`), the metrics each swap moves, the host-wide swap lock (`host_lock.py`) and
the pace of a swap beside serving (`service/pace.py`, `rollout_share`), and the series of
the served index's live changes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from contracts.changes import SEGMENT_OPS
from service.index.live import STATES, LiveEligibility, LiveState
from service.index.loaded import LoadedIndex
from service.metrics import Metrics
from service.pace import Pace
from service.pipeline.runtime import ModelRuntime, Serving, ServingHolder
from service.pipeline.stages import Stages
from service.rollout.host_lock import host_lock, swap_lock_path
from service.rollout.rollout import Rollout
from service.rollout.sources import index_follower, model_follower
from service.settings import ServerSettings

log = logging.getLogger("grace.rollout")


def build_rollout(
    settings: ServerSettings, stages: Stages, serving: ServingHolder, metrics: Metrics, device: str
) -> Rollout:
    """The server's rollout, wired from `settings` (module docstring)."""

    def served(kind: str) -> Callable[[], str | None]:
        return lambda: getattr(serving.current, kind).version if serving.ready else None

    def swapped(new: Serving, old: Serving | None) -> None:  # the first load is no swap
        if old is None or new.model is not old.model:
            if old is not None:
                metrics.model_swaps.inc()
            m = new.model
            metrics.set_model(m.version, m.model_version, m.sid_space, m.loaded_at, m.dtype)
        if old is None or new.index is not old.index:
            if old is not None:
                metrics.swaps.inc()
            metrics.set_index(new.index.version, new.index.manifest.get("created"),
                              new.index.loaded_at)  # fmt: skip

    failures = {"model": metrics.model_swap_failures, "index": metrics.swap_failures}
    backoff = max(settings.index_poll_seconds, 1.0)
    # the servers of one host following these roots (the workers of `--workers N`, each a
    # server of its own with workers = 1) swap one after the other
    lock = swap_lock_path(Path(settings.model_dir), Path(settings.index_root))
    one_at_a_time = functools.partial(host_lock, lock)
    # a swap yields to the requests it serves beside; start-up (nothing served) is not paced
    pace = Pace(settings.rollout_share, active=lambda: serving.ready, device=device)

    def prepare(model: ModelRuntime, index: LoadedIndex) -> None:
        pace.begin()
        slept = pace.slept
        model.prepare(index, tuple(settings.beams), pace, settings.ladder())
        if pace.slept > slept:
            log.info("model %s, index %s: the prepare rested %.1f s beside serving "
                     "(rollout_share %.2f)", model.version, index.version, pace.slept - slept,
                     settings.rollout_share)  # fmt: skip

    def current_live() -> LiveState:
        return serving.current.index.live.state if serving.ready else LiveState(0, None)

    metrics.catalog_seq.set_function(lambda: current_live().seq)
    for state, at in STATES.items():
        metrics.live_ads.labels(state).set_function(lambda at=at: current_live().counts[at])
    metrics.live_new_waiting.set_function(lambda: len(current_live().new_waiting))
    metrics.live_bytes.set_function(lambda: current_live().nbytes)
    metrics.live_placed.set_function(
        lambda: sum(not paused for _, paused in current_live().placed.values())
    )
    metrics.live_spare_rows.set_function(
        lambda: serving.current.index.live.spare_rows if serving.ready else 0
    )
    metrics.live_pruned.set_function(lambda: len(current_live().dead_entries))
    for op in SEGMENT_OPS:
        metrics.live_applied.labels(op)

    def applied(live: LiveEligibility, ops: dict[str, int]) -> None:
        for op, n in ops.items():
            metrics.live_applied.labels(op).inc(n)

    return Rollout(
        model_follower(Path(settings.model_dir), stages, settings.dtype, served=served("model"),
                       on_failure=lambda v, e: failures["model"].labels("invalid").inc(),
                       backoff_seconds=backoff, pace=pace),
        index_follower(Path(settings.index_root), device, served=served("index"),
                       on_failure=lambda v, e: failures["index"].labels("invalid").inc(),
                       backoff_seconds=backoff),
        serving,
        device=device,
        poll_seconds=settings.index_poll_seconds,
        prepare=prepare,
        on_swap=swapped,
        on_incompatible=lambda kind, version: failures[kind].labels("incompatible").inc(),
        one_at_a_time=one_at_a_time,
        on_live=applied,
    )  # fmt: skip
