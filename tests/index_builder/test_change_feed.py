"""Live catalog changes: the record contract (contracts/changes.py) and the directory feed
the builder follows (index_builder/change_feed.py) — every op read back as written, a
bad record rejected alone with its seq, field and reason while the rest still come, a
line still being written waiting for its newline, files read in name order, and a feed
reopened after its watermark applying nothing twice."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.changes import OPS, Change, ChangeError, parse_change
from index_builder.change_feed import DirectoryFeed

UPSERT = {"sid": [1, 2, 3, 4], "countries": ["US"], "campaign_id": 7}


def line(**record: object) -> bytes:
    return orjson.dumps(record) + b"\n"


def test_every_op_reads_back_as_written() -> None:
    changes = [Change(1, "upsert", 10, {"ad_id": 10, **UPSERT}), Change(2, "pause", 10),
               Change(3, "resume", 10), Change(4, "delete", 11)]  # fmt: skip
    last = None
    for c in changes:
        assert parse_change(c.to_json(), "f:1", after=last) == c
        last = c.seq


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (b"{not json", "f:3: invalid JSON"),
        (b"[1, 2]", "f:3: expected a JSON object, got list"),
        (line(op="pause", ad_id=1), "f:3: field 'seq': None is not an integer >= 0"),
        (line(seq=-1, op="pause", ad_id=1), "field 'seq': -1 is not an integer >= 0"),
        (line(seq=5, op="pause", ad_id=1), "f:3: seq 5: field 'seq': not above the feed's"),
        (line(seq=9, op="stop", ad_id=1), "seq 9: field 'op': 'stop' is not one of upsert"),
        (line(seq=9, op="pause", ad_id="7"), "seq 9: field 'ad_id': '7' is not an integer"),
        (line(seq=9, op="pause", ad_id=2**63), "field 'ad_id'"),
        (line(seq=9, op="pause", ad_id=True), "field 'ad_id'"),
        (line(seq=9, op="pause", ad_id=1, countries=["US"]),
         "seq 9: field 'countries': a pause carries only seq, op and ad_id"),
        (line(seq=9, op="upsert", ad_id=1), "seq 9: an upsert carries the ad's catalog row"),
    ],
)  # fmt: skip
def test_a_record_that_breaks_the_contract_is_named_in_one_line(record: bytes, says: str):
    with pytest.raises(ChangeError) as raised:
        parse_change(record, "f:3", after=5)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    back = orjson.loads(raised.value.to_json())  # a rejects-file line
    assert back["where"] == "f:3" and back["reason"] in str(raised.value)


def test_a_bad_record_is_rejected_alone_and_the_rest_still_come(tmp_path: Path) -> None:
    (tmp_path / "0001.jsonl").write_bytes(
        line(seq=1, op="pause", ad_id=5) + b"{oops\n" + b"\n"
        + line(seq=2, op="upsert", ad_id=6, **UPSERT) + line(seq=2, op="delete", ad_id=9)
        + line(seq=3, op="resume", ad_id=5)
    )  # fmt: skip
    polled = DirectoryFeed(tmp_path).poll()
    assert [(c.seq, c.op, c.ad_id) for c in polled.changes] == [
        (1, "pause", 5), (2, "upsert", 6), (3, "resume", 5)]  # fmt: skip
    assert polled.changes[1].row == {"ad_id": 6, **UPSERT}
    assert [(r.where, r.seq, r.field) for r in polled.rejects] == [
        ("0001.jsonl:2", None, None), ("0001.jsonl:5", 2, "seq")]  # fmt: skip


def test_lines_still_being_written_wait_and_files_are_read_in_name_order(tmp_path: Path):
    feed = DirectoryFeed(tmp_path)
    first = tmp_path / "a.jsonl"
    first.write_bytes(line(seq=1, op="pause", ad_id=1) + b'{"seq": 2, "op": "pa')
    assert [c.seq for c in feed.poll().changes] == [1]
    with first.open("ab") as fh:  # the writer finishes the line
        fh.write(b'use", "ad_id": 2}\n')
    (tmp_path / "b.jsonl").write_bytes(line(seq=3, op="delete", ad_id=3))
    (tmp_path / ".tmp.jsonl").write_bytes(line(seq=4, op="delete", ad_id=4))  # hidden
    (tmp_path / "notes.txt").write_bytes(line(seq=5, op="delete", ad_id=5))
    assert [c.seq for c in feed.poll().changes] == [2, 3]
    assert feed.poll().changes == []  # nothing new: nothing read twice
    (tmp_path / "b.jsonl").open("ab").write(line(seq=6, op="resume", ad_id=3))
    assert [c.seq for c in feed.poll().changes] == [6]


def test_a_feed_reopened_after_its_watermark_applies_nothing_twice(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"".join(line(seq=s, op="pause", ad_id=s)
                                                for s in range(1, 6)))  # fmt: skip
    again = DirectoryFeed(tmp_path, after=3).poll()
    assert [c.seq for c in again.changes] == [4, 5] and not again.rejects


def test_a_missing_change_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such change directory"):
        DirectoryFeed(tmp_path / "nope").poll()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS[1:]), st.integers(0, 50), st.booleans()),
                max_size=30), st.integers(1, 4))  # fmt: skip
def test_any_split_into_files_and_polls_gives_the_same_records(ops, n_files) -> None:
    """However the records are spread over files and however often the feed is polled,
    it yields every valid record once, in order (some seqs repeat: those are rejected)."""
    import tempfile

    records = [line(seq=i // 2 if dup else i, op=op, ad_id=ad)
               for i, (op, ad, dup) in enumerate(ops, 1)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        whole = DirectoryFeed(Path(tmp))
        Path(tmp, "all.jsonl").write_bytes(b"".join(records))
        want = [c.seq for c in whole.poll().changes]
    with tempfile.TemporaryDirectory() as tmp:
        feed, got = DirectoryFeed(Path(tmp)), []
        for i, rec in enumerate(records):
            with Path(tmp, f"{i * n_files // max(len(records), 1):03d}.jsonl").open("ab") as fh:
                fh.write(rec)
            if i % 3 == 0:
                got += [c.seq for c in feed.poll().changes]
        got += [c.seq for c in feed.poll().changes]
    assert got == want and want == sorted(set(want))
