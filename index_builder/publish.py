"""Atomic publishing of index versions under one root (DESIGN.md §3).

    <root>/<version>/      complete versions (manifest.json written last inside)
    <root>/CURRENT         one line: the version the server should serve
    <root>/.tmp-*          builds in progress (never visible as CURRENT)
    <root>/.lock           held by the one writer (flock)

`publish` writes a new version into a temp dir, fsyncs, renames it into place, then
replaces `CURRENT` by rename of a fsynced temp file, and prunes old versions. A crash at
any point leaves `CURRENT` naming the previous complete version; leftover temp dirs are
removed by the next writer. The server's watcher reads `current_version`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from index_builder.format import MANIFEST, fsync_path

CURRENT = "CURRENT"
_TMP_PREFIX = ".tmp-"


class PublishError(RuntimeError):
    """The root cannot be written (another writer holds it, or the filesystem refused)."""


def new_version_name(now: datetime | None = None) -> str:
    """Sortable, unique-per-microsecond version name, e.g. '20261129T123456123456Z'."""
    return f"{(now or datetime.now(UTC)):%Y%m%dT%H%M%S%fZ}"


def current_version(root: Path) -> str | None:
    """The version `CURRENT` names, or None when nothing was published yet."""
    try:
        name = (Path(root) / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


def current_path(root: Path) -> Path | None:
    version = current_version(root)
    return None if version is None else Path(root) / version


def resolve(path: Path) -> Path:
    """A version directory as given, or the CURRENT version of an index root."""
    path = Path(path)
    if (path / CURRENT).is_file():
        current = current_path(path)
        if current is not None:
            return current
    return path


def list_versions(root: Path) -> list[str]:
    """Complete versions (with a manifest) under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()
    )


@contextlib.contextmanager
def writer_lock(root: Path) -> Iterator[None]:
    """Exclusive writer lock on the root; fails at once if another builder holds it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PublishError(f"{root}: another index builder is writing here") from exc
        yield
    finally:
        os.close(fd)


def _set_current(root: Path, version: str) -> None:
    tmp = root / f".{CURRENT}.tmp"
    with open(tmp, "w") as fh:
        fh.write(version + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / CURRENT)
    fsync_path(root)


def publish(
    root: Path,
    write: Callable[[Path, str], object],
    *,
    keep: int = 3,
) -> str:
    """Build a version with `write(tmp_dir, version)` and publish it atomically.

    `write` must fill the (empty) directory it is given, manifest last. If it raises,
    the temp dir is removed and nothing changes. Returns the new version name.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    root = Path(root)
    with writer_lock(root):
        for stale in root.glob(_TMP_PREFIX + "*"):  # a previous writer died mid-build
            shutil.rmtree(stale, ignore_errors=True)
        version = new_version_name()
        while (root / version).exists():
            time.sleep(1e-6)
            version = new_version_name()
        tmp = root / f"{_TMP_PREFIX}{version}"
        tmp.mkdir()
        try:
            write(tmp, version)
            if not (tmp / MANIFEST).is_file():
                raise PublishError("index writer finished without a manifest")
            fsync_path(tmp)
            os.rename(tmp, root / version)
            fsync_path(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _set_current(root, version)
        prune(root, keep=keep)
    return version


def prune(root: Path, *, keep: int) -> list[str]:
    """Remove all but the newest `keep` versions (never the CURRENT one)."""
    versions = list_versions(root)
    current = current_version(root)
    doomed = [v for v in versions[:-keep] if v != current]
    for v in doomed:
        shutil.rmtree(Path(root) / v, ignore_errors=True)
    return doomed
