"""A full disk under `grace build-index` (a real tmpfs, the real command): at every fill
level the build fails with one line naming the index root and "no space left on device",
and leaves nothing behind — no version but the valid ones, no temp file, CURRENT where it
was, every byte it took given back (issue #46: numpy's `N requested and M written`, and a
complete version left beside CURRENT when CURRENT itself could not be written)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contracts import versions
from contracts.index_validation import validate_index
from index_builder.publish import current_version, list_versions, publish
from tests.helpers.indexes import small_index, validator, writer
from tests.helpers.tmpfs import PAGE, fill, free_bytes, small_tmpfs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def sid_catalog(path: Path, n: int = 3000) -> Path:
    """`n` ads with SIDs of their own and some targeting: an index of ~0.4 MB."""
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for i in range(n):
            row = {"ad_id": 1000 + i, "sid": rng.integers(0, 512, 4).tolist(),
                   "countries": ["US", "CA"][: i % 3], "locations": [f"US/{i % 97}"]}  # fmt: skip
            fh.write(json.dumps(row) + "\n")
    return path


def build_index_cli(catalog: Path, root: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cli", "build-index", "--catalog", str(catalog),
           "--out", str(root), "--no-progress"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def error_line(stderr: str, command: str) -> str:
    [line] = [x for x in stderr.splitlines() if x.startswith(f"grace {command}: error:")]
    return line


def test_build_index_on_a_full_disk_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    catalog = sid_catalog(tmp_path / "catalog.jsonl")
    with small_tmpfs(tmp_path / "fs", 8 << 20) as fs:
        root = fs / "idx"
        before = free_bytes(fs)
        done = build_index_cli(catalog, root)
        assert done.returncode == 0, done.stderr
        [first] = list_versions(root)
        # a second build needs one version more, and a page for the new CURRENT's temp file
        version_bytes = before - free_bytes(fs) - PAGE  # the version, its marker (CURRENT)
        baseline = free_bytes(fs)
        levels = [0, PAGE, version_bytes // 3, version_bytes * 2 // 3, version_bytes - PAGE]
        # all of a version fits, its marker too, and then CURRENT's temp file does not: the
        # issue's complete version beside CURRENT; only where the next manifest (its build
        # seconds may differ in a digit or two) takes as many pages as this one's
        manifest = (root / first / "manifest.json").stat().st_size
        if 64 < manifest % PAGE < PAGE - 64:
            levels.append(version_bytes)
        messages = []
        for leave in levels:
            filler = fill(fs, leave)
            done = build_index_cli(catalog, root)
            assert done.returncode != 0, f"built with {leave} bytes free"
            line = error_line(done.stderr, "build-index")
            assert f"{root}: no space left on device" in line, line
            assert f"CURRENT still names {first}" in line, line
            assert "Traceback" not in done.stderr
            messages.append(line)
            filler.unlink()
            assert sorted(p.name for p in root.iterdir()) == sorted([first, "CURRENT", ".lock"])
            assert current_version(root) == first
            assert free_bytes(fs) == baseline, f"{leave} bytes free: the build left files behind"
        # numpy's short write (no errno) was among them, and was named a full disk too
        assert any("requested and" in m for m in messages), messages
        validate_index(root / first, expect_version=first)
        assert build_index_cli(catalog, root).returncode == 0  # with room again: publishes
        assert len(list_versions(root)) == 2 and current_version(root) != first


def test_a_version_renamed_into_place_is_removed_when_current_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path of the issue, made certain: the version is complete, validated and renamed,
    then CURRENT's write fails for want of space. Nothing that looks complete may stay."""
    first = publish(tmp_path, writer(small_index()))

    def no_space(root: Path, version: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(versions, "set_current", no_space)
    with pytest.raises(versions.DiskFullError, match="no space left on device") as caught:
        publish(tmp_path, writer(small_index()), check=validator())
    assert str(caught.value).startswith(f"{tmp_path}: ") and first in str(caught.value)
    assert list_versions(tmp_path) == [first] and current_version(tmp_path) == first
    assert not list(tmp_path.glob(".*tmp*"))


def test_the_next_publish_names_a_version_newer_than_current(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer killed between its rename and CURRENT leaves a complete version CURRENT
    does not name; the next publish says so (it may be a hand rollback: kept)."""
    first = publish(tmp_path, writer(small_index()))
    orphan = publish(tmp_path, writer(small_index()))
    versions.set_current(tmp_path, first)
    caplog.set_level("WARNING", logger="grace.versions")
    third = publish(tmp_path, writer(small_index()))
    [line] = [r.getMessage() for r in caplog.records if "newer than CURRENT" in r.getMessage()]
    assert orphan in line and first in line
    assert current_version(tmp_path) == third
