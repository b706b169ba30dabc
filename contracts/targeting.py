"""The default targeting schema's fixed encoding (docs/FORMAT.md §1), and the request's
`Targeting`: what the catalog reader, the builder, the synthetic world, the study and the
C++ post stage's default path call by name. `contracts/targeting_schema.py` declares any
schema and `contracts/targeting_codec.py` encodes by it (the Bloom hashing and `Ragged`
are its; tests hold this module bit for bit equal to the codec's default). Every index
stores `TargetingSchema.to_manifest()` so a reader can refuse a mismatch. Bit layout
(schema version 1), LSB-first inside little-endian uint64 words — bit `b` lives in word `b // 64` at
position `b % 64`:

    [0, 249)    countries, in `COUNTRIES` order (ISO 3166-1 alpha-2)
    249         country unknown / not in the list
    [250, 257)  age buckets, in `AGE_BUCKETS` order
    257         age unknown (age 0, or below 13)
    [258, 260)  genders, in `GENDERS` order
    260         gender unknown
    [261, 320)  padding, always 0

An ad without a rule on an attribute sets every bit of that attribute, "unknown"
included; a request sets exactly one bit per attribute, so `(matcher & request) ==
request` is exact for one ad and conservative for an OR of ads (paper eq. 4–5). Bloom
(locations): 256 bits; a location string sets the 3 bits given by the first 3 bytes of
`blake2b(utf8(string), digest_size=8)`. An ad's Bloom is the OR over its location strings
(all ones without a location rule); a request carries one row per location, or one
all-ones sentinel row without locations, which only an all-ones matcher contains. It runs
past the house's ~300 lines while its callers move to the codec (issue #47: the catalog
reader and builder first); it shrinks to `Targeting` as they do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from contracts.targeting_codec import Ragged, TargetingError, value_bits, value_blooms
from contracts.targeting_schema import COUNTRIES, LEGACY_FIELDS

SCHEMA_VERSION = 1
MAX_REQUEST_LOCATIONS = 64
# A request's location strings are non-empty and at most this many UTF-8 bytes
# (service/validation.py); the catalog refuses a location rule no request could match.
MAX_LOCATION_BYTES = 256

AGE_BUCKETS: tuple[str, ...] = ("13-17", "18-24", "25-34", "35-44", "45-54", "55-64", "65+")
_AGE_LOWER = np.array([13, 18, 25, 35, 45, 55, 65])
GENDERS: tuple[str, ...] = ("female", "male")

BLOOM_BITS = 256
BLOOM_HASHES = 3
BLOOM_WORDS = BLOOM_BITS // 64


@dataclass(frozen=True)
class _Attribute:
    name: str
    values: tuple[str, ...]
    offset: int  # first bit; values take [offset, offset+len), "unknown" the next bit

    @property
    def width(self) -> int:
        return len(self.values) + 1

    @property
    def unknown_bit(self) -> int:
        return self.offset + len(self.values)


COUNTRY = _Attribute("country", COUNTRIES, 0)
AGE = _Attribute("age", AGE_BUCKETS, COUNTRY.offset + COUNTRY.width)
GENDER = _Attribute("gender", GENDERS, AGE.offset + AGE.width)
BITMASK_BITS = GENDER.offset + GENDER.width
BITMASK_WORDS = (BITMASK_BITS + 63) // 64
_COUNTRY_INDEX = {c: i for i, c in enumerate(COUNTRIES)}
_AGE_INDEX = {a: i for i, a in enumerate(AGE_BUCKETS)}
_GENDER_INDEX = {g: i for i, g in enumerate(GENDERS)}


@dataclass(frozen=True)
class TargetingSchema:
    """What an index was encoded with; stored in every manifest and compared on load."""

    version: int = SCHEMA_VERSION
    bitmask_bits: int = BITMASK_BITS
    bitmask_words: int = BITMASK_WORDS
    bloom_bits: int = BLOOM_BITS
    bloom_words: int = BLOOM_WORDS
    bloom_hashes: int = BLOOM_HASHES
    bloom_hash: str = "blake2b-64: bit_i = digest[i], i < bloom_hashes"
    max_request_locations: int = MAX_REQUEST_LOCATIONS
    attributes: dict[str, dict[str, object]] = field(
        default_factory=lambda: {
            a.name: {"offset": a.offset, "values": list(a.values), "unknown_bit": a.unknown_bit}
            for a in (COUNTRY, AGE, GENDER)
        }
    )

    def to_manifest(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def current(cls) -> TargetingSchema:
        return cls()

    def check_compatible(self, stored: dict[str, object]) -> None:
        """Raise ValueError naming the first field where `stored` differs from this schema."""
        mine = self.to_manifest()
        for key, value in mine.items():
            if stored.get(key) != value:
                raise ValueError(
                    f"targeting schema mismatch on {key!r}: index has {stored.get(key)!r}, "
                    f"this build expects {value!r}"
                )


def _set_bits(words: np.ndarray, bits: Iterable[int]) -> None:
    for b in bits:
        words[..., b // 64] |= np.uint64(1) << np.uint64(b % 64)


def _attribute_bits(attr: _Attribute) -> range:
    return range(attr.offset, attr.offset + attr.width)


FULL_BITMASK = np.zeros(BITMASK_WORDS, dtype=np.uint64)
_set_bits(FULL_BITMASK, range(BITMASK_BITS))
FULL_BLOOM = np.full(BLOOM_WORDS, np.iinfo(np.uint64).max, dtype=np.uint64)


def age_bucket_index(age: int) -> int | None:
    """Bucket index of an age in years; None for unknown (0) or below 13."""
    if age < 0:
        raise TargetingError("age", f"must be >= 0 (0 = unknown), got {age}")
    if age < 13:
        return None
    return int(np.searchsorted(_AGE_LOWER, age, side="right") - 1)


def _rule_bits(attr: _Attribute, values: Sequence[str], index: dict[str, int]) -> list[int]:
    if not values:
        return list(_attribute_bits(attr))
    bits = []
    for v in values:
        i = index.get(v)
        if i is None:
            raise TargetingError(attr.name, f"unknown value {v!r}")
        bits.append(attr.offset + i)
    return bits


def ad_bitmask(
    countries: Sequence[str] = (), age_buckets: Sequence[str] = (), genders: Sequence[str] = ()
) -> np.ndarray:
    """Exact low-cardinality matcher of one ad: uint64 [BITMASK_WORDS]."""
    out = np.zeros(BITMASK_WORDS, dtype=np.uint64)
    _set_bits(out, _rule_bits(COUNTRY, countries, _COUNTRY_INDEX))
    _set_bits(out, _rule_bits(AGE, age_buckets, _AGE_INDEX))
    _set_bits(out, _rule_bits(GENDER, genders, _GENDER_INDEX))
    return out


def location_bloom_bits(location: str) -> tuple[int, ...]:
    """The Bloom bit positions of one location string."""
    return value_bits(location, BLOOM_BITS, BLOOM_HASHES)


def location_blooms(locations: Sequence[str]) -> np.ndarray:
    """One Bloom row per location string: uint64 [len(locations), BLOOM_WORDS]."""
    return value_blooms(locations, BLOOM_BITS, BLOOM_HASHES)


def ad_bloom(locations: Sequence[str]) -> np.ndarray:
    """Bloom matcher of one ad: OR of its locations' bits; all ones without a location rule."""
    if not locations:
        return FULL_BLOOM.copy()
    return np.bitwise_or.reduce(location_blooms(locations), axis=0)


