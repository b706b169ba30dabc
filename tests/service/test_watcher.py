"""Index hot swap: new versions are validated before they serve; bad ones never serve, are
counted once per backoff period and retried; a version CURRENT names before it exists is
picked up when it appears; the first load falls back to the newest version that loads."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from index_builder.publish import CURRENT, current_path, publish
from service.index.loaded import IndexHolder, LoadedIndex
from service.index.watcher import IndexWatcher
from tests.helpers.indexes import corrupting, flip_byte, small_index, writer


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_watcher(root: Path, clock: Clock | None = None, **kw) -> tuple[IndexWatcher, dict]:
    seen: dict[str, list] = {"swapped": [], "failed": []}
    watcher = IndexWatcher(
        root, IndexHolder(), tokenizer_fingerprint="test", clock=clock or Clock(),
        on_swap=lambda i: seen["swapped"].append(i.version),
        on_failure=lambda v, e: seen["failed"].append(v), **kw,
    )  # fmt: skip
    return watcher, seen


def served(watcher: IndexWatcher) -> str:
    return watcher.holder.current.version


def test_watcher_swaps_in_new_versions_and_rejects_bad_ones(tmp_path: Path) -> None:
    clock = Clock()
    watcher, seen = make_watcher(tmp_path, clock)
    assert not watcher.check_once() and not watcher.behind  # nothing published yet
    v1 = publish(tmp_path, writer(small_index(30)))
    assert watcher.check_once() and served(watcher) == v1
    assert not watcher.check_once()  # unchanged
    v2 = publish(tmp_path, writer(small_index(40)))
    assert watcher.check_once() and served(watcher) == v2
    assert watcher.holder.current.arrays.ads.num_ads == 40

    v3 = publish(tmp_path, writer(small_index(50)))
    flip_byte(current_path(tmp_path) / "trie.bloom_table.npy")
    assert not watcher.check_once()
    assert served(watcher) == v2 and watcher.behind  # the old index keeps serving
    assert not watcher.check_once() and len(seen["failed"]) == 1  # not before the backoff
    clock.advance(watcher.backoff_seconds)
    assert not watcher.check_once() and len(seen["failed"]) == 2  # retried after it

    v4 = publish(tmp_path, writer(small_index(20), tokenizer="another-model"))
    assert not watcher.check_once() and served(watcher) == v2  # a new version: at once
    assert seen["swapped"] == [v1, v2] and seen["failed"] == [v3, v3, v4]


def _drop_sha256(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["arrays"]["trie.bloom_table"]["sha256"]
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _rename_in_manifest(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["index_version"] = "20200101T000000000000Z"
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("fault", "message"),
    [(_drop_sha256, "needs a string 'sha256'"), (_rename_in_manifest, "differs from the version")],
    ids=["array-without-sha256", "index-version-not-the-directory"],
)
def test_a_malformed_manifest_is_counted_once_per_backoff_and_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: Callable[[Path], None], message: str
) -> None:
    caplog.set_level(logging.INFO, logger="grace.watcher")
    clock = Clock()
    watcher, seen = make_watcher(tmp_path, clock, backoff_seconds=1.0, max_backoff_seconds=4.0)
    good = publish(tmp_path, writer(small_index(30)))
    assert watcher.check_once()
    bad = publish(tmp_path, writer(small_index(40)))
    fault(tmp_path / bad)
    counts = []
    for _ in range(40):  # 10 s in quarter seconds, several polls per step
        for _ in range(3):
            assert not watcher.check_once()
        counts.append(len(seen["failed"]))
        clock.advance(0.25)
    # tries at t = 0, 1, 1+2, 3+4, 7+4 (capped): each counted once
    assert [counts[i] for i in (0, 3, 4, 11, 12, 27, 28, 39)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert served(watcher) == good and watcher.behind
    assert seen["failed"] == [bad] * 4 and seen["swapped"] == [good]
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 4
    assert all(message in r.getMessage() and "\n" not in r.getMessage() for r in rejected)
    assert not any(r.exc_info for r in caplog.records)  # an expected fault: no traceback


def test_an_unexpected_error_while_preparing_is_a_counted_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    calls = []

    def prepare(index: LoadedIndex) -> None:
        calls.append(index.version)
        if len(calls) > 1:
            raise RuntimeError("graph capture failed")

    watcher, seen = make_watcher(tmp_path, clock, prepare=prepare)
    first = publish(tmp_path, writer(small_index(30)))
    assert watcher.check_once()
    second = publish(tmp_path, writer(small_index(40)))
    for _ in range(5):
        assert not watcher.check_once()
    assert len(seen["failed"]) == 1 and seen["failed"] == [second] and served(watcher) == first
    tracebacks = [r for r in caplog.records if r.exc_info]  # unexpected: one per attempt
    assert len(tracebacks) == 1
    assert "RuntimeError: graph capture failed" in tracebacks[0].getMessage()


def test_current_moving_on_tries_the_new_version_at_once(tmp_path: Path) -> None:
    clock = Clock()
    watcher, seen = make_watcher(tmp_path, clock, backoff_seconds=60.0)
    publish(tmp_path, writer(small_index(30)))
    assert watcher.check_once()
    publish(tmp_path, corrupting(writer(small_index(40))))
    assert not watcher.check_once() and len(seen["failed"]) == 1
    fixed = publish(tmp_path, writer(small_index(50)))
    assert watcher.check_once() and served(watcher) == fixed and not watcher.behind


def test_a_version_named_before_it_appears_is_picked_up_without_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.watcher")
    root, staging = tmp_path / "index", tmp_path / "staging"
    watcher, seen = make_watcher(root)
    first = publish(root, writer(small_index(30)))
    assert watcher.check_once()
    later = publish(staging, writer(small_index(40)))
    (root / CURRENT).write_text(later + "\n")  # CURRENT first, the directory after
    for _ in range(5):
        assert not watcher.check_once()
    assert watcher.behind and served(watcher) == first
    shutil.copytree(staging / later, root / later, ignore=shutil.ignore_patterns("manifest.json"))
    for _ in range(5):  # arrays there, manifest not yet: still pending
        assert not watcher.check_once()
    assert len(seen["failed"]) == 0 and seen["failed"] == []
    shutil.copy(staging / later / "manifest.json", root / later / "manifest.json")
    assert watcher.check_once() and served(watcher) == later and not watcher.behind
    assert len(seen["failed"]) == 0
    pending = [r for r in caplog.records if "has not appeared yet" in r.getMessage()]
    assert len(pending) == 1 and later in pending[0].getMessage()


@pytest.fixture
def three_versions(tmp_path: Path) -> tuple[Path, list[str]]:
    """v1 and v2 valid (30 and 40 ads), CURRENT on the newest, v3 (50 ads)."""
    versions = [publish(tmp_path, writer(small_index(n))) for n in (30, 40, 50)]
    return tmp_path, versions


@pytest.mark.parametrize("fault", ["corrupt", "tokenizer", "pending"])
def test_first_load_falls_back_to_the_newest_version_that_loads(
    three_versions: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    root, (_, v2, v3) = three_versions
    if fault == "corrupt":
        flip_byte(root / v3 / "ads.ad_ids.npy")
    elif fault == "tokenizer":
        shutil.rmtree(root / v3)
        v3 = publish(root, writer(small_index(50), tokenizer="another-model"))
    else:
        shutil.move(root / v3, root.parent / "elsewhere")
    watcher, seen = make_watcher(root)
    assert watcher.check_once() and served(watcher) == v2 and watcher.behind
    assert len(seen["failed"]) == (0 if fault == "pending" else 1)
    why = {"corrupt": "checksum mismatch", "tokenizer": "built for SID space",
           "pending": "has not appeared yet"}[fault]  # fmt: skip
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CURRENT names")]
    assert len(said) == 1 and v3 in said[0] and why in said[0] and f"serving {v2}" in said[0]
    if fault == "pending":  # once CURRENT's version appears, it serves
        shutil.move(root.parent / "elsewhere", root / v3)
        assert watcher.check_once() and served(watcher) == v3 and not watcher.behind
        assert seen["swapped"] == [v2, v3]


def test_first_load_with_nothing_loadable_serves_nothing(
    three_versions: tuple[Path, list[str]],
) -> None:
    root, versions = three_versions
    for v in versions:
        flip_byte(root / v / "trie.node_offsets.npy")
    watcher, seen = make_watcher(root)
    assert not watcher.check_once() and not watcher.holder.ready and watcher.behind
    assert len(seen["failed"]) == 3 and sorted(seen["failed"]) == versions
    assert not watcher.check_once() and len(seen["failed"]) == 3  # each waits for its backoff


def test_an_unreadable_current_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = publish(tmp_path, writer(small_index(30)))
    watcher, seen = make_watcher(tmp_path)
    assert watcher.check_once()
    (tmp_path / CURRENT).write_text("../../elsewhere\n")
    for _ in range(5):
        assert not watcher.check_once()
    assert served(watcher) == first and len(seen["failed"]) == 0
    assert len([r for r in caplog.records if "not a version" in r.getMessage()]) == 1
