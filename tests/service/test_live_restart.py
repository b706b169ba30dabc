"""Live catalog changes survive a server crash, and flow from a PostgreSQL table of ads to
the replies, end to end with real processes (`grace builder`, `grace serve --workers 1`,
a real PostgreSQL), a tiny model and the 2,000-ad catalog of tests/service/
test_live_changes.py, whose beams are wide enough that every reply is every live ad.

What a user sees:

* A server killed with SIGKILL in the middle of a feed, while changes keep arriving, comes
  back (a new process on the same index root) at the same state: its first reply is at
  the last catalog_seq published while it was down, never below the last one the killed
  server answered at, and every reply after the restart is exactly the ads an independent
  replay of the whole feed makes live at that reply's catalog_seq — no change lost, none
  applied twice, the follower going on past the restart; upserts served in place (a new
  ad, a narrowed ad, one moved to another SID, a placed ad paused and resumed) included.
* An ad paused with `UPDATE ads SET status = 'paused'` is in no reply whose catalog_seq
  is at or above that row's `change_seq`; set back to 'active' it is in every reply from
  the new `change_seq` on; ads marked 'deleted' are gone from theirs on; a row whose
  countries are narrowed is never returned to a request they no longer allow, and a row
  inserted into a SID the trie holds is returned from its `change_seq` on (both served
  in place; one full build: the live path alone).
* A pause through PostgreSQL outlives the full build it starts (the pause moves the
  table's change_seq): the snapshot leaves the paused row out, and the new version starts
  at the snapshot's catalog_seq, so no reply goes back in catalog_seq or holds the ad.

Conditions are waited for with deadlines, never fixed times.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from contracts.deltas import published_seq, read_segment, segments
from contracts.index_manifest import read_manifest
from index_builder.publish import current_path
from tests.helpers.postgres import postgres_server
from tests.helpers.server_process import ServerProcess, serving
from tests.service import test_live_changes as live

REPO = Path(__file__).resolve().parents[2]
DDL = REPO / "examples" / "postgres_ads.sql"
SERVE = ["--workers", "1"]
pytestmark = pytest.mark.slow

builder = live.builder  # `grace builder --changes FEED` on the e2e catalog, published once

Change = tuple[int, str, int]  # (seq, op, ad_id), as Feed.valid holds them


def check_exact(
    ads: list[int], changes: list[Change], replies: list[live.Reply],
    placed: dict[int, Any] | None = None,
) -> set[int]:  # fmt: skip
    """Every reply is exactly the ads live at its catalog_seq by a plain replay of
    `changes` (live.live_at; `placed`: each upsert's seq -> (SID, eligible) when served in
    place), the others counted not_live; the seqs seen."""
    expected: dict[int, tuple[np.ndarray, int, int]] = {}
    for r in replies:
        if r.seq not in expected:
            alive, moved = live.live_at(ads, changes, r.seq, placed or {})
            want = np.array(sorted(alive | {a for a, (_, ok) in moved.items() if ok}))
            expected[r.seq] = (want.astype(np.int64), len(moved), len(alive))
        want, n_moved, n_alive = expected[r.seq]
        assert len(np.unique(r.ids)) == len(r.ids), r.seq
        assert np.array_equal(np.sort(r.ids), want), (r.seq, np.setxor1d(r.ids, want)[:10])
        assert (r.expanded, r.not_live) == (live.N_ADS + n_moved, live.N_ADS - n_alive), r.seq
    return set(expected)


def published(index: Path) -> list[Change]:
    """The changes published over `index`'s CURRENT version, segment after segment."""
    base = current_path(index)
    assert base is not None
    return [(c.seq, c.op, c.ad_id) for s in segments(index, base.name) for c in read_segment(s)]


def check_monotonic(replies: list[live.Reply], clients: int = 2) -> None:
    """catalog_seq never goes back along each client's calls."""
    for c in range(clients):
        seqs = [r.seq for r in replies if r.client == c]
        assert seqs == sorted(seqs), (c, seqs)


def reached(load: live.Load, seq: int, check: Callable[[], None]) -> None:
    live.wait(f"a reply at catalog_seq >= {seq}", lambda: load.top >= seq, check)


