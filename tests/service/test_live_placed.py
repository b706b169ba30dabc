"""Upserts served in place (`contracts/placed.py`, `service/index/placed.py`): random feeds
of upserts (new targeting, new ads into existing SIDs, SIDs the trie lacks, values the
version does not know), pauses, resumes and deletes go through the real builder publisher
into a published index's live state. At every applied seq, against an oracle that replays
the same feed on the raw strings: the exact answer holds exactly the ads that are live and
eligible by their current row (0 ineligible, 0 eligible missed), and the served engine's
exhaustive beams reach every SID holding one (GTM never drops an eligible prefix, widened
rows included). When the spare rows run out a place waits like an upsert.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.changes import Change
from contracts.request import FilterMode
from contracts.targeting import Targeting
from index_builder.build import build_index
from index_builder.change_publisher import ChangePublisher
from index_builder.publish import current_path
from service.index.live import PLACED, WAITING
from service.index.loaded import LoadedIndex, load_index
from tests.helpers.oracle import Ad, eligible
from tests.service.decode.cases import WIDE, Served, ctx_for, make_ads, requests, setup

COUNTRIES, AGES, GENDERS = ("US", "CA", "GB"), ("25-34", "45-54"), ("female", "male")
LOCATIONS = ("US/R1", "CA/R2", "GB/R3", "FR/R9")  # FR/R9: in no built ad's rules
ASKED = [Targeting(c, age, g, locs) for c in ("US", "CA", "GB", "FR") for age in (30, 50)
         for g in ("female", "male") for locs in ((), ("US/R1",), ("GB/R3", "FR/R9"))]  # fmt: skip


def _pick(draw: st.DrawFn, pool: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(draw(st.sets(st.sampled_from(pool), max_size=2))))


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[Ad], list[Change], list[int]]:
    ads = make_ads(draw(st.integers(3, 24)), seed=draw(st.integers(0, 2**16)))
    ids = [a.ad_id for a in ads] + [900, 901]  # two ads the version does not hold
    built_sids = [a.sid for a in ads]
    changes = []
    for seq in range(1, draw(st.integers(1, 30)) + 1):
        op, ad = draw(st.sampled_from(("upsert", "upsert", "pause", "resume", "delete"))), \
            draw(st.sampled_from(ids))  # fmt: skip
        if op != "upsert":
            changes.append(Change(seq, op, ad))
            continue
        sid = draw(st.one_of(st.sampled_from(built_sids),
                             st.tuples(*[st.integers(0, 3)] * 4)))  # fmt: skip
        row = Ad(ad, sid, _pick(draw, COUNTRIES), _pick(draw, AGES), _pick(draw, GENDERS),
                 _pick(draw, LOCATIONS)).row()  # fmt: skip
        changes.append(Change(seq, "upsert", ad, row))
    cuts = sorted(draw(st.sets(st.integers(0, len(changes)), max_size=4)))
    return ads, changes, cuts


def oracle(ads: list[Ad], changes: list[Change], seq: int) -> dict[int, Ad]:
    """Each served ad's row after the feed up to `seq`: an upsert of the built row serves
    it as built; one whose SID is a built leaf and whose locations the built ads name is
    served in place; any other waits for the next full build."""
    built = {a.ad_id: a for a in ads}
    sids, vocab = {a.sid for a in ads}, {v for a in ads for v in a.locations}
    state: dict[int, tuple[Ad | None, str]] = {a.ad_id: (a, "live") for a in ads}
    for c in changes:
        if c.seq > seq:
            break
        row, status = state.get(c.ad_id, (None, "absent"))
        if c.op == "upsert":
            assert c.row is not None
            new = Ad(c.ad_id, tuple(c.row["sid"]), *(tuple(c.row[k]) for k in
                     ("countries", "age_buckets", "genders", "locations")))  # fmt: skip
            if new == built.get(c.ad_id) or (new.sid in sids and set(new.locations) <= vocab):
                state[c.ad_id] = (new, "live")
            else:
                state[c.ad_id] = (None, "waiting")
        elif c.op == "delete":
            state[c.ad_id] = (None, "deleted")
        elif c.op == "pause" and status == "live":
            state[c.ad_id] = (row, "paused")
        elif c.op == "resume" and status == "paused":
            state[c.ad_id] = (row, "live")
    return {a: row for a, (row, status) in state.items() if status == "live" and row is not None}


def publish(root: Path, ads: list[Ad]) -> tuple[ChangePublisher, LoadedIndex, Served]:
    """The published index of `ads` under `root`, the builder's publisher of root/feed over
    it, the index loaded, and the served engine over its tables."""
    (root / "catalog.jsonl").write_text("".join(json.dumps(a.row()) + "\n" for a in ads))
    (root / "feed").mkdir()
    build_index(root / "catalog.jsonl", root / "index", sid_space="s", progress=False)
    publisher = ChangePublisher(root / "feed", root / "index", root / "rejects.jsonl")
    loaded = load_index(current_path(root / "index"))
    return publisher, loaded, Served(setup(ads).served().engine, loaded.tables,
                                     loaded.level_offsets)  # fmt: skip


def feed_to(root: Path, changes: list[Change], publisher: ChangePublisher) -> None:
    with (root / "feed" / "0001.jsonl").open("ab") as fh:
        fh.write(b"".join(c.to_json() for c in changes))
    publisher.tick()


def answered(loaded: LoadedIndex, t: Targeting) -> set[int]:
    leaves = np.arange(len(loaded.arrays.ads.leaf_sids), dtype=np.int64)
    req = loaded.post_request(leaves, np.zeros(len(leaves), np.float32), t, 10_000)
    (out,) = loaded.answer([req], loaded.live.state)
    return set(out.ad_ids.tolist())


@settings(max_examples=30, deadline=None)
@given(cases())
def test_random_feeds_with_places_serve_exactly_the_eligible_live_rows(case) -> None:
    ads, changes, cuts = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        publisher, loaded, search = publish(root, ads)
        for lo, hi in zip([0, *cuts], [*cuts, len(changes)], strict=True):
            if lo < hi:
                feed_to(root, changes[lo:hi], publisher)
            loaded.live.catch_up()
            state = loaded.live.state
            want = oracle(ads, changes, state.seq)
            assert state.seq == (changes[hi - 1].seq if hi else 0)
            loaded.pruning.sync(state.dead_entries, state.widened)
            for t in ASKED[:: max(1, len(ASKED) // 6)]:
                good = {a for a, row in want.items() if eligible(row, t)}
                assert answered(loaded, t) == good  # 0 ineligible, 0 eligible missed
                res = search.run(ctx_for(1, seed=3), requests([t]), WIDE, FilterMode.CD_GTM)
                reached = {tuple(s) for s in res.sids[0][: len(res.valid(0)[0])].tolist()}
                assert {want[a].sid for a in good} <= reached  # GTM drops no eligible prefix


def test_a_new_ad_widens_its_path_and_is_returned() -> None:
    """A new ad placed into a SID whose subtree's matchers bar a request: the rows on its
    path are widened (new rows, the shared ones untouched), wide beams now reach the SID
    for that request and the answer holds the ad; pausing it leaves the rows wide (sound)
    and the answer without it."""
    ads = [Ad(1, (0, 0, 0, 0), countries=("GB",)), Ad(2, (1, 0, 0, 0), countries=("GB",))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        publisher, loaded, search = publish(root, ads)
        us = Targeting("US", 30, "female", ())

        def reached() -> set[tuple[int, ...]]:
            state = loaded.live.state
            loaded.pruning.sync(state.dead_entries, state.widened)
            res = search.run(ctx_for(1, seed=3), requests([us]), WIDE, FilterMode.CD_GTM)
            return {tuple(s) for s in res.sids[0][: len(res.valid(0)[0])].tolist()}

        assert reached() == set() and answered(loaded, us) == set()
        shared = loaded.tables.bitmask_table[: len(loaded.arrays.trie.bitmask_table)].clone()
        new = Ad(7, (1, 0, 0, 0), countries=("US",))
        feed_to(root, [Change(1, "upsert", 7, new.row())], publisher)
        loaded.live.catch_up()
        assert loaded.live.state.placed[7][0].sid == (1, 0, 0, 0)
        assert reached() == {(1, 0, 0, 0)} and answered(loaded, us) == {7}
        assert answered(loaded, Targeting("GB", 30, "female", ())) == {1, 2}
        built = loaded.tables.bitmask_table[: len(loaded.arrays.trie.bitmask_table)]
        assert (built == shared).all()  # copy on write: no shared row changed
        feed_to(root, [Change(2, "pause", 7)], publisher)
        loaded.live.catch_up()
        assert answered(loaded, us) == set() and reached() == {(1, 0, 0, 0)}
        # a narrowing: ad 2 itself now targets the US only, then GB is refused it
        feed_to(root, [Change(3, "upsert", 2, Ad(2, (1, 0, 0, 0), countries=("US",)).row())],
                publisher)  # fmt: skip
        loaded.live.catch_up()
        assert answered(loaded, Targeting("GB", 30, "female", ())) == {1}
        assert answered(loaded, us) == {2}


def test_spare_rows_spent_the_place_waits_for_the_next_build() -> None:
    ads = [Ad(1, (0, 0, 0, 0), countries=("GB",)), Ad(2, (1, 0, 0, 0), countries=("GB",))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        publisher, full, _ = publish(root, ads)
        # two spare rows: the first place widens its leaf's 4 entries... only 2 fit
        small = LoadedIndex.from_arrays(full.arrays, version=full.version, path=full.path,
                                        manifest=full.manifest, spare_rows=2)  # fmt: skip
        feed_to(root, [Change(1, "upsert", 7, Ad(7, (1, 0, 0, 0), ("US",)).row()),
                       Change(2, "upsert", 1, Ad(1, (0, 0, 0, 0), ("GB",), ("25-34",)).row())],
                publisher)  # fmt: skip
        small.live.catch_up()
        state = small.live.state
        assert state.new_waiting == {7} and 7 not in state.placed  # no row to widen
        assert 1 in state.placed and state.not_live[small.live.rows([1])[0]] == PLACED
        assert answered(small, Targeting("GB", 30, "female", ())) == {1, 2}
        full.live.catch_up()  # the same segments with the default spare rows: both placed
        assert set(full.live.state.placed) == {1, 7} and not full.live.state.new_waiting
        assert WAITING not in full.live.state.not_live.tolist()
