"""Stub of the C++ post stage extension (service/post/_post.cpp); use `service.post`."""

import numpy as np

class AdIndex:
    def __init__(
        self,
        leaf_sids: np.ndarray,  # int16 [num_leaves, 4]
        leaf_ad_offsets: np.ndarray,  # int64 [num_leaves + 1]
        ad_ids: np.ndarray,  # int64 [N]
        ad_bitmask: np.ndarray,  # uint64 [N, BITMASK_WORDS]
        ad_loc_offsets: np.ndarray,  # int64 [N + 1]
        ad_loc_ids: np.ndarray,  # int32 [nnz]
        threads: int,
    ) -> None: ...
    @property
    def threads(self) -> int: ...
    @property
    def words(self) -> int: ...
    def run(
        self,
        leaves: list[np.ndarray],  # per request int64 [S]
        scores: list[np.ndarray],  # per request float32 [S]
        bitmasks: list[np.ndarray],  # per request uint64 [BITMASK_WORDS]
        loc_ids: list[np.ndarray],  # per request int32 [n], sorted
        max_ads: list[int],
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]]:
        """Per request: (ad_ids int64 [K], scores float32 [K], sids int16 [K, 4],
        ads_expanded, ads_eligible). Runs with the GIL released."""

def encode_ads(
    ad_ids: np.ndarray,  # int64 [K]
    scores: np.ndarray,  # float32 [K]
    sids: np.ndarray | None = None,  # int16 [K, 4]
) -> bytes:
    """`RetrieveResponse.ads` (field 1, repeated Ad) in protobuf wire format."""
