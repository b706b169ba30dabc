"""The builder sidecar waits for a SID tokenizer that is not there yet (the server's first
start may still be training the model that owns it) instead of failing the catalog."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from index_builder.catalog import read_catalog
from index_builder.publish import current_version
from index_builder.sidecar import BuilderConfig, run_builder
from index_builder.synth import generate_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig


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
