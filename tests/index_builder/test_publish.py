"""Publishing and validation: atomic CURRENT, crash safety, validation before publishing,
pruning that keeps the last valid versions, corruption and malformed manifests caught."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import index_builder.publish as publish_module
from contracts.index_validation import IndexValidationError, validate_index
from contracts.versions import writer_lock
from index_builder.build import build_index
from index_builder.publish import (
    CURRENT,
    VALID_MARKER,
    PublishError,
    current_path,
    current_version,
    is_marked_valid,
    list_versions,
    new_version_name,
    prune,
    publish,
)
from tests.helpers.indexes import (
    corrupt_builds,
    corrupting,
    flip_byte,
    rewrite_array,
    small_index,
    validator,
    writer,
)

REPO = Path(__file__).resolve().parents[2]


def test_publish_points_current_at_a_valid_version_and_prunes(tmp_path: Path) -> None:
    arrays = small_index()
    versions = [publish(tmp_path, writer(arrays), keep=2) for _ in range(4)]
    assert current_version(tmp_path) == versions[-1]
    assert list_versions(tmp_path) == versions[-2:]
    validated = validate_index(current_path(tmp_path))
    assert validated.manifest["index_version"] == versions[-1]
    assert not list(tmp_path.glob(".tmp-*"))


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    first = publish(tmp_path, writer(small_index()))

    def broken(directory: Path, version: str) -> None:
        (directory / "half.npy").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish(tmp_path, broken)
    assert current_version(tmp_path) == first
    assert list_versions(tmp_path) == [first]
    assert not list(tmp_path.glob(".tmp-*"))


def test_second_writer_is_refused(tmp_path: Path) -> None:
    lock = writer_lock(tmp_path, "index builder")
    with lock, pytest.raises(PublishError, match="another index builder"):
        publish(tmp_path, writer(small_index()))


def test_publish_refuses_a_version_that_fails_its_check(tmp_path: Path) -> None:
    """A corrupt version, or one built for another SID tokenizer, is removed before it is
    renamed into place: CURRENT and the versions on disk stay as they were."""
    first = publish(tmp_path, writer(small_index()), check=validator())
    assert is_marked_valid(tmp_path / first)
    with pytest.raises(IndexValidationError, match="checksum mismatch"):
        publish(tmp_path, corrupting(writer(small_index(40))), check=validator())
    with pytest.raises(IndexValidationError, match="built for SID space"):
        publish(tmp_path, writer(small_index(40), tokenizer="another"), check=validator())
    assert current_version(tmp_path) == first
    assert list_versions(tmp_path) == [first]
    assert not list(tmp_path.glob(".tmp-*"))
    assert validate_index(current_path(tmp_path)).arrays.ads.num_ads == 50


def test_publish_refuses_a_manifest_naming_another_version(tmp_path: Path) -> None:
    def misnamed(directory: Path, version: str) -> None:
        writer(small_index())(directory, "20200101T000000000000Z")

    with pytest.raises(IndexValidationError, match="differs from the version name"):
        publish(tmp_path, misnamed, check=validator())
    assert current_version(tmp_path) is None and list_versions(tmp_path) == []
    assert not list(tmp_path.glob(".tmp-*"))


def _catalog(path: Path, n: int = 20) -> Path:
    rows = [{"ad_id": 10 + i, "sid": [i % 3, i % 5, i, 0], "countries": ["US"]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_build_index_validates_before_publishing_and_keeps_the_good_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three builds whose written files are corrupt (with the default keep=3, publishing
    them unchecked would have pruned the good version) publish nothing."""
    catalog, root = _catalog(tmp_path / "catalog.jsonl"), tmp_path / "index"
    good, report = build_index(catalog, root, progress=False)
    assert is_marked_valid(root / good) and "validate" in report.seconds
    corrupt_builds(monkeypatch, "ads.ad_ids.npy")
    for _ in range(3):
        with pytest.raises(IndexValidationError, match=r"ads\.ad_ids\.npy: checksum mismatch"):
            build_index(catalog, root, progress=False)
    assert current_version(root) == good and list_versions(root) == [good]
    validate_index(root / good)


