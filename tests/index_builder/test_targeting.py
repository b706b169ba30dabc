"""The targeting encoding contract (docs/FORMAT.md): bit layout, hashing, requests."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from contracts.targeting import (
    BITMASK_WORDS,
    COUNTRIES,
    FULL_BLOOM,
    Targeting,
    TargetingError,
    TargetingSchema,
    ad_bitmask,
    ad_bloom,
    bitmask_match,
    bloom_match_any,
    encode_requests,
    request_bitmask,
    request_blooms,
)


def bits_of(words: np.ndarray) -> set[int]:
    return {w * 64 + b for w in range(len(words)) for b in range(64) if int(words[w]) >> b & 1}


def test_documented_bit_positions() -> None:
    assert len(COUNTRIES) == 249 and BITMASK_WORDS == 5
    us = COUNTRIES.index("US")
    assert bits_of(request_bitmask(Targeting("US", 30, "female"))) == {us, 250 + 2, 258}
    assert bits_of(request_bitmask(Targeting())) == {249, 257, 260}  # all unknown
    assert bits_of(request_bitmask(Targeting("us", 70, "male"))) == {us, 256, 259}
    assert bits_of(request_bitmask(Targeting("GB", 12))) == {COUNTRIES.index("GB"), 257, 260}
    # an ad without rules sets all 261 schema bits and no padding bit
    assert bits_of(ad_bitmask()) == set(range(261))


def test_bloom_bits_are_the_first_digest_bytes() -> None:
    digest = hashlib.blake2b(b"US/R07/C0123", digest_size=8).digest()
    assert bits_of(request_blooms(Targeting(locations=("US/R07/C0123",)))[0]) == set(digest[:3])
    assert bits_of(ad_bloom([])) == set(range(256))


def test_paper_toy_example_union_is_conservative() -> None:
    """Paper eq. 6–7: the OR of two ads passes a user neither ad is eligible for."""
    a = ad_bitmask(["US"], ["18-24"])
    b = ad_bitmask(["CA"], ["25-34"])
    user = request_bitmask(Targeting("US", 30))
    assert not bitmask_match(a, user) and not bitmask_match(b, user)
    assert bitmask_match(a | b, user)


def test_unknown_attributes_match_only_ads_without_that_rule() -> None:
    unknown = request_bitmask(Targeting(country="", age=0, gender=""))
    assert bitmask_match(ad_bitmask(), unknown)
    assert not bitmask_match(ad_bitmask(countries=["US"]), unknown)
    assert not bitmask_match(ad_bitmask(age_buckets=list(("13-17", "65+"))), unknown)
    assert not bitmask_match(ad_bitmask(genders=["female", "male"]), unknown)


def test_request_without_locations_matches_only_ads_without_location_rule() -> None:
    sentinel = request_blooms(Targeting())
    assert bloom_match_any(FULL_BLOOM[None], sentinel)[0]
    assert not bloom_match_any(ad_bloom(["US/R1", "US/R2"])[None], sentinel)[0]


def test_any_of_many_locations() -> None:
    matcher = ad_bloom(["US/R1"])[None]
    assert bloom_match_any(matcher, request_blooms(Targeting(locations=("x", "US/R1"))))[0]
    assert not bloom_match_any(matcher, request_blooms(Targeting(locations=("x", "y"))))[0]


@pytest.mark.parametrize(
    ("targeting", "field"),
    [
        (Targeting(locations=tuple(f"l{i}" for i in range(65))), "locations"),
        (Targeting(gender="other"), "gender"),
        (Targeting(age=-1), "age"),
        (Targeting(country="USA"), "country"),
    ],
)
def test_bad_requests_name_the_field(targeting: Targeting, field: str) -> None:
    with pytest.raises(TargetingError) as err:
        encode_requests([targeting])
    assert err.value.field == field


def test_batch_padding_repeats_row_zero() -> None:
    enc = encode_requests([Targeting(locations=("a", "b", "c")), Targeting(locations=("z",))])
    assert enc.blooms.shape == (2, 3, 4)
    assert enc.n_blooms.tolist() == [3, 1]
    assert (enc.blooms[1, 1:] == enc.blooms[1, 0]).all()


def test_unknown_ad_values_are_refused() -> None:
    with pytest.raises(TargetingError, match="country"):
        ad_bitmask(countries=["XX"])
    with pytest.raises(TargetingError, match="age"):
        ad_bitmask(age_buckets=["18-25"])


def test_schema_mismatch_names_the_field() -> None:
    stored = TargetingSchema.current().to_manifest() | {"bloom_hashes": 4}
    with pytest.raises(ValueError, match="bloom_hashes"):
        TargetingSchema.current().check_compatible(stored)
