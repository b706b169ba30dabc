"""Subtrees with no live ad are barred in decoding (`service/index/prune.py`): each trie
entry's size and path are the catalog's; after random change sequences the barred
entries are exactly those below which no ad is live (a replay of the feed); through the
served engine, wide beams emit exactly the SIDs they emitted before less the barred ones,
narrow beams spend no beam on them, and a resumed subtree gets its matchers back."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.changes import Change
from contracts.index_arrays import IndexArrays
from contracts.request import FilterMode
from contracts.targeting import Targeting
from index_builder.build import build_arrays
from index_builder.kway import KwaySpec
from service.index.live import LIVE, LiveEligibility
from service.index.loaded import LoadedIndex
from service.index.prune import Subtrees
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.oracle import Ad
from tests.service.decode.cases import WIDE, Served, ctx_for, make_ads, requests, setup
from tests.service.test_live import feed, replay


def index_of(ads: list[Ad]) -> IndexArrays:
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64))


def prefixes(index: IndexArrays) -> dict[int, tuple[int, ...]]:
    """Every trie entry's SID prefix, walking the trie from the root."""
    t, out, todo = index.trie, {}, [(0, ())]
    while todo:
        node, prefix = todo.pop()
        for e in range(int(t.node_offsets[node]), int(t.node_offsets[node + 1])):
            out[e] = (*prefix, int(t.csr_tokens[e]))
            todo.append((int(t.csr_child_nodes[e]), out[e]))
    return out


def ad_sids(index: IndexArrays) -> list[tuple[int, ...]]:
    """Each ad row's SID."""
    counts = np.diff(index.ads.leaf_ad_offsets)
    return [tuple(s) for s in np.repeat(index.ads.leaf_sids, counts, axis=0).tolist()]


def test_paths_and_sizes_are_the_catalogs() -> None:
    index = index_of(make_ads(300, seed=7))
    sub, sids = Subtrees(index.trie, index.ads), ad_sids(index)
    for e, p in prefixes(index).items():
        assert sub.size(e, len(p)) == sum(s[: len(p)] == p for s in sids)
    pre = prefixes(index)
    for row, sid in enumerate(sids):
        assert [pre[e] for e in sub.path(row)] == [sid[:n] for n in range(1, 5)]


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, list[Change], list[int]]:
    seed = draw(st.integers(0, 2**16))
    n = draw(st.integers(1, 30))
    changes = feed(draw, [*range(500, 500 + n), 10**9])
    cuts = sorted(draw(st.sets(st.integers(0, len(changes)), max_size=5)))
    return seed, changes, cuts


@settings(max_examples=80, deadline=None)
@given(cases())
def test_barred_entries_are_those_with_no_live_ad(case) -> None:
    seed, changes, cuts = case
    ads = make_ads(30, seed=seed)  # ids 500..529, SIDs of 3 tokens each: shared prefixes
    index = index_of(ads)
    live = LiveEligibility(index.ads.ad_ids, "v", None, subtrees=Subtrees(index.trie, index.ads))
    sids, ids = ad_sids(index), index.ads.ad_ids.tolist()
    for a, b in zip([0, *cuts], [*cuts, len(changes)], strict=True):
        live.apply(changes[a:b])
        seq = live.state.seq
        alive = [s for ad, s in zip(ids, sids, strict=True) if replay(changes, ad, seq) == LIVE]
        want = [e for e, p in prefixes(index).items() if not any(s[: len(p)] == p for s in alive)]
        assert live.state.dead_entries.tolist() == sorted(want)


def emitted(search: Served, targeting: Targeting, beams: tuple[int, ...]) -> list[tuple[int, ...]]:
    res = search.run(ctx_for(1, seed=3), requests([targeting]), beams, FilterMode.CD_GTM)
    leaves, _ = res.valid(0)
    return [tuple(s) for s in res.sids[0][: len(leaves)].tolist()]


