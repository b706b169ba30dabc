"""Live eligibility of one index version: the changes the builder publishes over it
(delta segments, `contracts/deltas.py`) applied in the server without a rebuild
(docs/DATA.md "Live changes").

Flow: `grace builder --changes` publishes segments → `LiveEligibility.catch_up` (the
server's live follower thread, `follow`, and the rollout before a version swaps in)
reads the new ones and applies them → a new `LiveState`, copy on write: the per-ad state
array is copied, changed and swapped in by one reference assignment → stage 3 takes
`state` once per batch, bars its `dead_entries` in the GTM tables before the decode
(service/index/prune.py), and stage 4 hands its array to the post stage, which returns no ad that
is not live at that state's seq. So every request of a batch is answered at one
`catalog_seq`, which the reply names.

Per ad row: LIVE; PAUSED (pause; a resume makes it live again); DELETED (delete; a resume
does not bring it back); WAITING (upserted: its new row — targeting, SID — is served from
the next full build on and the ad is held back until then, so no ad is ever served by
targeting it no longer has); PLACED (a `place`: its new row is served in place, from the
state's placed ads, `placed.py`, and the old row is not); a `restore` (the builder's form
of an upsert whose row this version was built from) serves it as the version holds it,
whatever it was. A placed ad is paused and resumed as itself; a delete, an upsert or a
restore ends its place. A place or an upsert of an ad the version does not hold is served
in place or waits for the next full build (counted in `new_waiting`); so does a place
whose matcher rows the version's spare rows cannot widen. Every op is applied in seq
order, so the state after a segment is the state the feed describes at its last seq.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contracts.changes import SEGMENT_OPS, Change
from contracts.deltas import read_segment, segments
from contracts.placed import PLACE, PlacedAd
from service.index.placed import Overlay, Placing, Widened
from service.index.prune import NONE, DeadCounts, Subtrees

log = logging.getLogger("grace.live")

LIVE, PAUSED, DELETED, WAITING, PLACED = 0, 1, 2, 3, 4
STATES = {"paused": PAUSED, "deleted": DELETED, "waiting": WAITING}  # held back
PLACED_BYTES = 2048  # a placed ad's memory in the live state (LiveState.nbytes)


@dataclass(frozen=True)
class LiveState:
    """One applied point of the feed: never changed once made (stage 4 reads it unlocked)."""

    seq: int  # the catalog_seq of replies answered with it (0: the version as built)
    not_live: np.ndarray | None  # uint8 [N] per ad row (0: live); None: every ad live
    new_waiting: frozenset[int] = frozenset()  # upserted ads the version does not hold
    counts: tuple[int, ...] = (0, 0, 0, 0, 0)  # rows per state (LIVE's unused)
    # trie entries below which no ad is live, sorted (service/index/prune.py): barred in
    # decoding for the batches answered at this seq
    dead_entries: np.ndarray = field(default_factory=lambda: NONE)
    # upserts served in place (placed.py): ad id -> (its row, paused); the live ones'
    # post stage; the matcher rows widened for them
    placed: dict[int, tuple[PlacedAd, bool]] = field(default_factory=dict)
    overlay: Overlay | None = None
    widened: Widened = field(default_factory=Widened)

    @property
    def nbytes(self) -> int:
        """Memory the live changes take in this process: the per-ad array (one byte an ad
        once anything changed), the waiting ids (~70 bytes each in a Python set) and the
        placed ads (~2 KB each: their rows, the Python objects and the overlay's columns;
        measured at 100,000 placed ads)."""
        held = 0 if self.not_live is None else self.not_live.nbytes
        waiting = sys.getsizeof(self.new_waiting) + 32 * len(self.new_waiting)
        return held + PLACED_BYTES * len(self.placed) + (waiting if self.new_waiting else 0)


class LiveEligibility:
    """The live state of one version's N ads (`ad_ids`, its row order), from the segments
    under `segment_root` / deltas / `version` (None: nothing to follow)."""

    def __init__(
        self,
        ad_ids: np.ndarray,
        version: str,
        segment_root: Path | None,
        built_at: int = 0,
        *,
        by_id: tuple[np.ndarray, np.ndarray] | None = None,
        subtrees: Subtrees | None = None,
        placing: Placing | None = None,
    ) -> None:
        """`built_at`: the last change the version was built with (its manifest's
        `catalog.seq`, a database snapshot's), where its live state starts; `by_id`: the
        rows in ad-id order and those ids, when already made (the SID lookup's);
        `subtrees`: the version's trie, to find the subtrees with no live ad (None: not
        tracked, `dead_entries` stays empty); `placing`: what serves upserts in place
        (None: every upsert waits for the next full build)."""
        self.version, self.segment_root = version, segment_root
        if by_id is None:
            order = np.argsort(ad_ids, kind="stable")
            by_id = order, ad_ids[order]
        self._order, self._sorted = by_id
        self.state = LiveState(built_at, None, counts=(len(ad_ids), 0, 0, 0, 0))
        assert len(self._order) == len(self._sorted) == len(ad_ids)
        self._lock = threading.Lock()  # one applier at a time (the follower, a swap)
        self._dead = DeadCounts(subtrees) if subtrees is not None else None
        self._placing = placing

    @property
    def seq(self) -> int:
        return self.state.seq

    @property
    def spare_rows(self) -> int:
        """Spare matcher rows left for upserts served in place (0: none to place with)."""
        return 0 if self._placing is None else self._placing.spare.free

    def rows(self, ad_ids: Sequence[int]) -> np.ndarray:
        """Each ad id's row, -1 where the version does not hold it."""
        ids = np.asarray(ad_ids, dtype=np.int64)
        if not len(self._sorted):
            return np.full(len(ids), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
        return np.where(self._sorted[at] == ids, self._order[at], -1)

    def apply(self, changes: Sequence[Change]) -> dict[str, int]:
        """Apply the changes above the current seq, in seq order (a new `state`); the
        number applied by op."""
        with self._lock:
            return self._apply(changes)

    def _apply(self, changes: Sequence[Change]) -> dict[str, int]:
        cur = self.state
        todo = [c for c in changes if c.seq > cur.seq]
        applied = dict.fromkeys(SEGMENT_OPS, 0)
        if not todo:
            return applied
        n = len(self._sorted)
        state = np.zeros(n, np.uint8) if cur.not_live is None else cur.not_live.copy()
        new, counts = set(cur.new_waiting), list(cur.counts)
        placed = dict(cur.placed)
        flips: list[tuple[int, int]] = []  # (row, +1: no longer live / -1: live again)
        moved: list[tuple[int, int]] = []  # (leaf, +1: a placed ad live there / -1: not)

        touched: set[int] = set()  # the ads whose place changed

        def unplace(ad_id: int) -> None:
            touched.add(ad_id)
            gone = placed.pop(ad_id, None)
            if gone is not None and not gone[1]:
                moved.append((gone[0].leaf, -1))

        for c, row in zip(todo, self.rows([c.ad_id for c in todo]).tolist(), strict=True):
            applied[c.op] += 1
            op = c.op
            if op in ("pause", "resume") and c.ad_id in placed:  # the placed row's own state
                ad, paused = placed[c.ad_id]
                if paused != (op == "pause"):
                    touched.add(c.ad_id)
                    placed[c.ad_id] = (ad, op == "pause")
                    moved.append((ad.leaf, -1 if op == "pause" else 1))
                continue
            if op in ("delete", "restore", "upsert", PLACE):
                unplace(c.ad_id)
            if op == PLACE:
                ad = self._place(c)
                if ad is None:  # not this version's to serve in place: wait as an upsert
                    op = "upsert"
                else:
                    placed[c.ad_id] = (ad, False)
                    moved.append((ad.leaf, 1))
                    new.discard(c.ad_id)
            if row < 0:  # an ad this version does not hold
                if op == "upsert":
                    new.add(c.ad_id)
                elif op in ("delete", "restore"):
                    new.discard(c.ad_id)
                continue
            was = state[row]
            if op == "pause":
                state[row] = PAUSED if was in (LIVE, PAUSED) else was
            elif op == "resume":
                state[row] = LIVE if was == PAUSED else was
            elif op == "delete":
                state[row] = DELETED
            elif op == "restore":  # an upsert of the row this version serves
                state[row] = LIVE
            else:  # upsert: its new row waits for the next full build; place: served apart
                state[row] = PLACED if op == PLACE else WAITING
            counts[was] -= 1
            counts[state[row]] += 1
            if (was == LIVE) != (state[row] == LIVE):
                flips.append((row, 1 if was == LIVE else -1))
        dead = cur.dead_entries
        if self._dead is not None:
            dead = self._dead.after(flips, dead, moved)
        overlay = cur.overlay
        if moved and self._placing is not None:  # the live placed ads changed
            added, removed = _changed(cur.placed, placed, touched)
            overlay = self._placing.overlay(overlay, added, removed)
        widened = cur.widened if self._placing is None else self._placing.widened
        self.state = LiveState(todo[-1].seq, state, frozenset(new), tuple(counts), dead,
                               placed, overlay, widened)  # fmt: skip
        return applied

    def _place(self, c: Change) -> PlacedAd | None:
        """A `place` record's ad, its matcher rows widened; None when this version cannot
        serve it in place (no placing, spare rows spent)."""
        if self._placing is None or c.row is None:
            return None
        ad = self._placing.read(c.ad_id, c.row)  # ValueError: a damaged segment
        return ad if self._placing.widen(ad) else None

    def catch_up(self) -> dict[str, int]:
        """Apply the segments published since `seq`; the number applied by op."""
        total = dict.fromkeys(SEGMENT_OPS, 0)
        if self.segment_root is None:
            return total
        with self._lock:
            for seg in segments(self.segment_root, self.version):
                if seg.last > self.state.seq:
                    for op, n in self._apply(read_segment(seg)).items():
                        total[op] += n
        return total


def _changed(
    before: dict[int, tuple[PlacedAd, bool]],
    after: dict[int, tuple[PlacedAd, bool]],
    touched: set[int],
) -> tuple[list[PlacedAd], list[int]]:
    """Of the ads `touched`, the placed ads live in `after` and not (as they are) in
    `before`, and the ids live in `before` and not (as they were) in `after`."""

    def live(placed: dict[int, tuple[PlacedAd, bool]], a: int) -> PlacedAd | None:
        got = placed.get(a)
        return None if got is None or got[1] else got[0]

    added, removed = [], []
    for a in sorted(touched):
        old, new = live(before, a), live(after, a)
        if old is not new:
            if old is not None:
                removed.append(a)
            if new is not None:
                added.append(new)
    return added, removed


def follow(
    current: Callable[[], LiveEligibility | None],
    stop: threading.Event,
    interval: float,
    on_apply: Callable[[LiveEligibility, dict[str, int]], None] = lambda live, ops: None,
) -> None:
    """The server's live follower: every `interval` seconds, the served version's new
    segments applied (`current()`: its `LiveEligibility`, None before one serves); a
    failing read is logged once and retried."""
    fault = None
    while not stop.wait(interval):
        live = current()
        if live is None:
            continue
        try:
            applied = live.catch_up()
            if any(applied.values()):
                on_apply(live, applied)
            fault = None
        except (OSError, ValueError) as exc:  # an unreadable or damaged segment
            if repr(exc) != fault:
                log.error("live changes of index %s not applied: %s; retrying", live.version,
                          exc)  # fmt: skip
            fault = repr(exc)
