"""Delta segments: the live changes the builder publishes beside an index version, for the
servers to apply without a rebuild (docs/DATA.md "Live changes").

Flow: a change feed (`index_builder/change_feed.py`) → the builder's publisher
(`index_builder/change_publisher.py`) → `<index root>/deltas/<base version>/
<first seq>-<last seq>.jsonl` → the servers. A segment holds valid change records
(`contracts/changes.py`) in seq order, an upsert the version already serves as written
published as `restore` (`index_builder/as_built.py`). It is written under a hidden temporary name,
fsynced and renamed into place, so a reader only ever sees whole segments; a base's
segments never overlap and follow one another in seq order, so the last one's `last` is
the base's published watermark.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from contracts.changes import SEGMENT_OPS, Change, parse_change

DELTAS = "deltas"
_NAME = re.compile(r"^(\d{20})-(\d{20})\.jsonl$")


@dataclass(frozen=True, order=True)
class Segment:
    """One published segment: its first and last seq and its file."""

    first: int
    last: int
    path: Path


def segment_dir(root: Path, base: str) -> Path:
    """Where the segments over index version `base` of the index root `root` live."""
    return Path(root) / DELTAS / base


def segments(root: Path, base: str) -> list[Segment]:
    """The published segments over `base`, in seq order (none: [])."""
    folder = segment_dir(root, base)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        if m := _NAME.match(path.name):
            found.append(Segment(int(m[1]), int(m[2]), path))
    return sorted(found)


def published_seq(root: Path, base: str) -> int | None:
    """The last seq published over `base` (None: nothing yet)."""
    found = segments(root, base)
    return found[-1].last if found else None


def write_segment(root: Path, base: str, changes: Sequence[Change]) -> Segment:
    """Publish `changes` (seq order, above the base's watermark) as one segment, atomically."""
    if not changes:
        raise ValueError("a segment holds at least one change")
    seqs = [c.seq for c in changes]
    if any(b <= a for a, b in itertools.pairwise(seqs)):
        raise ValueError("a segment's changes must be in increasing seq order")
    last = published_seq(root, base)
    if last is not None and seqs[0] <= last:
        raise ValueError(f"seq {seqs[0]} is not above {base}'s published seq {last}")
    folder = segment_dir(root, base)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{seqs[0]:020d}-{seqs[-1]:020d}.jsonl"
    tmp = folder / f".{path.name}.tmp"
    with tmp.open("wb") as fh:
        fh.write(b"".join(c.to_json() for c in changes))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return Segment(seqs[0], seqs[-1], path)


def read_segment(segment: Segment) -> list[Change]:
    """A published segment's changes; a segment that breaks the contract raises
    ChangeError (the builder only publishes valid records: a broken one is damage)."""
    out: list[Change] = []
    with segment.path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            after = out[-1].seq if out else None
            where = f"{segment.path}: line {lineno}"
            out.append(parse_change(line, where, after, SEGMENT_OPS))
    return out