@dataclass(frozen=True)
class Targeting:
    """The request's side of targeting (RPC `Targeting`). The four named fields are also
    the model's user features; each fills the schema's attribute of its name, beside
    `attributes` (every other attribute, by name). Blocks: ads, campaigns, advertisers
    that must not come back."""

    country: str = ""  # ISO alpha-2, "" = unknown
    age: int = 0  # years, 0 = unknown
    gender: str = ""  # "female" | "male" | "" (unknown)
    locations: tuple[str, ...] = ()  # at most MAX_REQUEST_LOCATIONS
    attributes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, values), by name
    exclude_ad_ids: tuple[int, ...] = ()
    exclude_campaign_ids: tuple[int, ...] = ()
    exclude_advertiser_ids: tuple[int, ...] = ()

    def values(self) -> dict[str, tuple[str, ...]]:
        """Every attribute's values by name, as `targeting_codec.Codec` reads a request:
        the named fields under their own names (when set), then `attributes`."""
        out = dict(self.attributes)
        for name in LEGACY_FIELDS:
            given = getattr(self, name)
            if given:
                out[name] = tuple(given) if isinstance(given, tuple | list) else (str(given),)
        return out


def request_bitmask(t: Targeting) -> np.ndarray:
    """One bit per attribute: uint64 [BITMASK_WORDS]. Unknown values take the unknown bit."""
    out = np.zeros(BITMASK_WORDS, dtype=np.uint64)
    c = _COUNTRY_INDEX.get(t.country.upper()) if t.country else None
    if t.country and (len(t.country) != 2 or not t.country.isalpha()):
        raise TargetingError("country", f"expected an ISO 3166-1 alpha-2 code, got {t.country!r}")
    age = age_bucket_index(t.age)
    if t.gender and t.gender not in _GENDER_INDEX:
        raise TargetingError("gender", f"unknown value {t.gender!r}; expected one of {GENDERS}")
    g = _GENDER_INDEX.get(t.gender) if t.gender else None
    _set_bits(out, [COUNTRY.unknown_bit if c is None else COUNTRY.offset + c])
    _set_bits(out, [AGE.unknown_bit if age is None else AGE.offset + age])
    _set_bits(out, [GENDER.unknown_bit if g is None else GENDER.offset + g])
    return out


