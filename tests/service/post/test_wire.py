"""`encode_ads`: the reply's ads as protobuf wire bytes from C++ parse to exactly the
message the Python protobuf API builds (the server replies with the parsed bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.post import encode_ads
from service.rpc.grace.v1 import retrieval_pb2

ids = hnp.arrays(np.int64, st.integers(0, 40), elements=st.integers(-(2**63), 2**63 - 1))


def python_built(ad_ids, scores, sids) -> retrieval_pb2.RetrieveResponse:
    return retrieval_pb2.RetrieveResponse(
        ads=[
            retrieval_pb2.Ad(ad_id=a, score=s, sid=() if sids is None else sid)
            for a, s, sid in zip(
                ad_ids.tolist(),
                scores.tolist(),
                [None] * len(ad_ids) if sids is None else sids.tolist(),
                strict=True,
            )
        ]
    )


@settings(max_examples=200, deadline=None)
@given(ad_ids=ids, data=st.data(), with_sids=st.booleans())
def test_parses_to_the_python_built_message(ad_ids: np.ndarray, data, with_sids: bool) -> None:
    """Any int64 id (0 and negatives: 10-byte varints), any finite float32 score (−0.0
    included), SID tokens of any int16 (negatives sign-extend)."""
    k = len(ad_ids)
    scores = data.draw(hnp.arrays(np.float32, k, elements=st.floats(width=32, allow_nan=False)))
    sids = (
        data.draw(hnp.arrays(np.int16, (k, 4), elements=st.integers(-(2**15), 2**15 - 1)))
        if with_sids
        else None
    )
    got = retrieval_pb2.RetrieveResponse.FromString(encode_ads(ad_ids, scores, sids))
    want = python_built(ad_ids, scores, sids)
    assert got == want
    assert got.SerializeToString() == want.SerializeToString()


def test_merges_with_the_rest_of_the_reply() -> None:
    ad_ids = np.array([7, 0, -3], dtype=np.int64)
    scores = np.array([-0.5, -1.25, -9.0], dtype=np.float32)
    sids = np.array([[1, 2, 3, 511], [0, 0, 0, 0], [5, 6, 7, 8]], dtype=np.int16)
    rest = retrieval_pb2.RetrieveResponse(index_version="v1", model_version="m1")
    rest.stats.sids_generated = 12
    reply = retrieval_pb2.RetrieveResponse.FromString(
        encode_ads(ad_ids, scores, sids) + rest.SerializeToString()
    )
    assert [a.ad_id for a in reply.ads] == [7, 0, -3]
    assert [list(a.sid) for a in reply.ads] == sids.tolist()
    assert reply.index_version == "v1" and reply.stats.sids_generated == 12


def test_bad_shapes_are_refused() -> None:
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        encode_ads(one, np.zeros(2, dtype=np.float32))
    with pytest.raises(ValueError, match="sids"):
        encode_ads(one, np.zeros(1, dtype=np.float32), np.zeros((1, 3), dtype=np.int16))
    assert encode_ads(one[:0], np.zeros(0, dtype=np.float32)) == b""
