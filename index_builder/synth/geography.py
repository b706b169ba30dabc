"""Synthetic geography: countries → regions → cities → neighbourhoods (docs/SYNTH.md).

Built right after the profile; advertisers pick home and targeted places here, users
where they live and travel. Every place has a hierarchical location string (`"US"`,
`"US/R07"`, `"US/R07/C0123"`, `"US/R07/C0123/N4"`) and one id in a single vocabulary:

    [0, C) countries | [C, C+R) regions | [C+R, C+R+K) cities | then neighbourhoods

Children are contiguous under their parent, so "the cities of region r" is a slice and
population-weighted sampling inside a parent is one `searchsorted` on a cumulative sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from contracts.targeting import country_index
from index_builder.synth.profiles import WorldProfile

# Real ad markets, roughly largest first, with a coarse world region used to pick
# "neighbour" countries for national campaigns.
MARKETS: tuple[tuple[str, str], ...] = tuple(
    (code, group)
    for group_codes in (
        "US:na IN:as BR:sa ID:as GB:eu DE:eu MX:na JP:as FR:eu PH:as TR:me VN:as IT:eu ES:eu "
        "CA:na TH:as KR:as EG:af NG:af PK:as BD:as AR:sa CO:sa PL:eu AU:oc SA:me MY:as ZA:af "
        "NL:eu UA:eu PE:sa CL:sa AE:me TW:as RO:eu BE:eu SE:eu KE:af MA:af PT:eu GR:eu CZ:eu "
        "HU:eu AT:eu CH:eu IL:me DK:eu FI:eu NO:eu IE:eu NZ:oc SG:as HK:as EC:sa DZ:af IQ:me "
        "GT:na VE:sa KZ:as LK:as"
    ).split()
    for code, group in [group_codes.split(":")]
)


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Normalised rank^-s weights: float64 [n], largest first."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    return w / w.sum()


def _scaled_counts(share: np.ndarray, lo: int, hi: int, power: float) -> np.ndarray:
    """Child counts per parent, growing with the parent's population share."""
    rel = (share / share.max()) ** power
    return np.clip(np.rint(hi * rel), lo, hi).astype(np.int64)