def _hand_copy(root: Path, source: str, *, corrupt: bool) -> str:
    """`source` copied by hand under a newer name: no validity marker, its manifest
    renamed, one array byte flipped if `corrupt`."""
    name = new_version_name()
    while name <= max(list_versions(root)):
        name = new_version_name()
    shutil.copytree(root / source, root / name)
    (root / name / VALID_MARKER).unlink(missing_ok=True)
    manifest = json.loads((root / name / "manifest.json").read_text())
    (root / name / "manifest.json").write_text(json.dumps(manifest | {"index_version": name}))
    if corrupt:
        flip_byte(root / name / "trie.bloom_table.npy")
    return name


def _point_current(root: Path, version: str) -> None:
    (root / CURRENT).write_text(version + "\n")


def test_prune_keeps_the_newest_valid_versions_and_current(tmp_path: Path) -> None:
    """Invalid versions newer than the valid ones never push those out; CURRENT's version
    is never removed, even when it is invalid."""
    valid = [publish(tmp_path, writer(small_index()), check=validator()) for _ in range(2)]
    bad = [_hand_copy(tmp_path, valid[-1], corrupt=True) for _ in range(3)]
    _point_current(tmp_path, bad[-1])
    assert sorted(prune(tmp_path, keep=2)) == bad[:2]
    assert list_versions(tmp_path) == [*valid, bad[-1]]
    assert prune(tmp_path, keep=1) == [valid[0]]
    assert list_versions(tmp_path) == [valid[1], bad[-1]]
    assert prune(tmp_path, keep=1) == []  # the last valid version stays


def test_prune_validates_an_unmarked_version_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version without a marker (an older build, a copy) is validated when prune needs
    to know, and marked; a marked one is not validated again unless its manifest changed."""
    calls: list[str] = []
    real = publish_module.validate_index

    def counting(path: Path, **kw: object):
        calls.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(publish_module, "validate_index", counting)
    old = publish(tmp_path, writer(small_index()))  # unchecked: published without a marker
    assert calls == [old] and is_marked_valid(tmp_path / old)  # its prune needed to know
    newer = publish(tmp_path, writer(small_index()), check=validator())
    copy = _hand_copy(tmp_path, newer, corrupt=False)
    assert prune(tmp_path, keep=3) == [] and calls == [old, copy]
    assert prune(tmp_path, keep=3) == [] and calls == [old, copy]  # all marked now
    manifest = json.loads((tmp_path / old / "manifest.json").read_text())
    manifest["index_version"] = "20200101T000000000000Z"  # tampered: the marker is stale
    (tmp_path / old / "manifest.json").write_text(json.dumps(manifest))
    assert prune(tmp_path, keep=3) == [old] and calls == [old, copy, old]
    assert list_versions(tmp_path) == [newer, copy]


def test_expect_version_refuses_a_manifest_of_another_name(tmp_path: Path) -> None:
    version = publish(tmp_path, writer(small_index()))
    validate_index(tmp_path / version, expect_version=version)
    with pytest.raises(IndexValidationError, match="differs from the version name 'other'"):
        validate_index(tmp_path / version, expect_version="other")


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from tests.helpers.indexes import small_index, writer
    from index_builder.publish import publish
    real_fsync, stall_at, calls = os.fsync, int(sys.argv[2]), []
    def stalling_fsync(fd):  # the write stops at the given fsync, to be killed there
        real_fsync(fd)
        calls.append(fd)
        if len(calls) == stall_at:
            Path(sys.argv[3]).touch()
            time.sleep(3600)
    os.fsync = stalling_fsync
    publish(sys.argv[1], writer(small_index(3000)))
    """
)


