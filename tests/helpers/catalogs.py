"""Small catalogs for tests: hypothesis strategies, an in-memory `Catalog` builder and a
batch of requests as the default schema encodes it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from contracts.targeting import AGE_BUCKETS, GENDERS, Targeting
from contracts.targeting_codec import EncodedRequests, Ragged, codec
from contracts.targeting_schema import DEFAULT
from index_builder.catalog import Catalog, SetRules
from tests.helpers.oracle import Ad

COUNTRY_POOL = ("US", "CA", "GB", "DE")
LOCATION_POOL = ("US/R1", "US/R1/C1", "US/R2", "CA/R1", "GB/R1/C9", "DE")


def catalog_from_ads(ads: Sequence[Ad]) -> Catalog:
    """Encode test ads with the production encoders (the oracle stays string-based)."""
    vocab = np.array(sorted({loc for a in ads for loc in a.locations}), dtype=object)
    ids = {s: i for i, s in enumerate(vocab)}
    locs = Ragged.from_lists([sorted({ids[s] for s in a.locations}) for a in ads])
    sets = {"locations": SetRules(locs, None, vocab)}
    c = codec(DEFAULT)

    def rules(name: str, field: str) -> Ragged:
        attr = DEFAULT.attribute(name)
        return Ragged.from_lists([[c.value_index(attr, v) for v in getattr(a, field)] for a in ads])

    include = {n: rules(n, f) for n, f in (("country", "countries"), ("age", "age_buckets"),
                                             ("gender", "genders"))}  # fmt: skip
    bitmask = c.ad_bitmasks(include, {}, len(ads))
    return Catalog(
        ad_id=np.array([a.ad_id for a in ads], dtype=np.int64),
        sid=np.array([a.sid for a in ads], dtype=np.int32).reshape(-1, 4),
        embedding=None,
        bitmask=bitmask,
        sets=sets,
        source="<test>",
    )


def encode_default(batch: Sequence[Targeting]) -> EncodedRequests:
    """Requests' targeting as `codec(DEFAULT)` encodes a batch (n_blooms [B, 1])."""
    return codec(DEFAULT).encode_requests([t.values() for t in batch])


def catalog_arrays(cat: Catalog) -> dict[str, np.ndarray | None]:
    """Every array of a catalog by name, its set attributes' lists and vocabularies
    included (to compare two reads of one catalog)."""
    out: dict[str, np.ndarray | None] = {
        name: getattr(cat, name)
        for name in ("ad_id", "sid", "embedding", "bitmask", "exclude_bitmask", "campaign",
                     "advertiser")
    }  # fmt: skip
    for name, s in cat.sets.items():
        out[f"{name}.include.offsets"], out[f"{name}.include.values"] = (
            s.include.offsets,
            (s.include.values),
        )
        out[f"{name}.exclude.offsets"] = None if s.exclude is None else s.exclude.offsets
        out[f"{name}.exclude.values"] = None if s.exclude is None else s.exclude.values
        out[f"{name}.vocabulary"] = s.vocabulary
    return out


def _subset(pool: Sequence[str]) -> st.SearchStrategy[tuple[str, ...]]:
    return st.lists(st.sampled_from(pool), max_size=3, unique=True).map(tuple)


def ads_strategy(max_ads: int = 40, token_range: int = 3) -> st.SearchStrategy[list[Ad]]:
    """Catalogs whose SIDs share prefixes a lot (tokens from a small range)."""
    tok = st.integers(0, token_range - 1)
    ad = st.builds(
        lambda sid, c, a, g, loc: (sid, c, a, g, loc),
        st.tuples(tok, tok, tok, tok),
        _subset(COUNTRY_POOL),
        _subset(AGE_BUCKETS),
        st.lists(st.sampled_from(GENDERS), max_size=1).map(tuple),
        _subset(LOCATION_POOL),
    )
    return st.lists(ad, min_size=1, max_size=max_ads).map(
        lambda rows: [Ad(1000 + i, *r) for i, r in enumerate(rows)]
    )


requests_strategy = st.builds(
    Targeting,
    country=st.sampled_from(("US", "CA", "FR", "")),
    age=st.sampled_from((0, 10, 16, 30, 50, 70)),
    gender=st.sampled_from(("", "female", "male")),
    locations=st.lists(st.sampled_from((*LOCATION_POOL, "XX/nowhere")), max_size=4).map(tuple),
)
