"""Targeting encoded by a declared schema (contracts/targeting_codec.py): under random
schemas, with exclusions and blocks, the exact test agrees with the rules read literally,
and GTM's matchers — an ad's, and the OR of any group of ads — never bar an eligible ad
(the default schema's layout, bit by bit: tests/index_builder/test_targeting.py)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.targeting_codec import (
    AdRules,
    Ragged,
    RequestRules,
    blooms_pass,
    codec,
    contains,
    exact_eligible,
    value_blooms,
)
from contracts.targeting_schema import Attribute, TargetingSchema

# --- random schemas ------------------------------------------------------------------------


@st.composite
def schemas(draw: st.DrawFn) -> TargetingSchema:
    attrs = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["enum", "bucket", "set"]))
        name = f"a{i}"
        if kind == "enum":
            k = draw(st.integers(1, 70))  # past one 64-bit word
            attrs.append(Attribute(name=name, kind=kind, catalog_field=f"f{i}",
                                   values=tuple(f"v{j}" for j in range(k))))  # fmt: skip
        elif kind == "bucket":
            edges = sorted(draw(st.sets(st.integers(0, 100), min_size=1, max_size=5)))
            pairs = enumerate(itertools.pairwise(edges))
            buckets = {f"b{j}": (lo, hi - 1) for j, (lo, hi) in pairs}
            buckets[f"b{len(edges)}"] = (edges[-1], None)
            attrs.append(Attribute(name=name, kind=kind, catalog_field=f"f{i}", buckets=buckets))
        else:
            attrs.append(Attribute(name=name, kind=kind, catalog_field=f"f{i}",
                                   bloom_bits=draw(st.sampled_from([64, 128, 512])),
                                   bloom_hashes=draw(st.integers(1, 4))))  # fmt: skip
    return TargetingSchema(attributes=tuple(attrs))


def _labels(a: Attribute) -> list[str]:
    return list(a.labels) if a.kind != "set" else [f"s{j}" for j in range(12)]


@st.composite
def worlds(draw: st.DrawFn) -> tuple:
    """A schema, ads with include and exclude rules (as value names), and a request."""
    schema = draw(schemas())
    n = draw(st.integers(1, 10))
    ads = []
    for _ in range(n):
        ad = {}
        for a in schema.attributes:
            vals = _labels(a)
            inc = draw(st.lists(st.sampled_from(vals), max_size=3, unique=True))
            ad[a.name] = (inc, draw(st.lists(st.sampled_from(vals), max_size=2, unique=True)))
        ad["campaign"] = draw(st.integers(0, 3))
        ads.append(ad)
    req: dict[str, list[str]] = {}
    for a in schema.attributes:
        if a.kind == "set":
            req[a.name] = draw(st.lists(st.sampled_from([*_labels(a), "unseen"]), max_size=4,
                                        unique=True))  # fmt: skip
        elif a.kind == "enum":
            req[a.name] = draw(st.sampled_from([[], *[[v] for v in a.values]]))
        else:
            req[a.name] = draw(st.sampled_from([[], ["0"], ["7"], ["42"], ["99"], ["150"]]))
    blocked_ads = draw(st.lists(st.integers(0, n - 1), max_size=2))
    blocked_campaigns = draw(st.lists(st.integers(1, 3), max_size=1))
    return schema, ads, req, blocked_ads, blocked_campaigns


def _bucket_of(a: Attribute, values: list[str]) -> str | None:
    if not values:
        return None
    x = int(values[0])
    return next((b for b, (lo, hi) in a.buckets.items() if lo <= x and (hi is None or x <= hi)),
                None)  # fmt: skip


def literally(schema: TargetingSchema, ad: dict, i: int, req: dict, blocked: tuple) -> bool:
    """The contract's eligibility, read as written (docs/FORMAT.md §1)."""
    if i in blocked[0] or ad["campaign"] in blocked[1]:
        return False
    for a in schema.attributes:
        inc, exc = ad[a.name]
        if a.kind == "set":
            have = set(req[a.name])
            if (inc and not have & set(inc)) or have & set(exc):
                return False
            continue
        value = req[a.name][0] if req[a.name] else None
        if a.kind == "bucket":
            value = _bucket_of(a, req[a.name])
        if inc and value not in inc:
            return False
        if value is not None and value in exc:
            return False
    return True