# after the 1st, 4th and 9th of the 17 arrays written: the kill lands inside the write
# on a condition, not after a sleep that a busy machine could outlast
@pytest.mark.parametrize("stall_at", [1, 4, 9])
def test_build_killed_mid_write_leaves_current_on_the_previous_version(
    tmp_path: Path, stall_at: int
) -> None:
    root, stalled = tmp_path / "index", tmp_path / "stalled"
    good = publish(root, writer(small_index()))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(stall_at),
                              str(stalled)], cwd=REPO)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not stalled.exists():  # the child stopped mid-write
            assert child.poll() is None, "child finished before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert list(root.glob(".tmp-*/*.npy"))  # arrays written, none published
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert current_version(root) == good
    assert list_versions(root) == [good]
    validate_index(current_path(root))
    # the next writer cleans up the dead one's temp dir and publishes normally
    newer = publish(root, writer(small_index()))
    assert current_version(root) == newer
    assert not list(root.glob(".tmp-*"))


def test_flipped_byte_is_caught(published: Path) -> None:
    target = published / "trie.bloom_table.npy"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(IndexValidationError, match="checksum mismatch"):
        validate_index(published)


def test_truncated_file_is_caught(published: Path) -> None:
    target = published / "ads.ad_ids.npy"
    os.truncate(target, target.stat().st_size // 2)
    with pytest.raises(IndexValidationError, match=r"ads\.ad_ids\.npy"):
        validate_index(published)


def test_missing_manifest_is_caught(published: Path) -> None:
    (published / "manifest.json").unlink()
    with pytest.raises(IndexValidationError, match=r"no manifest\.json"):
        validate_index(published)


@pytest.mark.parametrize(
    ("name", "mutate", "fault"),
    [
        ("trie.csr_tokens", lambda a: np.where(a == a[1], 600, a).astype(a.dtype), "csr_tokens"),
        ("trie.node_offsets", lambda a: a[::-1].copy(), "node_offsets"),
        ("trie.bitmask_index", lambda a: a + 10_000, "bitmask_index"),
        ("trie.bloom_table", lambda a: np.zeros_like(a), "Bloom matcher misses"),
        ("trie.bitmask_table", lambda a: a & np.uint64(1), "bitmask matcher misses"),
        ("ads.leaf_ad_offsets", lambda a: np.r_[a[:1], a[:1], a[2:]], "maps to no ad"),
        ("ads.ad_ids", lambda a: np.zeros_like(a), "not unique"),
        ("ads.leaf_sids", lambda a: a[::-1].copy(), "leaf_sids disagree"),
    ],
)
def test_structural_corruption_is_caught(published: Path, name, mutate, fault) -> None:
    arr = np.load(published / f"{name}.npy")
    rewrite_array(published, name, mutate(arr))
    with pytest.raises(IndexValidationError, match=fault):
        validate_index(published)


@pytest.mark.parametrize("shared", [True, False], ids=["row-shared-with-child", "own-row"])
@pytest.mark.parametrize(("kind", "word"), [("bitmask", "bitmask"), ("bloom", "Bloom")])
def test_a_prefix_matcher_missing_a_childs_bits_is_caught(
    published: Path, kind: str, word: str, shared: bool
) -> None:
    """Inner matchers are checked against their children's (the leaf checks cannot see
    them): an ancestor entry pointed at an empty matcher row is refused, whether its row
    was its child's own (the pairs the check skips as trivially sound) or another."""
    table = np.load(published / f"trie.{kind}_table.npy")
    index = np.load(published / f"trie.{kind}_index.npy")
    node_offsets = np.load(published / "trie.node_offsets.npy")
    parent = np.repeat(np.arange(len(node_offsets) - 1), np.diff(node_offsets))
    (children,) = np.nonzero(parent > 0)  # entries whose parent is an entry too
    same = index[children] == index[parent[children] - 1]
    child = children[same if shared else ~same][-1]
    broken = index.copy()
    broken[parent[child] - 1] = len(table)  # a new, empty row
    rewrite_array(published, f"trie.{kind}_table", np.vstack([table, np.zeros_like(table[:1])]))
    rewrite_array(published, f"trie.{kind}_index", broken)
    with pytest.raises(IndexValidationError, match=f"prefix's {word} matcher misses"):
        validate_index(published)


def test_tokenizer_mismatch_is_refused(published: Path) -> None:
    with pytest.raises(IndexValidationError, match="built for SID space"):
        validate_index(published, expect_tokenizer="abc123")


def test_newer_format_is_refused_with_an_upgrade_hint(published: Path) -> None:
    manifest = json.loads((published / "manifest.json").read_text())
    manifest["format_version"] = 99
    (published / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexValidationError, match="upgrade"):
        validate_index(published)