@dataclass(frozen=True)
class Geography:
    """The places of a world; all weights are shares of the world population."""

    codes: tuple[str, ...]  # ISO alpha-2 per country
    iso_index: np.ndarray  # int32 [C]: index into targeting_schema.COUNTRIES
    group: np.ndarray  # int32 [C]: world-region id (neighbours share it)
    country_weight: np.ndarray  # float64 [C]
    region_country: np.ndarray  # int32 [R]
    region_start: np.ndarray  # int64 [C+1]: regions of country c are [start[c], start[c+1])
    city_region: np.ndarray  # int32 [K]
    city_start: np.ndarray  # int64 [R+1]: cities of region r
    city_weight: np.ndarray  # float64 [K]
    nbhd_city: np.ndarray  # int32 [Nb]
    nbhd_start: np.ndarray  # int64 [K+1]: neighbourhoods of city k
    nbhd_weight: np.ndarray  # float64 [Nb]
    names: np.ndarray  # object [V]: every location string, in vocabulary order

    @property
    def n_countries(self) -> int:
        return len(self.codes)

    @property
    def n_regions(self) -> int:
        return len(self.region_country)

    @property
    def n_cities(self) -> int:
        return len(self.city_region)

    # vocabulary ids
    def region_loc(self, r: np.ndarray | int) -> np.ndarray | int:
        return self.n_countries + r

    def city_loc(self, k: np.ndarray | int) -> np.ndarray | int:
        return self.n_countries + self.n_regions + k

    def nbhd_loc(self, n: np.ndarray | int) -> np.ndarray | int:
        return self.n_countries + self.n_regions + self.n_cities + n

    # sampling tables: cumulative weights with a leading 0, for `sample_within`
    @cached_property
    def country_cum(self) -> np.ndarray:  # float64 [C+1]
        return cumulative(self.country_weight)

    @cached_property
    def region_cum(self) -> np.ndarray:  # float64 [R+1]
        w = np.bincount(self.city_region, weights=self.city_weight, minlength=self.n_regions)
        return cumulative(w)

    @cached_property
    def city_cum(self) -> np.ndarray:  # float64 [K+1]
        return cumulative(self.city_weight)

    @cached_property
    def nbhd_cum(self) -> np.ndarray:  # float64 [Nb+1]
        return cumulative(self.nbhd_weight)

    def neighbour(self, country: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A country of each `country`'s world region, picked by u (float64 [n] in [0, 1)),
        uniformly: int64 [n]."""
        members = np.argsort(self.group, kind="stable")
        start = np.concatenate([[0], np.cumsum(np.bincount(self.group))])
        g = self.group[country]
        return members[start[g] + (u * (start[g + 1] - start[g])).astype(np.int64)]

    def counts(self) -> dict[str, int]:
        return {
            "countries": self.n_countries,
            "regions": self.n_regions,
            "cities": self.n_cities,
            "neighbourhoods": len(self.nbhd_city),
            "location_strings": len(self.names),
        }


def sample_within(
    cum: np.ndarray,  # float64 [M+1]: cumulative weights with a leading 0
    start: np.ndarray,  # int64 [n]: first child of each parent
    stop: np.ndarray,  # int64 [n]: one past the last child
    u: np.ndarray,  # float64 [n] in [0, 1)
) -> np.ndarray:
    """One weighted child per parent: int64 [n] in [start, stop)."""
    target = cum[start] + u * (cum[stop] - cum[start])
    idx = np.searchsorted(cum, target, side="right") - 1
    return np.clip(idx, start, stop - 1)


def build_geography(p: WorldProfile, rng: np.random.Generator) -> Geography:
    if not 1 <= p.n_countries <= len(MARKETS):
        raise ValueError(f"n_countries must be in [1, {len(MARKETS)}], got {p.n_countries}")
    markets = MARKETS[: p.n_countries]
    codes = tuple(c for c, _ in markets)
    groups = sorted({g for _, g in markets})
    iso = np.array([country_index(c) for c in codes], dtype=np.int32)
    country_w = zipf_weights(p.n_countries, p.country_zipf)

    n_regions = _scaled_counts(country_w, *p.regions_per_country, power=0.5)
    region_country = np.repeat(np.arange(p.n_countries, dtype=np.int32), n_regions)
    region_start = np.concatenate([[0], np.cumsum(n_regions)])
    region_w = np.concatenate(
        [country_w[c] * zipf_weights(int(n), p.region_zipf) for c, n in enumerate(n_regions)]
    )

    n_cities = _scaled_counts(region_w, *p.cities_per_region, power=0.5)
    city_region = np.repeat(np.arange(len(region_w), dtype=np.int32), n_cities)
    city_start = np.concatenate([[0], np.cumsum(n_cities)])
    # cities of a region: Zipf sizes with a little noise so ranks are not identical everywhere
    city_w = np.concatenate(
        [region_w[r] * zipf_weights(int(n), p.city_zipf) for r, n in enumerate(n_cities)]
    )
    city_w *= rng.lognormal(0.0, 0.2, size=len(city_w))
    city_w /= city_w.sum()

    n_nbhd = _scaled_counts(city_w, *p.neighbourhoods_per_city, power=0.3)
    nbhd_city = np.repeat(np.arange(len(city_w), dtype=np.int32), n_nbhd)
    nbhd_start = np.concatenate([[0], np.cumsum(n_nbhd)])
    nbhd_w = rng.gamma(2.0, size=len(nbhd_city))  # relative sizes inside a city

    region_names = [
        f"{codes[c]}/R{r - region_start[c]:02d}" for r, c in enumerate(region_country.tolist())
    ]
    city_names = [
        f"{region_names[r]}/C{k - city_start[r]:04d}" for k, r in enumerate(city_region.tolist())
    ]
    nbhd_names = [f"{city_names[k]}/N{n - nbhd_start[k]}" for n, k in enumerate(nbhd_city.tolist())]
    names = np.array([*codes, *region_names, *city_names, *nbhd_names], dtype=object)
    return Geography(
        codes=codes,
        iso_index=iso,
        group=np.array([groups.index(g) for _, g in markets], dtype=np.int32),
        country_weight=country_w,
        region_country=region_country,
        region_start=region_start,
        city_region=city_region,
        city_start=city_start,
        city_weight=city_w,
        nbhd_city=nbhd_city,
        nbhd_start=nbhd_start,
        nbhd_weight=nbhd_w,
        names=names,
    )


def cumulative(w: np.ndarray) -> np.ndarray:
    """Cumulative weights with a leading 0, for `sample_within`: float64 [len(w)+1]."""
    return np.concatenate([[0.0], np.cumsum(w)])
