"""The builder's change publisher (`grace builder --changes DIR`): follows a change feed
and publishes what it reads as delta segments over the CURRENT index version
(docs/DATA.md "Live changes").

Flow: `DirectoryFeed.poll` (complete records, the contract's rejects) → an upsert's row
checked by the catalog reader itself, under the index's targeting schema, so a row the
next full build would refuse is refused now, and published as `restore` when the version
already serves it as written, as `place` (contracts/placed.py) when the version can serve
its new row in place, else as the upsert that waits for the next full build
(`as_built.py`) → the rejects appended to the rejects file
(fsynced) → the valid changes written as one segment (`contracts/deltas.py`). It runs on
its own thread every `interval` (a fraction of a second), whatever a full build takes.

Restart and compaction: the feed is opened after the base's published watermark (the last
segment's last seq), so a restarted builder publishes nothing twice and loses nothing; a
crash between the rejects and the segment writes a reject line twice, never a change. A
new base (a full build published) gets its own segments, from the feed's start: every
change applies in seq order on top of the snapshot, each ad ends at its last change, and
an upsert the build folded in is a `restore` there.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import orjson

from contracts.changes import Change, ChangeError
from contracts.deltas import DELTAS, published_seq, write_segment
from contracts.index_manifest import manifest_schema, read_manifest
from contracts.placed import PLACE
from contracts.targeting_schema import TargetingSchema
from index_builder.as_built import BuiltAds
from index_builder.builder_metrics import BuilderMetrics
from index_builder.catalog import Catalog, read_catalog
from index_builder.catalog_files import CatalogError
from index_builder.change_feed import DirectoryFeed
from index_builder.postgres_source import PostgresFeed, is_postgres, shown
from index_builder.publish import current_path

log = logging.getLogger("grace.builder")


Rows = dict[int, tuple[Catalog, int]]  # an upsert's seq -> its row as the reader read it


def check_upserts(changes: list[Change], schema: TargetingSchema) -> tuple[list[ChangeError], Rows]:
    """The upserts whose rows the catalog reader refuses (removed from `changes`), as
    rejects naming the seq, the field and the reader's reason; and the rows it read."""
    rejects: list[ChangeError] = []
    rows: Rows = {}
    pending = [c for c in changes if c.op == "upsert"]
    while pending:
        # one round per occurrence: an ad upserted twice in a poll is no duplicate row
        seen: set[int] = set()
        batch = [c for c in pending if not (c.ad_id in seen or seen.add(c.ad_id))]
        with tempfile.TemporaryDirectory(prefix="grace-upserts-") as tmp:
            path = Path(tmp) / "upserts.jsonl"
            path.write_bytes(b"".join(orjson.dumps(c.row) + b"\n" for c in batch))
            try:
                catalog = read_catalog(path, progress=False, schema=schema)
            except CatalogError as exc:
                bad = _row_of(exc, batch)
                rejects.append(ChangeError("upsert", bad.seq, exc.field, exc.message))
                changes.remove(bad)
                pending.remove(bad)
                continue
        rows.update({c.seq: (catalog, j) for j, c in enumerate(batch)})
        pending = [c for c in pending if c not in batch]
    return rejects, rows


def _row_of(exc: CatalogError, batch: list[Change]) -> Change:
    """The upsert a reader error names ("line N" of the one-row-per-line file)."""
    if exc.location and exc.location.startswith("line "):
        return batch[int(exc.location.split()[1]) - 1]
    return batch[0]  # a whole-file error of a batch is its first row's (one row left)


class ChangePublisher:
    """Publishes the feed at `feed` as segments over `root`'s CURRENT version."""

    def __init__(self, feed: Path | str, root: Path, rejects: Path,
                 metrics: BuilderMetrics | None = None) -> None:  # fmt: skip
        self.feed_source = feed if is_postgres(feed) else Path(feed)
        self.root, self.rejects = Path(root), Path(rejects)
        self.metrics = metrics
        self.base: str | None = None
        self._feed: DirectoryFeed | PostgresFeed | None = None
        self._schema: TargetingSchema | None = None
        self._built: BuiltAds | None = None
        self.caught_up = time.time()  # when a poll last read the feed to its end
        if metrics is not None:
            metrics.feed_lag.set_function(lambda: time.time() - self.caught_up)

    def _open(self, base: Path) -> None:
        self.base = base.name
        for folder in (self.root / DELTAS).glob("*/"):  # the segments of pruned versions
            if folder.is_dir() and not (self.root / folder.name).is_dir():
                shutil.rmtree(folder, ignore_errors=True)
        manifest = read_manifest(base)
        self._schema = manifest_schema(manifest)
        self._built = BuiltAds(base)
        after = published_seq(self.root, self.base)
        # a snapshot holds every change up to its seq: the feed goes on after it
        held = manifest.get("catalog", {}).get("seq")
        if isinstance(held, int):
            after = held if after is None else max(after, held)
        if self._feed is not None and isinstance(self._feed, PostgresFeed):
            self._feed.close()
        if isinstance(self.feed_source, str):
            self._feed = PostgresFeed(self.feed_source, after=after)
        else:
            self._feed = DirectoryFeed(self.feed_source, after=after)
        log.info("publishing changes from %s over index %s after seq %s",
                 shown(str(self.feed_source)), self.base, after)  # fmt: skip

    def tick(self) -> int:
        """One poll; the number of changes published (0 while there is no index)."""
        base = current_path(self.root)
        if base is None:
            return 0
        if base.name != self.base:
            self._open(base)
        assert self._feed is not None and self._schema is not None and self._built is not None
        polled = self._feed.poll()
        changes = polled.changes
        bad, rows = check_upserts(changes, self._schema)
        rejects = polled.rejects + bad
        changes = [self._served(c, rows) if c.op == "upsert" else c for c in changes]
        if rejects:
            self.rejects.parent.mkdir(parents=True, exist_ok=True)
            with self.rejects.open("ab") as fh:
                fh.write(b"".join(r.to_json() for r in rejects))
                fh.flush()
            for r in rejects:
                log.warning("change rejected: %s", r)
        if changes:
            write_segment(self.root, self.base, changes)
        self.caught_up = time.time()
        if self.metrics is not None:
            self.metrics.changes_published(changes, len(rejects))
        return len(changes)

    def _served(self, c: Change, rows: Rows) -> Change:
        """How the version serves an upsert: `restore` (as built), `place` (in place) or
        `upsert` (from the next full build)."""
        assert self._built is not None and self._schema is not None
        catalog, i = rows[c.seq]
        if self._built.same(catalog, i):
            return Change(c.seq, "restore", c.ad_id)
        placed = self._built.place(catalog, i, self._schema)
        return c if placed is None else Change(c.seq, PLACE, c.ad_id, placed.to_row())

    def run(self, stop: threading.Event, interval: float) -> None:
        """Tick every `interval` seconds until `stop`; a failed tick is logged and retried
        (the feed lag grows meanwhile, which the alert watches)."""
        last_error = None
        while not stop.is_set():
            try:
                self.tick()
                last_error = None
            except (OSError, ValueError) as exc:  # a missing feed, a full disk, a bad base
                if str(exc) != last_error:
                    log.error("change publishing failed: %s; retrying", exc)
                last_error = str(exc)
            stop.wait(interval)
