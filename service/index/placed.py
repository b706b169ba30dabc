"""Upserts served in place (contracts/placed.py) in the server: the GTM matcher rows on a
placed ad's trie path widened to cover its bits, and the post stage over the placed ads
(docs/DATA.md "Live changes", issue #48).

Flow: `LiveEligibility.apply` (live.py) reads a `place` record → `Spare.widen`: each entry
on the ad's path whose rows do not cover the ad's bitmask and Bloom bits gets new rows —
its rows ORed with the ad's — written to spare rows at the end of each matcher table
(copy on write: a row that dedup shares between entries is never changed) → the state's
`Widened` (entry → rows), brought to the device by stage 3 (`prune.Pruning.sync`) before
a batch's decode. Widening only adds bits and a version's rows only ever widen, so a batch
that sees a row wider than its seq needs stays sound; a narrowing needs no matcher change.
Spare rows are a fixed number per version (`DEFAULT_SPARE_ROWS`, `LoadedIndex.from_arrays`'
`spare_rows`); once spent, a place that needs one waits for the next full build like an
upsert (`grace_live_ads{state="waiting"}`, or `grace_live_new_ads_waiting` for an ad the
version does not hold).

→ `Overlay`: the live placed ads as a small ad index with its own C++ post stage (the same
exact rules); stage 4 runs it over the batch's generated leaves beside the version's and
merges the two by beam score. The ad's old row is not live meanwhile (`PLACED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.index_arrays import AdArrays, TrieArrays
from contracts.placed import PlacedAd
from contracts.targeting_codec import AdRules, Ragged
from contracts.targeting_schema import TargetingSchema
from service.index.prune import Subtrees, Widened
from service.post import PostRequest, PostResult, PostStage
from service.post.expand import lists_of

DEFAULT_SPARE_ROWS = 16_384  # per matcher table: 1.2 MB of device memory at the default schema


class Spare:
    """The spare matcher rows of one version (appended after its tables and their zero
    row, `prune.with_spare_rows`), handed out as placed ads need them. Changed by one
    applier at a time (`LiveEligibility`'s lock)."""

    def __init__(self, trie: TrieArrays, rows: int) -> None:
        self._trie = trie
        self.base = (len(trie.bitmask_table) + 1, len(trie.bloom_table) + 1)
        self.capacity = rows
        self._new = (np.zeros((rows, trie.bitmask_table.shape[1]), np.uint64),
                     np.zeros((rows, trie.bloom_table.shape[1]), np.uint64))  # fmt: skip
        self.used = [0, 0]
        self._at: dict[int, tuple[int, int]] = {}  # entry -> its (bitmask, bloom) rows
        self.state = Widened()

    @property
    def free(self) -> int:
        return self.capacity - max(self.used)

    def _row(self, table: int, row: int) -> np.ndarray:
        base = self.base[table]
        if row >= base:
            return self._new[table][row - base]
        return (self._trie.bitmask_table, self._trie.bloom_table)[table][row]

    def widen(self, path: Sequence[int], bitmask: np.ndarray, bloom: np.ndarray) -> bool:
        """Widen the rows of `path`'s entries to cover the ad's bits; False (nothing
        changed) when the spare rows run out."""
        todo: list[tuple[int, int, np.ndarray | None, np.ndarray | None]] = []
        need = [0, 0]
        for e in path:
            rows = self._at.get(e, (int(self._trie.bitmask_index[e]),
                                    int(self._trie.bloom_index[e])))  # fmt: skip
            wider: list[np.ndarray | None] = []
            for t, bits in enumerate((bitmask, bloom)):
                cur = self._row(t, rows[t])
                new = cur | bits
                wider.append(None if np.array_equal(new, cur) else new)
                need[t] += wider[-1] is not None
            if wider[0] is not None or wider[1] is not None:
                todo.append((e, *rows, *wider))  # type: ignore[arg-type]
        if any(self.used[t] + need[t] > self.capacity for t in (0, 1)):
            return False
        for e, bm_row, bl_row, bm, bl in todo:
            at = [bm_row, bl_row]
            for t, new in enumerate((bm, bl)):
                if new is not None:
                    self._new[t][self.used[t]] = new
                    at[t] = self.base[t] + self.used[t]
                    self.used[t] += 1
            self._at[e] = (at[0], at[1])
        if todo:
            entries = np.array(sorted(self._at), dtype=np.int64)
            rows = np.array([self._at[e] for e in entries.tolist()], dtype=np.int64)
            new = self._new[0][: self.used[0]], self._new[1][: self.used[1]]
            self.state = Widened(entries, rows[:, 0], rows[:, 1], *new)
        return True


@dataclass(frozen=True)
class Columns:
    """Placed ads as columns, in (leaf, ad id) order: what `Overlay` serves. Changed by
    whole-array steps (`take`, `plus`), so a segment's few changes cost a few passes over
    the placed ads, never a Python loop over them."""

    leaf: np.ndarray  # int64 [K]: the version's leaf of each ad
    ad_id: np.ndarray  # int64 [K]
    bitmask: np.ndarray  # uint64 [K, words]
    cleared: np.ndarray  # uint64 [K, words]: the bits exclusions cleared
    campaign: np.ndarray  # int64 [K]
    advertiser: np.ndarray  # int64 [K]
    include: dict[str, Ragged]  # per set attribute
    exclude: dict[str, Ragged]

    @classmethod
    def of(cls, ads: Sequence[PlacedAd], names: Sequence[str], words: int) -> Columns:
        """A few placed ads (one segment's) as columns, in their order."""

        def owners(key: str) -> np.ndarray:
            return np.array([getattr(p, key) for p in ads], dtype=np.int64)

        def rows(key: str) -> np.ndarray:
            return np.array([getattr(p, key) for p in ads], dtype=np.uint64).reshape(-1, words)

        lists = {kind: {n: Ragged.from_lists([getattr(p, kind).get(n, ()) for p in ads])
                        for n in names} for kind in ("include", "exclude")}  # fmt: skip
        return cls(owners("leaf"), owners("ad_id"), rows("bitmask"), rows("exclude_bitmask"),
                   owners("campaign"), owners("advertiser"), lists["include"],
                   lists["exclude"])  # fmt: skip

    def take(self, rows: np.ndarray) -> Columns:
        """The ads `rows`, in that order."""
        return Columns(self.leaf[rows], self.ad_id[rows], self.bitmask[rows],
                       self.cleared[rows], self.campaign[rows], self.advertiser[rows],
                       {n: lists_of(r, rows) for n, r in self.include.items()},
                       {n: lists_of(r, rows) for n, r in self.exclude.items()})  # fmt: skip

    def plus(self, other: Columns) -> Columns:
        """These ads and `other`'s, in (leaf, ad id) order."""
        pairs = ((self.leaf, other.leaf), (self.ad_id, other.ad_id),
                 (self.bitmask, other.bitmask), (self.cleared, other.cleared),
                 (self.campaign, other.campaign), (self.advertiser, other.advertiser))  # fmt: skip
        include = {n: _joined(r, other.include[n]) for n, r in self.include.items()}
        exclude = {n: _joined(r, other.exclude[n]) for n, r in self.exclude.items()}
        both = Columns(*(np.concatenate(pair) for pair in pairs), include, exclude)
        return both.take(np.lexsort((both.ad_id, both.leaf)))


def _joined(a: Ragged, b: Ragged) -> Ragged:
    return Ragged(np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]]),
                  np.concatenate([a.values, b.values]).astype(np.int32))  # fmt: skip