def encode(schema: TargetingSchema, ads: list, req: dict) -> tuple:
    c, n = codec(schema), len(ads)
    include, exclude, vocab, ids = {}, {}, {}, {}
    for a in schema.attributes:
        labels = _labels(a)
        index = {v: j for j, v in enumerate(labels)}
        include[a.name] = Ragged.from_lists([[index[v] for v in ad[a.name][0]] for ad in ads])
        exclude[a.name] = Ragged.from_lists([[index[v] for v in ad[a.name][1]] for ad in ads])
        if a.kind == "set":
            vocab[a.name] = value_blooms(labels, a.bloom_bits, a.bloom_hashes)
            ids[a.name] = np.array([index[v] for v in req[a.name] if v in index], dtype=np.int32)
    masked = {a.name for a in schema.attributes if a.kind != "set"}
    bitmask = c.ad_bitmasks({k: v for k, v in include.items() if k in masked},
                            {k: v for k, v in exclude.items() if k in masked}, n)  # fmt: skip
    blooms = c.ad_blooms({k: v for k, v in include.items() if k not in masked}, vocab, n)
    rules = AdRules(bitmask, {k: v for k, v in include.items() if k not in masked},
                    {k: v for k, v in exclude.items() if k not in masked},
                    campaign=np.array([ad["campaign"] for ad in ads], dtype=np.int64))  # fmt: skip
    return c, bitmask, blooms, rules, ids


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_exact_eligibility_is_the_contract_read_literally(world: tuple) -> None:
    schema, ads, req, blocked_ads, blocked_campaigns = world
    c, _, _, rules, ids = encode(schema, ads, req)
    asked = RequestRules(c.request_bitmask(req), ids,
                         exclude_ads=np.array(blocked_ads, dtype=np.int64),
                         exclude_campaigns=np.array(blocked_campaigns, dtype=np.int64))  # fmt: skip
    got = exact_eligible(schema, np.arange(len(ads), dtype=np.int64), rules, asked)
    want = [literally(schema, ad, i, req, (blocked_ads, blocked_campaigns))
            for i, ad in enumerate(ads)]  # fmt: skip
    assert got.tolist() == want


@settings(max_examples=300, deadline=None)
@given(worlds(), st.data())
def test_gtm_never_bars_an_eligible_ad_alone_or_in_any_group(world: tuple, data) -> None:
    schema, ads, req, _, _ = world
    c, bitmask, blooms, rules, ids = encode(schema, ads, req)
    enc = c.encode_requests([req])
    rows = [enc.blooms[0, : enc.n_blooms[0, f], at : at + w]
            for f, (at, w) in enumerate(schema.family_words)]  # fmt: skip
    eligible = exact_eligible(schema, np.arange(len(ads), dtype=np.int64), rules,
                              RequestRules(enc.bitmask[0], ids))  # fmt: skip
    passes = contains(bitmask, enc.bitmask[0]) & blooms_pass(schema, blooms, rows)
    assert not (eligible & ~passes).any()  # one ad: its matcher passes when it is eligible
    # enum/bucket rules and exclusions are exact in the bitmask
    assert (contains(bitmask, enc.bitmask[0]) == exact_eligible(
        TargetingSchema(attributes=tuple(a for a in schema.attributes if a.kind != "set")),
        np.arange(len(ads), dtype=np.int64), AdRules(bitmask, {}, {}),
        RequestRules(enc.bitmask[0], {}))).all()  # fmt: skip
    group = data.draw(st.lists(st.integers(0, len(ads) - 1), min_size=1, unique=True))
    if eligible[group].any():  # a trie node over these ads: the OR of their matchers
        bm = np.bitwise_or.reduce(bitmask[group], axis=0)[None]
        bl = np.bitwise_or.reduce(blooms[group], axis=0)[None]
        assert contains(bm, enc.bitmask[0])[0] and blooms_pass(schema, bl, rows)[0]
