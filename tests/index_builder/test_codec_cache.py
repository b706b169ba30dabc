"""The request encoder's per-family cache of value bits (contracts/targeting_codec.py,
`Codec.request_blooms`): the rows a cached value gets are the rows `value_blooms` gives it,
and a request the schema refuses is refused whether or not its values were seen before."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.targeting_codec import Codec, TargetingError, value_blooms
from contracts.targeting_schema import Attribute, TargetingSchema

WORDS = st.text(alphabet="abcxyz/é0", min_size=1, max_size=12)


def schema(bits: int, hashes: int, most: int = 8) -> TargetingSchema:
    return TargetingSchema(attributes=(
        Attribute(name="tags", kind="set", catalog_field="tags", max_request_values=most,
                  bloom_bits=bits, bloom_hashes=hashes),
    ))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([64, 256, 512, 4096, 65536]),
    hashes=st.integers(1, 8),
    requests=st.lists(st.lists(WORDS, min_size=1, max_size=8), min_size=1, max_size=6),
)
def test_cached_rows_are_the_hashed_rows(bits: int, hashes: int, requests: list) -> None:
    codec = Codec(schema(bits, hashes))
    for _ in range(2):  # the second pass reads every value from the cache
        for values in requests:
            (rows,) = codec.request_blooms({"tags": values})
            np.testing.assert_array_equal(rows, value_blooms(values, bits, hashes))


def test_refusals_do_not_depend_on_the_cache() -> None:
    codec = Codec(schema(256, 3, most=2))
    codec.request_blooms({"tags": ["a", "b"]})  # both cached now
    with pytest.raises(TargetingError, match="at most 2"):
        codec.request_blooms({"tags": ["a", "b", "a"]})
    with pytest.raises(TargetingError, match="1 to"):
        codec.request_blooms({"tags": ["a", ""]})
    with pytest.raises(TargetingError, match="1 to"):  # a refused value was not cached
        codec.request_blooms({"tags": [""]})


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("contracts.targeting_codec.VALUE_CACHE", 4)
    codec = Codec(schema(256, 3))
    for i in range(10):
        values = [f"v{i}", f"w{i}", f"x{i}"]
        (rows,) = codec.request_blooms({"tags": values})
        np.testing.assert_array_equal(rows, value_blooms(values, 256, 3))
        assert len(codec._bits["tags"]) <= 4
