"""Ads: compact per-ad state, drawn in fixed-size chunks (docs/SYNTH.md "The world").

Ads stage of the synth flow (… advertisers → **ads** → users → histories). An ad is its
advertiser plus a few bytes of per-ad variation (`AdState`), so 30 M ads cost ~30 bytes
each plus one float32 embedding row in a memory-mapped file. `rules_of` turns any subset
of ads back into the contract's `targeting_codec.Ragged` rule lists, for the catalog writer,
the history sampler and the eligibility estimate. Chunk k always draws from
`stream(seed, "ads", k)`, so the world is identical however it is streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.targeting import AGE_BUCKETS
from contracts.targeting_codec import Ragged, codec
from contracts.targeting_schema import COUNTRIES, DEFAULT
from index_builder.parallel import take_segments
from index_builder.synth.advertisers import SLOTS, Advertisers
from index_builder.synth.campaigns import Creatives, draw_variants
from index_builder.synth.geography import Geography
from index_builder.synth.profiles import NATIONAL, WorldProfile

_MASK48 = np.uint64((1 << 48) - 1)


def mix_ids(index: np.ndarray, salt: int) -> np.ndarray:
    """Distinct large ids from distinct indices (< 2^48): a bijection on 48 bits. int64."""
    x = (index.astype(np.uint64) ^ np.uint64(salt & ((1 << 48) - 1))) & _MASK48
    x = (x * np.uint64(0x9E3779B97F4B)) & _MASK48  # odd multiplier: bijective mod 2^48
    x ^= x >> np.uint64(23)
    x = (x * np.uint64(0xD6E8FEB86659)) & _MASK48
    x ^= x >> np.uint64(19)
    return (x + np.uint64(1)).astype(np.int64)  # 0 is never an id


@dataclass(frozen=True)
class AdState:
    """Per-ad arrays, indexed by ad position 0..N-1 (the catalog row order)."""

    advertiser: np.ndarray  # int32 [N]
    ad_id: np.ndarray  # int64 [N], unique, not dense
    age_lo: np.ndarray  # int8 [N], -1 = no age rule
    age_hi: np.ndarray  # int8 [N]
    gender: np.ndarray  # int8 [N], -1 = no gender rule
    keep: np.ndarray  # uint8 [N]: bit j = advertiser slot j in use (slot 0 always)
    popularity: np.ndarray  # float32 [N]
    geo_country: np.ndarray  # int16 [N]: campaign market country (COUNTRIES), -1 = none
    geo_loc: np.ndarray  # int32 [N]: campaign market location id, -1 = none
    embedding: np.ndarray  # float32 [N, d] (memory-mapped)

    @property
    def n(self) -> int:
        return len(self.advertiser)


def allocate_ads(
    adv: Advertisers, embedding: np.ndarray, seed: int, rng: np.random.Generator
) -> AdState:
    """Shuffle ads over advertisers and assign ids; per-ad fields are filled by chunks."""
    owner = rng.permutation(np.repeat(np.arange(adv.n, dtype=np.int32), adv.size))
    n = len(owner)
    return AdState(
        advertiser=owner,
        ad_id=mix_ids(np.arange(n, dtype=np.int64), salt=seed * 0x5851F42D + 1),
        age_lo=np.empty(n, dtype=np.int8),
        age_hi=np.empty(n, dtype=np.int8),
        gender=np.empty(n, dtype=np.int8),
        keep=np.empty(n, dtype=np.uint8),
        popularity=np.empty(n, dtype=np.float32),
        geo_country=np.full(n, -1, dtype=np.int16),
        geo_loc=np.full(n, -1, dtype=np.int32),
        embedding=embedding,
    )


def fill_chunk(
    p: WorldProfile,
    adv: Advertisers,
    ads: AdState,
    lo: int,
    hi: int,
    rng: np.random.Generator,
    creatives: Creatives | None = None,
    markets: Geography | None = None,  # `campaigns.markets`
) -> None:
    """Draw the per-ad variation of ads [lo, hi) in place."""
    n = hi - lo
    a = ads.advertiser[lo:hi]
    if creatives is None:
        base, noise = adv.vector[a], p.ad_noise
    else:
        base, noise = creatives.vector[creatives.creative[lo:hi]], p.creative_noise
    z = rng.standard_normal((n, p.embedding_dim), dtype=np.float32)
    ads.embedding[lo:hi] = base + (noise / np.sqrt(p.embedding_dim)) * z
    popularity = rng.lognormal(0.0, p.popularity_sigma, size=n).astype(np.float32)
    ads.popularity[lo:hi] = adv.popularity[a] * popularity

    # age: shift one end of the advertiser's range by one bucket, staying contiguous
    age_lo, age_hi = adv.age_lo[a].astype(np.int16), adv.age_hi[a].astype(np.int16)
    jitter = (age_lo >= 0) & (rng.random(n) < p.rule_jitter)
    step = rng.choice(np.array([-1, 1], dtype=np.int16), size=n)
    low_end = rng.random(n) < 0.5
    age_lo = np.where(jitter & low_end, np.clip(age_lo + step, 0, age_hi), age_lo)
    age_hi = np.where(
        jitter & ~low_end, np.clip(age_hi + step, age_lo, len(AGE_BUCKETS) - 1), age_hi
    )
    ads.age_lo[lo:hi], ads.age_hi[lo:hi] = age_lo, age_hi
    drop_gender = rng.random(n) < p.rule_jitter / 2
    ads.gender[lo:hi] = np.where(drop_gender, -1, adv.gender[a])

    bits = (rng.random((n, SLOTS)) < p.slot_keep).astype(np.uint8)
    bits[:, 0] = 1
    ads.keep[lo:hi] = (bits << np.arange(SLOTS, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    if markets is not None:  # drawn last: the draws above stay those of a plain world
        v = draw_variants(p, markets, adv, a, rng)
        ads.geo_country[lo:hi], ads.geo_loc[lo:hi] = v.geo_country, v.geo_loc
        if creatives is not None and creatives.geo_country is not None:  # per creative
            assert creatives.geo_loc is not None
            mine = creatives.creative[lo:hi]
            ads.geo_country[lo:hi] = creatives.geo_country[mine]
            ads.geo_loc[lo:hi] = creatives.geo_loc[mine]
        for name in ("age_lo", "age_hi", "gender"):
            mine = getattr(ads, name)[lo:hi]
            mine[v.demo] = getattr(v, name)[v.demo]


def _ragged(slots: np.ndarray, mask: np.ndarray) -> Ragged:
    lengths = mask.sum(axis=1)
    offsets = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(offsets, slots[mask].astype(np.int32))


def _ranges(lo: np.ndarray, hi: np.ndarray) -> Ragged:
    lengths = np.where(lo >= 0, hi.astype(np.int64) - lo + 1, 0)
    offsets = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    return Ragged(offsets, (np.repeat(lo.astype(np.int64), lengths) + within).astype(np.int32))


@dataclass(frozen=True)
class AdRules:
    """Targeting rules of a set of ads, as the contract's ragged value indices."""

    countries: Ragged  # values index COUNTRIES
    age_buckets: Ragged  # values index AGE_BUCKETS
    genders: Ragged  # values index GENDERS
    locations: Ragged  # values are location vocabulary ids
    # int64 [n] per attribute above: rows with equal keys hold equal lists, so a writer
    # can serialise each distinct list once
    row_keys: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

    def bitmasks(self) -> np.ndarray:
        """Exact low-cardinality matchers by the default schema: uint64 [n, words]."""
        rules = {"country": self.countries, "age": self.age_buckets, "gender": self.genders}
        return codec(DEFAULT).ad_bitmasks(rules, {}, self.countries.n)