def checker(
    proc: subprocess.Popen, log: Path, server: ServerProcess, load: live.Load
) -> Callable[[], None]:
    """Raises for an exited builder or server, or a failed call."""

    def check() -> None:
        assert proc.poll() is None, f"builder exited:\n{log.read_text(errors='replace')}"
        server.check_alive()
        assert not load.errors, load.errors

    return check


# ---- 1. a server killed mid-feed ------------------------------------------------------


def test_a_server_killed_mid_feed_comes_back_at_the_same_state(
    builder: tuple[Path, live.Feed, subprocess.Popen],
) -> None:
    root, feed, proc = builder
    index = root / "index"
    ads = [r["ad_id"] for r in live.catalog_rows()]
    picked = random.Random(3).sample(ads, 30)
    p, d, q = picked[:10], picked[10:15], picked[15:25]  # paused, deleted, later paused
    m = picked[25:27]  # upserted: served in place
    seqs = itertools.count(10)
    placed: dict[int, tuple[tuple[int, ...], bool]] = {}  # an upsert's seq -> (SID, eligible)

    def rec(op: str, ad: int) -> dict:
        return {"seq": next(seqs), "op": op, "ad_id": ad}

    def upsert(ad: int, sid: list[int], countries: list[str] | None = None) -> dict:
        r = rec("upsert", ad) | {"sid": sid, **({"countries": countries} if countries else {})}
        placed[r["seq"]] = (tuple(sid), not countries)  # GB only: not the load's requests
        return r

    with serving(root, root / "server1.log", args=SERVE) as server, \
            live.Load(server.target) as load:  # fmt: skip
        check = checker(proc, root / "builder.log", server, load)
        live.wait("a first reply", lambda: load.replies, check)
        first = load.snapshot()[0]
        assert first.seq == 0 and len(first.ids) == live.N_ADS, "the beams miss ads"

        # batch 1, applied while the server runs (two writes); a new ad into a SID the
        # trie holds and a narrowed ad, both served in place
        feed.add(
            "0001.jsonl",
            [rec("pause", a) for a in p[:6]]
            + [rec("delete", a) for a in d[:3]]
            + [upsert(live.NEW_AD, [0, 1, 0, 1]), upsert(m[0], live.sid(m[0]), ["GB"])],
        )
        s1 = feed.add("0001.jsonl", [rec("resume", p[0]), rec("pause", p[6]), rec("delete", p[1])])
        reached(load, s1, check)
        # batch 2a, written just before the kill: applied or not, it must not matter
        feed.add("0001.jsonl", [rec("pause", p[0]), rec("resume", p[2]), rec("delete", d[3])])
        children = psutil.Process(server.proc.pid).children(recursive=True)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=live.DEADLINE)
        # the clients' calls fail now (each client stops at its first failure)
        live.wait("the clients to see the server gone", lambda: len(load.errors) == 2,
                  lambda: None)  # fmt: skip
    for child in children:  # nothing of the killed server lives on (holding its ports)
        with contextlib.suppress(psutil.NoSuchProcess):
            child.wait(timeout=live.DEADLINE)
    before = load.snapshot()
    top_before = max(r.seq for r in before)
    assert top_before >= s1

    # batch 2b, while no server runs: pauses, resumes (of paused, deleted and live ads),
    # deletes (of paused and deleted ads), in a later-named file
    s2 = feed.add(
        "0002.jsonl",
        [rec("resume", p[0]), rec("resume", d[0]), rec("pause", d[1]), rec("resume", p[1])]
        + [rec("pause", a) for a in q[:5]]
        + [rec("delete", q[0]), rec("resume", p[3]), rec("delete", p[4]), rec("resume", p[4]),
           rec("pause", p[2]), rec("resume", q[9]), rec("pause", live.NEW_AD),
           upsert(m[1], [3, 3, 1, 1])],
    )  # fmt: skip
    end = time.monotonic() + live.DEADLINE
    while published_seq(index, current_path(index).name) != s2:
        assert proc.poll() is None, (root / "builder.log").read_text()
        assert time.monotonic() < end, "the builder did not publish the changes made meanwhile"
        time.sleep(0.05)

    with serving(root, root / "server2.log", args=SERVE) as server, \
            live.Load(server.target) as load2:  # fmt: skip
        check = checker(proc, root / "builder.log", server, load2)
        live.wait("a first reply of the new server", lambda: load2.replies, check)
        # batch 3, after the restart: the follower goes on from where the start left it
        s3 = feed.add("0003.jsonl", [rec("resume", q[1]), rec("pause", q[5]),
                                     rec("delete", q[2]), rec("resume", p[5]),
                                     rec("resume", live.NEW_AD)])  # fmt: skip
        reached(load2, s3, check)
        live.wait(
            "2 replies per client at the last seq",
            lambda: all(sum(r.client == c and r.seq == s3 for r in load2.snapshot()) >= 2
                        for c in range(2)),
            check,
        )  # fmt: skip
    after = load2.replies

    # the new server starts at the state published while it was down, never below the
    # killed one's, and goes on from there
    assert after[0].seq == s2, (after[0].seq, s2)
    assert min(r.seq for r in after) >= top_before
    check_monotonic(before)
    check_monotonic(after)
    # every reply, before the kill and after the restart, is exactly the replay's
    seen = check_exact(ads, feed.valid, before, placed) | check_exact(ads, feed.valid, after,
                                                                       placed)  # fmt: skip
    assert {0, s1, s2, s3} <= seen
    # and the builder published every change once, in order (the upserts as `place`)
    assert published(index) == [(s, "place" if op == "upsert" else op, a)
                                for s, op, a in feed.valid]  # fmt: skip


