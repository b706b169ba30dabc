"""Interaction histories drawn only from eligible ads (docs/SYNTH.md "Histories").

Per user: sample `candidates_per_user` entries of its pool (`CandidateIndex`: a superset
of the ads it is eligible for, see `ads.pool_keys`), keep the eligible ones exactly, and
draw the events from softmax(beta · interest·embedding + log popularity) over them. The
last event of each sequence is held out; with fresh ads (`campaigns.fresh_ads`) only it
may show one. Users whose pool holds no eligible (logged) ad are dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from contracts.targeting import GENDERS, Targeting
from contracts.targeting_codec import AdRules, Ragged, RequestRules, codec, exact_eligible
from contracts.targeting_schema import DEFAULT
from index_builder.parallel import stable_argsort
from index_builder.synth.ads import GLOBAL_KEY, AdState, EncodedAds
from index_builder.synth.geography import Geography
from index_builder.synth.profiles import WorldProfile
from index_builder.synth.user_attributes import UserAttributes
from index_builder.synth.users import Users

VIEW, CLICK, CONVERSION = 1, 2, 3
BASE_TIME_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z


@dataclass(frozen=True)
class CandidateIndex:
    """Pool key → ad positions, CSR. Keys: location ids, then countries, then global."""

    offsets: np.ndarray  # int64 [n_keys + 1]
    ads: np.ndarray  # int64 [m]: ad positions, ascending within a key
    n_locations: int

    @classmethod
    def build(
        cls, keys: list[np.ndarray], positions: list[np.ndarray], n_locations: int
    ) -> CandidateIndex:
        k = np.concatenate(keys)
        n_keys = n_locations + GLOBAL_KEY + 1
        order = stable_argsort(k, key_bits=n_keys.bit_length())  # paper: 36 M entries
        counts = np.bincount(k, minlength=n_keys)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(offsets, np.concatenate(positions)[order], n_locations)

    def user_keys(self, users: Users, u: int, geo: Geography) -> np.ndarray:
        iso = int(geo.iso_index[users.country[u]])
        extra = [self.n_locations + iso, self.n_locations + GLOBAL_KEY]
        return np.concatenate([users.locations(u).astype(np.int64), extra])


def request_of(users: Users, u: int, geo: Geography) -> np.ndarray:
    """Request bitmask of user u (locations are matched separately, by id)."""
    g = int(users.gender[u])
    t = Targeting(geo.codes[users.country[u]], int(users.age[u]), GENDERS[g] if g >= 0 else "")
    return codec(DEFAULT).request_bitmask(t.values())


def eligible_for(
    users: Users,
    u: int,
    geo: Geography,
    encoded: tuple[np.ndarray, np.ndarray, np.ndarray],  # `EncodedAds.take` of some ads
    advertiser: np.ndarray,  # int [n]: their advertisers
    extra: UserAttributes | None = None,
) -> np.ndarray:
    """bool [n]: exactly which of these ads user u is eligible for; with richer targeting
    (`extra`) its extra enum values and audiences too."""
    bm, loc_off, loc_ids = encoded
    req = request_of(users, u, geo)
    if extra is not None:
        req = extra.request(req, u)
    # the default schema's one set attribute, locations, by id; audiences are `sets_pass`'s
    rules = AdRules(bm, {"locations": Ragged(loc_off, loc_ids)}, {})
    asked = RequestRules(req, {"locations": users.locations(u)})
    ok = exact_eligible(DEFAULT, np.zeros(len(bm), dtype=np.int64), rules, asked)  # no blocks
    return ok if extra is None else ok & extra.sets_pass(advertiser, u)


@dataclass(frozen=True)
class Histories:
    """Event sequences of the kept users, time-ordered; the last event is held out."""

    user: np.ndarray  # int64 [U']: user positions kept
    offsets: np.ndarray  # int64 [U' + 1]
    ad: np.ndarray  # int64 [E]: ad positions
    type: np.ndarray  # int8 [E]
    ts: np.ndarray  # int64 [E]: timestamp_ms


def _pool_sample(
    index: CandidateIndex, keys: np.ndarray, k: int, rng: np.random.Generator
) -> np.ndarray:
    """Ad positions drawn from the union of the pool lists under `keys`: int64."""
    lo, hi = index.offsets[keys], index.offsets[keys + 1]
    sizes = hi - lo
    total = int(sizes.sum())
    cum = np.concatenate([[0], np.cumsum(sizes)])
    # a small pool is taken whole; a large one sampled uniformly with replacement (a repeat
    # simply weighs twice, as in any Monte Carlo estimate of the softmax over the pool)
    r = np.arange(total) if total <= k else rng.integers(total, size=k)
    which = np.searchsorted(cum, r, side="right") - 1
    return np.sort(index.ads[lo[which] + r - cum[which]])  # sorted: cache-friendly gathers


def _event_weights(p: WorldProfile, affinity: np.ndarray, logpop: np.ndarray) -> np.ndarray:
    """softmax(beta · affinity + log popularity): the chance of each candidate per event."""
    s = p.affinity_beta * affinity + logpop
    w = np.exp(s - s.max())
    return w / w.sum()


def _event_types(p: WorldProfile, affinity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """VIEW / CLICK / CONVERSION of events with these affinities: clicks rise with it."""
    n = len(affinity)
    p_click = np.clip(p.click_rate * np.exp(2.0 * (affinity - 0.5)), 0.0, 0.9)
    click = rng.random(n) < p_click
    conv = click & (rng.random(n) < p.conversion_rate)
    return (VIEW + click + conv).astype(np.int8)


def _events(
    p: WorldProfile, affinity: np.ndarray, logpop: np.ndarray, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pick n events among eligible candidates: (choice index, type, timestamp_ms)."""
    w = _event_weights(p, affinity, logpop)
    pick = rng.choice(len(w), size=n, p=w)
    types = _event_types(p, affinity[pick], rng)
    session_break = rng.random(n) < 0.15
    gaps = np.where(
        session_break, rng.exponential(20 * 3600e3, size=n), rng.exponential(90e3, size=n)
    )
    start = BASE_TIME_MS + int(rng.integers(0, 30 * 86_400_000))
    ts = start + np.cumsum(gaps.astype(np.int64) + 1000)
    return pick, types, ts


