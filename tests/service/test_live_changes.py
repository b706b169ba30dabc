"""Live catalog changes reach the replies without a rebuild, end to end, as a team runs
them: `grace builder --changes FEED` (a real process) builds the index from a JSON Lines
catalog and publishes the change feed as delta segments over it; `grace serve` (a real
process, one worker) follows the segments while clients keep sending Retrieve calls.

Under beams wider than any level of the catalog every reply is exactly the ads live at
the `catalog_seq` it names: an ad paused at seq s is in no reply at catalog_seq >= s and
comes back with its resume; the ~1,000 ads of one advertiser, deleted in one file, are in
no reply from their seq on; a bad record in the middle of a file is rejected alone and the
records after it still apply; an ad whose targeting is narrowed in place is never returned
to a request it no longer allows, and is returned again once widened; a new ad upserted
into a SID the trie holds is returned from its seq, one into a SID it lacks waits for a
build; `catalog_seq` never goes back in the order replies arrive; the server's metrics show
the last seq applied, the ads paused, deleted, waiting and served in place. Conditions are
waited for with deadlines, never fixed times.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from index_builder.publish import current_path
from service.model.checkpoint import save_checkpoint
from service.model.config import PROFILES
from service.model.retriever import GenerativeRetriever
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import metric_value, serving

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SID_SPACE = "live-v1"
N_ADS = 2000
GONE = 7  # the advertiser whose ads are all deleted at once
# 64 distinct SIDs (4, 16, 32, 64 prefixes per level), ~31 ads each: beams as wide as
# the server allows cover every one, so every reply is every live ad
WIDE = [1, 64, 128, 128]
NEW_AD = 10_000  # upserted into a SID the trie holds: served in place
NEW_WAITING = 10_001  # upserted into a SID it lacks: counted in grace_live_new_ads_waiting
DEADLINE = 120.0  # seconds any one condition may take on a busy machine


def sid(i: int) -> list[int]:
    return [i % 4, (i // 4) % 4, (i // 16) % 2, (i // 32) % 2]


def catalog_rows() -> list[dict]:
    gone = set(random.Random(5).sample(range(1, N_ADS + 1), N_ADS // 2))
    return [
        {"ad_id": i, "sid": sid(i), "campaign_id": 100 + i % 9,
         "advertiser_id": GONE if i in gone else 1 + i % 5}
        for i in range(1, N_ADS + 1)
    ]  # fmt: skip


# ---- the feed, and what it makes live at each seq ------------------------------------


class Feed:
    """The change directory the builder follows, and the valid changes written to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        self.valid: list[tuple[int, str, int]] = []  # (seq, op, ad_id) in seq order

    def write(self, name: str, records: list[dict | str]) -> None:
        """Append records (a str: a raw line) to file `name` in one write."""
        text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        with (self.path / name).open("a") as fh:
            fh.write(text)

    def add(self, name: str, records: list[dict | str], bad: frozenset[int] = frozenset()) -> int:
        """Write `records` to file `name`; the ones at positions `bad` are expected to be
        rejected. The last valid seq."""
        self.write(name, records)
        for at, r in enumerate(records):
            if at not in bad:
                assert isinstance(r, dict)
                self.valid.append((r["seq"], r["op"], r["ad_id"]))
        return self.valid[-1][0]


def live_at(
    ads: list[int], changes: list[tuple[int, str, int]], seq: int, placed: dict[int, Any]
) -> tuple[set[int], dict[int, tuple[tuple[int, ...], bool]]]:
    """The catalog ads live once every change up to `seq` is applied (service/index/live.py's
    states, written out plainly), and the ads served in place then: ad -> (SID, eligible
    for the load's requests). `placed`: each upsert's seq -> (SID, eligible) when the
    version serves it in place, None when it waits for a build."""
    state = dict.fromkeys(ads, "live")
    moved: dict[int, tuple[tuple[int, ...], bool]] = {}
    held: dict[int, tuple[tuple[int, ...], bool]] = {}  # placed ads paused
    for s, op, ad in changes:
        if s > seq:
            break
        if op in ("upsert", "delete"):
            moved.pop(ad, None)
            held.pop(ad, None)
            if op == "upsert" and placed[s] is not None:
                moved[ad] = placed[s]
        elif op == "pause" and ad in moved:  # a placed ad is paused and resumed as itself
            held[ad] = moved.pop(ad)
        elif op == "resume" and ad in held:
            moved[ad] = held.pop(ad)
        if ad not in state:
            continue
        if op == "pause" and state[ad] == "live":
            state[ad] = "paused"
        elif op == "resume" and state[ad] == "paused":
            state[ad] = "live"
        elif op == "delete":
            state[ad] = "deleted"
        elif op == "upsert":
            state[ad] = "placed" if placed[s] is not None else "waiting"
    return {a for a, st in state.items() if st == "live"}, moved


