"""A PostgreSQL table of ads as the builder's catalog and change feed, against a real
server started for the test (tests/helpers/postgres.py) with the table of
`examples/postgres_ads.sql`: a build snapshots the table and records the last change it
holds; status and row changes after it are published as changes, in commit order, none
skipped or doubled — also while many transactions write at once; a resume is a
`restore`; a database that goes away is waited for, not a crash.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contracts.deltas import read_segment, segments
from contracts.index_manifest import read_manifest
from index_builder.postgres_source import PostgresFeed, snapshot, table_seq
from index_builder.publish import current_path
from tests.helpers.postgres import postgres_server
from tests.helpers.waiting import first

psycopg = pytest.importorskip("psycopg")

REPO = Path(__file__).resolve().parents[2]
DDL = (REPO / "examples" / "postgres_ads.sql").read_text()


def until(what: Callable[[], object], proc: subprocess.Popen | None = None) -> object:
    return first(what, "the condition", proc)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[str]:
    with postgres_server(tmp_path / "pg") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(DDL)
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO ads (ad_id, sid, countries, advertiser_id) "
                    "VALUES (%s, %s, %s, %s)",
                    [(i, [i % 5, i % 7, 1, 2], ["US"] if i % 2 else None, 1 + i % 3)
                     for i in range(1, 301)],
                )  # fmt: skip
        yield url


def sql(url: str, statement: str, *args: object) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement, args or None)


def test_a_snapshot_then_the_changes_after_it_in_commit_order(db: str, tmp_path: Path) -> None:
    sql(db, "UPDATE ads SET status = 'deleted' WHERE ad_id = 300")
    seq = snapshot(db, tmp_path / "snap.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "snap.jsonl").read_text().splitlines()]
    assert len(rows) == 299 and seq == table_seq(db) == 301  # 300 inserts, 1 update
    assert rows[0] == {"ad_id": 1, "sid": [1, 1, 1, 2], "countries": ["US"], "advertiser_id": 2}
    assert "countries" not in rows[1]  # NULL columns are absent fields
    feed = PostgresFeed(db, after=seq)
    assert not feed.poll().changes
    sql(db, "UPDATE ads SET status = 'paused' WHERE ad_id = 3")
    sql(db, "UPDATE ads SET status = 'active' WHERE ad_id = 3")
    sql(db, "UPDATE ads SET countries = '{FR}' WHERE ad_id = 4")
    sql(db, "UPDATE ads SET status = 'deleted' WHERE ad_id = 5")
    sql(db, "INSERT INTO ads (ad_id, sid) VALUES (1000, '{1,2,3,4}')")
    got = feed.poll().changes
    # a row is read as it is now: ad 3's pause and resume are one upsert of its row
    want = [("upsert", 3), ("upsert", 4), ("delete", 5), ("upsert", 1000)]
    assert [(c.op, c.ad_id) for c in got] == want
    seqs = [c.seq for c in got]
    assert seqs == sorted(seqs) and seqs[0] > seq
    assert got[-1].row == {"ad_id": 1000, "sid": [1, 2, 3, 4]}
    assert not feed.poll().changes  # nothing twice


def test_a_delete_is_a_change_and_leaves_the_snapshot(db: str, tmp_path: Path) -> None:
    """`DELETE FROM ads` leaves a tombstone the feed reads as a delete (the table's
    trigger), and the next snapshot does not hold the ad."""
    feed = PostgresFeed(db, after=snapshot(db, tmp_path / "a.jsonl"))
    sql(db, "DELETE FROM ads WHERE ad_id IN (7, 8)")
    # 2, 5, 8 (a tombstone now: deleting it again changes nothing), 11, 14, 17
    sql(db, "DELETE FROM ads WHERE advertiser_id = 3 AND ad_id < 20")
    got = feed.poll().changes
    assert [(c.op, c.ad_id) for c in got[:2]] == [("delete", 7), ("delete", 8)]
    assert sorted((c.op, c.ad_id) for c in got[2:]) == [("delete", a) for a in (2, 5, 11, 14, 17)]
    seqs = [c.seq for c in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    snapshot(db, tmp_path / "b.jsonl")
    held = {json.loads(x)["ad_id"] for x in (tmp_path / "b.jsonl").read_text().splitlines()}
    assert len(held) == 293 and not held & {2, 5, 7, 8, 11, 14, 17}
    sql(db, "UPDATE ads SET status = 'active' WHERE ad_id = 7")  # brought back: an upsert
    assert [(c.op, c.ad_id) for c in feed.poll().changes] == [("upsert", 7)]


def test_concurrent_writers_lose_no_change(db: str) -> None:
    """Many transactions stamping at once while a feed polls: every row's last change is
    read, in increasing seq order — a transaction that commits late never hides behind a
    seq already read (the trigger's lock, examples/postgres_ads.sql)."""
    feed = PostgresFeed(db, after=table_seq(db))
    seen: dict[int, int] = {}
    order: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            write(k)
        except BaseException as exc:  # a deadlock or a lost connection fails the test
            errors.append(exc)

    def write(k: int) -> None:
        rng = random.Random(k)
        with psycopg.connect(db, autocommit=True) as conn:
            for _ in range(40):
                with conn.transaction():
                    for ad in rng.sample(range(1, 301), 3):
                        status = rng.choice(["active", "paused"])
                        conn.execute("UPDATE ads SET status = %s WHERE ad_id = %s", (status, ad))
                    time.sleep(rng.random() * 0.002)  # hold the transaction open a while

    def poller() -> None:
        while not stop.is_set():
            for c in feed.poll().changes:
                order.append(c.seq)
                seen[c.ad_id] = c.seq

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    reader = threading.Thread(target=poller)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    until(lambda: feed.last_seq == table_seq(db))
    stop.set()
    reader.join()
    assert order == sorted(order) and len(order) == len(set(order))
    with psycopg.connect(db) as conn:
        final = dict(conn.execute("SELECT ad_id, change_seq FROM ads WHERE change_seq > 301"))
    assert {a: s for a, s in seen.items()} == final  # every row's last change, none skipped


def test_the_builder_follows_the_table(db: str, tmp_path: Path) -> None:
    root = tmp_path / "index"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "builder", "--catalog", f"{db}?table=ads", "--out",
         str(root), "--sid-space", "s", "--interval", "1", "--changes", f"{db}?table=ads",
         "--changes-interval", "0.05"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def published() -> list:
        base = current_path(root)
        return [c for s in segments(root, base.name) for c in read_segment(s)] if base else []

    try:
        base = until(lambda: current_path(root), proc)
        manifest = read_manifest(base)
        assert manifest["catalog"]["seq"] == 300 and manifest["counts"]["ads"] == 300
        assert "postgresql://grace@" in manifest["catalog"]["source"]
        sql(db, "UPDATE ads SET status = 'paused' WHERE ad_id = 7")
        pause = until(lambda: [c for c in published() if c.op == "pause"], proc)
        assert [(c.ad_id, c.seq) for c in pause] == [(7, 301)]
        sql(db, "UPDATE ads SET status = 'active' WHERE ad_id = 7")  # a resume: as built
        until(lambda: any(c.op == "restore" and c.ad_id == 7 for c in published()), proc)
        # the next build snapshots the table and goes on after its last change only
        until(lambda: current_path(root) != base, proc)
        newer = current_path(root)
        assert read_manifest(newer)["catalog"]["seq"] == 302
        sql(db, "UPDATE ads SET status = 'deleted' WHERE ad_id = 8")
        got = until(lambda: (p := published()) and p, proc)
        assert [(c.op, c.ad_id, c.seq) for c in got] == [("delete", 8, 303)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
