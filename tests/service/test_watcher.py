"""Index hot swap: new versions are validated before they serve; bad ones never serve."""

from __future__ import annotations

from pathlib import Path

from index_builder.publish import current_path, publish
from service.serving_index import IndexHolder
from service.watcher import IndexWatcher
from tests.helpers.indexes import small_index, writer


def test_watcher_swaps_in_new_versions_and_rejects_bad_ones(tmp_path: Path) -> None:
    holder = IndexHolder()
    swapped, failed = [], []
    watcher = IndexWatcher(
        tmp_path, holder, tokenizer_fingerprint="test",
        on_swap=lambda i: swapped.append(i.version), on_failure=lambda v, e: failed.append(v),
    )  # fmt: skip
    assert not watcher.check_once()  # nothing published yet
    v1 = publish(tmp_path, writer(small_index(30)))
    assert watcher.check_once() and holder.current.version == v1
    assert not watcher.check_once()  # unchanged
    v2 = publish(tmp_path, writer(small_index(40)))
    assert watcher.check_once() and holder.current.version == v2
    assert holder.current.retrieval.arrays.ads.num_ads == 40

    v3 = publish(tmp_path, writer(small_index(50)))
    victim = current_path(tmp_path) / "trie.bloom_table.npy"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    assert not watcher.check_once()
    assert holder.current.version == v2  # the old index keeps serving
    assert not watcher.check_once() and watcher.failures == 1  # not retried

    v4 = publish(tmp_path, writer(small_index(20), tokenizer="another-model"))
    assert not watcher.check_once() and holder.current.version == v2
    assert swapped == [v1, v2] and failed == [v3, v4]
