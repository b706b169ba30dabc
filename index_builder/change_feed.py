"""A feed of live catalog changes as a directory of append-only `*.jsonl` files, read in
name order (docs/DATA.md "Live changes"): the form any stream processor can write. The
builder polls it (`DirectoryFeed.poll`) and applies what it returns; each record is read
once, complete lines only (a line still being written waits for its newline), and a
record the contract refuses (`contracts/changes.py`) is returned as a reject while the
records after it still come.

Restart: a feed opened `after` a watermark (the last seq applied) skips the records at or
below it without rejecting them, so a restarted builder applies nothing twice. Files are
read in name order and never gone back to: a file whose name sorts before one already
read is not read (append to the newest file, or start a later-named one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson

from contracts.changes import Change, ChangeError, parse_change

SUFFIX = ".jsonl"


@dataclass
class Polled:
    """What one poll found: the valid changes in feed order and the rejected records."""

    changes: list[Change] = field(default_factory=list)
    rejects: list[ChangeError] = field(default_factory=list)


class DirectoryFeed:
    """The change files of `path`, followed from the records after `after` (None: all)."""

    def __init__(self, path: Path, after: int | None = None) -> None:
        self.path = Path(path)
        self.applied = after  # the watermark it was opened at: records up to it are done
        self.last_seq = after  # the newest valid seq read
        self._file: str | None = None  # the file being read and the bytes consumed of it
        self._offset = 0
        self._lines = 0

    def files(self) -> list[Path]:
        """The feed's files in name order, from the one being read on."""
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such change directory")
        hidden = (".", "_")  # a writer's temporary files
        names = sorted(p for p in self.path.iterdir()
                       if p.name.endswith(SUFFIX) and not p.name.startswith(hidden))  # fmt: skip
        return [p for p in names if self._file is None or p.name >= self._file]

    def poll(self) -> Polled:
        """The records completed since the last poll."""
        out = Polled()
        for path in self.files():
            if path.name != self._file:
                self._file, self._offset, self._lines = path.name, 0, 0
            with path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # complete lines only
            for raw in data[:end].splitlines():
                self._lines += 1
                if raw.strip():
                    self._read(raw, f"{path.name}:{self._lines}", out)
            self._offset += end
        return out

    def _read(self, raw: bytes, where: str, out: Polled) -> None:
        if self.applied is not None and self.last_seq == self.applied:
            try:  # before the watermark is passed: records already applied are skipped
                seq = orjson.loads(raw).get("seq")
            except (orjson.JSONDecodeError, AttributeError):
                seq = None
            if type(seq) is int and seq <= self.applied:
                return
        try:
            change = parse_change(raw, where, after=self.last_seq)
        except ChangeError as exc:
            out.rejects.append(exc)
            return
        self.last_seq = change.seq
        out.changes.append(change)
