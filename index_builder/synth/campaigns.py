"""Creatives and campaigns: ads that share content but not targeting (docs/SYNTH.md,
"Creatives and campaigns": the knobs, whose neutral values leave a world as it was).

Part of the ads stage. `build_creatives`, `with_markets` and `fresh_ads` run once before
the chunks, each on its own stream, so the ad layout is unchanged; `draw_variants` runs
inside `ads.fill_chunk`, after that chunk's other draws; `creative_summary` describes the
result for `world.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from contracts.targeting_codec import Ragged
from index_builder.synth.advertisers import Advertisers
from index_builder.synth.geography import Geography, sample_within
from index_builder.synth.profiles import AGE_RULES, GLOBAL, LOCAL, NATIONAL, REGIONAL, WorldProfile
from index_builder.trie import splitmix64


@dataclass(frozen=True)
class Creatives:
    """Which creative each ad shows, the creatives' shared content vectors and (with
    `campaign_geo_by_creative`) their campaign markets."""

    creative: np.ndarray  # int32 [N]: creative id of each ad position
    vector: np.ndarray  # float32 [n_creatives, d]: advertiser vector + ad_noise
    advertiser: np.ndarray  # int64 [n_creatives]: whose creative it is
    geo_country: np.ndarray | None = None  # int16 [n_creatives]: market country or -1
    geo_loc: np.ndarray | None = None  # int32 [n_creatives]: market location or -1


def build_creatives(
    p: WorldProfile, adv: Advertisers, owner: np.ndarray, rng: np.random.Generator
) -> Creatives | None:
    """Creative layout of the ads (`owner`: int32 [N] advertiser per ad position); None
    when `ads_per_creative` is 1 (every ad its own content, as without creatives)."""
    if p.ads_per_creative <= 1.0:
        return None
    n_cre = np.maximum(1, np.rint(adv.size / p.ads_per_creative)).astype(np.int64)  # [A]
    start = np.concatenate([[0], np.cumsum(n_cre)])
    pick = (rng.random(len(owner)) * n_cre[owner]).astype(np.int64)
    creative = (start[owner] + pick).astype(np.int32)
    cre_adv = np.repeat(np.arange(adv.n), n_cre)
    noise = rng.standard_normal((len(cre_adv), p.embedding_dim), dtype=np.float32)
    vector = adv.vector[cre_adv] + (p.ad_noise / np.sqrt(p.embedding_dim)) * noise
    return Creatives(creative, vector.astype(np.float32), cre_adv)


def with_markets(
    p: WorldProfile,
    creatives: Creatives,
    geo: Geography,
    adv: Advertisers,
    rng: np.random.Generator,
) -> Creatives:
    """`campaign_geo_by_creative`: each creative draws its campaign market once (as
    `draw_variants` draws one per ad), and every ad of it carries that market."""
    v = draw_variants(p, geo, adv, creatives.advertiser.astype(np.int32), rng)
    return replace(creatives, geo_country=v.geo_country, geo_loc=v.geo_loc)


def fresh_ads(
    p: WorldProfile, creatives: Creatives | None, n_ads: int, rng: np.random.Generator
) -> np.ndarray | None:
    """Which ads launched after the interaction log (bool [n_ads]), drawn per creative
    (its ads launch together) or per ad without creatives; None at `fresh_share` 0."""
    if p.fresh_share <= 0.0:
        return None
    if creatives is None:
        return rng.random(n_ads) < p.fresh_share
    return (rng.random(len(creatives.vector)) < p.fresh_share)[creatives.creative]


def markets(p: WorldProfile, geo: Geography) -> Geography | None:
    """Where campaign variants draw their markets; None when no ad varies its targeting."""
    return geo if p.campaign_geo_share > 0.0 or p.campaign_demo_share > 0.0 else None


@dataclass(frozen=True)
class Variants:
    """Per-ad campaign targeting of one chunk; -1 / False = the advertiser's rule."""

    geo_country: np.ndarray  # int16 [n]: the one targeted country (COUNTRIES index)
    geo_loc: np.ndarray  # int32 [n]: the one targeted location id, -1 = none
    demo: np.ndarray  # bool [n]: age and gender below replace the ad's own
    age_lo: np.ndarray  # int8 [n]
    age_hi: np.ndarray  # int8 [n]
    gender: np.ndarray  # int8 [n]: GENDERS index, -1 = no rule


