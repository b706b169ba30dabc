"""The index builder sidecar loop (`grace builder`): rebuild when the catalog or the
model's SID space changes (docs/OPERATIONS.md).

Runs beside each server on a shared volume. At start and then every `interval` seconds it
fingerprints the catalog and, when that differs from the CURRENT index's (or there is no
index), builds and publishes a version (`build.build_index`). SIDs come from a fixed
tokenizer, a named SID space, the catalog alone, or — following the model (`grace builder
--model`) — `sids`, asked at every check for the served model's SID space (`SidChoice`);
a model of a new SID space then also triggers a build, and the server swaps the pair in
together. A failed build publishes nothing and is not retried until its inputs change;
a tokenizer or model that does not exist yet is waited for. SIGTERM/SIGINT abandon a
build at its next phase boundary, CURRENT untouched. With `changes` a thread of its own
publishes the change feed as delta segments over the CURRENT version
(`change_publisher.py`), a fraction of a second behind the feed whatever a build takes.

No `service` or `cli` import (tests/test_layers.py): reading a model is the caller's
`sids` (cli/builder.py).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contracts.deltas import DELTAS
from contracts.index_manifest import IndexFormatError, read_manifest
from contracts.index_validation import IndexValidationError
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder.build import BuildCancelled, BuildError, BuildReport, build_index
from index_builder.builder_metrics import BuilderMetrics
from index_builder.catalog import CatalogError, source_fingerprint
from index_builder.change_publisher import ChangePublisher
from index_builder.kway import KwaySpec
from index_builder.postgres_source import is_postgres, shown, snapshot
from index_builder.publish import PublishError, current_path
from index_builder.tokenizer import SIDTokenizer

log = logging.getLogger("grace.builder")
SNAPSHOT = ".catalog-snapshot.jsonl"  # a database catalog's last snapshot, in the index root

# what a build can fail with and the sidecar survives (IndexValidationError, a ValueError,
# named for the reader: the written version failed the publisher's validation)
_BUILD_FAULTS = (CatalogError, BuildError, PublishError, IndexValidationError, OSError, ValueError)


@dataclass(frozen=True)
class SidChoice:
    """How to assign SIDs for the model being served: `key` is its SID space
    (contracts/sid_space.py: a tokenizer fingerprint or `sid-space:<name>`), the value
    the index's manifest must carry; then either the model's SID tokenizer or the name
    of its SID space (`build_index`'s `tokenizer_path` / `sid_space`)."""

    key: str
    tokenizer_path: Path | None = None
    sid_space: str | None = None

    def __post_init__(self) -> None:
        if (self.tokenizer_path is None) == (self.sid_space is None):
            raise ValueError("a SID choice names a SID tokenizer or a SID space, one of them")


@dataclass(frozen=True)
class BuilderConfig:
    catalog: Path | str  # a file or directory, or a postgresql:// table URL
    out: Path
    interval: float = 60.0
    tokenizer: Path | None = None
    sid_space: str | None = None  # instead of a tokenizer: the catalog's named SID space
    # instead of both: follow the model; asked at every check, None = no model yet (wait)
    sids: Callable[[], SidChoice | None] | None = None
    kway: KwaySpec | None = None
    keep: int = 3
    max_builds: int | None = None  # stop after this many successful builds (tests, one-shots)
    schema: TargetingSchema = DEFAULT  # the targeting schema to read and encode by
    metrics: BuilderMetrics | None = None  # the sidecar's Prometheus series, when served
    bad_row_budget: float = 0.0  # the share of bad catalog rows a build leaves out
    changes: Path | str | None = None  # a change feed (directory or postgresql://) to publish
    rejects: Path | None = None  # its rejected records (default <out>/deltas/rejects.jsonl)
    changes_interval: float = 0.2  # seconds between polls of the feed

    def __post_init__(self) -> None:
        if self.sids is not None and (self.tokenizer is not None or self.sid_space is not None):
            raise ValueError("follow the model (sids) or give a tokenizer or SID space, not both")


@dataclass
class BuilderStats:
    builds: int = 0
    failures: int = 0
    checks: int = 0


# what an index was built from: (catalog fingerprint, SID-space key); the key is None when
# the sidecar does not follow a model (then only the catalog decides)
_Built = tuple[str | None, str | None]


def _published(root: Path) -> _Built:
    """The catalog fingerprint and SID-space key of the CURRENT index (None: unknown)."""
    path = current_path(root)
    if path is None:
        return None, None
    try:
        manifest = read_manifest(path)
    except IndexFormatError:
        return None, None
    key = manifest.get("tokenizer_fingerprint")
    return manifest.get("catalog", {}).get("fingerprint"), key if isinstance(key, str) else None


class _Notes:
    """Logs a waiting or error message once, until a different one (or none) comes."""

    def __init__(self) -> None:
        self.last: str | None = None

    def say(self, level: int, message: str) -> None:
        if message != self.last:
            log.log(level, message)
        self.last = message

    def clear(self) -> None:
        self.last = None


@dataclass(frozen=True)
class _Plan:
    """What one check builds with; `key` None: a fixed source, only the catalog decides."""

    key: str | None
    tokenizer_path: Path | None
    sid_space: str | None


def _plan(cfg: BuilderConfig, notes: _Notes) -> _Plan | None:
    """The SIDs to build with now: the model's (`cfg.sids`) or the fixed tokenizer / SID
    space / catalog of `cfg`; None while waiting (logged once)."""
    if cfg.sids is None:
        if cfg.tokenizer is not None and not SIDTokenizer.ready(cfg.tokenizer):
            # e.g. the server's first start is still training the model that owns it: not
            # a failure, so the same catalog is built as soon as the tokenizer appears
            notes.say(logging.INFO, f"waiting for the SID tokenizer at {cfg.tokenizer}")
            return None
        return _Plan(None, cfg.tokenizer, cfg.sid_space)
    try:
        choice = cfg.sids()
    except (OSError, ValueError) as exc:  # an unreadable model: not an index build failure
        notes.say(logging.ERROR, f"cannot read the model's SID space: {exc}; waiting")
        return None
    if choice is None:
        notes.say(logging.INFO, "waiting for a model to follow (none published yet)")
        return None
    if choice.tokenizer_path is not None and not SIDTokenizer.ready(choice.tokenizer_path):
        notes.say(logging.INFO, f"waiting for the model's tokenizer at {choice.tokenizer_path}")
        return None
    return _Plan(choice.key, choice.tokenizer_path, choice.sid_space)


def run_builder(cfg: BuilderConfig, stop: threading.Event | None = None) -> BuilderStats:
    """Loop until `stop` is set (or max_builds reached); returns what it did."""
    stop = stop or threading.Event()
    stats = BuilderStats()
    published = _published(cfg.out)
    built: _Built = published if cfg.sids is not None else (published[0], None)
    failed: _Built | None = None
    notes = _Notes()
    metrics = cfg.metrics
    if metrics is not None and published[0] is not None:  # the CURRENT index's publication
        metrics.last_success.set(current_path(cfg.out).stat().st_mtime)
    log.info("builder watching %s -> %s: a check now, then every %.1f s",
             shown(str(cfg.catalog)), cfg.out, cfg.interval)  # fmt: skip
    publishing = threading.Event()  # cleared: the change publisher stops
    publisher = None
    if cfg.changes is not None:
        rejects = cfg.rejects or cfg.out / DELTAS / "rejects.jsonl"
        publisher = threading.Thread(
            target=ChangePublisher(cfg.changes, cfg.out, rejects, metrics).run,
            args=(publishing, cfg.changes_interval), name="grace-changes", daemon=True,
        )  # fmt: skip
        publisher.start()
    while not stop.is_set():
        stats.checks += 1
        try:
            fingerprint = source_fingerprint(cfg.catalog, cfg.schema)
        except CatalogError as exc:
            log.error("%s; waiting", exc)
            fingerprint = None
        if metrics is not None:
            metrics.catalog_unreadable.set(fingerprint is None)
        plan = _plan(cfg, notes)
        if plan is not None and fingerprint is not None:
            notes.clear()
            want: _Built = (fingerprint, plan.key)
            if want == built and stats.checks == 1:  # else nothing is said until a change
                log.info("index %s is up to date: nothing to build", current_path(cfg.out).name)
            if want not in (built, failed):
                if plan.key is not None and fingerprint == built[0]:
                    log.info("the model's SID space %s differs from the index's %s: rebuilding",
                             plan.key, built[1])  # fmt: skip
                try:
                    version, report = _build(cfg, plan, stop)
                    built, failed = want, None
                    stats.builds += 1
                    if metrics is not None:
                        metrics.built()
                        metrics.rows_rejected.set(report.rejected_rows)
                    seconds = report.seconds.get("total", 0.0)
                    log.info("build %d ok: version %s in %.2fs", stats.builds, version, seconds)
                except BuildCancelled as exc:
                    log.info("build abandoned: %s", exc)
                    break
                except _BUILD_FAULTS as exc:
                    failed = want
                    stats.failures += 1
                    if metrics is not None:
                        metrics.failed(exc)
                    reason = exc.summary if isinstance(exc, IndexValidationError) else exc
                    log.error("build failed, nothing published (CURRENT unchanged): %s", reason)
        if cfg.max_builds is not None and stats.builds >= cfg.max_builds:
            break
        stop.wait(cfg.interval)
    if publisher is not None:
        publishing.set()
        publisher.join()
    log.info("builder stopped: %d builds, %d failures", stats.builds, stats.failures)
    return stats


def _build(cfg: BuilderConfig, plan: _Plan, stop: threading.Event) -> tuple[str, BuildReport]:
    """One build of `cfg`'s catalog; a database table's from a snapshot of it
    (`postgres_source.snapshot`), which records the last change it holds."""
    catalog, snap = cfg.catalog, {}
    if is_postgres(cfg.catalog):
        url, catalog = str(cfg.catalog), Path(cfg.out) / SNAPSHOT
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        seq = snapshot(url, catalog)
        snap = {"catalog_seq": seq, "source": shown(url),
                "fingerprint": source_fingerprint(url, cfg.schema, seq)}  # fmt: skip
    return build_index(
        catalog,
        cfg.out,
        tokenizer_path=plan.tokenizer_path,
        sid_space=plan.sid_space,
        kway=cfg.kway,
        keep=cfg.keep,
        progress=False,
        should_stop=stop.is_set,
        schema=cfg.schema,
        bad_row_budget=cfg.bad_row_budget,
        **snap,
    )


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (main thread only)."""

    def handler(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
