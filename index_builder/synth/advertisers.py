"""Advertisers: Zipf sizes, topics, home places and targeting styles (docs/SYNTH.md).

An advertiser owns what its ads share: a topic vector (ads are noisy copies of it, so
SIDs cluster by advertiser and topic), a popularity, a home city, and a targeting style
(table in docs/SYNTH.md) with up to `SLOTS` targeted countries and location strings.
Per-ad variation (which slots an ad keeps, a jittered age range) is drawn in `ads.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from index_builder.synth.geography import Geography, sample_within, zipf_weights
from index_builder.synth.profiles import AGE_RULES, GLOBAL, LOCAL, NATIONAL, REGIONAL, WorldProfile

SLOTS = 4  # targeted countries / location strings per advertiser, at most


@dataclass(frozen=True)
class Topics:
    """Latent content topics shared by advertisers and user interests."""

    centroids: np.ndarray  # float32 [T, d], unit rows
    weights: np.ndarray  # float64 [T]: how common each topic is


def build_topics(p: WorldProfile, rng: np.random.Generator) -> Topics:
    c = rng.standard_normal((p.n_topics, p.embedding_dim))
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    return Topics(c.astype(np.float32), zipf_weights(p.n_topics, p.topic_zipf))


@dataclass(frozen=True)
class Advertisers:
    """Per-advertiser arrays, indexed by advertiser id (0..A-1)."""

    size: np.ndarray  # int64 [A]: number of ads
    style: np.ndarray  # int8 [A]: GLOBAL / NATIONAL / REGIONAL / LOCAL
    home_city: np.ndarray  # int32 [A]
    home_country: np.ndarray  # int32 [A]: geography country index
    country_slots: np.ndarray  # int32 [A, SLOTS]: targeting_schema.COUNTRIES indices, -1 = empty
    loc_slots: np.ndarray  # int32 [A, SLOTS]: location vocabulary ids, -1 = empty
    age_lo: np.ndarray  # int8 [A]: first AGE_BUCKETS index of the rule, -1 = no rule
    age_hi: np.ndarray  # int8 [A]: last bucket (inclusive)
    gender: np.ndarray  # int8 [A]: GENDERS index, -1 = no rule
    topic: np.ndarray  # int32 [A]
    vector: np.ndarray  # float32 [A, d]: unit topic vector
    popularity: np.ndarray  # float32 [A]

    @property
    def n(self) -> int:
        return len(self.size)


def zipf_sizes(n_ads: int, n_adv: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Advertiser sizes ~ rank^-s, each >= 1, summing exactly to n_ads; shuffled: int64."""
    w = zipf_weights(n_adv, s)
    sizes = 1 + np.floor(w * (n_ads - n_adv)).astype(np.int64)
    sizes[: n_ads - int(sizes.sum())] += 1  # hand the rounding remainder to the largest
    return rng.permutation(sizes)


def _dedupe_rows(slots: np.ndarray) -> None:
    """Blank (-1) repeated values within each row, keeping the first occurrence."""
    for j in range(1, slots.shape[1]):
        dup = (slots[:, j, None] == slots[:, :j]).any(axis=1)
        slots[dup, j] = -1


