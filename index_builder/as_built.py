"""Which upserts a published index version already serves as written, for the builder's
change publisher (`change_publisher.py`; docs/DATA.md "Live changes").

The publisher replays the feed over every new version, and a server holds an upserted ad
back until a version serves its new row. An upsert whose row the version was built from —
the same SID, targeting (enum/bucket bits and exclusions, each set attribute's include
and exclude values) and owners — is therefore published as `restore` (the ad serves as
the version holds it), so the full build that folds an upsert in serves the ad again. An
upsert without an explicit `sid` is never taken as built: its SID comes from a tokenizer.

Any other upsert is served in place (`place`, contracts/placed.py) when the version can
hold its new row exactly: its SID is one of the version's leaves (the row's `sid`, or for
an ad the version holds and a row with only an embedding, the SID the version gave it:
its targeting changes, its place in the trie waits for the next full build), every set
value it names is in the version's vocabularies (a value the version does not know could
not be matched or excluded exactly), and the version has no k-way matchers (whose
partitions are not widened). Otherwise it waits for the next full build.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contracts.index_format import VOCAB_SIZE, read_index_dir
from contracts.placed import PlacedAd
from contracts.targeting_codec import Ragged
from contracts.targeting_schema import TargetingSchema
from index_builder.blooms import ad_blooms
from index_builder.catalog import Catalog
from index_builder.parallel import digit_keys


class BuiltAds:
    """The ads of one version directory, memory-mapped, looked up by ad id."""

    def __init__(self, version: Path) -> None:
        _, arrays = read_index_dir(version, verify_checksums=False, mmap=True)
        self.ads = ads = arrays.ads
        self.kway = arrays.kway is not None
        self._keys: np.ndarray | None = None  # the leaves' SID keys, made at the first place
        self._order = np.argsort(ads.ad_ids, kind="stable")
        self._sorted = ads.ad_ids[self._order]
        self._vocab = {name: s.strings() for name, s in ads.sets.items()}

    def row(self, ad_id: int) -> int:
        """The ad's row, -1 when the version does not hold it."""
        at = int(np.searchsorted(self._sorted, ad_id))
        return int(self._order[at]) if at < len(self._sorted) and self._sorted[at] == ad_id else -1

    def same(self, catalog: Catalog, i: int) -> bool:
        """Whether catalog row `i` is what the version serves for its ad."""
        ads, row = self.ads, self.row(int(catalog.ad_id[i]))
        if row < 0 or catalog.sid[i, 0] < 0:
            return False
        leaf = int(np.searchsorted(ads.leaf_ad_offsets, row, side="right")) - 1
        zero = np.zeros(ads.ad_bitmask.shape[1], np.uint64)
        pairs = [
            (ads.leaf_sids[leaf], catalog.sid[i]),
            (ads.ad_bitmask[row], catalog.bitmask[i]),
            (zero if ads.ad_exclude_bitmask is None else ads.ad_exclude_bitmask[row],
             zero if catalog.exclude_bitmask is None else catalog.exclude_bitmask[i]),
            (_owner(ads.ad_campaign_ids, row), _owner(catalog.campaign, i)),
            (_owner(ads.ad_advertiser_ids, row), _owner(catalog.advertiser, i)),
        ]  # fmt: skip
        if not all(np.array_equal(a, b) for a, b in pairs):
            return False
        for name, rules in catalog.sets.items():
            built, vocab = ads.sets.get(name), self._vocab.get(name, [])
            for kind in ("include", "exclude"):
                had = _values(
                    vocab,
                    None
                    if built is None
                    else (getattr(built, f"{kind}_offsets"), getattr(built, f"{kind}_ids")),
                    row,
                )
                lists = getattr(rules, kind)
                has = _values(rules.vocabulary, None if lists is None else (
                    lists.offsets, lists.values), i)  # fmt: skip
                if had != has:
                    return False
        return True

    def place(self, catalog: Catalog, i: int, schema: TargetingSchema) -> PlacedAd | None:
        """Catalog row `i` as the version serves it in place; None when it cannot (the
        module's rules: it waits for the next full build)."""
        ads, ad_id = self.ads, int(catalog.ad_id[i])
        if self.kway:
            return None
        sid = catalog.sid[i]
        if sid[0] < 0:  # an embedding only: an ad the version holds keeps its SID
            row = self.row(ad_id)
            if row < 0:
                return None
            leaf = int(np.searchsorted(ads.leaf_ad_offsets, row, side="right")) - 1
        else:
            if self._keys is None:
                self._keys = digit_keys(ads.leaf_sids, VOCAB_SIZE)
            key = int(digit_keys(sid[None, :], VOCAB_SIZE)[0])
            leaf = int(np.searchsorted(self._keys, key))
            if leaf == len(self._keys) or self._keys[leaf] != key:
                return None  # a SID the trie lacks: served from the next full build
        lists: dict[str, dict[str, np.ndarray]] = {"include": {}, "exclude": {}}
        one: dict[str, Ragged] = {}
        for name, rules in catalog.sets.items():
            ids = {v: k for k, v in enumerate(self._vocab.get(name, []))}
            for kind in ("include", "exclude"):
                values = sorted(_values(rules.vocabulary, _csr(getattr(rules, kind)), i))
                if any(v not in ids for v in values):
                    return None
                if values:
                    lists[kind][name] = np.array([ids[v] for v in values], dtype=np.int32)
            inc = rules.include
            lo, hi = int(inc.offsets[i]), int(inc.offsets[i + 1])
            one[name] = Ragged(np.array([0, hi - lo], np.int64), inc.values[lo:hi])
        vocab = {name: list(rules.vocabulary) for name, rules in catalog.sets.items()}
        bloom = ad_blooms(schema, one, vocab)[0] if one else np.zeros(0, np.uint64)
        words = ads.ad_bitmask.shape[1]
        cleared = (np.zeros(words, np.uint64) if catalog.exclude_bitmask is None
                   else catalog.exclude_bitmask[i])  # fmt: skip
        owners = [_owner(mine, i) if held is not None else 0 for mine, held in
                  ((catalog.campaign, ads.ad_campaign_ids),
                   (catalog.advertiser, ads.ad_advertiser_ids))]  # fmt: skip
        return PlacedAd(ad_id, leaf, tuple(int(t) for t in ads.leaf_sids[leaf]),
                        catalog.bitmask[i].copy(), cleared.copy(), bloom, lists["include"],
                        lists["exclude"], *owners)  # fmt: skip


def _csr(lists: Ragged | None) -> tuple[np.ndarray, np.ndarray] | None:
    return None if lists is None else (lists.offsets, lists.values)


def _owner(ids: np.ndarray | None, row: int) -> int:
    return 0 if ids is None else int(ids[row])


def _values(
    vocab: list[str] | np.ndarray, csr: tuple[np.ndarray | None, np.ndarray | None] | None, row: int
) -> frozenset[str]:
    """The values one row's list names (empty without a list)."""
    if csr is None or csr[0] is None or csr[1] is None:
        return frozenset()
    off, ids = csr
    return frozenset(str(vocab[int(v)]) for v in ids[off[row] : off[row + 1]])