def sample_histories(
    p: WorldProfile,
    geo: Geography,
    ads: AdState,
    enc: EncodedAds,
    users: Users,
    index: CandidateIndex,
    rng: np.random.Generator,
    progress: bool = True,
    fresh: np.ndarray | None = None,
    extra: UserAttributes | None = None,
) -> Histories:
    """The event sequences of every user; `fresh` (bool [N], `campaigns.fresh_ads`) marks
    the ads launched after the log, which only a held-out event may show; `extra`: the
    users' values of a world's extra attributes."""
    med = np.log(p.history_len_median)
    lengths = np.clip(
        np.rint(rng.lognormal(med, 0.8, size=users.n)), p.history_len_min, p.history_len_max
    ).astype(np.int64)
    emb = ads.embedding.view(np.ndarray)  # plain gathers; memmap.__getitem__ is slow
    kept: list[int] = []
    seq_ad: list[np.ndarray] = []
    seq_type: list[np.ndarray] = []
    seq_ts: list[np.ndarray] = []
    for u in tqdm(range(users.n), desc="histories", unit="user", disable=not progress):
        cand = _pool_sample(index, index.user_keys(users, u, geo), p.candidates_per_user, rng)
        ok = eligible_for(users, u, geo, enc.take(cand), ads.advertiser[cand], extra)
        eligible = cand[ok]
        logged = eligible if fresh is None else eligible[~fresh[eligible]]
        if not len(logged):
            continue
        affinity = emb[logged] @ users.interest[u]
        logpop = np.log(ads.popularity[logged])
        pick, types, ts = _events(p, affinity, logpop, int(lengths[u]), rng)
        events = logged[pick]
        if fresh is not None:  # the next interaction may show an ad launched since
            a = emb[eligible] @ users.interest[u]
            j = rng.choice(len(eligible), p=_event_weights(p, a, np.log(ads.popularity[eligible])))
            events[-1] = eligible[j]
            types[-1] = _event_types(p, a[j : j + 1], rng)[0]
        kept.append(u)
        seq_ad.append(events)
        seq_type.append(types)
        seq_ts.append(ts)
    n_ev = np.array([len(a) for a in seq_ad], dtype=np.int64)
    return Histories(
        user=np.array(kept, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(n_ev)]).astype(np.int64),
        ad=np.concatenate(seq_ad) if seq_ad else np.zeros(0, np.int64),
        type=np.concatenate(seq_type) if seq_type else np.zeros(0, np.int8),
        ts=np.concatenate(seq_ts) if seq_ts else np.zeros(0, np.int64),
    )
