"""Pipeline stage 4 (post): SID -> ads expansion, exact targeting filter, rank, cut.

`PostStage.run` expands each request's generated leaves (`DecodeResult.valid`) to their ads
through the SID -> ad index, keeps the exactly eligible ones (docs/ARCHITECTURE.md §3; the
rules of the targeting schema, `contracts/targeting_codec.py` `exact_eligible`: the
bitmask of enum/bucket attributes, each set attribute's include and exclude lists by
actual vocabulary ids — never Bloom bits — and the request's blocks of ad, campaign and
advertiser ids), ranks them by beam score and cuts each request to its `max_ads`. It also
counts, per request, the expanded ads each kind of rule removed. The work runs in the
private C++ extension `_post` (built by `pip install -e .`) with the GIL released, a
batch's requests spread over a few threads, with results identical to
`tests/helpers/reference_post.py`. This module owns the types and checks the arrays it
hands over; `encode_ads` writes a result's ads as the reply's wire bytes (parsed in one C
call instead of a Python message per ad).

Without `rules` a stage reads the index as it was before declared schemas: the default
schema's bitmask and one set attribute, locations, with include lists only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from contracts.index_format import SID_LENGTH, AdArrays
from contracts.targeting import BITMASK_WORDS, Targeting, request_bitmask
from contracts.targeting_codec import AdRules, Ragged, RequestRules
from contracts.targeting_schema import TargetingSchema
from service.post._post import AdIndex, encode_ads

# fmt: off
__all__ = ["LocationVocabulary", "PostRequest", "PostResult", "PostStage", "Vocabulary",
           "encode_ads"]
# fmt: on

DEFAULT_THREADS = 4  # the post stage shares the host with stages 1-3


class Vocabulary:
    """Value string -> id of one set attribute's sorted vocabulary (built once per index
    load)."""

    def __init__(self, strings: Sequence[str]) -> None:
        self._ids = {s: i for i, s in enumerate(strings)}

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, values: Sequence[str]) -> np.ndarray:
        """Sorted ids of the known strings; unknown strings match no rule and are dropped."""
        found = {self._ids[s] for s in values if s in self._ids}
        return np.array(sorted(found), dtype=np.int32)


class LocationVocabulary(Vocabulary):
    """The location vocabulary of an index's ad arrays."""

    def __init__(self, ads: AdArrays) -> None:
        super().__init__(ads.location_strings())


@dataclass(frozen=True)
class PostResult:
    """One request's answer from the post stage. Every expanded ad is counted once:
    ads_expanded = ads_eligible + ads_blocked + ads_targeting + ads_excluded."""

    ad_ids: np.ndarray  # int64 [K]: eligible ads, best first
    scores: np.ndarray  # float32 [K]: the beam score of each ad's SID
    sids: np.ndarray  # int16 [K, SID_LENGTH]
    ads_expanded: int  # ads behind the generated SIDs, before the filter
    ads_eligible: int  # of those, exactly eligible (before the max_ads cut)
    ads_blocked: int = 0  # removed first: its ad, campaign or advertiser id is blocked
    ads_targeting: int = 0  # then: an include rule failed (bitmask or a set's list)
    ads_excluded: int = 0  # then: an exclusion (an enum/bucket value or a set's list)

    @property
    def ads_removed(self) -> dict[str, int]:
        """The reply's `Stats.ads_removed`, by its keys."""
        return {
            "block": self.ads_blocked,
            "targeting": self.ads_targeting,
            "exclusion": self.ads_excluded,
        }


