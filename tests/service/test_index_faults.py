"""Index faults under a real `grace serve` process: rejected publishes never cost the last
good version (a restart still serves), a hand-corrupted CURRENT falls back to the newest
valid version at start-up, and damaging the served files does not reach the server."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from contracts.index_validation import IndexValidationError
from index_builder.build import build_index
from index_builder.publish import (
    CURRENT,
    VALID_MARKER,
    current_version,
    list_versions,
    new_version_name,
)
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.indexes import corrupt_builds, flip_byte
from tests.helpers.server_process import ServerProcess
from tests.helpers.server_process import serving as serve_process
from tests.helpers.serving import make_serving_data


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("faults"))


@pytest.fixture
def root(data: Path, tmp_path: Path) -> Path:
    """A private copy of the served index root (one valid version, CURRENT on it)."""
    shutil.copytree(data / "index", tmp_path / "index")
    return tmp_path / "index"


def build(data: Path, root: Path) -> str:
    """`grace build-index` of the served world's catalog into `root`; the new version."""
    catalog, tokenizer = data / "world" / "catalog.parquet", data / "model" / "tokenizer"
    version, _ = build_index(catalog, root, tokenizer_path=tokenizer, progress=False)
    return version


def retrieve(server: ServerProcess, data: Path, user: int = 0) -> retrieval_pb2.RetrieveResponse:
    with grpc.insecure_channel(server.target) as ch:
        stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
        req = request_for_user(data / "world", user, 20, retrieval_pb2.CD_GTM)
        return stub.Retrieve(req, timeout=30)


@contextmanager
def serving(data: Path, root: Path, log_path: Path) -> Iterator[ServerProcess]:
    """A `grace serve` process on `root`, SERVING; stopped (SIGTERM) on exit."""
    with serve_process(data, log_path, index_root=root) as server:
        yield server


def test_rejected_publishes_keep_the_last_good_version_across_a_restart(
    data: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three builds whose written index is corrupt, with the default keep=3: none is
    published, the good version stays on disk and CURRENT, and a restart serves it."""
    good = current_version(root)
    with serving(data, root, tmp_path / "first.log") as server:
        assert retrieve(server, data).index_version == good
        corrupt_builds(monkeypatch, "trie.bloom_table.npy")
        for _ in range(3):
            with pytest.raises(IndexValidationError, match="checksum mismatch"):
                build(data, root)
        assert current_version(root) == good and list_versions(root) == [good]
        assert retrieve(server, data).index_version == good
    with serving(data, root, tmp_path / "restart.log") as server:
        reply = retrieve(server, data)
        assert reply.index_version == good and len(reply.ads) > 0


def test_a_hand_corrupted_current_restarts_on_the_newest_valid_version(
    data: Path, root: Path, tmp_path: Path
) -> None:
    """CURRENT pointed by hand at a corrupt copy: the server still starts, serves the
    newest valid version and says so in its log."""
    oldest = current_version(root)
    newest = build(data, root)
    corrupt = new_version_name()  # a newer name, as a hand copy would get
    shutil.copytree(root / newest, root / corrupt)
    (root / corrupt / VALID_MARKER).unlink()
    manifest = json.loads((root / corrupt / "manifest.json").read_text())
    (root / corrupt / "manifest.json").write_text(json.dumps(manifest | {"index_version": corrupt}))
    flip_byte(root / corrupt / "ads.ad_ids.npy")
    (root / CURRENT).write_text(corrupt + "\n")
    assert list_versions(root) == [oldest, newest, corrupt]
    with serving(data, root, tmp_path / "server.log") as server:
        reply = retrieve(server, data)
        assert reply.index_version == newest and len(reply.ads) > 0
        log = server.log_text()
    said = [line for line in log.splitlines() if f"CURRENT names {corrupt}" in line]
    assert len(said) == 1, log
    assert "checksum mismatch" in said[0] and f"serving {newest}" in said[0]


def _truncate(path: Path) -> None:
    os.truncate(path, 0)


def _garbage(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # in place: the same inode a memory map would share
        fh.write(os.urandom(size))


@pytest.mark.parametrize("damage", [_truncate, _garbage], ids=["truncated", "overwritten"])
def test_damaging_the_served_files_does_not_reach_the_server(
    data: Path, root: Path, tmp_path: Path, damage
) -> None:
    version = current_version(root)
    with serving(data, root, tmp_path / "server.log") as server:
        before = [retrieve(server, data, u) for u in range(4)]
        for path in (root / version).glob("*.npy"):
            damage(path)
        after = [retrieve(server, data, u) for u in range(4)]
        assert server.proc.poll() is None, server.log_text()
    for b, a in zip(before, after, strict=True):
        assert a.index_version == version and len(a.ads) > 0
        assert [x.ad_id for x in a.ads] == [x.ad_id for x in b.ads]


def test_with_no_valid_version_start_up_fails_naming_each_version_and_why(
    data: Path, root: Path
) -> None:
    """Every version on disk damaged: `grace serve` exits non-zero at once with one line
    that names each version and why it was refused — no traceback, no crash loop of
    guesses."""
    import subprocess
    import sys

    older = current_version(root)
    newer = build(data, root)
    for version in (older, newer):
        flip_byte(root / version / "ads.ad_ids.npy")
    cmd = [sys.executable, "-m", "cli", "serve", "--data-dir", str(data), "--index-root",
           str(root), "--port", "0", "--metrics-port", "0", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("grace serve: error")]
    assert len(errors) == 1, done.stderr
    assert f"no model and index under {data / 'model'} and {root} that serve together" in errors[0]
    assert f"indexes: {newer} (named by CURRENT) was rejected" in errors[0]
    assert f"; {older}: " in errors[0] and errors[0].count("checksum mismatch") == 2
    assert "Traceback" not in done.stderr
