"""Live catalog changes (docs/DATA.md "Live changes"): the record contract every feed
follows, read by the builder from a feed (`index_builder/change_feed.py`) before it
publishes them beside an index version for the servers.

A change is one JSON object per line: `{"seq": int, "op": "upsert" | "pause" | "resume"
| "delete", "ad_id": int, ...}`. `seq` increases strictly within a feed (a record at or
below the last one is refused, never applied twice). An `upsert` carries the ad's whole
catalog row beside them (the catalog's fields, docs/DATA.md); the other ops carry nothing
else. A record that breaks the contract is a `ChangeError` naming where it is, its `seq`
when it has one, the field and the reason: it is rejected alone, the records after it
still apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

OPS = ("upsert", "pause", "resume", "delete")
# a delta segment's records (contracts/deltas.py) may also be `restore`: the builder's form
# of an upsert whose row the version was built from (the ad serves as the version holds
# it), or `place`: an upsert the version serves in place, its row encoded for the version
# (contracts/placed.py)
SEGMENT_OPS = (*OPS, "restore", "place")
ROW_OPS = ("upsert", "place")  # the ops that carry fields beyond seq, op and ad_id
HEAD = ("seq", "op", "ad_id")  # every record's own fields; an upsert's others are its row
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Change:
    """One valid change record."""

    seq: int
    op: str  # one of OPS
    ad_id: int
    # upsert: the catalog row, `ad_id` included; place: its encoding (contracts/placed.py)
    row: dict[str, Any] | None = None

    def to_json(self) -> bytes:
        """The record as one line of a feed (what `parse_change` reads back)."""
        head = {"seq": self.seq, "op": self.op, "ad_id": self.ad_id}
        return orjson.dumps({**head, **(self.row or {})}) + b"\n"


class ChangeError(ValueError):
    """A record that breaks the contract: where (file and line), its seq if it has a
    valid one, the field at fault (None: the whole record) and why, in one line."""

    def __init__(self, where: str, seq: int | None, field: str | None, reason: str) -> None:
        parts = [where, f"seq {seq}" if seq is not None else None,
                 f"field {field!r}" if field else None]  # fmt: skip
        super().__init__(": ".join(p for p in (*parts, reason) if p))
        self.where, self.seq, self.field, self.reason = where, seq, field, reason

    def to_json(self) -> bytes:
        """One line of a rejects file."""
        return orjson.dumps({"where": self.where, "seq": self.seq, "field": self.field,
                             "reason": self.reason}) + b"\n"  # fmt: skip


def _int64(value: object) -> bool:
    return type(value) is int and I64_MIN <= value <= I64_MAX  # bool is no int


def parse_change(
    line: bytes, where: str, after: int | None = None, ops: tuple[str, ...] = OPS
) -> Change:
    """One feed line as a `Change` (`after`: the feed's last seq, which this one must
    exceed; `ops`: those a feed may carry, `SEGMENT_OPS` in a delta segment); ChangeError
    otherwise."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ChangeError(where, None, None, f"invalid JSON: {exc}") from None
    if type(obj) is not dict:
        raise ChangeError(where, None, None, f"expected a JSON object, got {type(obj).__name__}")
    seq = obj.get("seq")
    if not _int64(seq) or seq < 0:
        raise ChangeError(where, None, "seq", f"{seq!r} is not an integer >= 0")
    if after is not None and seq <= after:
        raise ChangeError(where, seq, "seq", f"not above the feed's last seq {after}")
    op = obj.get("op")
    if op not in ops:
        raise ChangeError(where, seq, "op", f"{op!r} is not one of {', '.join(ops)}")
    ad_id = obj.get("ad_id")
    if not _int64(ad_id):
        raise ChangeError(where, seq, "ad_id", f"{ad_id!r} is not an integer in int64 range")
    extra = [k for k in obj if k not in HEAD]
    if op not in ROW_OPS:
        if extra:
            raise ChangeError(where, seq, extra[0], f"a {op} carries only seq, op and ad_id")
        return Change(seq, op, ad_id)
    if not extra:
        raise ChangeError(where, seq, None, f"an {op} carries the ad's catalog row")
    row = {"ad_id": ad_id, **{k: obj[k] for k in extra}}
    return Change(seq, op, ad_id, row)
