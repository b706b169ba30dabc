"""The GTM trie and its reference lookup: CSR shape, SID -> ad, and no false negatives."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.index_arrays import IndexArrays, TrieArrays
from contracts.index_format import SID_LENGTH
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.tensors import GtmTables, RequestTensors
from index_builder.build import build_arrays
from index_builder.kway import KwaySpec
from kernels.gtm_mask import lookup
from tests.helpers.catalogs import (
    ads_strategy,
    catalog_from_ads,
    encode_default,
    requests_strategy,
)
from tests.helpers.oracle import Ad, eligible_prefixes

SMALL_STATIC = KwaySpec("static", (3, 2, 2, 1))
SMALL_DYNAMIC = KwaySpec("dynamic", k_max=4, target_fill=0.25)


def build(ads: list[Ad], kway: KwaySpec | None = None) -> IndexArrays:
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64), kway)


def undeduplicated(trie: TrieArrays) -> TrieArrays:
    """The same trie with one matcher row per child entry (no dedup)."""
    e = np.arange(trie.num_entries, dtype=np.int32)
    return dataclasses.replace(
        trie,
        bitmask_table=trie.bitmask_table[trie.bitmask_index],
        bloom_table=trie.bloom_table[trie.bloom_index],
        bitmask_index=e,
        bloom_index=e.copy(),
    )


def node_prefixes(index: IndexArrays) -> dict[int, tuple[int, ...]]:
    """Node id -> its SID prefix, by walking the CSR from the root."""
    t = index.trie
    prefix = {0: ()}
    for node in range(t.num_nodes):
        for j in range(t.node_offsets[node], t.node_offsets[node + 1]):
            prefix[int(t.csr_child_nodes[j])] = (*prefix[node], int(t.csr_tokens[j]))
    return prefix


def allowed_prefixes(
    index: IndexArrays, req: Targeting, mode: FilterMode, trie: TrieArrays | None = None
) -> set[tuple[int, ...]]:
    """Every prefix the reference lookup lets through, asked from every inner node."""
    tables = GtmTables.from_arrays(trie or index.trie, index.kway)
    inner = torch.arange(int(index.trie.level_offsets[SID_LENGTH]))
    allowed, child = lookup(
        tables,
        inner,
        torch.zeros_like(inner),
        RequestTensors.from_encoded(encode_default([req])),
        mode,
    )
    prefix = node_prefixes(index)
    return {prefix[int(c)] for c in child[allowed].tolist()}


def test_trie_enumerates_exactly_the_catalog_sids_and_maps_back_to_ads() -> None:
    ads = [
        Ad(7, (1, 2, 3, 4)),
        Ad(3, (1, 2, 3, 4)),  # two ads share one SID
        Ad(9, (1, 2, 5, 0)),
        Ad(5, (0, 511, 0, 0)),
        Ad(1, (511, 511, 511, 511)),
    ]
    index = build(ads)
    prefix = node_prefixes(index)
    leaves = range(int(index.trie.level_offsets[SID_LENGTH]), index.trie.num_nodes)
    assert sorted(prefix[n] for n in leaves) == sorted({a.sid for a in ads})
    # SID -> ads round-trips
    ads_of = {}
    for i, sid in enumerate(index.ads.leaf_sids.tolist()):
        lo, hi = index.ads.leaf_ad_offsets[i : i + 2]
        ads_of[tuple(sid)] = sorted(index.ads.ad_ids[lo:hi].tolist())
    assert ads_of == {
        (0, 511, 0, 0): [5],
        (1, 2, 3, 4): [3, 7],
        (1, 2, 5, 0): [9],
        (511, 511, 511, 511): [1],
    }
    # the root has one child per distinct first token, in token order
    t = index.trie
    assert t.csr_tokens[t.node_offsets[0] : t.node_offsets[1]].tolist() == [0, 1, 511]


def test_cd_only_allows_exactly_the_catalog_prefixes() -> None:
    ads = [Ad(1, (0, 1, 2, 3), countries=("US",)), Ad(2, (0, 1, 4, 4), locations=("x",))]
    index = build(ads)
    got = allowed_prefixes(index, Targeting(country="FR"), FilterMode.CD_ONLY)
    assert got == {a.sid[:n] for a in ads for n in range(1, 5)}


def test_gtm_masks_prefixes_without_eligible_ads() -> None:
    ads = [
        Ad(1, (0, 0, 0, 0), countries=("US",)),
        Ad(2, (0, 0, 0, 1), countries=("CA",), locations=("CA/R1",)),
        Ad(3, (1, 0, 0, 0), genders=("female",)),
    ]
    index = build(ads)
    got = allowed_prefixes(index, Targeting("US", 30, "male"), FilterMode.CD_GTM)
    assert got == {(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)}


def test_dedup_shares_matcher_rows() -> None:
    ads = [Ad(i, (i % 2, i % 3, i, 0), countries=("US",)) for i in range(30)]
    index = build(ads)
    t = index.trie
    assert len(t.bitmask_table) == 1  # every entry has the same OR
    assert len(t.bloom_table) == 1
    assert t.num_entries > 30


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ads=ads_strategy(), reqs=st.lists(requests_strategy, min_size=1, max_size=4))
def test_gtm_never_drops_an_eligible_prefix(ads: list[Ad], reqs: list[Targeting]) -> None:
    """For every node whose subtree holds an eligible ad, the matcher passes — with and
    without dedup, with static and dynamic k-way; and GTM never adds a non-catalog prefix."""
    plain = build(ads)
    static = build(ads, SMALL_STATIC)
    dynamic = build(ads, SMALL_DYNAMIC)
    catalog = {a.sid[:n] for a in ads for n in range(1, 5)}
    for req in reqs:
        must = eligible_prefixes(ads, req)
        variants = [
            allowed_prefixes(plain, req, FilterMode.CD_GTM),
            allowed_prefixes(plain, req, FilterMode.CD_GTM, trie=undeduplicated(plain.trie)),
            allowed_prefixes(static, req, FilterMode.CD_GTM_KWAY),
            allowed_prefixes(dynamic, req, FilterMode.CD_GTM_KWAY),
        ]
        for got in variants:
            assert must <= got, f"dropped eligible prefixes {must - got}"
            assert got <= catalog
        # dedup is storage only: identical decisions
        assert variants[0] == variants[1]


@settings(max_examples=40, deadline=None)
@given(ads=ads_strategy(max_ads=25), reqs=st.lists(requests_strategy, min_size=1, max_size=3))
def test_kway_is_at_least_as_selective_as_plain_gtm(ads: list[Ad], reqs: list[Targeting]):
    plain, static = build(ads), build(ads, SMALL_STATIC)
    for req in reqs:
        assert allowed_prefixes(static, req, FilterMode.CD_GTM_KWAY) <= allowed_prefixes(
            plain, req, FilterMode.CD_GTM
        )


def test_lookup_serves_a_batch_of_requests_independently() -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("US",)), Ad(2, (1, 0, 0, 0), countries=("CA",))]
    index = build(ads)
    tables = GtmTables.from_arrays(index.trie)
    reqs = RequestTensors.from_encoded(encode_default([Targeting("US"), Targeting("CA")]))
    root = torch.zeros(2, dtype=torch.int64)
    allowed, child = lookup(tables, root, torch.tensor([0, 1]), reqs, FilterMode.CD_GTM)
    assert allowed[0].nonzero().flatten().tolist() == [0]
    assert allowed[1].nonzero().flatten().tolist() == [1]
    assert (child[~allowed] == -1).all()


def test_kway_lookup_without_partitions_says_how_to_get_them() -> None:
    index = build([Ad(1, (0, 0, 0, 0))])
    with pytest.raises(ValueError, match="--kway"):
        allowed_prefixes(index, Targeting(), FilterMode.CD_GTM_KWAY)


def test_static_kway_respects_k_per_step() -> None:
    ads = [Ad(i, (0, i % 4, i % 7, i), locations=(f"L{i}",)) for i in range(40)]
    index = build(ads, SMALL_STATIC)
    assert index.kway is not None
    groups = np.diff(index.kway.offsets)
    lo = index.trie.level_offsets
    for depth, k in enumerate(SMALL_STATIC.k, start=1):
        step = groups[lo[depth] - 1 : lo[depth + 1] - 1]
        assert step.max() <= k and step.min() >= 1
    assert groups[0] == 3  # the root's one child holds 40 distinct SIDs: all 3 groups used


@settings(max_examples=50, deadline=None)
@given(ads=ads_strategy(max_ads=50, token_range=4))
def test_csr_trie_and_sid_index_round_trip_random_catalogs(ads: list[Ad]) -> None:
    index = build(ads)
    prefix = node_prefixes(index)
    lo = index.trie.level_offsets
    for depth in range(SID_LENGTH + 1):
        nodes = {prefix[n] for n in range(int(lo[depth]), int(lo[depth + 1]))}
        assert nodes == {a.sid[:depth] for a in ads}
    got = {}
    for i, sid in enumerate(index.ads.leaf_sids.tolist()):
        lo_, hi = index.ads.leaf_ad_offsets[i : i + 2]
        for ad_id in index.ads.ad_ids[lo_:hi].tolist():
            got[ad_id] = tuple(sid)
    assert got == {a.ad_id: a.sid for a in ads}
