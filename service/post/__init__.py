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
call instead of a Python message per ad). Its requests, results and vocabularies are
`service/post/records.py`'s.

A stage reads its index's rules by the schema the index was built with
(`LoadedIndex.post`), the default one unless told.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from contracts.index_arrays import AdArrays
from contracts.index_format import SID_LENGTH
from contracts.targeting_codec import AdRules, Ragged
from contracts.targeting_schema import DEFAULT, TargetingSchema
from service.post._post import AdIndex, encode_ads
from service.post.records import (
    BLOCKS,
    LocationVocabulary,
    PostRequest,
    PostResult,
    Vocabulary,
    request_rules,
)

# fmt: off
__all__ = ["LocationVocabulary", "PostRequest", "PostResult", "PostStage", "Vocabulary",
           "encode_ads", "request_rules"]
# fmt: on

DEFAULT_THREADS = 4  # the post stage shares the host with stages 1-3


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
}


class PostStage:
    """The post stage over one index's ad arrays; `run` is thread-safe.

    `ads` gives the SID -> ad index and, without `rules`, the targeting (`AdArrays.rules`,
    read by `schema`, the default one when not given). With `rules` (and the `schema`
    they follow) the targeting is theirs: the bitmask, per set attribute of the schema an
    include and an exclude list (a missing one: no such rules), and each ad's campaign
    and advertiser. `ad_exclude_bitmask` (uint64 [N, words], the ads' own when not given:
    the bits each ad's enum/bucket exclusions cleared from its include bits) only tells
    exclusions from include failures in the counts (an ad failing the bitmask is excluded
    iff it passes with those bits restored); without it every bitmask failure counts as
    `ads_targeting`. Eligibility never depends on it."""

    def __init__(
        self,
        ads: AdArrays,
        threads: int | None = None,
        *,
        schema: TargetingSchema | None = None,
        rules: AdRules | None = None,
        ad_exclude_bitmask: np.ndarray | None = None,
    ) -> None:
        if rules is not None and schema is None:
            raise ValueError("PostStage: rules come with the schema they follow")
        where = "AdArrays.ad_bitmask" if rules is None else "AdRules.bitmask"
        schema = DEFAULT if schema is None else schema
        rules = ads.rules() if rules is None else rules
        if ad_exclude_bitmask is None:
            ad_exclude_bitmask = ads.ad_exclude_bitmask
        for name, dtype in _AD_DTYPES.items():
            _checked(f"AdArrays.{name}", getattr(ads, name), dtype)
        if ads.leaf_sids.ndim != 2 or ads.leaf_sids.shape[1] != SID_LENGTH:
            raise ValueError(f"AdArrays.leaf_sids: expected [L, {SID_LENGTH}]")
        if threads is None:
            threads = min(DEFAULT_THREADS, os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        n = ads.num_ads
        if ad_exclude_bitmask is not None:
            _checked("ad_exclude_bitmask", ad_exclude_bitmask, np.uint64)
        self.ads, self.schema = ads, schema
        self.attributes = tuple(a.name for a in schema.families)
        for kind, lists in (("include", rules.include), ("exclude", rules.exclude)):
            if unknown := set(lists) - set(self.attributes):
                raise ValueError(f"AdRules.{kind}: {sorted(unknown)[0]!r} is no set attribute")
        bitmask = _checked(where, rules.bitmask, np.uint64)
        if bitmask.shape != (n, schema.bitmask_words):
            raise ValueError(f"{where}: expected [{n}, {schema.bitmask_words}]")
        names = self.attributes
        include = [_csr(f"AdRules.include[{a!r}]", rules.include.get(a), n) for a in names]
        exclude = [_csr(f"AdRules.exclude[{a!r}]", rules.exclude.get(a), n) for a in names]
        campaign, advertiser = rules.campaign, rules.advertiser
        for name, owners in (("campaign", campaign), ("advertiser", advertiser)):
            if owners is not None and _checked(name, owners, np.int64).shape != (n,):
                raise ValueError(f"{name} ids: expected [{n}]")
        owned = {"exclude_campaign_ids": campaign, "exclude_advertiser_ids": advertiser}
        # the block lists this stage can apply: ads always, campaigns and advertisers
        # when the index holds their ids
        self.blockable = ("exclude_ad_ids", *(k for k, ids in owned.items() if ids is not None))
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

    def applies(self, r: PostRequest) -> bool:
        """Whether every block list of `r` is one this index can apply (an ad of no known
        campaign is in no blocked campaign: the exact test cannot bar it)."""
        return all(name in self.blockable or not len(getattr(r, name)) for name in BLOCKS)

    @property
    def threads(self) -> int:
        return self._index.threads

    def run(
        self, batch: Sequence[PostRequest], not_live: np.ndarray | None = None
    ) -> list[PostResult]:
        """Expand, filter, rank and cut every request of `batch` (GIL released).
        `not_live` (uint8 [N], non-zero: not served; `service/index/live.py`): the batch's
        live state, one catalog_seq for every request; None: every ad is live."""
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
        blocks = {name: [getattr(r, name) for r in batch] if blocked else None for name in BLOCKS}
        raw = self._index.run(
            [r.leaves for r in batch],
            [r.scores for r in batch],
            [r.req_bitmask for r in batch],
            set_ids,
            [int(r.max_ads) for r in batch],
            **blocks,
            not_live=not_live,
        )
        return [PostResult(*row) for row in raw]