class Overlay:
    """The live placed ads of one state as an ad index of their own, run by the same C++
    post stage as the version's ads (`main`) and merged with its results. Made anew for
    each state that changes them (`after`), from columns, off the request path."""

    def __init__(self, ads: Columns, main: PostStage, schema: TargetingSchema) -> None:
        self.columns = ads
        self.leaves, first = np.unique(ads.leaf, return_index=True)  # the version's leaf ids
        owned = main.ads.ad_campaign_ids is not None, main.ads.ad_advertiser_ids is not None
        rules = AdRules(
            bitmask=ads.bitmask,
            include=ads.include,
            exclude=ads.exclude,
            campaign=ads.campaign if owned[0] else None,
            advertiser=ads.advertiser if owned[1] else None,
        )
        arrays = AdArrays(
            leaf_sids=np.ascontiguousarray(main.ads.leaf_sids[self.leaves]),
            leaf_ad_offsets=np.append(first, len(ads.ad_id)).astype(np.int64),
            ad_ids=ads.ad_id,
            ad_bitmask=ads.bitmask,
        )
        self.stage = PostStage(arrays, threads=1, schema=schema, rules=rules,
                               ad_exclude_bitmask=ads.cleared)  # fmt: skip

    @classmethod
    def after(
        cls,
        overlay: Overlay | None,
        added: Sequence[PlacedAd],
        removed: Sequence[int],
        main: PostStage,
        schema: TargetingSchema,
    ) -> Overlay | None:
        """The overlay with the ads `removed` (ids) left out and `added` put in (None:
        no placed ad left)."""
        names = [a.name for a in schema.families]
        ads = Columns.of(added, names, schema.bitmask_words)
        if overlay is not None:
            kept = overlay.columns
            if len(removed):
                kept = kept.take(np.flatnonzero(~np.isin(kept.ad_id, np.asarray(removed))))
            ads = kept.plus(ads)
        else:
            ads = ads.take(np.lexsort((ads.ad_id, ads.leaf)))
        return cls(ads, main, schema) if len(ads.ad_id) else None

    def merge(self, requests: Sequence[PostRequest], main: list[PostResult]) -> list[PostResult]:
        """`main` (the version's results for `requests`) with the placed ads behind the
        same generated leaves, best first, each cut to its request's max_ads."""
        mine = []
        for r in requests:
            at = np.minimum(np.searchsorted(self.leaves, r.leaves), len(self.leaves) - 1)
            hit = self.leaves[at] == r.leaves
            mine.append(dataclasses.replace(r, leaves=at[hit], scores=r.scores[hit]))
        return [_merged(a, b, r.max_ads)
                for a, b, r in zip(main, self.stage.run(mine), requests, strict=True)]  # fmt: skip


