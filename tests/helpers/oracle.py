"""Brute-force oracles written straight from docs/ARCHITECTURE.md §3's eligibility rules, on the
raw strings — independent of the bit encoding they are used to test."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from contracts.targeting import Targeting

_BUCKETS = [(13, 17, "13-17"), (18, 24, "18-24"), (25, 34, "25-34"), (35, 44, "35-44"),
            (45, 54, "45-54"), (55, 64, "55-64"), (65, 10**9, "65+")]  # fmt: skip


@dataclass(frozen=True)
class Ad:
    ad_id: int
    sid: tuple[int, int, int, int]
    countries: tuple[str, ...] = ()
    age_buckets: tuple[str, ...] = ()
    genders: tuple[str, ...] = ()
    locations: tuple[str, ...] = ()
    embedding: tuple[float, ...] = field(default=(), compare=False)

    def row(self) -> dict:
        out = {
            "ad_id": self.ad_id,
            "sid": list(self.sid),
            "countries": list(self.countries),
            "age_buckets": list(self.age_buckets),
            "genders": list(self.genders),
            "locations": list(self.locations),
        }
        if self.embedding:
            out["embedding"] = list(self.embedding)
        return out


def bucket_of(age: int) -> str | None:
    for lo, hi, name in _BUCKETS:
        if lo <= age <= hi:
            return name
    return None


def eligible(ad: Ad, req: Targeting) -> bool:
    """docs/ARCHITECTURE.md §3, literally."""
    if ad.countries and req.country.upper() not in {c.upper() for c in ad.countries}:
        return False
    if ad.age_buckets and bucket_of(req.age) not in ad.age_buckets:
        return False
    if ad.genders and req.gender not in ad.genders:
        return False
    return not ad.locations or bool(set(ad.locations) & set(req.locations))


def eligible_prefixes(ads: Sequence[Ad], req: Targeting) -> set[tuple[int, ...]]:
    """Every SID prefix (length 1..4) whose subtree holds an ad eligible for `req`."""
    out: set[tuple[int, ...]] = set()
    for ad in ads:
        if eligible(ad, req):
            out.update(ad.sid[:n] for n in range(1, 5))
    return out