def request_blooms(t: Targeting) -> np.ndarray:
    """Bloom rows of a request: uint64 [max(1, n_loc), BLOOM_WORDS] (sentinel if none)."""
    if len(t.locations) > MAX_REQUEST_LOCATIONS:
        raise TargetingError(
            "locations", f"at most {MAX_REQUEST_LOCATIONS} allowed, got {len(t.locations)}"
        )
    if not t.locations:
        return FULL_BLOOM[None].copy()
    return location_blooms(t.locations)


@dataclass(frozen=True)
class EncodedRequests:
    """A batch of requests as the GTM matcher reads them (CPU reference and GPU kernel)."""

    bitmask: np.ndarray  # uint64 [B, BITMASK_WORDS]
    blooms: np.ndarray  # uint64 [B, L, BLOOM_WORDS]; rows >= n_blooms[b] repeat row 0
    n_blooms: np.ndarray  # int32 [B], >= 1


def encode_requests(batch: Sequence[Targeting]) -> EncodedRequests:
    """Encode a batch; padding rows repeat row 0 so ANY-of-many is unchanged by padding."""
    rows = [request_blooms(t) for t in batch]
    width = max((len(r) for r in rows), default=1)
    blooms = np.empty((len(batch), width, BLOOM_WORDS), dtype=np.uint64)
    for b, r in enumerate(rows):
        blooms[b, : len(r)] = r
        blooms[b, len(r) :] = r[0]
    bitmask = [request_bitmask(t) for t in batch]
    return EncodedRequests(
        bitmask=np.stack(bitmask) if batch else np.zeros((0, BITMASK_WORDS), dtype=np.uint64),
        blooms=blooms,
        n_blooms=np.array([len(r) for r in rows], dtype=np.int32),
    )


def bitmask_match(matchers: np.ndarray, req: np.ndarray) -> np.ndarray:
    """Paper eq. 5: (matcher & req) == req, per row. matchers [..., W], req [W] -> bool [...]."""
    return np.all((matchers & req) == req, axis=-1)