def _merged(a: PostResult, b: PostResult, max_ads: int) -> PostResult:
    if not b.ads_expanded:
        return a
    ids = np.concatenate([a.ad_ids, b.ad_ids])
    scores = np.concatenate([a.scores, b.scores])
    sids = np.concatenate([a.sids, b.sids])
    order = np.argsort(-scores, kind="stable")[:max_ads]  # ties: the version's ads first
    counts = [getattr(a, f) + getattr(b, f) for f in
              ("ads_expanded", "ads_eligible", "ads_blocked", "ads_targeting", "ads_excluded",
               "ads_not_live")]  # fmt: skip
    return PostResult(ids[order], scores[order], sids[order], *counts)


class Placing:
    """What one version needs to serve upserts in place: the reader of `place` records
    for its leaves, widths and vocabularies, its spare matcher rows and the trie paths to
    widen (`subtrees`), and its post stage (`main`) the placed ads' stage mirrors. A
    version with k-way matchers places nothing (the builder does not publish `place` for
    it; one that comes anyway waits)."""

    def __init__(
        self,
        ads: AdArrays,
        trie: TrieArrays,
        schema: TargetingSchema,
        main: PostStage,
        subtrees: Subtrees,
        spare_rows: int = DEFAULT_SPARE_ROWS,
        kway: bool = False,
    ) -> None:
        self._ads, self._schema, self._main, self._subtrees = ads, schema, main, subtrees
        self.spare = Spare(trie, 0 if kway else spare_rows)
        self._sizes = {name: len(s.vocab_offsets) - 1 for name, s in ads.sets.items()}
        self._sizes.update({a.name: self._sizes.get(a.name, 0) for a in schema.families})

    @property
    def widened(self) -> Widened:
        return self.spare.state

    def read(self, ad_id: int, row: dict[str, Any]) -> PlacedAd:
        """A `place` record's row for this version (ValueError: damaged)."""
        schema = self._schema
        return PlacedAd.from_row(
            ad_id, row, leaf_sids=self._ads.leaf_sids, bitmask_words=schema.bitmask_words,
            bloom_words=schema.bloom_words, vocab_sizes=self._sizes,
        )  # fmt: skip

    def widen(self, ad: PlacedAd) -> bool:
        """The matcher rows on the ad's trie path widened to cover it; False when the
        spare rows cannot (nothing changed)."""
        return self.spare.widen(self._subtrees.leaf_path(ad.leaf), ad.bitmask, ad.bloom)

    def overlay(
        self, overlay: Overlay | None, added: Sequence[PlacedAd], removed: Sequence[int]
    ) -> Overlay | None:
        """The post stage over the live placed ads once `added` come live and the ads
        `removed` (ids) go (None: none left)."""
        return Overlay.after(overlay, added, removed, self._main, self._schema)