# ---- 2. pauses, resumes and deletes through PostgreSQL --------------------------------


def sql(url: str, statement: str, *args: object) -> list[tuple]:
    """One statement in its own transaction; the rows it returns."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, args or None)
        return cur.fetchall() if cur.description else []


@contextlib.contextmanager
def postgres_world(tmp_path: Path, interval: float) -> Iterator[tuple[Path, str, subprocess.Popen]]:
    """A real PostgreSQL holding the e2e catalog in examples/postgres_ads.sql's table,
    `grace builder` following it as catalog (a full build every `interval` s at most, when
    the table changed) and change feed, its first version published, and the model."""
    with postgres_server(tmp_path / "pg") as url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(DDL.read_text())
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO ads (ad_id, sid, campaign_id, advertiser_id) "
                    "VALUES (%s, %s, %s, %s)",
                    [(r["ad_id"], r["sid"], r["campaign_id"], r["advertiser_id"])
                     for r in live.catalog_rows()],
                )  # fmt: skip
        source = f"{url}?table=ads"
        with live.builder_process(tmp_path, source, source, interval) as proc:
            yield tmp_path, url, proc


def test_pauses_through_postgresql_reach_the_replies(tmp_path: Path) -> None:
    ads = [r["ad_id"] for r in live.catalog_rows()]
    picked = random.Random(4).sample(ads, 7)
    ad, narrowed, gone = picked[0], picked[1], sorted(picked[2:])
    changes: list[Change] = []
    # one full build (no rebuild in between): the live path alone
    with postgres_world(tmp_path, interval=3600) as (root, url, proc), \
            serving(root, root / "server.log", args=SERVE) as server, \
            live.Load(server.target) as load:  # fmt: skip
        check = checker(proc, root / "builder.log", server, load)
        live.wait("a first reply", lambda: load.replies, check)
        first = load.snapshot()[0]
        built = read_manifest(current_path(root / "index"))["catalog"]["seq"]
        # a version of a snapshot starts at the snapshot's last change, not at 0
        assert built == live.N_ADS and first.seq == built
        assert len(first.ids) == live.N_ADS, "the beams miss ads"

        [(s_pause,)] = sql(url, "UPDATE ads SET status = 'paused' WHERE ad_id = %s "
                                "RETURNING change_seq", ad)  # fmt: skip
        changes.append((s_pause, "pause", ad))
        reached(load, s_pause, check)
        [(s_resume,)] = sql(url, "UPDATE ads SET status = 'active' WHERE ad_id = %s "
                                 "RETURNING change_seq", ad)  # fmt: skip
        changes.append((s_resume, "resume", ad))  # the builder's `restore`: as built
        reached(load, s_resume, check)
        deleted = sql(url, "UPDATE ads SET status = 'deleted' WHERE ad_id = ANY(%s) "
                           "RETURNING change_seq, ad_id", gone)  # fmt: skip
        changes += sorted((s, "delete", a) for s, a in deleted)
        s_delete = changes[-1][0]
        reached(load, s_delete, check)
        # a targeting change (GB only: not the load's requests) and a new ad into a SID
        # the trie holds, both served in place
        [(s_narrow,)] = sql(url, "UPDATE ads SET countries = ARRAY['GB'] WHERE ad_id = %s "
                                 "RETURNING change_seq", narrowed)  # fmt: skip
        [(s_new,)] = sql(url, "INSERT INTO ads (ad_id, sid, campaign_id, advertiser_id) "
                              "VALUES (%s, ARRAY[0, 1, 0, 1], 101, 2) RETURNING change_seq",
                         live.NEW_AD)  # fmt: skip
        changes += [(s_narrow, "upsert", narrowed), (s_new, "upsert", live.NEW_AD)]
        placed = {s_narrow: (tuple(live.sid(narrowed)), False), s_new: ((0, 1, 0, 1), True)}
        reached(load, s_new, check)
        segs = published(root / "index")
    replies = load.replies
    # the rows' changes, in change_seq order; the resume as the builder's `restore`, the
    # changed and new rows as `place`
    ops = {"resume": "restore", "upsert": "place"}
    assert segs == [(s, ops.get(op, op), a) for s, op, a in changes]
    assert s_pause < s_resume < s_delete < s_narrow < s_new

    def has(r: live.Reply, a: int) -> bool:
        return bool(np.any(r.ids == a))

    def at(lo: int, hi: float = float("inf")) -> list[live.Reply]:
        return [r for r in replies if lo <= r.seq < hi]

    assert at(built, s_pause) and all(has(r, ad) for r in at(built, s_pause))
    assert at(s_pause, s_resume), "no reply was answered while the ad was paused"
    assert not [r.seq for r in at(s_pause) if has(r, ad) and r.seq < s_resume]
    assert at(s_resume) and all(has(r, ad) for r in at(s_resume))
    assert not [r.seq for r in at(s_delete) if np.isin(gone, r.ids).any()]
    assert not [r.seq for r in at(s_narrow) if has(r, narrowed)]
    assert at(s_new) and all(has(r, live.NEW_AD) for r in at(s_new))
    check_monotonic(replies)
    seen = check_exact(ads, changes, replies, placed)
    assert {built, s_pause, s_resume, s_delete, s_new} <= seen


# ---- 3. a pause through PostgreSQL across the next full build ------------------------


def test_a_pause_through_postgresql_outlives_the_next_full_build(tmp_path: Path) -> None:
    """The sidecar rebuilds when the table's change_seq moves: the pause itself starts a
    full build. A user expects the paused ad to stay out of every reply, and catalog_seq
    never to go back, whatever version answers."""
    ad = random.Random(4).sample([r["ad_id"] for r in live.catalog_rows()], 1)[0]
    with postgres_world(tmp_path, interval=1) as (root, url, proc), \
            serving(root, root / "server.log", args=SERVE) as server, \
            live.Load(server.target) as load:  # fmt: skip
        check = checker(proc, root / "builder.log", server, load)
        live.wait("a first reply", lambda: load.replies, check)
        first = current_path(root / "index")
        [(s_pause,)] = sql(url, "UPDATE ads SET status = 'paused' WHERE ad_id = %s "
                                "RETURNING change_seq", ad)  # fmt: skip
        reached(load, s_pause, check)
        seen = time.monotonic()  # a reply at >= s_pause has arrived

        def rebuilt() -> bool:  # a version built from a snapshot holding the pause
            cur = current_path(root / "index")
            return cur not in (None, first) and read_manifest(cur)["catalog"]["seq"] >= s_pause

        live.wait("a full build after the pause", rebuilt, check)
        version = current_path(root / "index").name
        live.wait(f"the server to serve index {version}",
                  lambda: server.metric("grace_index_info", {"version": version}) == 1,
                  check)  # fmt: skip
        swapped = time.monotonic()
        live.wait("2 replies per client sent after the swap",
                  lambda: all(sum(r.client == c and r.sent > swapped for r in load.snapshot())
                              >= 2 for c in range(2)),
                  check)  # fmt: skip
    replies = load.replies
    later = [r for r in replies if r.sent > seen]
    assert later and all(r.seq >= s_pause for r in later), sorted({r.seq for r in later})
    assert not [r.seq for r in later if np.any(r.ids == ad)]
    check_monotonic(replies)
