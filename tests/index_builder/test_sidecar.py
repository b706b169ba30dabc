"""The builder sidecar waits for a SID tokenizer that is not there yet (the server's first
start may still be training the model that owns it) instead of failing the catalog, and
survives a build whose written index fails validation; it builds at start, not an
interval later. Following the model (`grace
builder --model`, real checkpoints in a real model repository): it waits for the first
model, builds for its SID space, builds again when a model of another SID space is
published (the coordinated rollout) but not for a model of the same space, and does not
retry a failed build until the catalog or the model's SID space changes."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cli import build_parser
from cli.builder import model_sids
from contracts.index_manifest import read_manifest
from index_builder import sidecar
from index_builder.catalog import read_catalog
from index_builder.publish import current_path, current_version
from index_builder.sidecar import BuilderConfig, SidChoice, run_builder
from index_builder.synth import generate_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from service.model.checkpoint import CONFIG_FILE, TOKENIZER_DIR, save_checkpoint
from service.model.config import PROFILES
from service.model.repository import publish_model
from service.model.retriever import GenerativeRetriever
from tests.helpers.indexes import corrupt_builds, running_builder


def test_builder_waits_for_the_tokenizer_then_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generate_world("tiny", 0, tmp_path / "world", progress=False)
    catalog = tmp_path / "world" / "catalog.parquet"
    tokenizer = tmp_path / "model" / "tokenizer"
    cfg = BuilderConfig(catalog=catalog, out=tmp_path / "index", interval=0.05,
                        tokenizer=tokenizer, max_builds=1)  # fmt: skip
    checks = []  # one catalog fingerprint a check: the checks counted, not timed
    fingerprint = sidecar.source_fingerprint
    monkeypatch.setattr(sidecar, "source_fingerprint",
                        lambda *a: (checks.append(1), fingerprint(*a))[1])  # fmt: skip
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.update(stats=run_builder(cfg, stop)))
    thread.start()
    try:
        _wait(lambda: len(checks) > 3)  # several checks without a tokenizer
        assert current_version(tmp_path / "index") is None
        emb = read_catalog(catalog, progress=False).embedding
        tok = SIDTokenizer.train(emb, TokenizerConfig(codebook_size=16, iterations=3),
                                 progress=False)  # fmt: skip
        tok.save(tokenizer)
        thread.join(timeout=120)
    finally:
        stop.set()
        thread.join()
    stats = result["stats"]
    assert stats.builds == 1 and stats.failures == 0  # waiting was not a failure
    assert stats.checks > 2
    assert current_version(tmp_path / "index") is not None


def _write_catalog(path: Path, n: int) -> None:
    rows = [{"ad_id": 10 + i, "sid": [i % 3, i % 5, i, 0]} for i in range(n)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tmp.replace(path)


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_build_refused_by_validation_is_logged_and_the_builder_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.builder")
    catalog, root = tmp_path / "catalog.jsonl", tmp_path / "index"
    _write_catalog(catalog, 20)
    corrupt_builds(monkeypatch, "trie.node_offsets.npy")
    cfg = BuilderConfig(catalog=catalog, out=root, interval=0.05, max_builds=1)
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.update(stats=run_builder(cfg, stop)))
    thread.start()
    try:
        _wait(lambda: any("build failed" in r.getMessage() for r in caplog.records))
        assert thread.is_alive() and current_version(root) is None
        monkeypatch.undo()  # the builder is fixed; the next catalog change builds
        _write_catalog(catalog, 25)
        thread.join(timeout=60)
    finally:
        stop.set()
        thread.join()
    stats = result["stats"]
    assert stats.builds == 1 and stats.failures == 1
    assert current_version(root) is not None
    refused = [r.getMessage() for r in caplog.records if "build failed" in r.getMessage()]
    assert len(refused) == 1 and "checksum mismatch" in refused[0] and "\n" not in refused[0]


# ---- following the model (`grace builder --model`) ----


class Counted:
    """`BuilderConfig.sids` of a model path, counting the sidecar's checks."""

    def __init__(self, model: Path) -> None:
        self.inner, self.calls = model_sids(model), 0

    def __call__(self) -> SidChoice | None:
        self.calls += 1
        return self.inner()

    def checks_pass(self, n: int = 3) -> None:
        """Wait until `n` more checks ran: the one in progress now has finished."""
        start = self.calls
        _wait(lambda: self.calls >= start + n)


@pytest.fixture(scope="module")
def tokenizer() -> SIDTokenizer:
    emb = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    return SIDTokenizer.train(emb, TokenizerConfig(codebook_size=4, iterations=2),
                              progress=False)  # fmt: skip


def _checkpoint(out: Path, seed: int, tokenizer: SIDTokenizer | None = None,
                sid_space: str | None = None) -> Path:  # fmt: skip
    """An untrained tiny model of `tokenizer`'s SID space or of a named one."""
    torch.manual_seed(seed)
    save_checkpoint(GenerativeRetriever(PROFILES["tiny"]), tokenizer, out, sid_space=sid_space)
    return out