def bloom_match_any(matchers: np.ndarray, req_blooms: np.ndarray) -> np.ndarray:
    """Paper eq. 8, ANY-of-many: matchers [N, W], req_blooms [L, W] -> bool [N]."""
    contained = np.all((matchers[:, None, :] & req_blooms[None]) == req_blooms[None], axis=-1)
    return contained.any(axis=1)


def exact_eligible(
    ad_bitmask_rows: np.ndarray,  # uint64 [N, BITMASK_WORDS], exact per ad
    ad_loc_offsets: np.ndarray,  # int64 [N + 1] into ad_loc_ids
    ad_loc_ids: np.ndarray,  # int32 [nnz]: each ad's location-rule ids (empty = no rule)
    req_bitmask: np.ndarray,  # uint64 [BITMASK_WORDS]
    req_loc_ids: np.ndarray,  # int32 [n]: the request's locations as ids of the same vocabulary
) -> np.ndarray:
    """Exact eligibility of N ads for one request (docs/ARCHITECTURE.md §3): bool [N].
    Locations compare actual ids, never Bloom bits; request strings absent from the
    vocabulary match no rule, so the caller leaves them out of `req_loc_ids`."""
    ok = bitmask_match(ad_bitmask_rows, req_bitmask)
    counts = np.diff(ad_loc_offsets)
    ruled = counts > 0
    if ruled.any():
        hit = np.isin(ad_loc_ids, req_loc_ids)
        # any hit per ad: reduceat over non-empty segments only
        starts = ad_loc_offsets[:-1][ruled]
        any_hit = np.zeros(len(counts), dtype=bool)
        any_hit[ruled] = np.logical_or.reduceat(hit, starts) if len(hit) else False
        ok &= ~ruled | any_hit
    return ok


def country_index(code: str) -> int | None:
    """Index of an ISO alpha-2 code in COUNTRIES (case-insensitive), None if unknown."""
    return _COUNTRY_INDEX.get(code.upper())


def age_bucket_value_index(name: str) -> int | None:
    return _AGE_INDEX.get(name)


def gender_value_index(name: str) -> int | None:
    return _GENDER_INDEX.get(name)


def _or_attribute(out: np.ndarray, attr: _Attribute, rule: Ragged) -> None:
    counts = np.diff(rule.offsets)
    # no rule: every bit of the attribute, "unknown" included
    full = np.zeros(BITMASK_WORDS, dtype=np.uint64)
    _set_bits(full, _attribute_bits(attr))
    out[counts == 0] |= full
    if len(rule.values):
        rows = np.repeat(np.arange(rule.n), counts)
        bits = attr.offset + rule.values.astype(np.int64)
        one = np.left_shift(np.uint64(1), (bits % 64).astype(np.uint64))
        np.bitwise_or.at(out, (rows, bits // 64), one)


def ad_bitmasks(countries: Ragged, age_buckets: Ragged, genders: Ragged) -> np.ndarray:
    """Vectorised `ad_bitmask` for N ads: uint64 [N, BITMASK_WORDS]. Values are indices."""
    out = np.zeros((countries.n, BITMASK_WORDS), dtype=np.uint64)
    _or_attribute(out, COUNTRY, countries)
    _or_attribute(out, AGE, age_buckets)
    _or_attribute(out, GENDER, genders)
    return out


def ad_blooms(locations: Ragged, vocabulary_blooms: np.ndarray) -> np.ndarray:
    """Vectorised `ad_bloom`: uint64 [N, BLOOM_WORDS] from location ids into a vocabulary
    whose rows are `vocabulary_blooms` (uint64 [V, BLOOM_WORDS], see `location_blooms`)."""
    counts = np.diff(locations.offsets)
    out = np.broadcast_to(FULL_BLOOM, (locations.n, BLOOM_WORDS)).copy()
    ruled = counts > 0
    if ruled.any():
        out[ruled] = np.bitwise_or.reduceat(
            vocabulary_blooms[locations.values], locations.offsets[:-1][ruled], axis=0
        )
    return out
