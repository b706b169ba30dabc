"""Atomic publishing of index versions under one root (docs/FORMAT.md "Publishing"): the
versioned-root protocol of `contracts/versions.py` with the index's own validity check
(`validate_index`). The server follows the root with `service/rollout/`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from contracts import versions
from contracts.index_manifest import MANIFEST
from contracts.index_validation import IndexValidationError, validate_index
from contracts.versions import (
    CURRENT,
    VALID_MARKER,
    PublishError,
    current_path,
    current_version,
    new_version_name,
    resolve,
)

__all__ = [
    "CURRENT",
    "VALID_MARKER",
    "PublishError",
    "current_path",
    "current_version",
    "is_marked_valid",
    "list_versions",
    "new_version_name",
    "prune",
    "publish",
    "resolve",
    "version_is_valid",
]
log = logging.getLogger("grace.index_builder")


def list_versions(root: Path) -> list[str]:
    """Complete index versions (with a manifest) under root, oldest first."""
    return versions.list_versions(root, MANIFEST)


def is_marked_valid(directory: Path) -> bool:
    """Whether a marker says `directory` passed validation with the manifest it has now."""
    return versions.is_marked_valid(directory, MANIFEST)


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
    versions.mark_valid(directory, MANIFEST)  # tied to the manifest's exact bytes
    return True


def publish(
    root: Path,
    write: Callable[[Path, str], object],
    *,
    keep: int = 3,
    check: Callable[[Path, str], None] | None = None,
) -> str:
    """Build an index version with `write(tmp_dir, version)` (manifest last) and publish
    it atomically; `check` (the builder's full `validate_index`) runs before it is renamed
    into place. Returns the new version name."""
    return versions.publish_version(
        root, write, complete=MANIFEST, keep=keep, check=check, is_valid=version_is_valid,
        what="index builder",
    )  # fmt: skip


def prune(root: Path, *, keep: int) -> list[str]:
    """Keep the newest `keep` valid index versions and CURRENT's; remove the rest."""
    return versions.prune(root, keep=keep, complete=MANIFEST, is_valid=version_is_valid)
