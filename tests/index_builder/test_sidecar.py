"""The builder sidecar waits for a SID tokenizer that is not there yet (the server's first
start may still be training the model that owns it) instead of failing the catalog, and
survives a build whose written index fails validation."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from index_builder.catalog import read_catalog
from index_builder.publish import current_version
from index_builder.sidecar import BuilderConfig, run_builder
from index_builder.synth import generate_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from tests.helpers.indexes import corrupt_builds


def test_builder_waits_for_the_tokenizer_then_builds(tmp_path: Path) -> None:
    generate_world("tiny", 0, tmp_path / "world", progress=False)
    catalog = tmp_path / "world" / "catalog.parquet"
    tokenizer = tmp_path / "model" / "tokenizer"
    cfg = BuilderConfig(catalog=catalog, out=tmp_path / "index", interval=0.05,
                        tokenizer=tokenizer, max_builds=1)  # fmt: skip
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.update(stats=run_builder(cfg, stop)))
    thread.start()
    try:
        time.sleep(0.5)  # several checks without a tokenizer
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