def _request_array(name: str, value: object, dtype: type[np.generic]) -> np.ndarray:
    if (
        type(value) is np.ndarray
        and value.dtype == dtype
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value  # already what the C++ side reads (the common case: no copy, no checks)
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"PostRequest.{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise TypeError(f"PostRequest.{name}: expected {np.dtype(dtype)}, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS.flags.writeable = False
_BLOCKS = ("exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids")


@dataclass(frozen=True)
class PostRequest:
    """One request of a batch as the post stage reads it (arrays coerced on creation).

    Set attributes: `set_ids` holds each set attribute's ids, in the stage's order
    (`PostStage.attributes`); without it the request has one, `req_loc_ids` (locations)."""

    leaves: np.ndarray  # int64 [S]: generated leaf positions (DecodeResult.valid)
    scores: np.ndarray  # float32 [S]: beam score of each leaf, in any order
    req_bitmask: np.ndarray  # uint64 [words]: one bit per enum/bucket attribute
    req_loc_ids: np.ndarray  # int32 [n]: sorted location ids (LocationVocabulary.ids)
    max_ads: int  # keep at most this many eligible ads, best first
    # per set attribute int32 [n_k], sorted vocabulary ids; None: (req_loc_ids,)
    set_ids: tuple[np.ndarray, ...] | None = None
    exclude_ad_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int64 [a], any order
    exclude_campaign_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int64 [c]
    exclude_advertiser_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int64 [d]

    def __post_init__(self) -> None:
        fixed = {
            "leaves": _request_array("leaves", self.leaves, np.int64),
            "scores": _request_array("scores", self.scores, np.float32),
            "req_bitmask": _request_array("req_bitmask", self.req_bitmask, np.uint64),
            "req_loc_ids": _request_array("req_loc_ids", self.req_loc_ids, np.int32),
        }
        for name in _BLOCKS:
            fixed[name] = _request_array(name, getattr(self, name), np.int64)
        if self.set_ids is not None:
            fixed["set_ids"] = tuple(
                _request_array(f"set_ids[{k}]", ids, np.int32) for k, ids in enumerate(self.set_ids)
            )
        for name, arr in fixed.items():
            object.__setattr__(self, name, arr)
        if len(self.scores) != len(self.leaves):
            raise ValueError(
                f"PostRequest: {len(self.leaves)} leaves but {len(self.scores)} scores"
            )
        if self.set_ids is None:
            # the form before declared schemas: the default schema's bitmask words
            if len(self.req_bitmask) != BITMASK_WORDS:
                raise ValueError(
                    f"PostRequest.req_bitmask: expected {BITMASK_WORDS} words, "
                    f"got {len(self.req_bitmask)}"
                )
        elif len(self.req_loc_ids):
            raise ValueError("PostRequest: give set_ids or req_loc_ids, not both")
        named = enumerate(self.set_ids or ())
        for name, ids in [
            ("req_loc_ids", self.req_loc_ids),
            *((f"set_ids[{k}]", x) for k, x in named),
        ]:
            if np.any(np.diff(ids) < 0):
                raise ValueError(f"PostRequest.{name}: must be sorted ascending")
        if int(self.max_ads) < 0:
            raise ValueError(f"PostRequest.max_ads: must be >= 0, got {self.max_ads}")

    @property
    def sets(self) -> tuple[np.ndarray, ...]:
        """Each set attribute's ids, as the stage reads them."""
        return self.set_ids if self.set_ids is not None else (self.req_loc_ids,)

    @property
    def has_blocks(self) -> bool:
        return any(len(getattr(self, name)) for name in _BLOCKS)

    @classmethod
    def from_targeting(
        cls,
        leaves: np.ndarray,  # int64 [S]
        scores: np.ndarray,  # float [S]
        targeting: Targeting,
        vocabulary: LocationVocabulary,
        max_ads: int,
    ) -> PostRequest:
        """Encode a request's targeting, its blocks included, against one index's location
        vocabulary."""
        return cls(
            leaves=leaves,
            scores=scores,
            req_bitmask=request_bitmask(targeting),
            req_loc_ids=vocabulary.ids(targeting.locations),
            max_ads=max_ads,
            exclude_ad_ids=np.array(targeting.exclude_ad_ids, dtype=np.int64),
            exclude_campaign_ids=np.array(targeting.exclude_campaign_ids, dtype=np.int64),
            exclude_advertiser_ids=np.array(targeting.exclude_advertiser_ids, dtype=np.int64),
        )

    @classmethod
    def from_rules(
        cls,
        leaves: np.ndarray,  # int64 [S]
        scores: np.ndarray,  # float [S]
        rules: RequestRules,
        schema: TargetingSchema,
        max_ads: int,
    ) -> PostRequest:
        """A request encoded by a schema (`targeting_codec`): its set attributes' ids in
        the schema's order (an attribute missing from `rules.ids` has none), its blocks."""
        unknown = set(rules.ids) - {a.name for a in schema.families}
        if unknown:
            raise ValueError(f"RequestRules.ids: {sorted(unknown)[0]!r} is no set attribute")
        return cls(
            leaves=leaves,
            scores=scores,
            req_bitmask=rules.bitmask,
            req_loc_ids=np.zeros(0, dtype=np.int32),
            max_ads=max_ads,
            set_ids=tuple(
                np.unique(np.asarray(rules.ids.get(a.name, ()), dtype=np.int32))
                for a in schema.families
            ),
            exclude_ad_ids=rules.exclude_ads,
            exclude_campaign_ids=rules.exclude_campaigns,
            exclude_advertiser_ids=rules.exclude_advertisers,
        )


def _checked(where: str, arr: object, dtype: type[np.generic]) -> np.ndarray:
    """An index array the C++ side reads in place: refuse anything it would copy."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype):
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise TypeError(f"{where}: expected {np.dtype(dtype)}, got {got}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: must be C-contiguous (it is not copied)")
    return arr


def _csr(where: str, lists: Ragged | None, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One set attribute's include or exclude lists for the C++ side; None (the test is
    skipped) without any id."""
    if lists is None or not len(lists.values):
        return None
    offsets = _checked(f"{where}.offsets", lists.offsets, np.int64)
    if offsets.shape != (n + 1,):
        raise ValueError(f"{where}.offsets: expected [{n + 1}], got {list(offsets.shape)}")
    return offsets, _checked(f"{where}.values", lists.values, np.int32)


# AdArrays field -> dtype the C++ side reads in place
_AD_DTYPES: dict[str, type[np.generic]] = {
    "leaf_sids": np.int16,
    "leaf_ad_offsets": np.int64,
    "ad_ids": np.int64,
    "ad_bitmask": np.uint64,
    "ad_loc_offsets": np.int64,
    "ad_loc_ids": np.int32,
}


class PostStage:
    """The post stage over one index's ad arrays; `run` is thread-safe.

    `ads` gives the SID -> ad index and, without `rules`, the targeting (the default
    schema's bitmask and locations). With `rules` (and the `schema` they follow) the
    targeting is theirs: the bitmask, per set attribute of the schema an include and an
    exclude list (a missing one: no such rules), and each ad's campaign and advertiser.
    `ad_exclude_bitmask` (uint64 [N, words]: the bits each ad's enum/bucket exclusions
    cleared from its include bits, `tests/helpers/reference_post.py` `ad_exclude_bitmask`)
    only tells exclusions from include failures in the counts (an ad failing the bitmask
    is excluded iff it passes with those bits restored); without it every bitmask failure
    counts as `ads_targeting`. Eligibility never depends on it."""

    def __init__(
        self,
        ads: AdArrays,
        threads: int | None = None,
        *,
        schema: TargetingSchema | None = None,
        rules: AdRules | None = None,
        ad_exclude_bitmask: np.ndarray | None = None,
    ) -> None:
        if (schema is None) != (rules is None):
            raise ValueError("PostStage: schema and rules come together")
        fields = list(_AD_DTYPES) if rules is None else ["leaf_sids", "leaf_ad_offsets", "ad_ids"]
        for name in fields:
            _checked(f"AdArrays.{name}", getattr(ads, name), _AD_DTYPES[name])
        if ads.leaf_sids.ndim != 2 or ads.leaf_sids.shape[1] != SID_LENGTH:
            raise ValueError(f"AdArrays.leaf_sids: expected [L, {SID_LENGTH}]")
        if threads is None:
            threads = min(DEFAULT_THREADS, os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        n = ads.num_ads
        if ad_exclude_bitmask is not None:
            _checked("ad_exclude_bitmask", ad_exclude_bitmask, np.uint64)
        self.ads = ads
        if schema is None or rules is None:
            if ads.ad_bitmask.ndim != 2 or ads.ad_bitmask.shape[1] != BITMASK_WORDS:
                raise ValueError(f"AdArrays.ad_bitmask: expected [N, {BITMASK_WORDS}]")
            self.attributes: tuple[str, ...] = ("locations",)
            include: list[tuple[np.ndarray, np.ndarray] | None] = [
                (ads.ad_loc_offsets, ads.ad_loc_ids)
            ]
            exclude: list[tuple[np.ndarray, np.ndarray] | None] = [None]
            bitmask, campaign, advertiser = (
                ads.ad_bitmask,
                ads.ad_campaign_ids,
                ads.ad_advertiser_ids,
            )
        else:
            names = [a.name for a in schema.families]
            self.attributes = tuple(names)
            for kind, lists in (("include", rules.include), ("exclude", rules.exclude)):
                if unknown := set(lists) - set(self.attributes):
                    raise ValueError(f"AdRules.{kind}: {sorted(unknown)[0]!r} is no set attribute")
            bitmask = _checked("AdRules.bitmask", rules.bitmask, np.uint64)
            if bitmask.shape != (n, schema.bitmask_words):
                raise ValueError(f"AdRules.bitmask: expected [{n}, {schema.bitmask_words}]")
            include = [_csr(f"AdRules.include[{a!r}]", rules.include.get(a), n) for a in names]
            exclude = [_csr(f"AdRules.exclude[{a!r}]", rules.exclude.get(a), n) for a in names]
            campaign, advertiser = rules.campaign, rules.advertiser
        for name, owners in (("campaign", campaign), ("advertiser", advertiser)):
            if owners is not None and _checked(name, owners, np.int64).shape != (n,):
                raise ValueError(f"{name} ids: expected [{n}]")
        self._index = AdIndex(
            ads.leaf_sids,
            ads.leaf_ad_offsets,
            ads.ad_ids,
            bitmask,
            include=include,
            exclude=exclude,
            threads=threads,
            ad_exclude_bitmask=ad_exclude_bitmask,
            campaign_ids=campaign,
            advertiser_ids=advertiser,
        )

    @property
    def threads(self) -> int:
        return self._index.threads

    def run(self, batch: Sequence[PostRequest]) -> list[PostResult]:
        """Expand, filter, rank and cut every request of `batch` (GIL released)."""
        set_ids: list[np.ndarray] = []
        for i, r in enumerate(batch):
            if len(r.sets) != len(self.attributes):
                raise ValueError(
                    f"request {i}: ids of {len(r.sets)} set attributes, the stage has "
                    f"{len(self.attributes)} ({', '.join(self.attributes) or 'none'})"
                )
            set_ids.extend(r.sets)
        # no request with blocks (the common case): the C++ side skips the test
        blocked = any(r.has_blocks for r in batch)
        blocks = {name: [getattr(r, name) for r in batch] if blocked else None for name in _BLOCKS}
        raw = self._index.run(
            [r.leaves for r in batch],
            [r.scores for r in batch],
            [r.req_bitmask for r in batch],
            set_ids,
            [int(r.max_ads) for r in batch],
            **blocks,
        )
        return [PostResult(*row) for row in raw]
