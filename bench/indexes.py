"""The indexes and requests the decode benchmarks run on (bench/bench_decoder_loop.py):
a published index, or a synthetic one whose trie has the paper's fan-out per level, and
requests that some ad of the index is eligible for.

`synthetic_catalog`: ads with a realistic mix of targeting rules (country / age / gender
rules, hierarchical location rules) on random SIDs; `requests_for`: each request copies
one ad's rules and carries a given number of locations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contracts.index_format import VOCAB_SIZE, IndexArrays, read_index_dir
from contracts.targeting import (
    AGE,
    AGE_BUCKETS,
    COUNTRY,
    GENDER,
    GENDERS,
    Ragged,
    Targeting,
    ad_bitmasks,
    country_index,
)
from index_builder.build import build_arrays
from index_builder.catalog import Catalog, SetRules
from index_builder.publish import resolve

HOME_COUNTRIES = ("US", "GB", "DE", "FR", "BR", "IN", "JP", "CA", "MX", "AU", "ES", "IT")
REGIONS, CITIES = 20, 25  # per country, per region


def _ragged(counts: np.ndarray, values: np.ndarray) -> Ragged:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Ragged(offsets, values.astype(np.int32))


def synthetic_catalog(
    n_ads: int, ads_per_sid: int = 2, first_tokens: int = 32, seed: int = 0
) -> tuple[Catalog, np.ndarray]:
    """Ads with a realistic mix of targeting rules on random SIDs: (catalog, sids [N, 4])."""
    rng = np.random.default_rng(seed)
    weight = 1.0 / np.arange(1, len(HOME_COUNTRIES) + 1)  # Zipf: the US market is largest
    home = rng.choice(len(HOME_COUNTRIES), n_ads, p=weight / weight.sum())
    home_idx = np.array([country_index(c) for c in HOME_COUNTRIES])
    # countries: 15 % global, 70 % the home market, 15 % the home market and 1-3 more
    n_c = np.where(rng.random(n_ads) < 0.15, 0, 1)
    extra = np.where(rng.random(n_ads) < 0.15 / 0.85, rng.integers(1, 4, n_ads), 0) * n_c
    n_c = n_c + extra
    c_vals = home_idx[rng.integers(0, len(home_idx), n_c.sum())]
    ruled = n_c > 0
    c_vals[(np.cumsum(n_c) - n_c)[ruled]] = home_idx[home[ruled]]  # the home market first
    # ages: 60 % no rule, else a run of 1-4 consecutive buckets
    n_a = np.where(rng.random(n_ads) < 0.6, 0, rng.integers(1, 5, n_ads))
    lo = rng.integers(0, len(AGE_BUCKETS) - n_a + 1)
    a_vals = np.repeat(lo, n_a) + (np.arange(n_a.sum()) - np.repeat(np.cumsum(n_a) - n_a, n_a))
    # genders: 85 % no rule
    n_g = (rng.random(n_ads) < 0.15).astype(np.int64)
    g_vals = rng.integers(0, len(GENDERS), n_g.sum())
    bitmask = ad_bitmasks(_ragged(n_c, c_vals), _ragged(n_a, a_vals), _ragged(n_g, g_vals))
    # locations "CC", "CC/Rr", "CC/Rr/Cc": 55 % none, 25 % 1-2 regions, 20 % 1-10 cities
    names = [
        s
        for c in HOME_COUNTRIES
        for r in range(REGIONS)
        for s in (c, f"{c}/R{r}", *(f"{c}/R{r}/C{k}" for k in range(CITIES)))
    ]
    vocab = np.array(sorted(set(names)), dtype=object)
    ids = {s: i for i, s in enumerate(vocab)}
    regions = np.array([[ids[f"{c}/R{r}"] for r in range(REGIONS)] for c in HOME_COUNTRIES])
    cities = np.array(
        [[ids[f"{c}/R{r}/C{k}"] for r in range(REGIONS) for k in range(CITIES)]
         for c in HOME_COUNTRIES]
    )  # fmt: skip
    kind = rng.random(n_ads)
    n_l = np.where(kind < 0.55, 0, np.where(kind < 0.8, rng.integers(1, 3, n_ads), 0))
    n_l = np.where(kind >= 0.8, rng.integers(1, 11, n_ads), n_l)
    owner = np.repeat(np.arange(n_ads), n_l)
    is_city = np.repeat(kind >= 0.8, n_l)
    h = home[owner]
    l_vals = np.where(
        is_city,
        cities[h, rng.integers(0, REGIONS * CITIES, len(owner))],
        regions[h, rng.integers(0, REGIONS, len(owner))],
    )
    key = np.unique(owner.astype(np.int64) * len(vocab) + l_vals)  # sorted, unique per ad
    owner, l_vals = key // len(vocab), key % len(vocab)
    locs = _ragged(np.bincount(owner, minlength=n_ads), l_vals)
    # SIDs: the first token from `first_tokens` values only, so that a 1 M-SID trie has
    # the fan-out per level of the paper's 30 M SIDs over 512 first tokens (512, 512,
    # ~60, ~1 children for the nodes of steps 1..4), the rest uniform
    n_sids = max(1, n_ads // ads_per_sid)
    rest = rng.choice(VOCAB_SIZE**3, size=n_sids, replace=False)
    codes = np.unique(rng.integers(0, first_tokens, n_sids) * VOCAB_SIZE**3 + rest)
    digits = (codes[:, None] // VOCAB_SIZE ** np.arange(3, -1, -1)) % VOCAB_SIZE
    sids = digits[rng.integers(0, len(digits), n_ads)]
    catalog = Catalog(
        ad_id=np.arange(n_ads, dtype=np.int64),
        sid=sids.astype(np.int32),
        embedding=None,
        bitmask=bitmask,
        sets={"locations": SetRules(locs, None, vocab)},
        source="<synthetic>",
    )
    return catalog, sids


def synthetic_index(
    n_ads: int, ads_per_sid: int = 2, first_tokens: int = 32, seed: int = 0
) -> IndexArrays:
    catalog, sids = synthetic_catalog(n_ads, ads_per_sid, first_tokens, seed)
    return build_arrays(catalog, sids)


def load_index(root: Path) -> IndexArrays:
    _, arrays = read_index_dir(resolve(root), verify_checksums=False)
    return arrays


# --------------------------------------------------------------------------- requests


def _set_bits(words: np.ndarray, lo: int, n: int) -> list[int]:
    bits = np.arange(lo, lo + n)
    on = ((words[bits // 64] >> (bits % 64).astype(np.uint64)) & np.uint64(1)) == 1
    return bits[on].tolist()


def requests_for(index: IndexArrays, batch: int, n_loc: int, seed: int) -> list[Targeting]:
    """Requests that some ad of the index is eligible for: each copies a random ad's
    rules (one allowed country, age bucket and gender) and carries n_loc locations —
    the ad's own, then ones of the same country, then any."""
    rng = np.random.default_rng(seed)
    ads = index.ads
    locations = ads.sets["locations"]
    vocab = locations.strings()
    by_country: dict[str, list[str]] = {}
    for s in vocab:
        by_country.setdefault(s.split("/")[0], []).append(s)
    out = []
    for ad in rng.choice(ads.num_ads, batch, replace=False).tolist():
        words = ads.ad_bitmask[ad]
        countries = _set_bits(words, COUNTRY.offset, len(COUNTRY.values))
        ages = _set_bits(words, AGE.offset, len(AGE.values))
        genders = _set_bits(words, GENDER.offset, len(GENDER.values))
        lo, hi = locations.include_offsets[ad], locations.include_offsets[ad + 1]
        own = [vocab[i] for i in locations.include_ids[lo:hi].tolist()]
        country = COUNTRY.values[rng.choice(countries) - COUNTRY.offset] if countries else ""
        if len(countries) == len(COUNTRY.values):  # no country rule: where its places are
            home = own[0].split("/")[0] if own else ""
            country = home if country_index(home) is not None else "US"
        age = 0
        if ages:
            bucket = AGE.values[rng.choice(ages) - AGE.offset]
            age = int(bucket.rstrip("+").split("-")[0])
        gender = GENDER.values[rng.choice(genders) - GENDER.offset] if genders else ""
        near = by_country.get(own[0].split("/")[0] if own else country, [])
        picks = list(dict.fromkeys(own))
        for pool in (near, vocab):
            extra = [pool[i] for i in rng.permutation(len(pool))[: 2 * n_loc]]
            picks += [s for s in extra if s not in picks][: n_loc - len(picks)]
        out.append(Targeting(country, age, gender, tuple(picks[:n_loc])))
    return out
