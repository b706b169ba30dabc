"""Atomic publishing of index versions under one root (docs/ARCHITECTURE.md §3).

    <root>/<version>/      complete versions (manifest.json written last inside)
    <root>/<version>/validated.json   marker: this version passed validation
    <root>/CURRENT         one line: the version the server should serve
    <root>/.tmp-*          builds in progress (never visible as CURRENT)
    <root>/.lock           held by the one writer (flock)

`publish` writes a new version into a temp dir, runs the caller's `check` on it (the
builder's: full `validate_index`), marks it valid, fsyncs, renames it into place, then
replaces `CURRENT` by rename of a fsynced temp file, and prunes old versions. A version
that fails its check is removed and nothing changes. A crash at any point leaves
`CURRENT` naming the previous complete version; leftover temp dirs are removed by the
next writer. `prune` keeps the newest `keep` versions known valid (by marker, or
validated once and marked), so failed or corrupt versions never push the last good ones
out. The server's watcher reads `current_version` and, at start-up, `list_versions`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from contracts.index_format import MANIFEST, fsync_path
from index_builder.validate import IndexValidationError, validate_index

log = logging.getLogger("grace.index_builder")

CURRENT = "CURRENT"
VALID_MARKER = "validated.json"
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
    check: Callable[[Path, str], None] | None = None,
) -> str:
    """Build a version with `write(tmp_dir, version)` and publish it atomically.

    `write` must fill the (empty) directory it is given, manifest last. `check(tmp_dir,
    version)`, when given, runs before the version is renamed into place and raises if it
    must not serve (the builder passes a full `validate_index`); a version that passed is
    marked valid (`VALID_MARKER`). If `write` or `check` raises, the temp dir is removed,
    nothing changes and the error propagates. Returns the new version name.
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
            if check is not None:
                check(tmp, version)
                mark_valid(tmp)
            fsync_path(tmp)
            os.rename(tmp, root / version)
            fsync_path(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _set_current(root, version)
        prune(root, keep=keep)
    return version


def _manifest_digest(directory: Path) -> str:
    return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()


def mark_valid(directory: Path) -> None:
    """Record that `directory` passed validation, tied to its manifest's exact bytes."""
    marker = {"manifest_sha256": _manifest_digest(directory),
              "validated": datetime.now(UTC).isoformat()}  # fmt: skip
    tmp = directory / f".{VALID_MARKER}.tmp"
    with open(tmp, "w") as fh:
        json.dump(marker, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / VALID_MARKER)
    fsync_path(directory)


def is_marked_valid(directory: Path) -> bool:
    """Whether a marker says `directory` passed validation with the manifest it has now."""
    try:
        marker = json.loads((directory / VALID_MARKER).read_text())
        return isinstance(marker, dict) and marker.get("manifest_sha256") == _manifest_digest(
            directory
        )
    except (OSError, ValueError):
        return False


def version_is_valid(root: Path, version: str) -> bool | None:
    """True if `version` is marked valid or validates now (then it is marked); False if
    it fails validation; None if it cannot be read at all (unknown: keep it)."""
    directory = Path(root) / version
    if is_marked_valid(directory):
        return True
    try:
        validate_index(directory, expect_version=version)
    except IndexValidationError as exc:
        log.warning("index %s is invalid: %s", version, exc.summary)
        return False
    except OSError as exc:
        log.warning("index %s cannot be checked, kept: %s", version, exc)
        return None
    mark_valid(directory)
    return True


def prune(root: Path, *, keep: int) -> list[str]:
    """Keep the newest `keep` valid versions and CURRENT's; remove the rest.

    Validity comes from each version's marker; an unmarked version newer than the
    `keep`-th valid one is validated once (and marked if valid). Invalid versions are
    removed, except CURRENT's; versions that cannot be read are kept. Returns the removed.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    current = current_version(root)
    valid, doomed = 0, []
    for version in reversed(list_versions(root)):  # newest first
        if valid < keep:
            known = version_is_valid(root, version)
            if known is True:
                valid += 1
            if known is not False or version == current:
                continue
        if version != current:
            doomed.append(version)
    for version in doomed:
        shutil.rmtree(Path(root) / version, ignore_errors=True)
    return doomed
