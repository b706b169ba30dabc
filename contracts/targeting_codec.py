"""Targeting encoded by a declared schema (contracts/targeting_schema.py): ads' rules and
requests' values as the bits GTM reads in decoding, and the exact test the post stage
applies after it (docs/FORMAT.md §1 "Targeting schema"). The builder encodes ads with
`Codec.ad_bitmasks` / `ad_blooms`; the server encodes a batch with `encode_requests`.

Bitmask (enum and bucket attributes): each attribute its values' bits then an "unknown"
bit, at `schema.bit_offsets`. An ad sets, per attribute, its include list's bits (every
bit, unknown included, without one) less its exclude list's (never the unknown bit); a
request sets exactly one bit per attribute (its value's, or unknown), so `(matcher &
request) == request` is exact for one ad — exclusions included — and conservative for an
OR of ads (paper eq. 4–5).

Bloom (set attributes): one family each, `bloom_bits` wide, concatenated in a row at
`schema.family_words`. A value sets `bloom_hashes` bits (`value_bits`). An ad's family is
the OR of its include values (all ones without an include rule); exclusions on sets are
not in the Bloom (an OR of ads cannot prove that every ad excludes a value), the post
stage applies them exactly. A request has, per family, one row per value, or one all-ones
sentinel row without values (only an all-ones matcher, no include rule, contains it);
the rule is ANY row of each family, ALL families. The encoding and the exact test are one
contract read by the builder, the server, the kernel and the C++ stage, so they stay in
one module, a little past the house's ~300 lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from contracts.targeting_schema import MAX_VALUE_BYTES, Attribute, TargetingSchema

ONES = np.iinfo(np.uint64).max
VALUE_CACHE = 1 << 16  # set values per family whose Bloom bits a codec keeps (~10 MB)
_NO_IDS = np.zeros(0, dtype=np.int64)


class TargetingError(ValueError):
    """A request or catalog value outside the schema; `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Ragged:
    """Per-ad value lists in CSR form: ad i has values[offsets[i]:offsets[i+1]]."""

    offsets: np.ndarray  # int64 [N + 1]
    values: np.ndarray  # int32 [nnz]: value indices into the attribute's value list

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> Ragged:
        lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((v for x in lists for v in x), dtype=np.int32, count=int(offsets[-1]))
        return cls(offsets, values)

    @classmethod
    def empty(cls, n: int) -> Ragged:
        return cls(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int32))


@dataclass(frozen=True)
class EncodedRequests:
    """A batch as the GTM matcher reads it (CPU reference and GPU kernel)."""

    bitmask: np.ndarray  # uint64 [B, bitmask_words]
    # uint64 [B, L, bloom_words]: row l of family f in words family_words[f]; rows at and
    # past n_blooms[b, f] repeat the family's row 0, so ANY-of-many is unchanged by them
    blooms: np.ndarray
    n_blooms: np.ndarray  # int32 [B, K], each >= 1


def value_bits(value: str, bits: int, hashes: int) -> tuple[int, ...]:
    """The Bloom bit positions of one set value (schema BLOOM_HASH)."""
    wide = bits > 256
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=16 if wide else 8).digest()
    if wide:
        return tuple(int.from_bytes(digest[2 * i : 2 * i + 2], "little") % bits
                     for i in range(hashes))  # fmt: skip
    return tuple(digest[i] % bits for i in range(hashes))


def _pack(at: tuple[int, ...]) -> bytes:
    """A value's bit positions (each < 65,536) as uint16 bytes."""
    return struct.pack(f"<{len(at)}H", *at)


def _rows(packed: bytes, n: int, bits: int, hashes: int) -> np.ndarray:
    """Bloom rows uint64 [n, bits // 64] from n values' packed bit positions (`_pack`)."""
    at = np.frombuffer(packed, dtype="<u2").reshape(n, hashes).astype(np.int64)
    rows = np.zeros((n, bits // 64), dtype=np.uint64)
    for i in range(hashes):  # one hash at a time: no (row, word) twice in one assignment
        rows[np.arange(n), at[:, i] >> 6] |= np.left_shift(
            np.uint64(1), (at[:, i] & 63).astype(np.uint64)
        )
    return rows


def value_blooms(values: Sequence[str], bits: int, hashes: int) -> np.ndarray:
    """One Bloom row per value: uint64 [len(values), bits // 64]."""
    packed = b"".join(_pack(value_bits(v, bits, hashes)) for v in values)
    return _rows(packed, len(values), bits, hashes)


def _set(words: np.ndarray, bits: Sequence[int] | np.ndarray) -> None:
    for b in bits:
        words[..., b // 64] |= np.uint64(1) << np.uint64(b % 64)


class Codec:
    """Ads and requests encoded by one schema (`codec(schema)` caches one per schema)."""

    def __init__(self, schema: TargetingSchema) -> None:
        self.schema = schema
        self.words, self.bloom_words = schema.bitmask_words, schema.bloom_words
        self.families = schema.families
        # per family: value -> its packed Bloom bits, for values a request passed before (a
        # server sees the same audiences and locations request after request; hashing a
        # 256-value request was most of its encoding)
        self._bits: dict[str, dict[str, bytes]] = {a.name: {} for a in self.families}
        self.masked = tuple(a for a in schema.attributes if a.kind != "set")
        self._index = {a.name: {v: i for i, v in enumerate(a.labels)} for a in self.masked}
        self.full_bitmask = np.zeros(self.words, dtype=np.uint64)
        _set(self.full_bitmask, range(schema.bitmask_bits))

    # --- values -------------------------------------------------------------------------

    def value_index(self, attr: Attribute, value: str) -> int | None:
        """An enum/bucket value's index in `attr.labels` (a catalog names buckets), or None
        when the schema does not list it."""
        return self._index[attr.name].get(value.upper() if attr.case == "upper" else value)

    def request_bit(self, attr: Attribute, values: Sequence[str], field: str) -> int:
        """The one bit a request sets for an enum/bucket attribute: its value's, or the
        unknown bit (no value; a bucket value in no bucket; an unlisted enum value when
        the attribute reads those as unknown)."""
        base = self.schema.bit_offsets[attr.name]
        unknown = base + len(attr.labels)
        if len(values) > 1:
            raise TargetingError(field, f"takes one value, got {len(values)}")
        if not values or values[0] == "":
            return unknown
        value = values[0]
        if attr.kind == "bucket":
            if not (value.isascii() and value.isdigit()):
                raise TargetingError(field, f"expected a decimal integer >= 0, got {value[:64]!r}")
            number = int(value)
            for i, (_, lo, hi) in enumerate(attr.spans):
                if lo <= number and (hi is None or number <= hi):
                    return base + i
            return unknown
        i = self.value_index(attr, value)
        if i is None:
            if attr.unlisted == "unknown":
                return unknown
            shown = ", ".join(attr.values[:8]) + (", ..." if len(attr.values) > 8 else "")
            raise TargetingError(field, f"unknown value {value[:64]!r}; expected one of {shown}")
        return base + i

    def check_set(self, attr: Attribute, values: Sequence[str], field: str) -> None:
        if len(values) > attr.max_request_values:
            raise TargetingError(field, f"at most {attr.max_request_values} allowed, got "
                                 f"{len(values)}")  # fmt: skip
        for v in values:
            if not v or len(v.encode("utf-8")) > MAX_VALUE_BYTES:
                raise TargetingError(field, f"values are 1 to {MAX_VALUE_BYTES} bytes of "
                                     f"UTF-8, got {v[:64]!r}")  # fmt: skip

    # --- requests -----------------------------------------------------------------------

    def request_bitmask(self, values: Mapping[str, Sequence[str]]) -> np.ndarray:
        """uint64 [words]: one bit per enum/bucket attribute."""
        words = [0] * self.words  # Python ints: a numpy scalar op per bit costs more
        for a in self.masked:
            bit = self.request_bit(a, values.get(a.name, ()), a.name)
            words[bit >> 6] |= 1 << (bit & 63)
        return np.array(words, dtype=np.uint64)

    def request_blooms(self, values: Mapping[str, Sequence[str]]) -> list[np.ndarray]:
        """Per family, its rows: uint64 [max(1, n), bloom_bits // 64] (the sentinel when n
        is 0)."""
        rows = []
        for a in self.families:
            mine = values.get(a.name, ())
            if not mine:
                rows.append(np.full((1, a.bloom_bits // 64), ONES, dtype=np.uint64))
                continue
            rows.append(_rows(self._packed(a, mine), len(mine), a.bloom_bits, a.bloom_hashes))
        return rows

    def _packed(self, a: Attribute, values: Sequence[str]) -> bytes:
        """The values' packed Bloom bits (`_pack`), checked (`check_set`) unless all were
        seen before (a value that passed once passes again)."""
        seen = self._bits[a.name]
        if len(values) <= a.max_request_values:
            with contextlib.suppress(KeyError):  # all seen before: no check, no hashing
                return b"".join(map(seen.__getitem__, values))
        self.check_set(a, values, a.name)
        if len(seen) + len(values) > VALUE_CACHE:
            seen.clear()
        packed = [seen.get(v) or _pack(value_bits(v, a.bloom_bits, a.bloom_hashes)) for v in values]
        seen.update(zip(values, packed, strict=True))
        return b"".join(packed)

    def fits(self, values: Mapping[str, Sequence[str]]) -> bool:
        """Whether a request's values are ones this schema reads (`TargetingError` else)."""
        try:
            self.request_bitmask(values)
            for a in self.families:
                self.check_set(a, values.get(a.name, ()), a.name)
        except TargetingError:
            return False
        return True

    def encode_requests(self, batch: Sequence[Mapping[str, Sequence[str]]]) -> EncodedRequests:
        """A batch of requests' values (by attribute name) as the matcher reads them."""
        per = [self.request_blooms(v) for v in batch]
        width = max((len(r) for rows in per for r in rows), default=1)
        blooms = np.empty((len(batch), width, self.bloom_words), dtype=np.uint64)
        n = np.ones((len(batch), len(self.families)), dtype=np.int32)
        for b, rows in enumerate(per):
            for f, ((at, w), r) in enumerate(zip(self.schema.family_words, rows, strict=True)):
                blooms[b, : len(r), at : at + w] = r
                blooms[b, len(r) :, at : at + w] = r[0]
                n[b, f] = len(r)
        bitmask = np.zeros((len(batch), self.words), dtype=np.uint64)
        for b, v in enumerate(batch):
            bitmask[b] = self.request_bitmask(v)
        return EncodedRequests(bitmask, blooms, n)

    # --- ads ----------------------------------------------------------------------------

    def ad_bitmasks(
        self, include: Mapping[str, Ragged], exclude: Mapping[str, Ragged], n: int
    ) -> np.ndarray:
        """uint64 [N, words] for N ads from their enum/bucket rules as value indices (an
        attribute missing from a mapping: no such rules)."""
        out = np.zeros((n, self.words), dtype=np.uint64)
        for a in self.masked:
            base = self.schema.bit_offsets[a.name]
            full = np.zeros(self.words, dtype=np.uint64)
            _set(full, range(base, base + len(a.labels) + 1))
            rule = include.get(a.name) or Ragged.empty(n)
            counts = np.diff(rule.offsets)
            out[counts == 0] |= full
            _or_bits(out, rule, base)
            gone = exclude.get(a.name)
            if gone is not None and len(gone.values):
                cleared = np.zeros_like(out)
                _or_bits(cleared, gone, base)
                out &= ~cleared
        return out

    def ad_blooms(
        self, include: Mapping[str, Ragged], vocabularies: Mapping[str, np.ndarray], n: int
    ) -> np.ndarray:
        """uint64 [N, bloom_words]: per family the OR of the ad's include values' rows in
        `vocabularies[name]` (`value_blooms` of the family's vocabulary), all ones without."""
        out = np.full((n, self.bloom_words), ONES, dtype=np.uint64)
        for a, (at, _w) in zip(self.families, self.schema.family_words, strict=True):
            rule = include.get(a.name)
            if rule is None:
                continue
            ruled = np.diff(rule.offsets) > 0
            if ruled.any():
                rows = vocabularies[a.name][rule.values]
                out[ruled, at : at + _w] = np.bitwise_or.reduceat(
                    rows, rule.offsets[:-1][ruled], axis=0
                )
        return out


def _or_bits(out: np.ndarray, rule: Ragged, base: int) -> None:
    if len(rule.values):
        rows = np.repeat(np.arange(rule.n), np.diff(rule.offsets))
        bits = base + rule.values.astype(np.int64)
        one = np.left_shift(np.uint64(1), (bits % 64).astype(np.uint64))
        np.bitwise_or.at(out, (rows, bits // 64), one)


_CODECS: dict[str, Codec] = {}
_SEEN: dict[int, tuple[TargetingSchema, Codec]] = {}  # by object: the request path's lookup


def codec(schema: TargetingSchema) -> Codec:
    """The codec of `schema`, made once per distinct schema (looked up by the object
    itself first: a served index's schema is asked for on every request)."""
    seen = _SEEN.get(id(schema))
    if seen is not None and seen[0] is schema:
        return seen[1]
    key = schema.model_dump_json()
    found = _CODECS.get(key)
    if found is None:
        found = _CODECS[key] = Codec(schema)
    if len(_SEEN) >= 64:  # one schema object per loaded index: bounded over many swaps
        _SEEN.clear()
    _SEEN[id(schema)] = (schema, found)  # holds `schema`: its id is not reused meanwhile
    return found


def contains(matchers: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Paper eq. 5: (matcher & query) == query over the last axis (broadcasting)."""
    return np.all((matchers & query) == query, axis=-1)


def blooms_pass(
    schema: TargetingSchema, matchers: np.ndarray, rows: Sequence[np.ndarray]
) -> np.ndarray:
    """Paper eq. 8 per family: matchers uint64 [N, bloom_words], a request's rows per
    family ([L_f, W_f] each) -> bool [N]: ANY row of each family, ALL families."""
    ok = np.ones(len(matchers), dtype=bool)
    for (at, w), r in zip(schema.family_words, rows, strict=True):
        m = matchers[:, at : at + w]
        ok &= contains(m[:, None, :], r[None]).any(axis=1)
    return ok


def any_in(offsets: np.ndarray, ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per ad of a CSR list (`offsets` int64 [N + 1], `ids`): does its list share an id
    with `wanted`? bool [N] (False for an empty list)."""
    counts = np.diff(offsets)
    out = np.zeros(len(counts), dtype=bool)
    ruled = counts > 0
    if ruled.any() and len(ids):
        out[ruled] = np.logical_or.reduceat(np.isin(ids, wanted), offsets[:-1][ruled])
    return out


@dataclass(frozen=True)
class AdRules:
    """N ads' exact targeting, as the ad targeting index holds it (the post stage's)."""

    bitmask: np.ndarray  # uint64 [N, words]: enum/bucket rules, exclusions folded in
    include: Mapping[str, Ragged]  # per set attribute: ids into its vocabulary
    exclude: Mapping[str, Ragged]
    campaign: np.ndarray | None = None  # int64 [N]; 0: none
    advertiser: np.ndarray | None = None  # int64 [N]; 0: none


@dataclass(frozen=True)
class RequestRules:
    """One request's side of the exact test."""

    bitmask: np.ndarray  # uint64 [words]
    ids: Mapping[str, np.ndarray]  # per set attribute: its values' vocabulary ids
    exclude_ads: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int64, any order
    exclude_campaigns: np.ndarray = field(default_factory=lambda: _NO_IDS)
    exclude_advertisers: np.ndarray = field(default_factory=lambda: _NO_IDS)


def exact_eligible(
    schema: TargetingSchema, ad_ids: np.ndarray, ads: AdRules, req: RequestRules
) -> np.ndarray:
    """Exact eligibility of N ads (`ad_ids` int64 [N]) for one request: bool [N]. Set
    attributes compare vocabulary ids, never Bloom bits; a request value absent from the
    vocabulary matches no rule, so the caller leaves it out of `req.ids`."""
    ok = contains(ads.bitmask, req.bitmask)
    for a in schema.families:
        ids = req.ids.get(a.name, np.zeros(0, dtype=np.int32))
        inc = ads.include.get(a.name)
        if inc is not None:
            ok &= (np.diff(inc.offsets) == 0) | any_in(inc.offsets, inc.values, ids)
        exc = ads.exclude.get(a.name)
        if exc is not None:
            ok &= ~any_in(exc.offsets, exc.values, ids)
    ok &= ~np.isin(ad_ids, req.exclude_ads)
    for owner, blocked in ((ads.campaign, req.exclude_campaigns),
                           (ads.advertiser, req.exclude_advertisers)):  # fmt: skip
        if owner is not None and len(blocked):
            ok &= ~np.isin(owner, blocked)
    return ok
