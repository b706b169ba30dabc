"""The default schema's encoding contract (docs/FORMAT.md): bit layout, hashing, requests,
as `codec(DEFAULT)` encodes them, and the fixed layout old index manifests store."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np
import pytest

from contracts.index_manifest import check_legacy_schema, legacy_schema_manifest
from contracts.targeting import Targeting
from contracts.targeting_codec import Ragged, TargetingError, codec, contains, value_blooms
from contracts.targeting_schema import COUNTRIES, DEFAULT

C = codec(DEFAULT)
FULL_BLOOM = np.full(DEFAULT.bloom_words, np.iinfo(np.uint64).max, dtype=np.uint64)


def bits_of(words: np.ndarray) -> set[int]:
    return {w * 64 + b for w in range(len(words)) for b in range(64) if int(words[w]) >> b & 1}


def request_bitmask(t: Targeting) -> np.ndarray:
    return C.request_bitmask(t.values())


def request_blooms(t: Targeting) -> np.ndarray:
    (rows,) = C.request_blooms(t.values())  # the default's one family: locations
    return rows


def ad_bitmask(
    countries: Sequence[str] = (), age_buckets: Sequence[str] = (), genders: Sequence[str] = ()
) -> np.ndarray:
    """One ad's matcher from its rules as value names: uint64 [words]."""
    include = {}
    for name, values in (("country", countries), ("age", age_buckets), ("gender", genders)):
        attr = DEFAULT.attribute(name)
        index = [C.value_index(attr, v) for v in values]
        if None in index:
            raise TargetingError(name, f"unknown value {values[index.index(None)]!r}")
        include[name] = Ragged.from_lists([index])
    return C.ad_bitmasks(include, {}, 1)[0]


def ad_bloom(locations: Sequence[str]) -> np.ndarray:
    """One ad's Bloom matcher from its location rule: uint64 [bloom_words]."""
    vocab = value_blooms(locations, 256, 3)
    rule = {"locations": Ragged.from_lists([list(range(len(locations)))])}
    return C.ad_blooms(rule, {"locations": vocab}, 1)[0]


def bloom_match_any(matchers: np.ndarray, req_blooms: np.ndarray) -> np.ndarray:
    """Paper eq. 8, ANY-of-many: matchers [N, W], req_blooms [L, W] -> bool [N]."""
    return contains(matchers[:, None, :], req_blooms[None]).any(axis=1)


def test_documented_bit_positions() -> None:
    assert len(COUNTRIES) == 249 and DEFAULT.bitmask_words == 5
    us = COUNTRIES.index("US")
    assert bits_of(request_bitmask(Targeting("US", 30, "female"))) == {us, 250 + 2, 258}
    assert bits_of(request_bitmask(Targeting())) == {249, 257, 260}  # all unknown
    assert bits_of(request_bitmask(Targeting("us", 70, "male"))) == {us, 256, 259}
    assert bits_of(request_bitmask(Targeting("GB", 12))) == {COUNTRIES.index("GB"), 257, 260}
    # an ad without rules sets all 261 schema bits and no padding bit
    assert bits_of(ad_bitmask()) == set(range(261))
    assert bits_of(C.full_bitmask) == set(range(261))


def test_bloom_bits_are_the_first_digest_bytes() -> None:
    digest = hashlib.blake2b(b"US/R07/C0123", digest_size=8).digest()
    assert bits_of(request_blooms(Targeting(locations=("US/R07/C0123",)))[0]) == set(digest[:3])
    assert bits_of(ad_bloom([])) == set(range(256))


def test_paper_toy_example_union_is_conservative() -> None:
    """Paper eq. 6–7: the OR of two ads passes a user neither ad is eligible for."""
    a = ad_bitmask(["US"], ["18-24"])
    b = ad_bitmask(["CA"], ["25-34"])
    user = request_bitmask(Targeting("US", 30))
    assert not contains(a, user) and not contains(b, user)
    assert contains(a | b, user)


def test_unknown_attributes_match_only_ads_without_that_rule() -> None:
    unknown = request_bitmask(Targeting(country="", age=0, gender=""))
    assert contains(ad_bitmask(), unknown)
    assert not contains(ad_bitmask(countries=["US"]), unknown)
    assert not contains(ad_bitmask(age_buckets=list(("13-17", "65+"))), unknown)
    assert not contains(ad_bitmask(genders=["female", "male"]), unknown)


