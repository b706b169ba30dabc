"""The post stage's records (service/post/__init__.py runs the stage): a request as the
stage reads it (`PostRequest`, its arrays coerced and checked on creation, built from a
validated request's targeting or from the codec's `RequestRules`), what it answers
(`PostResult`, with the expanded ads each rule kind removed), and the value -> id
vocabularies of set attributes the requests are encoded against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from contracts.index_arrays import AdArrays
from contracts.targeting import Targeting
from contracts.targeting_codec import RequestRules, codec
from contracts.targeting_schema import DEFAULT, TargetingSchema


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
    """The location vocabulary of an index of the default schema."""

    def __init__(self, ads: AdArrays) -> None:
        super().__init__(ads.sets["locations"].strings())


@dataclass(frozen=True)
class PostResult:
    """One request's answer from the post stage. Every expanded ad is counted once:
    ads_expanded = ads_eligible + ads_not_live + ads_blocked + ads_targeting + ads_excluded."""

    ad_ids: np.ndarray  # int64 [K]: eligible ads, best first
    scores: np.ndarray  # float32 [K]: the beam score of each ad's SID
    sids: np.ndarray  # int16 [K, SID_LENGTH]
    ads_expanded: int  # ads behind the generated SIDs, before the filter
    ads_eligible: int  # of those, exactly eligible (before the max_ads cut)
    ads_blocked: int = 0  # removed first: its ad, campaign or advertiser id is blocked
    ads_targeting: int = 0  # then: an include rule failed (bitmask or a set's list)
    ads_excluded: int = 0  # then: an exclusion (an enum/bucket value or a set's list)
    ads_not_live: int = 0  # before any rule: paused, deleted or waiting at the catalog_seq

    @property
    def ads_removed(self) -> dict[str, int]:
        """The reply's `Stats.ads_removed`, by its keys."""
        return {
            "block": self.ads_blocked,
            "targeting": self.ads_targeting,
            "exclusion": self.ads_excluded,
            "not_live": self.ads_not_live,
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
BLOCKS = ("exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids")


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
        for name in BLOCKS:
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
            if len(self.req_bitmask) != DEFAULT.bitmask_words:
                raise ValueError(
                    f"PostRequest.req_bitmask: expected {DEFAULT.bitmask_words} words, "
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
        return any(len(getattr(self, name)) for name in BLOCKS)

    @classmethod
    def from_targeting(
        cls,
        leaves: np.ndarray,  # int64 [S]
        scores: np.ndarray,  # float [S]
        targeting: Targeting,
        vocabulary: LocationVocabulary,
        max_ads: int,
    ) -> PostRequest:
        """`from_rules` of a request by the default schema, against one index's location
        vocabulary (tests and bench/bench_post.py; the server: `LoadedIndex.post_request`)."""
        rules = request_rules(targeting, DEFAULT, {"locations": vocabulary})
        return cls.from_rules(leaves, scores, rules, DEFAULT, max_ads)

    @classmethod
    def from_rules(
        cls,
        leaves: np.ndarray,  # int64 [S]
        scores: np.ndarray,  # float [S]
        rules: RequestRules,
        schema: TargetingSchema,
        max_ads: int,
    ) -> PostRequest:
        """A request encoded by a schema (`request_rules`): its set attributes' ids in the
        schema's order (an attribute missing from `rules.ids` has none), its blocks."""
        unknown = set(rules.ids) - {a.name for a in schema.families}
        if unknown:
            raise ValueError(f"RequestRules.ids: {sorted(unknown)[0]!r} is no set attribute")
        return cls(
            leaves=leaves,
            scores=scores,
            req_bitmask=rules.bitmask,
            req_loc_ids=_NO_SET_IDS,
            max_ads=max_ads,
            set_ids=tuple(_sorted_ids(rules.ids.get(a.name, _NO_SET_IDS)) for a in schema.families),
            exclude_ad_ids=rules.exclude_ads,
            exclude_campaign_ids=rules.exclude_campaigns,
            exclude_advertiser_ids=rules.exclude_advertisers,
        )


_NO_SET_IDS = np.zeros(0, dtype=np.int32)
_NO_SET_IDS.flags.writeable = False


def _sorted_ids(ids: object) -> np.ndarray:
    """int32, sorted and unique (`Vocabulary.ids` already are: no second sort)."""
    arr = np.asarray(ids, dtype=np.int32)
    return arr if len(arr) < 2 or bool((arr[1:] > arr[:-1]).all()) else np.unique(arr)


def _ids(ids: tuple[int, ...]) -> np.ndarray:
    return np.array(ids, dtype=np.int64) if ids else _NO_IDS


def request_rules(
    targeting: Targeting, schema: TargetingSchema, vocabularies: Mapping[str, Vocabulary]
) -> RequestRules:
    """A request's side of the exact test (`targeting_codec.exact_eligible`) by `schema`
    and one index's set-attribute vocabularies, its blocks included: the one encoding of
    a request for the post stage (TargetingError for a value the schema does not read)."""
    values = targeting.values()
    return RequestRules(
        bitmask=codec(schema).request_bitmask(values),
        ids={a.name: vocabularies[a.name].ids(values.get(a.name, ())) for a in schema.families},
        exclude_ads=_ids(targeting.exclude_ad_ids),
        exclude_campaigns=_ids(targeting.exclude_campaign_ids),
        exclude_advertisers=_ids(targeting.exclude_advertiser_ids),
    )