def test_decoding_spends_no_beam_on_a_subtree_with_no_live_ad() -> None:
    ads = make_ads(60, seed=11)
    case = setup(ads)
    loaded = LoadedIndex.from_arrays(case.index)
    search = Served(case.served().engine, loaded.tables, loaded.level_offsets)
    anyone = Targeting("US", 30, "female", ("US/R1", "CA/R2", "GB/R3"))
    before = emitted(search, anyone, WIDE)
    original = (loaded.tables.bitmask_index.clone(), loaded.tables.bloom_index.clone())
    # pause every ad under the most emitted first token, and the ads of one more SID
    top = max({s[0] for s in before}, key=lambda t: sum(s[0] == t for s in before))
    other = next(s for s in before if s[0] != top)
    gone = [a for a in ads if a.sid[0] == top or a.sid == other]
    live = loaded.live
    live.apply([Change(i + 1, "pause", a.ad_id) for i, a in enumerate(gone)])
    loaded.pruning.sync(live.state.dead_entries)
    dead = {a.sid for a in gone}
    after = emitted(search, anyone, WIDE)
    # wide beams: the same SIDs less the barred ones (nothing else moves)
    assert set(after) == set(before) - dead and not set(after) & dead
    # narrow beams: every beam on a SID with a live ad, as many as there are
    narrow = emitted(search, anyone, (1, 2, 3, 3))
    assert len(narrow) == min(3, len(after)) and not set(narrow) & dead
    # resumed: the matchers the build made, and the search of before
    live.apply([Change(1000 + i, "resume", a.ad_id) for i, a in enumerate(gone)])
    loaded.pruning.sync(live.state.dead_entries)
    assert not len(live.state.dead_entries)
    assert torch.equal(loaded.tables.bitmask_index, original[0])
    assert torch.equal(loaded.tables.bloom_index, original[1])
    assert emitted(search, anyone, WIDE) == before


def test_a_state_taken_before_a_pause_keeps_its_subtrees() -> None:
    """A batch decodes with the barred entries of the state it took: one taken before a
    pause, synced after a later one, reads every entry again (nothing barred twice or
    left barred)."""
    ads = [Ad(1, (0, 0, 0, 0)), Ad(2, (0, 0, 0, 1)), Ad(3, (1, 0, 0, 0))]
    loaded = LoadedIndex.from_arrays(index_of(ads))
    before = loaded.live.state
    loaded.live.apply([Change(1, "pause", 1), Change(2, "delete", 2)])
    paused = loaded.live.state
    assert len(paused.dead_entries) == 5  # (0), (0, 0), (0, 0, 0) and both leaves below
    loaded.pruning.sync(paused.dead_entries)
    zero = len(index_of(ads).trie.bitmask_table)  # the row after the built ones
    assert (loaded.tables.bitmask_index[paused.dead_entries] == zero).all()
    loaded.pruning.sync(before.dead_entries)
    assert not (loaded.tables.bitmask_index == zero).any()


def test_kway_matchers_are_pruned_and_restored() -> None:
    """With k-way matchers (CD_GTM_KWAY) a barred entry's partitions are zero rows; a
    resume gives back the rows the build made."""
    ads = make_ads(60, seed=4)
    case = setup(ads, kway=KwaySpec("static", (3, 2, 2, 1)))
    loaded = LoadedIndex.from_arrays(case.index)
    search = Served(case.served(batch_buckets=(1,)).engine, loaded.tables, loaded.level_offsets)
    t = loaded.tables
    assert t.kway_bitmask is not None and t.kway_bloom is not None
    original = (t.kway_bitmask.clone(), t.kway_bloom.clone())
    anyone = Targeting("US", 30, "female", ("US/R1", "CA/R2", "GB/R3"))

    def sids() -> set[tuple[int, ...]]:
        res = search.run(ctx_for(1, seed=3), requests([anyone]), WIDE, FilterMode.CD_GTM_KWAY)
        return {tuple(s) for s in res.sids[0][: len(res.valid(0)[0])].tolist()}

    before = sids()
    gone = [a for a in ads if a.sid[:2] == next(iter(before))[:2]]
    loaded.live.apply([Change(i + 1, "delete", a.ad_id) for i, a in enumerate(gone)])
    loaded.pruning.sync(loaded.live.state.dead_entries)
    assert sids() == before - {a.sid for a in gone}
    loaded.live.apply([Change(100 + i, "restore", a.ad_id) for i, a in enumerate(gone)])
    loaded.pruning.sync(loaded.live.state.dead_entries)
    assert torch.equal(t.kway_bitmask, original[0]) and torch.equal(t.kway_bloom, original[1])
    assert sids() == before