def test_request_without_locations_matches_only_ads_without_location_rule() -> None:
    sentinel = request_blooms(Targeting())
    assert bits_of(sentinel[0]) == set(range(256)) and len(sentinel) == 1
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
    ],
)
def test_bad_requests_name_the_field(targeting: Targeting, field: str) -> None:
    with pytest.raises(TargetingError) as err:
        C.encode_requests([targeting.values()])
    assert err.value.field == field


def test_a_country_the_schema_does_not_list_is_unknown() -> None:
    """`DEFAULT` reads an unlisted country as unknown (`unlisted: unknown`); that a code is
    two letters is request validation's check (tests/service/test_validation.py)."""
    for country in ("XX", "USA"):
        assert bits_of(request_bitmask(Targeting(country, 30, "female"))) == {249, 252, 258}


def test_batch_padding_repeats_row_zero() -> None:
    enc = C.encode_requests(
        [Targeting(locations=("a", "b", "c")).values(), Targeting(locations=("z",)).values()]
    )
    assert enc.blooms.shape == (2, 3, 4)
    assert enc.n_blooms.tolist() == [[3], [1]]
    assert (enc.blooms[1, 1:] == enc.blooms[1, 0]).all()


def test_unknown_ad_values_are_refused() -> None:
    """The codec knows no index for them (the catalog reader refuses such a rule:
    tests/index_builder/test_catalog.py)."""
    assert C.value_index(DEFAULT.attribute("country"), "XX") is None
    assert C.value_index(DEFAULT.attribute("age"), "18-25") is None
    with pytest.raises(TargetingError, match="country"):
        ad_bitmask(countries=["XX"])
    with pytest.raises(TargetingError, match="age"):
        ad_bitmask(age_buckets=["18-25"])


# the fixed layout (schema version 1) every index before declared schemas stores, as JSON
LEGACY_MANIFEST = {
    "version": 1,
    "bitmask_bits": 261,
    "bitmask_words": 5,
    "bloom_bits": 256,
    "bloom_words": 4,
    "bloom_hashes": 3,
    "bloom_hash": "blake2b-64: bit_i = digest[i], i < bloom_hashes",
    "max_request_locations": 64,
    "attributes": {
        "country": {"offset": 0, "values": list(COUNTRIES), "unknown_bit": 249},
        "age": {
            "offset": 250,
            "values": ["13-17", "18-24", "25-34", "35-44", "45-54", "55-64", "65+"],
            "unknown_bit": 257,
        },
        "gender": {"offset": 258, "values": ["female", "male"], "unknown_bit": 260},
    },
}
# sha256 of that manifest key as contracts/index_format.py writes it (indent=1, sort_keys),
# taken from the `TargetingSchema` dataclass that wrote it before it was removed
LEGACY_MANIFEST_SHA256 = "aebc2f3d88a14c6d81e1e6f957608894c149f0e57ac3e3f0961f54d6094d4ab0"


def test_the_legacy_manifest_layout_is_byte_identical() -> None:
    stored = legacy_schema_manifest()
    assert stored == LEGACY_MANIFEST
    assert list(stored) == list(LEGACY_MANIFEST)  # key order too: json.dumps keeps it
    assert json.dumps(stored) == json.dumps(LEGACY_MANIFEST)
    written = json.dumps(stored, indent=1, sort_keys=True).encode()
    assert hashlib.sha256(written).hexdigest() == LEGACY_MANIFEST_SHA256
    check_legacy_schema(json.loads(json.dumps(stored)))  # as a manifest reads back


def test_schema_mismatch_names_the_field() -> None:
    stored = legacy_schema_manifest() | {"bloom_hashes": 4}
    with pytest.raises(ValueError, match="bloom_hashes"):
        check_legacy_schema(stored)
    with pytest.raises(
        ValueError,
        match=r"^targeting schema mismatch on 'bitmask_bits': index has None, this build "
        r"expects 261$",
    ):
        check_legacy_schema({k: v for k, v in LEGACY_MANIFEST.items() if k != "bitmask_bits"})
