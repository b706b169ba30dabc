"""`grace builder --changes DIR`: a change feed published as delta segments over the
CURRENT index version, a real builder process followed through its files and its metrics.

Each valid record is published once, in seq order, in whole segments; a bad record (a
broken line, an upsert row the catalog reader refuses) goes to the rejects file with its
seq, field and reason and the records after it still publish; a builder killed mid-feed
and started again publishes nothing twice and loses nothing; a new base version gets its
own segments. Conditions are waited for, never fixed times.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.changes import Change
from contracts.deltas import Segment, published_seq, read_segment, segments, write_segment
from index_builder.build import build_index
from index_builder.change_publisher import ChangePublisher
from index_builder.publish import current_path
from tests.helpers.server_process import free_port, metric_value
from tests.helpers.waiting import first
from tests.index_builder.test_builder_metrics import scrape

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"ad_id": i, "sid": [i % 3, i % 5, i % 7, 0]} for i in range(1, 40)]


def until(what: Callable[[], object], proc: subprocess.Popen | None = None) -> object:
    return first(what, "the condition", proc)


def start(tmp: Path, port: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cli", "builder", "--catalog", str(tmp / "catalog.jsonl"),
           "--out", str(tmp / "index"), "--sid-space", "s", "--interval", "0.2",
           "--changes", str(tmp / "feed"), "--changes-interval", "0.05"]  # fmt: skip
    if port is not None:
        cmd += ["--metrics-port", str(port)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=60)


def published(root: Path) -> list[Change]:
    base = current_path(root)
    return [c for s in segments(root, base.name) for c in read_segment(s)] if base else []


def append(feed: Path, name: str, records: list[dict | str]) -> None:
    with (feed / name).open("a") as fh:
        for r in records:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


@pytest.fixture
def world(tmp_path: Path) -> Path:
    (tmp_path / "catalog.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "feed").mkdir()
    return tmp_path


def test_changes_publish_in_order_bad_records_rejected_the_rest_applied(world: Path) -> None:
    feed, root = world / "feed", world / "index"
    port = free_port()
    proc = start(world, port)
    try:
        until(lambda: current_path(root), proc)
        append(feed, "0001.jsonl", [
            {"seq": 1, "op": "pause", "ad_id": 3},
            {"seq": 2, "op": "upsert", "ad_id": 99, "sid": [1, 2, 3, 0], "countries": ["US"]},
            "{not json",
            {"seq": 4, "op": "upsert", "ad_id": 98, "sid": [1, 2, 3, 0], "countries": ["USA"]},
            {"seq": 5, "op": "resume", "ad_id": 3, "countries": ["US"]},
            {"seq": 6, "op": "delete", "ad_id": 7},
        ])  # fmt: skip
        got = until(lambda: (p := published(root)) and p[-1].seq == 6 and p, proc)
        assert [(c.seq, c.op, c.ad_id) for c in got] == [(1, "pause", 3), (2, "upsert", 99),
                                                         (6, "delete", 7)]  # fmt: skip
        assert got[1].row == {"ad_id": 99, "sid": [1, 2, 3, 0], "countries": ["US"]}
        rejects = [json.loads(x) for x in (root / "deltas" / "rejects.jsonl").read_text()
                   .splitlines()]  # fmt: skip
        by_seq = {r["seq"]: r for r in rejects}
        assert len(rejects) == 3 and None in by_seq
        assert "invalid JSON" in by_seq[None]["reason"]
        assert by_seq[4]["field"] == "countries" and "USA" in by_seq[4]["reason"]
        assert by_seq[5]["field"] == "countries"  # a resume carries nothing else
        text = scrape(port)
        assert metric_value(text, "grace_builder_changes_published_total", {"op": "pause"}) == 1
        assert metric_value(text, "grace_builder_changes_published_total", {"op": "delete"}) == 1
        assert metric_value(text, "grace_builder_changes_rejected_total", {}) == 3
        assert metric_value(text, "grace_builder_published_seq", {}) == 6
        assert metric_value(text, "grace_builder_feed_lag_seconds", {}) < 60
        # a later file, and the catalog's next build: a new base with its own segments
        append(feed, "0002.jsonl", [{"seq": 7, "op": "pause", "ad_id": 8}])
        until(lambda: published(root)[-1].seq == 7, proc)
        first = current_path(root).name
        with (world / "catalog.jsonl").open("a") as fh:
            fh.write(json.dumps({"ad_id": 500, "sid": [0, 0, 0, 1]}) + "\n")
        until(lambda: current_path(root).name != first, proc)
        again = until(lambda: (p := published(root)) and p[-1].seq == 7 and p, proc)
        assert [c.seq for c in again] == [1, 2, 6, 7]  # the feed from its start, once
    finally:
        stop(proc)


def test_a_killed_builder_resumes_from_its_watermark(world: Path) -> None:
    feed, root = world / "feed", world / "index"
    proc = start(world)
    try:
        until(lambda: current_path(root), proc)
        append(feed, "a.jsonl", [{"seq": s, "op": "pause", "ad_id": s} for s in range(1, 51)])
        until(lambda: published_seq(root, current_path(root).name) == 50, proc)
    finally:
        stop(proc, signal.SIGKILL)
    # written while no builder runs, and one record in the file being written when it died
    append(feed, "a.jsonl", [{"seq": s, "op": "pause", "ad_id": s} for s in range(51, 81)])
    append(feed, "b.jsonl", [{"seq": s, "op": "delete", "ad_id": s} for s in range(81, 101)])
    proc = start(world)
    try:
        until(lambda: published_seq(root, current_path(root).name) == 100, proc)
        assert [c.seq for c in published(root)] == list(range(1, 101))  # none twice, none lost
        assert not (root / "deltas" / "rejects.jsonl").exists()
    finally:
        stop(proc)


def test_a_segment_is_whole_ordered_and_above_the_watermark(tmp_path: Path) -> None:
    changes = [Change(3, "pause", 1), Change(5, "delete", 2)]
    seg = write_segment(tmp_path, "v1", changes)
    assert seg == Segment(3, 5, tmp_path / "deltas" / "v1" / f"{3:020d}-{5:020d}.jsonl")
    assert read_segment(seg) == changes
    assert not [p for p in seg.path.parent.iterdir() if p.name.startswith(".")]
    with pytest.raises(ValueError, match="not above"):
        write_segment(tmp_path, "v1", [Change(5, "resume", 1)])
    with pytest.raises(ValueError, match="increasing"):
        write_segment(tmp_path, "v1", [Change(9, "pause", 1), Change(8, "pause", 1)])
    assert published_seq(tmp_path, "v1") == 5 and published_seq(tmp_path, "v2") is None


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_segments_concatenate_to_the_published_changes(sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, seq, want = Path(tmp), 0, []
        for n in sizes:
            batch = [Change(seq + i + 1, "pause", seq + i) for i in range(n)]
            write_segment(root, "v", batch)
            want += batch
            seq += n
        got = [c for s in segments(root, "v") for c in read_segment(s)]
        assert got == want and published_seq(root, "v") == seq


def test_an_upsert_is_published_as_restore_place_or_upsert(world: Path) -> None:
    """An upsert of the row a version serves is a `restore`; one whose SID is a leaf of the
    version and whose values it knows is a `place`, its row encoded for the version (an
    ad the version holds that comes with an embedding only keeps its SID); any other is an
    upsert the server holds back until a build serves its new row — and once a full build
    serves that row, the feed republished over it carries a `restore`."""
    feed, root = world / "feed", world / "index"
    catalog = world / "catalog.jsonl"
    build_index(catalog, root, sid_space="s", progress=False)
    publisher = ChangePublisher(feed, root, world / "rejects.jsonl")
    moved = {"ad_id": 5, "sid": [1, 1, 1, 1], "countries": ["US"], "campaign_id": 9}
    append(feed, "0001.jsonl", [
        {"seq": 1, "op": "upsert", **moved},  # a SID the trie lacks
        {"seq": 2, "op": "upsert", **ROWS[6]},  # ad 7 exactly as built
        {"seq": 3, "op": "upsert", "ad_id": 8, "sid": ROWS[7]["sid"], "countries": ["FR"]},
        {"seq": 4, "op": "upsert", "ad_id": 77, "sid": ROWS[10]["sid"], "genders": ["male"]},
        {"seq": 5, "op": "upsert", "ad_id": 9, "sid": ROWS[8]["sid"], "locations": ["Paris"]},
        {"seq": 6, "op": "upsert", "ad_id": 10, "embedding": [0.5, 0.25], "countries": ["GB"]},
        {"seq": 7, "op": "upsert", "ad_id": 78, "embedding": [0.5, 0.25]},  # no SID to take
    ])  # fmt: skip
    publisher.tick()
    got = published(root)
    assert [(c.seq, c.op) for c in got] == [(1, "upsert"), (2, "restore"), (3, "place"),
                                            (4, "place"), (5, "upsert"), (6, "place"),
                                            (7, "upsert")]  # fmt: skip
    fr = got[2].row
    assert fr["sid"] == ROWS[7]["sid"] and fr["include"] == {} and fr["campaign"] == 0
    assert got[3].row["sid"] == ROWS[10]["sid"] and got[5].row["sid"] == ROWS[9]["sid"]
    # the bitmask names France and every age and gender: not the ad's built row (all ones)
    assert got[2].row["bitmask"] != got[5].row["bitmask"]
    # the catalog takes ad 5's new row; the next build serves it
    rows = [moved if r["ad_id"] == 5 else r for r in ROWS]
    catalog.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = current_path(root).name
    build_index(catalog, root, sid_space="s", progress=False)
    assert current_path(root).name != first
    publisher.tick()
    again = [(c.seq, c.op) for c in published(root)][:4]
    assert again == [(1, "restore"), (2, "restore"), (3, "place"), (4, "place")]
