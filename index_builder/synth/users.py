"""Users: country, age, gender, clustered locations and latent interests (docs/SYNTH.md).

A user lives in a city drawn by population; its locations are, in order, its country,
home region, home city and neighbourhoods, nearby cities of the home region and travel
cities anywhere (each with its region), deduplicated and cut at `MAX_REQUEST_LOCATIONS`.
Draws are vectorised; only the cheap list assembly loops over users.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.targeting import AGE_BUCKETS, MAX_REQUEST_LOCATIONS
from index_builder.synth.ads import mix_ids
from index_builder.synth.advertisers import Topics
from index_builder.synth.geography import Geography, sample_within
from index_builder.synth.profiles import WorldProfile

# Ages drawn inside each AGE_BUCKETS range; 65+ is spread over 65..84.
_AGE_RANGES = ((13, 17), (18, 24), (25, 34), (35, 44), (45, 54), (55, 64), (65, 84))
assert len(_AGE_RANGES) == len(AGE_BUCKETS)


@dataclass(frozen=True)
class Users:
    """Per-user arrays, indexed by user position 0..U-1."""

    user_id: np.ndarray  # int64 [U], unique
    country: np.ndarray  # int32 [U]: geography country index
    age: np.ndarray  # int32 [U], 0 = unknown
    gender: np.ndarray  # int8 [U]: GENDERS index, -1 = unknown
    loc_offsets: np.ndarray  # int64 [U+1]
    loc_ids: np.ndarray  # int32 [nnz]: location vocabulary ids, <= 64 per user
    interest: np.ndarray  # float32 [U, d], unit rows

    @property
    def n(self) -> int:
        return len(self.user_id)

    def locations(self, u: int) -> np.ndarray:
        return self.loc_ids[self.loc_offsets[u] : self.loc_offsets[u + 1]]


def _ages(p: WorldProfile, n: int, rng: np.random.Generator) -> np.ndarray:
    w = np.asarray(p.age_bucket_weights)
    bucket = rng.choice(len(w), size=n, p=w / w.sum())
    lo = np.array([a for a, _ in _AGE_RANGES])[bucket]
    hi = np.array([b for _, b in _AGE_RANGES])[bucket]
    age = lo + (rng.random(n) * (hi - lo + 1)).astype(np.int64)
    return np.where(rng.random(n) < p.unknown_age_share, 0, age).astype(np.int32)


def build_users(
    p: WorldProfile, geo: Geography, topics: Topics, seed: int, rng: np.random.Generator
) -> Users:
    n = p.n_users
    home = rng.choice(geo.n_cities, size=n, p=geo.city_weight)
    region = geo.city_region[home].astype(np.int64)
    country = geo.region_country[region]
    age = _ages(p, n, rng)
    known = rng.random(n) >= p.unknown_gender_share
    gender = np.where(known, (rng.random(n) < 0.5).astype(np.int8), -1).astype(np.int8)

    # home neighbourhoods: 1..3 weighted draws (duplicates merge)
    nb_lo, nb_hi = geo.nbhd_start[home], geo.nbhd_start[home + 1]
    nb = np.stack([sample_within(geo.nbhd_cum, nb_lo, nb_hi, rng.random(n)) for _ in range(3)], 1)
    n_nb = rng.integers(1, 4, size=n)
    # nearby cities: negative binomial (heavy-ish tail), drawn with replacement then merged
    mean = p.nearby_cities_mean
    n_near = rng.negative_binomial(2, 2 / (2 + mean), size=n) if mean > 0 else np.zeros(n, int)
    near_user = np.repeat(np.arange(n), n_near)
    near_lo, near_hi = geo.city_start[region[near_user]], geo.city_start[region[near_user] + 1]
    near = sample_within(geo.city_cum, near_lo, near_hi, rng.random(len(near_user)))
    near_off = np.concatenate([[0], np.cumsum(n_near)])
    n_travel = rng.poisson(p.travel_cities_mean, size=n)
    travel = rng.choice(geo.n_cities, size=int(n_travel.sum()), p=geo.city_weight)
    travel_off = np.concatenate([[0], np.cumsum(n_travel)])

    c_loc = country.astype(np.int64)
    r_loc = geo.region_loc(region)
    h_loc = geo.city_loc(home)
    nb_loc = geo.nbhd_loc(nb)
    near_loc = geo.city_loc(near)
    travel_loc = geo.city_loc(travel)
    travel_region = geo.region_loc(geo.city_region[travel].astype(np.int64))
    lists: list[list[int]] = []
    for u in range(n):
        t = slice(travel_off[u], travel_off[u + 1])
        seq = [
            c_loc[u],
            r_loc[u],
            h_loc[u],
            *nb_loc[u, : n_nb[u]],
            *near_loc[near_off[u] : near_off[u + 1]],
            *np.stack([travel_loc[t], travel_region[t]], axis=1).ravel(),
        ]
        lists.append(list(dict.fromkeys(seq))[:MAX_REQUEST_LOCATIONS])
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=n)
    loc_offsets = np.concatenate([[0], np.cumsum(lengths)])
    loc_ids = np.fromiter((v for x in lists for v in x), dtype=np.int32, count=int(lengths.sum()))

    # interests: mixture of 1..max_user_topics topics
    k = p.max_user_topics
    tops = rng.choice(p.n_topics, size=(n, k), p=topics.weights)
    mix = rng.dirichlet(np.ones(k), size=n) * (
        np.arange(k) < rng.integers(1, k + 1, size=n)[:, None]
    )
    mix /= mix.sum(axis=1, keepdims=True)
    vec = np.einsum("uk,ukd->ud", mix, topics.centroids[tops])
    vec += p.interest_noise * rng.standard_normal(vec.shape) / np.sqrt(p.embedding_dim)
    vec /= np.linalg.norm(vec, axis=1, keepdims=True)
    return Users(
        user_id=mix_ids(np.arange(n, dtype=np.int64), salt=seed * 0x2545F491 + 7),
        country=country.astype(np.int32),
        age=age,
        gender=gender,
        loc_offsets=loc_offsets,
        loc_ids=loc_ids,
        interest=vec.astype(np.float32),
    )