def build_advertisers(
    p: WorldProfile, geo: Geography, topics: Topics, rng: np.random.Generator
) -> Advertisers:
    n_adv = max(1, min(p.n_ads, round(p.n_ads / p.ads_per_advertiser)))
    size = zipf_sizes(p.n_ads, n_adv, p.advertiser_zipf, rng)
    style = rng.choice(len(p.style_mix), size=n_adv, p=p.style_mix).astype(np.int8)
    home_city = rng.choice(geo.n_cities, size=n_adv, p=geo.city_weight).astype(np.int32)
    home_region = geo.city_region[home_city].astype(np.int64)
    home_country = geo.region_country[home_region]

    # countries: [home] for every style but global, plus neighbours for some national ones
    country_slots = np.full((n_adv, SLOTS), -1, dtype=np.int32)
    country_slots[:, 0] = np.where(style == GLOBAL, -1, geo.iso_index[home_country])
    n_nb = np.where(
        (style == NATIONAL) & (rng.random(n_adv) < p.neighbour_country_share),
        rng.integers(1, SLOTS, size=n_adv),
        0,
    )
    for j in range(1, SLOTS):
        pick = geo.neighbour(home_country, rng.random(n_adv))
        country_slots[:, j] = np.where(n_nb >= j, geo.iso_index[pick], -1)
    _dedupe_rows(country_slots)

    # locations: region strings (regional), cities or neighbourhoods (local)
    loc_slots = np.full((n_adv, SLOTS), -1, dtype=np.int32)
    c_lo, c_hi = geo.region_start[home_country], geo.region_start[home_country + 1]
    r_lo, r_hi = geo.city_start[home_region], geo.city_start[home_region + 1]
    n_lo, n_hi = geo.nbhd_start[home_city], geo.nbhd_start[home_city + 1]
    regional, local = style == REGIONAL, style == LOCAL
    by_nbhd = local & (rng.random(n_adv) < 0.4)
    by_city = local & ~by_nbhd
    n_extra_region = rng.choice(SLOTS, size=n_adv, p=(0.5, 0.25, 0.15, 0.10))
    n_extra_city = rng.choice(SLOTS, size=n_adv, p=(0.4, 0.3, 0.2, 0.1))
    n_nbhd = rng.choice(SLOTS, size=n_adv, p=(0.35, 0.3, 0.2, 0.15)) + 1
    loc_slots[regional, 0] = geo.region_loc(home_region[regional])
    loc_slots[by_city, 0] = geo.city_loc(home_city[by_city])
    for j in range(SLOTS):
        if j:
            r = sample_within(geo.region_cum, c_lo, c_hi, rng.random(n_adv))
            m = regional & (n_extra_region >= j)
            loc_slots[m, j] = geo.region_loc(r[m])
            k = sample_within(geo.city_cum, r_lo, r_hi, rng.random(n_adv))
            m = by_city & (n_extra_city >= j)
            loc_slots[m, j] = geo.city_loc(k[m])
        nb = sample_within(geo.nbhd_cum, n_lo, n_hi, rng.random(n_adv))
        m = by_nbhd & (n_nbhd > j)
        loc_slots[m, j] = geo.nbhd_loc(nb[m])
    _dedupe_rows(loc_slots)
    # keep filled slots first so slot 0 (always kept per ad) is never empty
    order = np.argsort(loc_slots < 0, axis=1, kind="stable")
    loc_slots = np.take_along_axis(loc_slots, order, axis=1)

    # demographic rules
    rules = np.array([(lo, hi) for lo, hi, _ in AGE_RULES], dtype=np.int8)
    rule_w = np.array([w for *_, w in AGE_RULES])
    pick = rng.choice(len(rules), size=n_adv, p=rule_w / rule_w.sum())
    has_age = rng.random(n_adv) < p.age_rule_share
    age_lo = np.where(has_age, rules[pick, 0], -1).astype(np.int8)
    age_hi = np.where(has_age, rules[pick, 1], -1).astype(np.int8)
    has_gender = rng.random(n_adv) < p.gender_rule_share
    female = rng.random(n_adv) < p.female_rule_share
    gender = np.where(has_gender, np.where(female, 0, 1), -1).astype(np.int8)

    topic = rng.choice(p.n_topics, size=n_adv, p=topics.weights).astype(np.int32)
    noise = rng.standard_normal((n_adv, p.embedding_dim)) / np.sqrt(p.embedding_dim)
    vec = topics.centroids[topic] + p.advertiser_topic_noise * noise
    vec /= np.linalg.norm(vec, axis=1, keepdims=True)
    return Advertisers(
        size=size,
        style=style,
        home_city=home_city,
        home_country=home_country.astype(np.int32),
        country_slots=country_slots,
        loc_slots=loc_slots,
        age_lo=age_lo,
        age_hi=age_hi,
        gender=gender,
        topic=topic,
        vector=vec.astype(np.float32),
        popularity=rng.lognormal(0.0, 0.5, size=n_adv).astype(np.float32),
    )
