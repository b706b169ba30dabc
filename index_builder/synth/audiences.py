"""Audience segments, the `audiences` set attribute (docs/SYNTH.md "Richer targeting").

Part of the richer-targeting knobs, each draw on a stream of its own so the rest of the
world draws what it drew without them. `build_segments` lays out `n_audiences` segments
before the ads, each tied to a topic, popularity Zipf over a shuffled rank;
`advertiser_rules` gives some advertisers segments of their own topic to include or to
exclude ("existing customers"); `user_audiences` gives each user 0..MAX_USER_AUDIENCES
segments, most of them of the topics its interests are nearest, so an audience rule
picks users who like what the advertiser sells and targeting by audience is no noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.targeting_codec import Ragged
from index_builder.synth.geography import cumulative, sample_within, zipf_weights
from index_builder.synth.profiles import MAX_USER_AUDIENCES, WorldProfile

TOPIC_WEIGHTS = (0.6, 0.3, 0.1)  # a user's on-topic segment: of its 1st, 2nd, 3rd topic


@dataclass(frozen=True)
class Segments:
    """The audience segments; those of one topic are contiguous."""

    names: np.ndarray  # object [S]: "aud00042", in id order (and sorted)
    topic_start: np.ndarray  # int64 [T + 1]: topic t's segments are [start[t], start[t+1])
    cum: np.ndarray  # float64 [S + 1]: cumulative popularity, for `sample_within`

    @property
    def n(self) -> int:
        return len(self.names)


def build_segments(p: WorldProfile, rng: np.random.Generator) -> Segments:
    s, t = p.n_audiences, p.n_topics
    per_topic = np.full(t, s // t, dtype=np.int64)
    per_topic[: s % t] += 1
    popularity = zipf_weights(s, p.audience_zipf)[rng.permutation(s)]
    width = len(str(s - 1))
    names = np.array([f"aud{i:0{width}d}" for i in range(s)], dtype=object)
    return Segments(names, np.concatenate([[0], np.cumsum(per_topic)]), cumulative(popularity))


def _of_topics(seg: Segments, topic: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One segment of each `topic` by popularity (u: float64 in [0, 1)): int64."""
    return sample_within(seg.cum, seg.topic_start[topic], seg.topic_start[topic + 1], u)


def distinct_rows(values: np.ndarray, mask: np.ndarray) -> Ragged:
    """Each row's masked values (>= 0), sorted and deduplicated, as a Ragged."""
    v = np.where(mask, values, -1)
    v.sort(axis=1)
    keep = v >= 0
    keep[:, 1:] &= v[:, 1:] != v[:, :-1]
    offsets = np.zeros(len(v) + 1, dtype=np.int64)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return Ragged(offsets, v[keep].astype(np.int32))


def advertiser_rules(
    p: WorldProfile, seg: Segments, topic: np.ndarray, rng: np.random.Generator
) -> tuple[Ragged, Ragged]:
    """(include, exclude) segment lists of advertisers of `topic` (int32 [A]): 1-4 segments
    of their topic on `audience_rule_share`, 1-2 on `audience_exclude_share`; never one
    segment both."""
    a = len(topic)
    draws = []
    for share, most in ((p.audience_rule_share, 4), (p.audience_exclude_share, 2)):
        on = rng.random(a) < share
        count = rng.integers(1, most + 1, size=a)
        picks = np.stack([_of_topics(seg, topic, rng.random(a)) for _ in range(most)], axis=1)
        draws.append((picks, on[:, None] & (np.arange(most) < count[:, None])))
    (inc, inc_on), (exc, exc_on) = draws
    included = np.where(inc_on, inc, -1)
    exc_on &= ~(exc[:, :, None] == included[:, None, :]).any(axis=2)
    return distinct_rows(inc, inc_on), distinct_rows(exc, exc_on)


def user_audiences(
    p: WorldProfile, seg: Segments, centroids: np.ndarray, interest: np.ndarray,
    rng: np.random.Generator,
) -> Ragged:  # fmt: skip
    """Each user's segments, sorted: a negative-binomial count around `audiences_per_user`
    (cut at MAX_USER_AUDIENCES) of draws, `audience_topic_share` of them among the
    segments of the user's nearest topics (`TOPIC_WEIGHTS`), the rest among all, each by
    popularity; repeats merge."""
    n, mean = len(interest), p.audiences_per_user
    count = rng.negative_binomial(2, 2 / (2 + mean), size=n) if mean > 0 else np.zeros(n, int)
    count = np.minimum(count, MAX_USER_AUDIENCES)
    k = min(len(TOPIC_WEIGHTS), len(centroids))
    nearest = np.argsort(-(interest @ centroids.T), axis=1, kind="stable")[:, :k]
    user = np.repeat(np.arange(n), count)
    w = np.asarray(TOPIC_WEIGHTS[:k])
    topic = nearest[user, rng.choice(k, size=len(user), p=w / w.sum())]
    u = rng.random(len(user))
    on_topic = rng.random(len(user)) < p.audience_topic_share
    anywhere = sample_within(seg.cum, np.zeros(len(user), np.int64), np.full(len(user), seg.n), u)
    ids = np.where(on_topic, _of_topics(seg, topic, u), anywhere)
    key = np.unique(user.astype(np.int64) * seg.n + ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // seg.n, minlength=n), out=offsets[1:])
    return Ragged(offsets, (key % seg.n).astype(np.int32))
