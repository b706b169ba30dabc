"""The publish protocol of a versioned root — the one contract between a publisher (the
index builder, `grace publish-model`) and the server that follows it (docs/ARCHITECTURE.md
§3). Index roots and model repositories share it:

    <root>/<version>/            complete versions (their `complete` file written last inside)
    <root>/<version>/validated.json   marker: this version passed its check
    <root>/CURRENT               one line: the version the server should serve
    <root>/.tmp-*                versions being written (never visible as CURRENT)
    <root>/.lock                 held by the one writer (flock)

`publish_version` publishes one version (every step: docs/FORMAT.md §3, "Publishing"): a
crash at any point leaves `CURRENT` naming the previous complete version, and a failure (a
full disk included: `DiskFullError`) leaves no new version behind.
"""

from __future__ import annotations

import contextlib
import errno
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

from contracts.index_format import fsync_path

CURRENT = "CURRENT"
VALID_MARKER = "validated.json"
TMP_PREFIX = ".tmp-"
FREE_SPACE_FLOOR = 1 << 20  # bytes free below which a write error without errno is ENOSPC
log = logging.getLogger("grace.versions")


class PublishError(RuntimeError):
    """The root cannot be written (another writer holds it, or the filesystem refused)."""


class DiskFullError(OSError):
    """A write refused for want of space, as one line naming the path (`disk_full`)."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def disk_full(exc: BaseException, path: Path, then: str = "") -> DiskFullError | None:
    """`exc` as a DiskFullError naming `path` (`then` ends it) if a full disk caused it: errno
    ENOSPC, or none and ENOSPC in Rust's words (safetensors) or under FREE_SPACE_FLOOR free
    (numpy's `N requested and M written`). Call it before the failed write's files go."""
    code, detail = getattr(exc, "errno", None), ""
    if code is None and isinstance(exc, Exception) and not isinstance(exc, RuntimeError):
        rust_enospc = f"(os error {errno.ENOSPC})" in str(exc)  # a Rust io::Error's text
        with contextlib.suppress(OSError):  # errno dropped by the library: ask the filesystem
            st = os.statvfs(path if os.path.exists(path) else os.path.dirname(path))
            if rust_enospc or st.f_bavail * st.f_frsize < FREE_SPACE_FLOOR:
                code, detail = errno.ENOSPC, f": {exc}"
    if code != errno.ENOSPC:
        return None  # not a full disk (RuntimeError: a cancelled build, a held lock)
    return DiskFullError(errno.ENOSPC, f"no space left on device (ENOSPC{detail}){then}", str(path))


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
    """A version directory as given, or the CURRENT version of a root."""
    path = Path(path)
    current = current_path(path) if (path / CURRENT).is_file() else None
    return path if current is None else current


def is_version_name(name: str) -> bool:
    """Whether `name` can name a version (what a CURRENT may hold): no path, no dot file."""
    bad = name.startswith(".") or "/" in name or any(c.isspace() or c == "\0" for c in name)
    return bool(name) and not bad


def list_versions(root: Path, complete: str) -> list[str]:
    """Complete versions (holding their `complete` file) under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / complete).is_file()
    )


@contextlib.contextmanager
def writer_lock(root: Path, what: str = "publisher") -> Iterator[None]:
    """Exclusive writer lock on the root; fails at once if another writer holds it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PublishError(f"{root}: another {what} is writing here") from exc
        yield
    finally:
        os.close(fd)


def _replace(path: Path, text: str) -> None:
    """Write `path` atomically: the rename of a fsynced temp file, its directory fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written temp file left
        raise
    fsync_path(path.parent)


def set_current(root: Path, version: str) -> None:
    """Point CURRENT at `version` (atomically)."""
    _replace(root / CURRENT, version + "\n")


def _digest(directory: Path, complete: str) -> str:
    return hashlib.sha256((directory / complete).read_bytes()).hexdigest()


def mark_valid(directory: Path, complete: str) -> None:
    """Record that `directory` passed its check, tied to its `complete` file's exact bytes."""
    marker = {"manifest_sha256": _digest(directory, complete),
              "validated": datetime.now(UTC).isoformat()}  # fmt: skip
    _replace(directory / VALID_MARKER, json.dumps(marker))


def is_marked_valid(directory: Path, complete: str) -> bool:
    """Whether a marker says `directory` passed its check with the file it has now."""
    try:
        marker = json.loads((directory / VALID_MARKER).read_text())
        digest = _digest(directory, complete)
        return isinstance(marker, dict) and marker.get("manifest_sha256") == digest
    except (OSError, ValueError):
        return False


def publish_version(
    root: Path,
    write: Callable[[Path, str], object],
    *,
    complete: str,
    keep: int,
    check: Callable[[Path, str], None] | None = None,
    is_valid: Callable[[Path, str], bool | None],
    what: str = "publisher",
) -> str:
    """Publish a new version, checked, marked valid, renamed into place, named by `CURRENT`,
    then prune; returns its name. `write(tmp_dir, version)` fills the empty directory, its
    `complete` file last; `check(tmp_dir, version)`, when given, raises if the version must
    not serve (an error of either propagates, nothing changed); `is_valid` is `prune`'s."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    root = Path(root)
    with writer_lock(root, what):
        for stale in root.glob(TMP_PREFIX + "*"):  # a previous writer died mid-write
            log.warning("%s: removing %s, left by a writer stopped mid-write", root, stale.name)
            shutil.rmtree(stale, ignore_errors=True)
        current = current_version(root)
        if ahead := [v for v in list_versions(root, complete) if current is None or v > current]:
            log.warning("%s: %s newer than CURRENT's %s: a writer stopped between rename and "
                        "CURRENT, or CURRENT was set back", root, ahead, current)  # fmt: skip
        version = new_version_name()
        while (root / version).exists():
            time.sleep(1e-6)
            version = new_version_name()
        tmp = root / f"{TMP_PREFIX}{version}"
        try:
            tmp.mkdir()
            write(tmp, version)
            if not (tmp / complete).is_file():
                raise PublishError(f"the {what} finished without writing {complete}")
            if check is not None:
                check(tmp, version)
                mark_valid(tmp, complete)
            fsync_path(tmp)
            os.rename(tmp, root / version)  # the one way a version directory appears
            fsync_path(root)
            set_current(root, version)
        except BaseException as exc:
            named = current_version(root) == version  # CURRENT moved; only an fsync failed
            full = disk_full(exc, root, "" if named else f"; {version} not published, "
                             f"CURRENT still names {current or 'nothing'}")  # fmt: skip
            if not named:  # renamed but never named (CURRENT's write failed): not a version
                shutil.rmtree(root / version, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
            if full is None:
                raise
            raise full from exc
        prune(root, keep=keep, complete=complete, is_valid=is_valid)
    return version


def prune(
    root: Path, *, keep: int, complete: str, is_valid: Callable[[Path, str], bool | None]
) -> list[str]:
    """Keep the newest `keep` valid versions and CURRENT's; remove and return the rest.
    `is_valid(root, version)`: True, False or None (unreadable: kept); only versions
    newer than the `keep`-th valid one are asked."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    current = current_version(root)
    valid, doomed = 0, []
    for version in reversed(list_versions(root, complete)):  # newest first
        if valid < keep:
            known = is_valid(Path(root), version)
            if known is True:
                valid += 1
            if known is not False or version == current:
                continue
        if version != current:
            doomed.append(version)
    for version in doomed:
        shutil.rmtree(Path(root) / version, ignore_errors=True)
    return doomed
