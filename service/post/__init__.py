"""Pipeline stage 4 (post): SID -> ads expansion, exact targeting filter, rank, cut.

`PostStage.run` expands each request's generated leaves (`DecodeResult.valid`) to their ads
through the SID -> ad index, keeps the exactly eligible ones (bitmask rules and actual
location ids, never Bloom bits: docs/ARCHITECTURE.md §3), ranks them by beam score and
cuts each request to its `max_ads`. The work runs in the private C++ extension `_post`
(built by `pip install -e .`) with the GIL released, a batch's requests spread over a few
threads, with results identical to `tests/helpers/reference_post.py`. This module owns the
types and checks the arrays it hands over; `encode_ads` writes a result's ads as the
reply's wire bytes (parsed in one C call instead of a Python message per ad).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contracts.index_format import SID_LENGTH, AdArrays
from contracts.targeting import BITMASK_WORDS, Targeting, request_bitmask
from service.post._post import AdIndex, encode_ads

__all__ = ["LocationVocabulary", "PostRequest", "PostResult", "PostStage", "encode_ads"]

DEFAULT_THREADS = 4  # the post stage shares the host with stages 1-3


class LocationVocabulary:
    """Location string -> id of an index's sorted vocabulary (built once per index load)."""

    def __init__(self, ads: AdArrays) -> None:
        self._ids = {s: i for i, s in enumerate(ads.location_strings())}

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, locations: Sequence[str]) -> np.ndarray:
        """Sorted ids of the known strings; unknown strings match no rule and are dropped."""
        found = {self._ids[s] for s in locations if s in self._ids}
        return np.array(sorted(found), dtype=np.int32)


@dataclass(frozen=True)
class PostResult:
    """One request's answer from the post stage."""

    ad_ids: np.ndarray  # int64 [K]: eligible ads, best first
    scores: np.ndarray  # float32 [K]: the beam score of each ad's SID
    sids: np.ndarray  # int16 [K, SID_LENGTH]
    ads_expanded: int  # ads behind the generated SIDs, before the filter
    ads_eligible: int  # of those, exactly eligible (before the max_ads cut)


def _request_array(name: str, value: object, dtype: type[np.generic]) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"PostRequest.{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise TypeError(f"PostRequest.{name}: expected {np.dtype(dtype)}, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


@dataclass(frozen=True)
class PostRequest:
    """One request of a batch as the post stage reads it (arrays coerced on creation)."""

    leaves: np.ndarray  # int64 [S]: generated leaf positions (DecodeResult.valid)
    scores: np.ndarray  # float32 [S]: beam score of each leaf, in any order
    req_bitmask: np.ndarray  # uint64 [BITMASK_WORDS]: targeting.request_bitmask
    req_loc_ids: np.ndarray  # int32 [n]: sorted location ids (LocationVocabulary.ids)
    max_ads: int  # keep at most this many eligible ads, best first

    def __post_init__(self) -> None:
        fixed = {
            "leaves": _request_array("leaves", self.leaves, np.int64),
            "scores": _request_array("scores", self.scores, np.float32),
            "req_bitmask": _request_array("req_bitmask", self.req_bitmask, np.uint64),
            "req_loc_ids": _request_array("req_loc_ids", self.req_loc_ids, np.int32),
        }
        for name, arr in fixed.items():
            object.__setattr__(self, name, arr)
        if len(self.scores) != len(self.leaves):
            raise ValueError(
                f"PostRequest: {len(self.leaves)} leaves but {len(self.scores)} scores"
            )
        if len(self.req_bitmask) != BITMASK_WORDS:
            raise ValueError(
                f"PostRequest.req_bitmask: expected {BITMASK_WORDS} words, "
                f"got {len(self.req_bitmask)}"
            )
        if np.any(np.diff(self.req_loc_ids) < 0):
            raise ValueError("PostRequest.req_loc_ids: must be sorted ascending")
        if int(self.max_ads) < 0:
            raise ValueError(f"PostRequest.max_ads: must be >= 0, got {self.max_ads}")

    @classmethod
    def from_targeting(
        cls,
        leaves: np.ndarray,  # int64 [S]
        scores: np.ndarray,  # float [S]
        targeting: Targeting,
        vocabulary: LocationVocabulary,
        max_ads: int,
    ) -> PostRequest:
        """Encode a request's targeting against one index's location vocabulary."""
        return cls(
            leaves=leaves,
            scores=scores,
            req_bitmask=request_bitmask(targeting),
            req_loc_ids=vocabulary.ids(targeting.locations),
            max_ads=max_ads,
        )


# AdArrays field -> dtype the C++ side reads in place, in `AdIndex`'s argument order
_AD_DTYPES: dict[str, type[np.generic]] = {
    "leaf_sids": np.int16,
    "leaf_ad_offsets": np.int64,
    "ad_ids": np.int64,
    "ad_bitmask": np.uint64,
    "ad_loc_offsets": np.int64,
    "ad_loc_ids": np.int32,
}


class PostStage:
    """The post stage over one index's ad arrays; `run` is thread-safe."""

    def __init__(self, ads: AdArrays, threads: int | None = None) -> None:
        for name, dtype in _AD_DTYPES.items():
            arr = getattr(ads, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype):
                got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
                raise TypeError(f"AdArrays.{name}: expected {np.dtype(dtype)}, got {got}")
            # a non-contiguous array would be copied by the extension: refuse it instead
            if not arr.flags.c_contiguous:
                raise ValueError(f"AdArrays.{name}: must be C-contiguous (it is not copied)")
        if ads.leaf_sids.ndim != 2 or ads.leaf_sids.shape[1] != SID_LENGTH:
            raise ValueError(f"AdArrays.leaf_sids: expected [L, {SID_LENGTH}]")
        if ads.ad_bitmask.ndim != 2 or ads.ad_bitmask.shape[1] != BITMASK_WORDS:
            raise ValueError(f"AdArrays.ad_bitmask: expected [N, {BITMASK_WORDS}]")
        if threads is None:
            threads = min(DEFAULT_THREADS, os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.ads = ads
        self._index = AdIndex(*(getattr(ads, name) for name in _AD_DTYPES), threads)

    @property
    def threads(self) -> int:
        return self._index.threads

    def run(self, batch: Sequence[PostRequest]) -> list[PostResult]:
        """Expand, filter, rank and cut every request of `batch` (GIL released)."""
        raw = self._index.run(
            [r.leaves for r in batch],
            [r.scores for r in batch],
            [r.req_bitmask for r in batch],
            [r.req_loc_ids for r in batch],
            [int(r.max_ads) for r in batch],
        )
        return [
            PostResult(ad_ids=ids, scores=sc, sids=sids, ads_expanded=n_exp, ads_eligible=n_el)
            for ids, sc, sids, n_exp, n_el in raw
        ]
