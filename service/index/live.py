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
targeting it no longer has); a `restore` (the builder's form of an upsert whose row this
version was built from) serves it as the version holds it, whatever it was. An upsert of
an ad the version does not hold waits for the next full build too (counted in
`new_waiting`). Every op is applied in seq order, so the state after a segment is the
state the feed describes at its last seq.
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
from service.index.prune import NONE, DeadCounts, Subtrees

log = logging.getLogger("grace.live")

LIVE, PAUSED, DELETED, WAITING = 0, 1, 2, 3
STATES = {"paused": PAUSED, "deleted": DELETED, "waiting": WAITING}


@dataclass(frozen=True)
class LiveState:
    """One applied point of the feed: never changed once made (stage 4 reads it unlocked)."""

    seq: int  # the catalog_seq of replies answered with it (0: the version as built)
    not_live: np.ndarray | None  # uint8 [N] per ad row (0: live); None: every ad live
    new_waiting: frozenset[int] = frozenset()  # upserted ads the version does not hold
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # rows per state (LIVE's unused)
    # trie entries below which no ad is live, sorted (service/index/prune.py): barred in
    # decoding for the batches answered at this seq
    dead_entries: np.ndarray = field(default_factory=lambda: NONE)

    @property
    def nbytes(self) -> int:
        """Memory the live changes take in this process: the per-ad array (one byte an ad
        once anything changed) and the waiting ids (~70 bytes each in a Python set)."""
        held = 0 if self.not_live is None else self.not_live.nbytes
        return held + (sys.getsizeof(self.new_waiting) + 32 * len(self.new_waiting)
                       if self.new_waiting else 0)  # fmt: skip


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
    ) -> None:
        """`built_at`: the last change the version was built with (its manifest's
        `catalog.seq`, a database snapshot's), where its live state starts; `by_id`: the
        rows in ad-id order and those ids, when already made (the SID lookup's);
        `subtrees`: the version's trie, to find the subtrees with no live ad (None: not
        tracked, `dead_entries` stays empty)."""
        self.version, self.segment_root = version, segment_root
        if by_id is None:
            order = np.argsort(ad_ids, kind="stable")
            by_id = order, ad_ids[order]
        self._order, self._sorted = by_id
        self.state = LiveState(built_at, None, counts=(len(ad_ids), 0, 0, 0))
        assert len(self._order) == len(self._sorted) == len(ad_ids)
        self._lock = threading.Lock()  # one applier at a time (the follower, a swap)
        self._dead = DeadCounts(subtrees) if subtrees is not None else None

    @property
    def seq(self) -> int:
        return self.state.seq

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
        flips: list[tuple[int, int]] = []  # (row, +1: no longer live / -1: live again)
        for c, row in zip(todo, self.rows([c.ad_id for c in todo]).tolist(), strict=True):
            applied[c.op] += 1
            if row < 0:  # an ad this version does not hold
                if c.op == "upsert":
                    new.add(c.ad_id)
                elif c.op in ("delete", "restore"):
                    new.discard(c.ad_id)
                continue
            was = state[row]
            if c.op == "pause":
                state[row] = PAUSED if was in (LIVE, PAUSED) else was
            elif c.op == "resume":
                state[row] = LIVE if was == PAUSED else was
            elif c.op == "delete":
                state[row] = DELETED
            elif c.op == "restore":  # an upsert of the row this version serves
                state[row] = LIVE
            else:  # upsert: its new row waits for the next full build
                state[row] = WAITING
            counts[was] -= 1
            counts[state[row]] += 1
            if (was == LIVE) != (state[row] == LIVE):
                flips.append((row, 1 if was == LIVE else -1))
        dead = cur.dead_entries if self._dead is None else self._dead.after(flips, cur.dead_entries)
        self.state = LiveState(todo[-1].seq, state, frozenset(new), tuple(counts), dead)  # type: ignore[arg-type]
        return applied

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
