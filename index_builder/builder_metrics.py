"""The index builder sidecar's own Prometheus metrics (`grace builder --metrics-port`,
docs/ops/monitoring.md "The builder"): what it built, what failed and why, when it last
published, whether it can read its catalog, and with `--changes` the changes it published
and rejected and how far behind the feed it is — so a build that keeps failing is a
metric, not only a log line. `sidecar.run_builder` records them; the server's metrics
(`service/metrics.py`) are another process's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from contracts.changes import SEGMENT_OPS, Change
from contracts.index_validation import IndexValidationError
from index_builder.build import BuildError
from index_builder.catalog import CatalogError
from index_builder.publish import PublishError

# failure reason label -> what raised it (the first match; anything else: "other")
REASONS: tuple[tuple[str, type[BaseException]], ...] = (
    ("catalog", CatalogError),  # a bad row or file: the catalog must be fixed
    ("validation", IndexValidationError),  # the written version failed validation
    ("publish", PublishError),
    ("build", BuildError),  # e.g. SIDs missing and no tokenizer
    ("io", OSError),  # a full disk, a permission
)


def reason_of(exc: BaseException) -> str:
    return next((name for name, kind in REASONS if isinstance(exc, kind)), "other")


class BuilderMetrics:
    """The sidecar's series, on a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.builds = Counter("grace_builder_builds", "Index builds attempted, by result "
                              "(ok: published; failed: nothing published).", ["result"],
                              registry=r)  # fmt: skip
        self.failures = Counter("grace_builder_failures", "Failed builds by reason.",
                                ["reason"], registry=r)  # fmt: skip
        self.last_success = Gauge("grace_builder_last_success_timestamp_seconds",
                                  "Unix time the CURRENT index was published (0: none yet).",
                                  registry=r)  # fmt: skip
        self.last_failure = Gauge("grace_builder_last_failure_timestamp_seconds",
                                  "Unix time of the last failed build (0: none).",
                                  registry=r)  # fmt: skip
        self.catalog_unreadable = Gauge("grace_builder_catalog_unreadable",
                                        "1 while the catalog cannot be read (missing, "
                                        "unreadable): nothing is built.", registry=r)  # fmt: skip
        self.rows_rejected = Gauge("grace_builder_catalog_rows_rejected",
                                   "Bad catalog rows the last published build left out (within "
                                   "the bad-row budget; in catalog-rejects.jsonl).",
                                   registry=r)  # fmt: skip
        self.changes = Counter("grace_builder_changes_published", "Live changes published "
                               "in delta segments, by op.", ["op"], registry=r)  # fmt: skip
        self.rejected = Counter("grace_builder_changes_rejected", "Change records rejected "
                                "(written to the rejects file).", registry=r)  # fmt: skip
        self.published_seq = Gauge("grace_builder_published_seq", "The last change seq "
                                   "published over the CURRENT index.", registry=r)  # fmt: skip
        self.feed_lag = Gauge("grace_builder_feed_lag_seconds", "Seconds since the change "
                              "feed was last read to its end (grows while publishing "
                              "fails).", registry=r)  # fmt: skip
        for op in SEGMENT_OPS:
            self.changes.labels(op)
        for result in ("ok", "failed"):
            self.builds.labels(result)
        for name, _ in (*REASONS, ("other", Exception)):
            self.failures.labels(name)

    def serve(self, port: int, host: str) -> int:
        """Serve /metrics on `host:port` (0: any free port) from a daemon thread; the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])

    def built(self, published_at: float | None = None) -> None:
        self.builds.labels("ok").inc()
        self.last_success.set(published_at or time.time())

    def failed(self, exc: BaseException) -> None:
        self.builds.labels("failed").inc()
        self.failures.labels(reason_of(exc)).inc()
        self.last_failure.set(time.time())

    def changes_published(self, changes: Sequence[Change], rejected: int) -> None:
        for c in changes:
            self.changes.labels(c.op).inc()
        if changes:
            self.published_seq.set(changes[-1].seq)
        self.rejected.inc(rejected)
