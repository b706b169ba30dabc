"""Live eligibility in the server (`service/index/live.py`): random change sequences,
applied in random segment cuts, leave every ad in the state a plain replay of the feed
gives; through the C++ post stage, a reply at any applied seq holds exactly the ads that
are eligible and live then — 0 ineligible, 0 eligible missed; a state once taken never
changes (a batch answers at one catalog_seq); published segments are caught up from disk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.changes import OPS, SEGMENT_OPS, Change
from contracts.deltas import write_segment
from contracts.targeting_codec import exact_eligible
from service.index.live import DELETED, LIVE, PAUSED, WAITING, LiveEligibility
from service.post import PostRequest, PostStage
from tests.service.post.test_rules import make_request, make_world


def replay(changes: list[Change], ad_id: int, upto: int) -> int:
    """An ad's state after the changes up to seq `upto`, folded one record at a time."""
    state = LIVE
    for c in changes:
        if c.seq > upto or c.ad_id != ad_id:
            continue
        if c.op == "delete":
            state = DELETED
        elif c.op == "upsert":
            state = WAITING
        elif c.op == "restore":
            state = LIVE
        elif c.op == "pause" and state == LIVE:
            state = PAUSED
        elif c.op == "resume" and state == PAUSED:
            state = LIVE
    return state


def feed(draw: st.DrawFn, ad_ids: list[int]) -> list[Change]:
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from((*OPS, "restore")), st.sampled_from(ad_ids)), max_size=60
        )
    )
    seqs = sorted(draw(st.sets(st.integers(1, 10**6), min_size=len(ops), max_size=len(ops))))
    return [Change(s, op, a, {"ad_id": a} if op == "upsert" else None)
            for s, (op, a) in zip(seqs, ops, strict=True)]  # fmt: skip


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, list[Change], list[int]]:
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 40))
    ids = [*range(1, n + 1), 10**9, 10**9 + 1]  # two ads no version holds
    changes = feed(draw, ids)
    cuts = sorted(draw(st.sets(st.integers(0, len(changes)), max_size=6)))
    return seed, changes, cuts


@settings(max_examples=120, deadline=None)
@given(cases())
def test_random_feeds_serve_exactly_the_eligible_live_ads(case) -> None:
    seed, changes, cuts = case
    rng = np.random.default_rng(seed)
    world = make_world(rng, 1, int(rng.integers(1, 41)))
    ads = world.ads
    ads.ad_ids[:] = np.arange(1, ads.num_ads + 1)[rng.permutation(ads.num_ads)]
    stage = PostStage(ads, 2, schema=world.schema, rules=world.rules)
    live = LiveEligibility(ads.ad_ids, "v", None)
    leaves = np.arange(len(ads.leaf_sids), dtype=np.int64)
    scores = np.zeros(len(leaves), dtype=np.float32)
    before = []
    for lo, hi in zip([0, *cuts], [*cuts, len(changes)], strict=True):
        taken = live.state
        frozen = None if taken.not_live is None else taken.not_live.copy()
        live.apply(changes[lo:hi])
        before.append((taken, frozen))
        state = live.state
        seq = state.seq
        want_states = [replay(changes, int(a), seq) for a in ads.ad_ids]
        got_states = [LIVE if state.not_live is None else int(x) for x in
                      (state.not_live if state.not_live is not None else ads.ad_ids)]  # fmt: skip
        assert got_states == want_states
        held = set(ads.ad_ids.tolist())
        new = {c.ad_id for c in changes if c.ad_id not in held and c.seq <= seq}
        waiting = {a for a in new if replay(changes, a, seq) == WAITING}
        assert state.new_waiting == waiting
        assert state.counts[1:4] == tuple(want_states.count(s) for s in (PAUSED, DELETED, WAITING))
        req, _ = make_request(rng, world)
        post = PostRequest.from_rules(leaves, scores, req, world.schema, ads.num_ads)
        (out,) = stage.run([post], state.not_live)
        ok = exact_eligible(world.schema, ads.ad_ids, world.rules, req)
        served = {int(a) for a, good, s in zip(ads.ad_ids, ok, want_states, strict=True)
                  if good and s == LIVE}  # fmt: skip
        assert set(out.ad_ids.tolist()) == served  # 0 ineligible, 0 eligible missed
        assert out.ads_not_live == sum(s != LIVE for s in want_states)
    for taken, frozen in before:  # copy on write: a batch's state never moves under it
        assert (taken.not_live is None) == (frozen is None)
        if frozen is not None:
            np.testing.assert_array_equal(taken.not_live, frozen)


def test_segments_on_disk_are_caught_up_in_order_once() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        live = LiveEligibility(np.array([7, 3, 5], dtype=np.int64), "v1", root)
        assert live.catch_up() == dict.fromkeys(SEGMENT_OPS, 0) and live.seq == 0
        write_segment(root, "v1", [Change(1, "pause", 3), Change(2, "delete", 5)])
        write_segment(root, "v1", [Change(4, "resume", 3), Change(6, "resume", 5)])
        write_segment(root, "v2", [Change(9, "pause", 7)])  # another version's
        applied = live.catch_up()
        assert applied == {"upsert": 0, "pause": 1, "resume": 2, "delete": 1, "restore": 0,
                           "place": 0}  # fmt: skip
        assert live.seq == 6 and live.state.not_live.tolist() == [LIVE, LIVE, DELETED]
        assert live.catch_up() == dict.fromkeys(SEGMENT_OPS, 0)  # nothing twice
        row = {"sid": [1, 2, 3, 0]}
        write_segment(root, "v1", [Change(8, "upsert", 7, {"ad_id": 7, **row}),
                                   Change(9, "upsert", 1, {"ad_id": 1, **row})])  # fmt: skip
        live.catch_up()
        assert live.state.not_live.tolist() == [WAITING, LIVE, DELETED]
        assert live.state.new_waiting == frozenset({1}) and live.seq == 9
        write_segment(root, "v1", [Change(10, "restore", 5), Change(11, "restore", 7)])
        live.catch_up()  # the rows these versions were built from: served again
        assert live.state.not_live.tolist() == [LIVE, LIVE, LIVE]


def test_a_version_built_from_a_snapshot_starts_at_its_seq() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        live = LiveEligibility(np.array([7, 3], dtype=np.int64), "v1", root, built_at=40)
        assert live.seq == 40 and live.state.not_live is None
        write_segment(root, "v1", [Change(41, "pause", 3)])
        live.catch_up()
        assert live.seq == 41 and live.state.not_live.tolist() == [LIVE, PAUSED]
        live.apply([Change(39, "delete", 7)])  # at or below where it started: held already
        assert live.state.not_live.tolist() == [LIVE, PAUSED]