def draw_variants(
    p: WorldProfile, geo: Geography, adv: Advertisers, a: np.ndarray, rng: np.random.Generator
) -> Variants:
    """Campaign variants of ads whose advertisers are `a` (int32 [n])."""
    n = len(a)
    style, home = adv.style[a], adv.home_country[a].astype(np.int64)
    home_region = geo.city_region[adv.home_city[a]].astype(np.int64)
    u = rng.random((4, n))
    anywhere = np.searchsorted(geo.country_cum, u[0], side="right") - 1
    country = np.where(style == GLOBAL, np.clip(anywhere, 0, geo.n_countries - 1), home)
    country = np.where(style == NATIONAL, geo.neighbour(home, u[1]), country)
    r_lo, r_hi = geo.region_start[home], geo.region_start[home + 1]
    k_lo, k_hi = geo.city_start[home_region], geo.city_start[home_region + 1]
    region = sample_within(geo.region_cum, r_lo, r_hi, u[2])
    city = sample_within(geo.city_cum, k_lo, k_hi, u[3])
    loc = np.where(style == REGIONAL, geo.region_loc(region), -1)
    loc = np.where(style == LOCAL, geo.city_loc(city), loc)
    geo_on = rng.random(n) < p.campaign_geo_share

    rules = np.array([(lo, hi) for lo, hi, _ in AGE_RULES], dtype=np.int8)
    rule_w = np.array([w for *_, w in AGE_RULES])
    band = rng.choice(len(rules), size=n, p=rule_w / rule_w.sum())
    has_gender = rng.random(n) < 0.5
    female = rng.random(n) < p.female_rule_share
    return Variants(
        geo_country=np.where(geo_on, geo.iso_index[country], -1).astype(np.int16),
        geo_loc=np.where(geo_on, loc, -1).astype(np.int32),
        demo=rng.random(n) < p.campaign_demo_share,
        age_lo=rules[band, 0],
        age_hi=rules[band, 1],
        gender=np.where(has_gender, np.where(female, 0, 1), -1).astype(np.int8),
    )


def targeting_keys(bitmask: np.ndarray, locations: Ragged) -> np.ndarray:
    """uint64 [n]: equal for ads with equal rules (bitmask rows [n, W] are exact for
    country / age / gender; location lists are hashed as sets)."""
    with np.errstate(over="ignore"):
        key = np.zeros(len(bitmask), dtype=np.uint64)
        for w in range(bitmask.shape[1]):
            key = splitmix64(key ^ splitmix64(bitmask[:, w] + np.uint64(w)))
        lengths = np.diff(locations.offsets)
        loc_hash = splitmix64(locations.values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        rows = np.repeat(np.arange(len(bitmask)), lengths)
        per_ad = np.zeros(len(bitmask), dtype=np.uint64)
        np.add.at(per_ad, rows, loc_hash)
        return splitmix64(key ^ per_ad)


def creative_summary(creative: np.ndarray, keys: np.ndarray) -> dict[str, float | int]:
    """Creative sizes and how often the ads of one creative differ in targeting."""
    order = np.lexsort((keys, creative))
    c, k = creative[order], keys[order]
    new_c = np.r_[True, c[1:] != c[:-1]]
    new_pair = new_c | np.r_[True, k[1:] != k[:-1]]
    size = np.diff(np.r_[np.flatnonzero(new_c), len(c)])  # [non-empty creatives]
    distinct = np.add.reduceat(new_pair.astype(np.int64), np.flatnonzero(new_c))
    multi = size > 1
    return {
        "creatives": len(size),
        "mean_ads_per_creative": float(size.mean()),
        "p50_ads_per_creative": float(np.quantile(size, 0.5)),
        "p99_ads_per_creative": float(np.quantile(size, 0.99)),
        "max_ads_per_creative": int(size.max()),
        "mean_targetings_per_creative": float(distinct.mean()),
        "share_multi_targeting": float((distinct > 1).mean()),
        "share_multi_targeting_of_multi_ad": float((distinct[multi] > 1).mean())
        if multi.any()
        else 0.0,
    }
