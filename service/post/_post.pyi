"""Stub of the C++ post stage extension (service/post/_post.cpp); use `service.post`."""

from typing import overload

import numpy as np

# one set attribute's per-ad lists: (offsets int64 [N + 1], ids int32 [nnz], sorted per ad),
# or None without such lists
_Csr = tuple[np.ndarray, np.ndarray] | None

class AdIndex:
    @overload
    def __init__(
        self,
        leaf_sids: np.ndarray,  # int16 [num_leaves, 4]
        leaf_ad_offsets: np.ndarray,  # int64 [num_leaves + 1]
        ad_ids: np.ndarray,  # int64 [N]
        ad_bitmask: np.ndarray,  # uint64 [N, BITMASK_WORDS]
        ad_loc_offsets: np.ndarray,  # int64 [N + 1]
        ad_loc_ids: np.ndarray,  # int32 [nnz]
        threads: int,
    ) -> None:
        """The form before declared schemas: one set attribute (locations), includes only."""
    @overload
    def __init__(
        self,
        leaf_sids: np.ndarray,  # int16 [num_leaves, 4]
        leaf_ad_offsets: np.ndarray,  # int64 [num_leaves + 1]
        ad_ids: np.ndarray,  # int64 [N]
        ad_bitmask: np.ndarray,  # uint64 [N, words]: enum/bucket rules, exclusions folded in
        *,
        include: list[_Csr],  # [K] per set attribute, the schema's order
        exclude: list[_Csr],  # [K]
        threads: int,
        ad_exclude_bitmask: np.ndarray | None = None,  # uint64 [N, words]: bits exclusions cleared
        campaign_ids: np.ndarray | None = None,  # int64 [N]; 0: none
        advertiser_ids: np.ndarray | None = None,  # int64 [N]; 0: none
    ) -> None: ...
    @property
    def threads(self) -> int: ...
    @property
    def words(self) -> int: ...
    @property
    def set_attributes(self) -> int: ...
    def run(
        self,
        leaves: list[np.ndarray],  # per request int64 [S]
        scores: list[np.ndarray],  # per request float32 [S]
        bitmasks: list[np.ndarray],  # per request uint64 [words]
        set_ids: list[np.ndarray],  # [B * K], request-major: int32 [n], sorted
        max_ads: list[int],
        *,
        exclude_ad_ids: list[np.ndarray] | None = None,  # per request int64 [a], any order
        exclude_campaign_ids: list[np.ndarray] | None = None,  # per request int64 [c]
        exclude_advertiser_ids: list[np.ndarray] | None = None,  # per request int64 [d]
        not_live: np.ndarray | None = None,  # uint8 [N]: non-zero = the ad is not served
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int, int, int, int]]:
        """Per request: (ad_ids int64 [K], scores float32 [K], sids int16 [K, 4],
        ads_expanded, ads_eligible, ads_blocked, ads_targeting, ads_excluded, ads_not_live).
        Runs with the GIL released."""

def encode_ads(
    ad_ids: np.ndarray,  # int64 [K]
    scores: np.ndarray,  # float32 [K]
    sids: np.ndarray | None = None,  # int16 [K, 4]
) -> bytes:
    """`RetrieveResponse.ads` (field 1, repeated Ad) in protobuf wire format."""