# ---- load: clients sending Retrieve calls the whole time -------------------------------


@dataclass(frozen=True)
class Reply:
    client: int
    sent: float  # monotonic time the call was made
    got: float  # and its reply arrived
    seq: int
    ids: np.ndarray  # int64, in reply order
    expanded: int
    not_live: int


class Load:
    """`clients` threads, each sending Retrieve calls one after the other until stopped,
    every reply recorded in arrival order."""

    def __init__(self, target: str, clients: int = 2) -> None:
        self.target = target
        self.replies: list[Reply] = []
        self.errors: list[str] = []
        self.top = -1  # the highest catalog_seq seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True)
                         for c in range(clients)]  # fmt: skip

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=DEADLINE)
        assert not any(t.is_alive() for t in self._threads), "a client did not stop"

    def _run(self, client: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = retrieval_pb2_grpc.AdRetrievalStub(channel)
            n = 0
            while not self._stop.is_set():
                req = retrieval_pb2.RetrieveRequest(request_id=f"live-{client}-{n}")
                req.user.user_id = 1 + client
                req.options.max_ads = 10_000
                req.options.beam_widths.extend(WIDE)
                sent = time.monotonic()
                try:
                    r = stub.Retrieve(req, timeout=DEADLINE)
                except grpc.RpcError as exc:
                    with self._lock:
                        self.errors.append(
                            f"client {client} call {n}: {exc.code()} {exc.details()}"
                        )
                    return
                got = time.monotonic()
                ids = np.fromiter((a.ad_id for a in r.ads), dtype=np.int64, count=len(r.ads))
                st = r.stats
                reply = Reply(client, sent, got, st.catalog_seq, ids, st.ads_expanded,
                              st.ads_removed["not_live"])  # fmt: skip
                with self._lock:
                    self.replies.append(reply)
                    self.top = max(self.top, reply.seq)
                n += 1

    def snapshot(self) -> list[Reply]:
        with self._lock:
            return list(self.replies)


def wait(what: object, cond: Callable[[], object], check: Callable[[], None]) -> None:
    """Until `cond()` holds; `check()` raises for a dead process or a failed call. `what`
    is formatted only at the deadline (so it may show what was last seen)."""
    end = time.monotonic() + DEADLINE
    while not cond():
        check()
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {DEADLINE:.0f} s waiting for {what}")
        time.sleep(0.02)


class _Seen:
    """A wait's `what` that shows, at the deadline, what was wanted and last seen."""

    def __init__(self, what: str, want: dict, seen: dict) -> None:
        self.what, self.want, self.seen = what, want, seen

    def __str__(self) -> str:
        return f"{self.what}: want {self.want}, last seen {self.seen}"


# ---- the world: a catalog, a model, a builder and a server ----------------------------


@contextlib.contextmanager
def builder_process(
    tmp_path: Path, catalog: str, changes: str, interval: float = 1
) -> Iterator[subprocess.Popen]:
    """`grace builder` on `catalog` publishing `changes` into tmp_path/index, its first
    version published, and the tiny model of SID_SPACE beside it; stopped after."""
    log = (tmp_path / "builder.log").open("wb")
    cmd = [sys.executable, "-m", "cli", "builder", "--catalog", catalog,
           "--out", str(tmp_path / "index"), "--sid-space", SID_SPACE,
           "--interval", str(interval), "--changes", changes,
           "--changes-interval", "0.05"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + DEADLINE
        while current_path(tmp_path / "index") is None:
            assert proc.poll() is None, (tmp_path / "builder.log").read_text()
            assert time.monotonic() < end, "the builder published no index"
            time.sleep(0.05)
        torch.manual_seed(0)
        save_checkpoint(
            GenerativeRetriever(PROFILES["tiny"]), None, tmp_path / "model", sid_space=SID_SPACE
        )
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def builder(tmp_path: Path) -> Iterator[tuple[Path, Feed, subprocess.Popen]]:
    """`grace builder --changes` on a catalog, its first version published."""
    rows = catalog_rows()
    (tmp_path / "catalog.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    feed = Feed(tmp_path / "feed")
    with builder_process(tmp_path, str(tmp_path / "catalog.jsonl"), str(feed.path)) as proc:
        yield tmp_path, feed, proc


def test_live_changes_reach_every_reply(builder: tuple[Path, Feed, subprocess.Popen]) -> None:
    root, feed, proc = builder
    rows = catalog_rows()
    ads = [r["ad_id"] for r in rows]
    gone = [r["ad_id"] for r in rows if r["advertiser_id"] == GONE]
    kept = sorted(set(ads) - set(gone))
    assert 900 <= len(gone) <= 1100

    with serving(root, root / "server.log", args=["--workers", "1"]) as server, \
            Load(server.target) as load:  # fmt: skip

        def check() -> None:
            assert proc.poll() is None, f"builder exited:\n{(root / 'builder.log').read_text()}"
            server.check_alive()
            assert not load.errors, load.errors

        def reached(seq: int) -> None:
            wait(f"a reply at catalog_seq >= {seq}", lambda: load.top >= seq, check)

        wait("a first reply", lambda: load.replies, check)
        first = load.snapshot()[0]
        assert first.seq == 0 and len(first.ids) == N_ADS, "the beams do not cover the catalog"
        paused = next(int(a) for a in first.ids if a in kept)  # an ad replies return

        # 1-2. pause one ad, then resume it
        s_pause = feed.add("0001.jsonl", [{"seq": 10, "op": "pause", "ad_id": paused}])
        reached(s_pause)
        s_resume = feed.add("0001.jsonl", [{"seq": 20, "op": "resume", "ad_id": paused}])
        reached(s_resume)

        # 3. every ad of one advertiser deleted, in one file written at once
        s_delete = feed.add("0002.jsonl", [{"seq": 100 + k, "op": "delete", "ad_id": a}
                                           for k, a in enumerate(gone)])  # fmt: skip
        reached(s_delete)

        # 4. bad records in the middle of a file: each rejected alone, the rest applied;
        # an ad narrowed in place (GB only: not the load's requests), a new ad into a SID
        # the trie holds (served), one into a SID it lacks (waits for a build)
        a_ad, b_ad, c_ad, u_ad = kept[10], kept[11], kept[12], kept[13]
        assert sid(u_ad) != [3, 3, 1, 1]
        rest = [a for a in kept if sid(a) == sid(kept[20]) and a not in (a_ad, c_ad, u_ad)]
        placed = {5004: ((3, 3, 1, 1), False), 5005: ((0, 1, 0, 1), True), 5006: None,
                  6000: ((3, 3, 1, 1), True)}  # fmt: skip
        feed.add(
            "0003.jsonl",
            [
                {"seq": 5000, "op": "pause", "ad_id": a_ad},
                '{"seq": 5001, "op": "pause", "ad_id": ',  # broken JSON
                {"seq": 5002, "op": "stop", "ad_id": b_ad},  # no such op
                {"seq": 4000, "op": "pause", "ad_id": b_ad},  # below the feed's last seq
                {"seq": 5003, "op": "pause", "ad_id": c_ad},
                {"seq": 5004, "op": "upsert", "ad_id": u_ad, "sid": [3, 3, 1, 1],
                 "advertiser_id": 2, "campaign_id": 101, "countries": ["GB"]},
                {"seq": 5005, "op": "upsert", "ad_id": NEW_AD, "sid": [0, 1, 0, 1]},
                {"seq": 5006, "op": "upsert", "ad_id": NEW_WAITING, "sid": [0, 0, 0, 2]},
                # the rest of one SID's ads: its subtree has no live ad, pruned in decoding
                *({"seq": 5007 + k, "op": "pause", "ad_id": a} for k, a in enumerate(rest)),
            ],
            bad=frozenset({1, 2, 3}),
        )  # fmt: skip
        reached(5006 + len(rest))
        # 5. the narrowed ad widened again: every country, at the SID it moved to
        s_last = feed.add("0004.jsonl", [{"seq": 6000, "op": "upsert", "ad_id": u_ad,
                                          "sid": [3, 3, 1, 1], "advertiser_id": 2,
                                          "campaign_id": 101}])  # fmt: skip
        reached(s_last)
        # a few more replies at the last seq from every client
        wait(
            "3 replies per client at the last seq",
            lambda: all(sum(r.client == c and r.seq == s_last for r in load.snapshot()) >= 3
                        for c in range(2)),
            check,
        )  # fmt: skip

        # 6. the server's metrics (read until they settle: the applied counter follows
        # the new state a moment later)
        # the trie's prefixes below which no ad is live then: pruned in decoding
        live_sids = [sid(a) for a in kept if a not in (a_ad, c_ad, u_ad, *rest)]
        prefixes = {tuple(sid(a)[:n]) for a in ads for n in range(1, 5)}
        pruned = sum(not any(s[: len(p)] == list(p) for s in live_sids) for p in prefixes)
        assert pruned >= 1  # the SID of `rest` (its leaf) at least
        want = {"grace_catalog_seq": s_last, "deleted": len(gone), "paused": 2 + len(rest),
                "waiting": 0, "grace_live_placed_ads": 2,
                "grace_live_pruned_subtrees": pruned,
                "grace_live_new_ads_waiting": 1, "pause": 3 + len(rest), "resume": 1,
                "delete": len(gone), "upsert": 1, "place": 3,
                "state bytes cover every ad": True}  # fmt: skip
        seen: dict[str, Any] = {}

        def metrics_settled() -> bool:
            text = server.metrics_text()
            seen.clear()
            for name in (
                "grace_catalog_seq",
                "grace_live_new_ads_waiting",
                "grace_live_pruned_subtrees",
                "grace_live_placed_ads",
            ):
                seen[name] = metric_value(text, name)
            for state in ("deleted", "paused", "waiting"):
                seen[state] = metric_value(text, "grace_live_ads", {"state": state})
            for op in ("pause", "resume", "delete", "upsert", "place"):
                seen[op] = metric_value(text, "grace_live_changes_applied_total", {"op": op})
            # one byte per ad of the version (its catalog rows) once anything changed
            held = metric_value(text, "grace_live_state_bytes") or 0
            seen["state bytes cover every ad"] = held >= N_ADS
            return seen == want

        wait(_Seen("the live metrics", want, seen), metrics_settled, check)
    replies = load.replies

    def has(r: Reply, ad: int) -> bool:
        return bool(np.any(r.ids == ad))

    def where(lo: int, hi: float = float("inf")) -> list[Reply]:
        return [r for r in replies if lo <= r.seq < hi]

    # 1. the paused ad: in every reply before its pause, in none from it until its resume
    before = where(0, s_pause)
    assert before and all(has(r, paused) for r in before)
    assert where(s_pause, s_resume), "no reply was answered while the ad was paused"
    assert not [r.seq for r in where(s_pause, s_resume) if has(r, paused)]
    # 2. back with its resume
    assert where(s_resume) and all(has(r, paused) for r in where(s_resume))
    # 3. none of the deleted advertiser's ads once the file is applied
    gone_ids = np.array(gone, dtype=np.int64)
    assert where(s_delete)
    assert not [r.seq for r in where(s_delete) if np.isin(gone_ids, r.ids).any()]
    # 4. the records after the bad ones took effect; the bad ones changed nothing
    assert not [r.seq for r in where(5000) if has(r, a_ad)]
    assert not [r.seq for r in where(5003) if has(r, c_ad)]
    assert not [r.seq for r in where(5004, 6000) if has(r, u_ad)]  # narrowed: never
    assert where(6000) and all(has(r, u_ad) for r in where(6000))  # widened: back
    assert not [r.seq for r in where(0, 5005) if has(r, NEW_AD)]
    assert where(5005) and all(has(r, NEW_AD) for r in where(5005))  # new ad, known SID
    assert not [r.seq for r in replies if has(r, NEW_WAITING)]
    assert all(has(r, b_ad) for r in replies)
    rejects = [json.loads(x) for x in (root / "index" / "deltas" / "rejects.jsonl")
               .read_text().splitlines()]  # fmt: skip
    assert [(r["where"], r["seq"], r["field"]) for r in rejects] == [
        ("0003.jsonl:2", None, None), ("0003.jsonl:3", 5002, "op"),
        ("0003.jsonl:4", 4000, "seq")]  # fmt: skip

    # 6. catalog_seq never goes back: along each client's calls, and across clients for
    # a call made after another's reply had arrived
    for c in range(2):
        seqs = [r.seq for r in replies if r.client == c]
        assert seqs == sorted(seqs), seqs
    by_arrival = sorted(replies, key=lambda r: r.got)
    arrived = [r.got for r in by_arrival]
    highest = np.maximum.accumulate([r.seq for r in by_arrival])
    for r in replies:
        n = bisect.bisect_left(arrived, r.sent)  # replies that arrived before r was sent
        assert n == 0 or highest[n - 1] <= r.seq, (r.seq, int(highest[n - 1]))

    # every reply is exactly the ads live at its catalog_seq, the others counted not_live
    # (a SID none of whose ads is live is pruned in decoding: its ads are never expanded;
    # an ad served in place is expanded at its new SID, its old row counted not live)
    expected: dict[int, tuple[np.ndarray, int, int]] = {}
    for r in replies:
        if r.seq not in expected:
            alive, moved = live_at(ads, feed.valid, r.seq, placed)
            live_sids = {tuple(sid(a)) for a in alive} | {s for s, _ in moved.values()}
            shown = sum(tuple(sid(a)) in live_sids for a in ads)
            want = np.array(sorted(alive | {a for a, (_, ok) in moved.items() if ok}))
            expected[r.seq] = (want, shown + len(moved), shown - len(alive))
        want, expanded, not_live = expected[r.seq]
        assert len(np.unique(r.ids)) == len(r.ids)
        assert np.array_equal(np.sort(r.ids), want), (r.seq, np.setxor1d(r.ids, want)[:10])
        assert (r.expanded, r.not_live) == (expanded, not_live), r.seq
    assert {0, s_pause, s_resume, s_delete, s_last} <= set(expected)
