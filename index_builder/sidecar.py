"""The index builder sidecar loop (`grace builder`): rebuild when the catalog changes.

Runs beside each server (same pod, shared volume). Every `interval` seconds it
fingerprints the catalog; when it differs from the one the CURRENT index was built from,
it builds and publishes a new version (`build.build_index`, atomic). A failed build
publishes nothing, is logged with its reason and is not retried until the catalog
changes again — a build whose written version fails validation (`IndexValidationError`)
is such a failure; a tokenizer that does not exist yet is waited for (no failure).
SIGTERM/SIGINT stop the loop cleanly: a build in progress is abandoned
at its next phase boundary, its temp dir removed, CURRENT untouched.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from contracts.index_format import IndexFormatError, read_manifest
from index_builder.build import BuildCancelled, BuildError, build_index
from index_builder.catalog import CatalogError, catalog_fingerprint
from index_builder.kway import KwaySpec
from index_builder.publish import PublishError, current_path
from index_builder.tokenizer import SIDTokenizer
from index_builder.validate import IndexValidationError

log = logging.getLogger("grace.builder")

# what a build can fail with and the sidecar survives (IndexValidationError: the written
# version failed the publisher's validation; it is a ValueError, named for the reader)
_BUILD_FAULTS = (CatalogError, BuildError, PublishError, IndexValidationError, OSError, ValueError)


@dataclass(frozen=True)
class BuilderConfig:
    catalog: Path
    out: Path
    interval: float = 60.0
    tokenizer: Path | None = None
    sid_space: str | None = None  # instead of a tokenizer: the catalog's named SID space
    kway: KwaySpec | None = None
    keep: int = 3
    max_builds: int | None = None  # stop after this many successful builds (tests, one-shots)


@dataclass
class BuilderStats:
    builds: int = 0
    failures: int = 0
    checks: int = 0


def _published_fingerprint(root: Path) -> str | None:
    path = current_path(root)
    if path is None:
        return None
    try:
        return read_manifest(path).get("catalog", {}).get("fingerprint")
    except IndexFormatError:
        return None


def run_builder(cfg: BuilderConfig, stop: threading.Event | None = None) -> BuilderStats:
    """Loop until `stop` is set (or max_builds reached); returns what it did."""
    stop = stop or threading.Event()
    stats = BuilderStats()
    built = _published_fingerprint(cfg.out)
    failed: str | None = None
    log.info("builder watching %s -> %s every %.1fs", cfg.catalog, cfg.out, cfg.interval)
    while not stop.is_set():
        stats.checks += 1
        try:
            fingerprint = catalog_fingerprint(cfg.catalog)
        except CatalogError as exc:
            log.error("%s; waiting", exc)
            fingerprint = None
        if cfg.tokenizer is not None and not SIDTokenizer.ready(cfg.tokenizer):
            # e.g. the server's first start is still training the model that owns it: not
            # a failure, so the same catalog is built as soon as the tokenizer appears
            log.info("waiting for the SID tokenizer at %s", cfg.tokenizer)
            fingerprint = None
        if fingerprint is not None and fingerprint not in (built, failed):
            try:
                version, report = build_index(
                    cfg.catalog,
                    cfg.out,
                    tokenizer_path=cfg.tokenizer,
                    sid_space=cfg.sid_space,
                    kway=cfg.kway,
                    keep=cfg.keep,
                    progress=False,
                    should_stop=stop.is_set,
                )
                built, failed = fingerprint, None
                stats.builds += 1
                log.info(
                    "build %d ok: version %s in %.2fs",
                    stats.builds,
                    version,
                    report.seconds.get("total", 0.0),
                )
            except BuildCancelled as exc:
                log.info("build abandoned: %s", exc)
                break
            except _BUILD_FAULTS as exc:
                failed = fingerprint
                stats.failures += 1
                reason = exc.summary if isinstance(exc, IndexValidationError) else exc
                log.error("build failed, nothing published (CURRENT unchanged): %s", reason)
        if cfg.max_builds is not None and stats.builds >= cfg.max_builds:
            break
        stop.wait(cfg.interval)
    log.info("builder stopped: %d builds, %d failures", stats.builds, stats.failures)
    return stats


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (main thread only)."""

    def handler(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
