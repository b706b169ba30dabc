"""The indexes and requests the decode benchmarks run on (bench/bench_decoder_loop.py):
a published index, or a synthetic one whose trie has the paper's fan-out per level, and
requests that some ad of the index is eligible for.

`synthetic_catalog`: ads with a realistic mix of targeting rules (country / age / gender
rules, hierarchical location rules) on random SIDs, and under the `RICH` schema two more
enum attributes and two set attributes (audiences with exclusions, interests);
`requests_for`: each request copies one ad's rules and carries a given number of
locations (and 256 audiences, 32 interests under `RICH`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contracts.index_arrays import IndexArrays
from contracts.index_format import VOCAB_SIZE, read_index_dir
from contracts.index_manifest import manifest_schema
from contracts.targeting import AGE_BUCKETS, GENDERS, Targeting, country_index
from contracts.targeting_codec import Ragged, codec
from contracts.targeting_schema import DEFAULT, Attribute, TargetingSchema
from index_builder.build import build_arrays
from index_builder.catalog import Catalog, SetRules
from index_builder.publish import resolve

HOME_COUNTRIES = ("US", "GB", "DE", "FR", "BR", "IN", "JP", "CA", "MX", "AU", "ES", "IT")
REGIONS, CITIES = 20, 25  # per country, per region
# issue #47's rich schema: two more enums, audiences (256 values a request), interests (32)
RICH = TargetingSchema(attributes=(
    *DEFAULT.attributes,
    Attribute(name="platform", kind="enum", catalog_field="platforms",
              values=("ios", "android", "web")),
    Attribute(name="device", kind="enum", catalog_field="devices",
              values=("phone", "tablet", "desktop", "tv")),
    Attribute(name="audiences", kind="set", catalog_field="audiences", max_request_values=256,
              bloom_bits=1024),
    Attribute(name="interests", kind="set", catalog_field="interests", max_request_values=32),
))  # fmt: skip
SCHEMAS = {"default": DEFAULT, "rich": RICH}
# (share of ads with a rule, most values, values to draw from, Zipf exponent or 0)
RICH_RULES = {"platforms": (0.3, 2, 3, 0.0), "devices": (0.2, 3, 4, 0.0),
              "audiences": (0.3, 10, 20_000, 1.0), "audiences_exclude": (0.1, 3, 20_000, 1.0),
              "interests": (0.4, 5, 1_000, 0.0)}  # fmt: skip


def _ragged(counts: np.ndarray, values: np.ndarray) -> Ragged:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Ragged(offsets, values.astype(np.int32))


def _lists(rng: np.random.Generator, n_ads: int, field: str) -> Ragged:
    """Each ad's sorted, unique values of one `RICH_RULES` field."""
    share, most, pool, zipf = RICH_RULES[field]
    counts = np.where(rng.random(n_ads) < share, rng.integers(1, most + 1, n_ads), 0)
    weight = 1.0 / np.arange(1, pool + 1) ** zipf
    values = rng.choice(pool, counts.sum(), p=weight / weight.sum())
    key = np.unique(np.repeat(np.arange(n_ads, dtype=np.int64), counts) * pool + values)
    return _ragged(np.bincount(key // pool, minlength=n_ads), key % pool)


def synthetic_catalog(
    n_ads: int,
    ads_per_sid: int = 2,
    first_tokens: int = 32,
    seed: int = 0,
    schema: TargetingSchema = DEFAULT,
) -> tuple[Catalog, np.ndarray]:
    """Ads with a realistic mix of targeting rules on random SIDs: (catalog, sids [N, 4]);
    `schema`: `DEFAULT` or `RICH`."""
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
    include = {"country": _ragged(n_c, c_vals), "age": _ragged(n_a, a_vals),
               "gender": _ragged(n_g, g_vals)}  # fmt: skip
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
    sets = {"locations": SetRules(locs, None, vocab)}
    if schema == RICH:
        extra = np.random.default_rng(seed + 1)  # the default columns' draws stay the same
        include |= {"platform": _lists(extra, n_ads, "platforms"),
                    "device": _lists(extra, n_ads, "devices")}  # fmt: skip
        for name, letter in (("audiences", "a"), ("interests", "i")):
            pool = RICH_RULES[name][2]
            words = np.array([f"{letter}{i:05d}" for i in range(pool)], dtype=object)
            excluded = _lists(extra, n_ads, f"{name}_exclude") if name == "audiences" else None
            sets[name] = SetRules(_lists(extra, n_ads, name), excluded, words)
    catalog = Catalog(
        ad_id=np.arange(n_ads, dtype=np.int64),
        sid=sids.astype(np.int32),
        embedding=None,
        bitmask=codec(schema).ad_bitmasks(include, {}, n_ads),
        sets=sets,
        source="<synthetic>",
        schema=schema,
    )
    return catalog, sids


def synthetic_index(n_ads: int, seed: int = 0, schema: TargetingSchema = DEFAULT) -> IndexArrays:
    """The index arrays of `synthetic_catalog(n_ads, seed=seed, schema=schema)`."""
    return build_arrays(*synthetic_catalog(n_ads, seed=seed, schema=schema))


def load_index(root: Path) -> tuple[IndexArrays, TargetingSchema]:
    """A published index (a root or a version directory) and its targeting schema."""
    manifest, arrays = read_index_dir(resolve(root), verify_checksums=False)
    return arrays, manifest_schema(manifest)


# --------------------------------------------------------------------------- requests


def _allowed(words: np.ndarray, attr: Attribute) -> tuple[list[int], int]:
    """An ad's allowed values of a default-schema attribute, as bit numbers, and the
    attribute's first bit."""
    at = DEFAULT.bit_offsets[attr.name]
    return _set_bits(words, at, len(attr.labels)), at


def _set_bits(words: np.ndarray, lo: int, n: int) -> list[int]:
    bits = np.arange(lo, lo + n)
    on = ((words[bits // 64] >> (bits % 64).astype(np.uint64)) & np.uint64(1)) == 1
    return bits[on].tolist()


def requests_for(
    index: IndexArrays, batch: int, n_loc: int, seed: int, schema: TargetingSchema = DEFAULT
) -> list[Targeting]:
    """Requests that some ad of the index is eligible for: each copies a random ad's
    rules (one allowed country, age bucket and gender) and carries n_loc locations —
    the ad's own, then ones of the same country, then any; under `RICH` also an allowed
    platform and device, and its set attributes' most values, the ad's own first."""
    rng = np.random.default_rng(seed)
    ads = index.ads
    locations = ads.sets["locations"]
    vocab = locations.strings()
    by_country: dict[str, list[str]] = {}
    for s in vocab:
        by_country.setdefault(s.split("/")[0], []).append(s)
    country_a, age_a, gender_a = (DEFAULT.attribute(n) for n in ("country", "age", "gender"))
    out = []
    for ad in rng.choice(ads.num_ads, batch, replace=False).tolist():
        words = ads.ad_bitmask[ad]
        (countries, c_at), (ages, a_at), (genders, g_at) = (
            _allowed(words, a) for a in (country_a, age_a, gender_a)
        )
        lo, hi = locations.include_offsets[ad], locations.include_offsets[ad + 1]
        own = [vocab[i] for i in locations.include_ids[lo:hi].tolist()]
        country = country_a.labels[rng.choice(countries) - c_at] if countries else ""
        if len(countries) == len(country_a.labels):  # no country rule: where its places are
            home = own[0].split("/")[0] if own else ""
            country = home if country_index(home) is not None else "US"
        age = 0
        if ages:
            bucket = age_a.labels[rng.choice(ages) - a_at]
            age = int(bucket.rstrip("+").split("-")[0])
        gender = gender_a.labels[rng.choice(genders) - g_at] if genders else ""
        near = by_country.get(own[0].split("/")[0] if own else country, [])
        picks = list(dict.fromkeys(own))
        for pool in (near, vocab):
            extra = [pool[i] for i in rng.permutation(len(pool))[: 2 * n_loc]]
            picks += [s for s in extra if s not in picks][: n_loc - len(picks)]
        attributes = _rich_values(index, schema, ad, rng) if schema == RICH else ()
        out.append(Targeting(country, age, gender, tuple(picks[:n_loc]), attributes))
    return out


def _rich_values(
    index: IndexArrays, schema: TargetingSchema, ad: int, rng: np.random.Generator
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`RICH`'s attributes of a request the ad `ad` is eligible for."""
    out = []
    for a in schema.attributes[len(DEFAULT.attributes) :]:
        if a.kind == "enum":
            bits = _set_bits(index.ads.ad_bitmask[ad], schema.bit_offsets[a.name], len(a.values))
            out.append((a.name, (a.values[rng.choice(bits) - schema.bit_offsets[a.name]],)))
            continue
        s = index.ads.sets[a.name]
        own = s.include.values[s.include.offsets[ad] : s.include.offsets[ad + 1]]
        x = s.exclude
        gone = set() if x is None else set(x.values[x.offsets[ad] : x.offsets[ad + 1]].tolist())
        pool = len(s.vocab_offsets) - 1
        more = [i for i in rng.permutation(pool)[: 2 * a.max_request_values].tolist()
                if i not in gone]  # fmt: skip
        ids = list(dict.fromkeys([*own.tolist(), *more]))[: a.max_request_values]
        strings = s.strings()
        out.append((a.name, tuple(strings[i] for i in ids)))
    return tuple(out)