def _index(root: Path) -> dict[str, Any]:
    path = current_path(root)
    return {} if path is None else read_manifest(path)


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_first_build_is_at_start_not_an_interval_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`grace builder --interval 3600`: a catalog without an index is published at once; a
    restart beside an index of the same catalog says so at once and builds nothing."""
    caplog.set_level(logging.INFO, logger="grace.builder")
    catalog, root = tmp_path / "catalog.jsonl", tmp_path / "index"
    _write_catalog(catalog, 20)
    cfg = BuilderConfig(catalog=catalog, out=root, interval=3600.0)
    with running_builder(cfg) as first:
        _wait(lambda: current_version(root) is not None)  # the first tick is an hour away
    with running_builder(cfg) as second:
        _wait(lambda: bool(_messages(caplog, "is up to date")))
    assert first["stats"].builds == 1 and second["stats"].builds == 0


def test_builder_follows_the_model_repository_into_a_new_sid_space(
    tmp_path: Path, tokenizer: SIDTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.builder")
    catalog, index, models = tmp_path / "catalog.jsonl", tmp_path / "index", tmp_path / "models"
    _write_catalog(catalog, 30)  # SIDs of its own: builds for a tokenizer or a named space
    sids = Counted(models)
    with running_builder(
        BuilderConfig(catalog=catalog, out=index, interval=0.01, sids=sids)
    ) as result:
        sids.checks_pass(5)  # nothing published yet: waited for, logged once
        assert current_version(index) is None
        assert len(_messages(caplog, "waiting for a model")) == 1

        publish_model(_checkpoint(tmp_path / "a", 0, tokenizer), models)
        _wait(lambda: current_version(index) is not None)
        first = _index(index)
        assert first["tokenizer_fingerprint"] == tokenizer.fingerprint

        publish_model(_checkpoint(tmp_path / "b", 1, tokenizer), models)  # same SID space
        sids.checks_pass()
        assert _index(index)["index_version"] == first["index_version"]

        publish_model(_checkpoint(tmp_path / "c", 2, sid_space="team-v2"), models)
        _wait(lambda: _index(index).get("tokenizer_fingerprint") == "sid-space:team-v2")
        assert _index(index)["catalog"] == first["catalog"]  # the same catalog, a new space
    stats = result["stats"]
    assert stats.builds == 2 and stats.failures == 0
    assert len(_messages(caplog, "differs from the index's")) == 1


def test_a_failed_build_waits_for_another_sid_space(
    tmp_path: Path,
    tokenizer: SIDTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="grace.builder")
    catalog, index, models = tmp_path / "catalog.jsonl", tmp_path / "index", tmp_path / "models"
    _write_catalog(catalog, 20)
    publish_model(_checkpoint(tmp_path / "a", 0, tokenizer), models)
    corrupt_builds(monkeypatch, "trie.node_offsets.npy")
    sids = Counted(models)
    with running_builder(
        BuilderConfig(catalog=catalog, out=index, interval=0.01, sids=sids)
    ) as result:
        _wait(lambda: bool(_messages(caplog, "build failed")))
        monkeypatch.undo()  # fixed, but (catalog, SID space) is the pair that failed
        publish_model(_checkpoint(tmp_path / "b", 1, tokenizer), models)  # same space
        sids.checks_pass()
        assert len(_messages(caplog, "build failed")) == 1 and current_version(index) is None

        publish_model(_checkpoint(tmp_path / "c", 2, sid_space="team-v2"), models)
        _wait(lambda: current_version(index) is not None)
        assert _index(index)["tokenizer_fingerprint"] == "sid-space:team-v2"
    stats = result["stats"]
    assert stats.builds == 1 and stats.failures == 1


def test_a_checkpoint_directory_is_followed_and_its_index_kept_until_the_catalog_changes(
    tmp_path: Path, tokenizer: SIDTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.builder")
    catalog, index, model = tmp_path / "catalog.jsonl", tmp_path / "index", tmp_path / "model"
    _write_catalog(catalog, 20)
    model.mkdir()
    (model / CONFIG_FILE).write_text("{")  # a broken checkpoint: logged once, waited for
    sids = Counted(model)
    with running_builder(
        BuilderConfig(catalog=catalog, out=index, interval=0.01, sids=sids)
    ) as result:
        sids.checks_pass()
        assert len(_messages(caplog, "cannot read the model's SID space")) == 1
        _checkpoint(model, 0, tokenizer)
        _wait(lambda: current_version(index) is not None)
    assert result["stats"].builds == 1 and result["stats"].failures == 0

    # an index for this catalog and the model's space is there: a restart builds nothing
    first = current_version(index)
    sids = Counted(model)
    with running_builder(
        BuilderConfig(catalog=catalog, out=index, interval=0.01, sids=sids)
    ) as result:
        sids.checks_pass()
        assert current_version(index) == first
        _write_catalog(catalog, 25)  # ... until the catalog changes
        _wait(lambda: current_version(index) != first)
    assert result["stats"].builds == 1
    assert _index(index)["tokenizer_fingerprint"] == tokenizer.fingerprint


def test_model_sids_reads_the_current_models_sid_space(
    tmp_path: Path, tokenizer: SIDTokenizer
) -> None:
    models = tmp_path / "models"
    assert model_sids(models)() is None
    publish_model(_checkpoint(tmp_path / "a", 0, tokenizer), models)
    choice = model_sids(models)()
    assert choice is not None and choice.key == tokenizer.fingerprint and choice.sid_space is None
    assert choice.tokenizer_path is not None and choice.tokenizer_path.name == TOKENIZER_DIR
    publish_model(_checkpoint(tmp_path / "b", 1, sid_space="team-v2"), models)
    assert model_sids(models)() == SidChoice(key="sid-space:team-v2", sid_space="team-v2")


def test_builder_model_flag_excludes_the_fixed_sid_sources(tmp_path: Path) -> None:
    base = ["builder", "--catalog", "c.parquet", "--out", "index"]
    assert build_parser().parse_args([*base, "--model", "/data/model"]).model == "/data/model"
    for fixed in (["--tokenizer", "t"], ["--sid-space", "s"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--model", "/data/model", *fixed])
    with pytest.raises(ValueError, match="not both"):
        BuilderConfig(catalog=tmp_path, out=tmp_path, tokenizer=tmp_path, sids=lambda: None)