def rules_of(adv: Advertisers, ads: AdState, idx: np.ndarray | slice) -> AdRules:
    """The targeting rules of ads `idx` (positions or a slice), in that order."""
    a = ads.advertiser[idx]
    keep = ((ads.keep[idx][:, None] >> np.arange(SLOTS, dtype=np.uint8)) & 1) > 0
    c_slots, l_slots = adv.country_slots[a], adv.loc_slots[a]  # copies: fancy indexing
    slot_key = a.astype(np.int64) << 8 | ads.keep[idx]  # the slots depend on these only
    gc, gl = ads.geo_country[idx], ads.geo_loc[idx]
    market = gc >= 0
    if market.any():  # a campaign market replaces the advertiser's geo rule entirely
        c_slots[market], l_slots[market] = -1, -1
        c_slots[market, 0], l_slots[market, 0] = gc[market], gl[market]
        keep |= market[:, None]
        own = (gc[market].astype(np.int64) + 1) << 32 | (gl[market].astype(np.int64) + 1)
        slot_key[market] = 1 << 62 | own  # apart from every advertiser's (a << 8 | keep)
    c_mask = (c_slots >= 0) & (keep | (adv.style[a] != NATIONAL)[:, None])
    g = ads.gender[idx]
    has_g = g >= 0
    age_key = (ads.age_lo[idx].astype(np.int64) + 1) << 4 | (ads.age_hi[idx] + 1)
    return AdRules(
        countries=_ragged(c_slots, c_mask),
        age_buckets=_ranges(ads.age_lo[idx], ads.age_hi[idx]),
        genders=_ragged(g[:, None].astype(np.int32), has_g[:, None]),
        locations=_ragged(l_slots, (l_slots >= 0) & keep),
        row_keys=(slot_key, age_key, g.astype(np.int64), slot_key),
    )


GLOBAL_KEY = len(COUNTRIES)  # key after the per-country keys (see `pool_keys`)


def pool_keys(rules: AdRules, positions: np.ndarray, n_locations: int) -> tuple[np.ndarray, ...]:
    """Candidate-pool keys of ads: (key int64 [m], ad position int64 [m]).

    An ad with a location rule is keyed by each of its location ids; else, with a country
    rule, by `n_locations + country`; else by `n_locations + GLOBAL_KEY`. A user's pool
    (global ∪ own country ∪ own locations) is then a superset of the ads it is eligible
    for, so sampling from it never misses an eligible ad.
    """
    n_loc = np.diff(rules.locations.offsets)
    n_c = np.diff(rules.countries.offsets)
    by_country = (n_loc == 0) & (n_c > 0)
    glob = (n_loc == 0) & (n_c == 0)
    c_rows = np.repeat(by_country, n_c)
    loc_keys = rules.locations.values.astype(np.int64)
    country_keys = n_locations + rules.countries.values[c_rows].astype(np.int64)
    global_keys = np.full(int(glob.sum()), n_locations + GLOBAL_KEY, dtype=np.int64)
    pos = [np.repeat(positions, n_loc), np.repeat(positions, n_c)[c_rows], positions[glob]]
    return np.concatenate([loc_keys, country_keys, global_keys]), np.concatenate(pos)


@dataclass(frozen=True)
class EncodedAds:
    """Exact matchers of every ad, as `histories.eligible_for` reads them."""

    bitmask: np.ndarray  # uint64 [N, words]: `AdRules.bitmasks` (or the world's schema's)
    loc_offsets: np.ndarray  # int64 [N + 1] into loc_ids
    loc_ids: np.ndarray  # int32 [nnz]: location vocabulary ids (empty = no rule)

    @classmethod
    def allocate(cls, n: int) -> EncodedAds:
        return cls(
            np.empty((n, DEFAULT.bitmask_words), dtype=np.uint64),
            np.zeros(n + 1, dtype=np.int64),
            np.zeros(0, dtype=np.int32),
        )

    def store(self, lo: int, bitmask: np.ndarray, locations: Ragged) -> None:
        """Record already-encoded ads [lo, lo + len(bitmask)): bitmask rows and the lengths
        of their location rules."""
        n = len(bitmask)
        self.bitmask[lo : lo + n] = bitmask
        self.loc_offsets[lo + 1 : lo + n + 1] = np.diff(locations.offsets)

    @classmethod
    def finish(cls, partial: EncodedAds, loc_chunks: list[np.ndarray]) -> EncodedAds:
        """Turn the recorded lengths into offsets and join the location ids."""
        offsets = np.cumsum(partial.loc_offsets)
        ids = np.concatenate(loc_chunks) if loc_chunks else np.zeros(0, np.int32)
        return cls(partial.bitmask, offsets, ids)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bitmask rows, location offsets, location ids) of ads `idx`, in that order."""
        offsets, flat = take_segments(self.loc_offsets, idx)
        return self.bitmask[idx], offsets, self.loc_ids[flat]
