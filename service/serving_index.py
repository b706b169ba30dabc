"""The index as the server holds it: one validated version, prepared for every stage.

The hot-swap watcher loads and fully validates a new version in the background
(`load_serving_index`), then `IndexHolder.swap` makes it current between batches. A
batch takes `IndexHolder.current` once, at stage 1, and keeps that object to the end, so
no batch ever mixes two versions; an old version is freed when the last batch holding it
finishes (plain reference counting — nothing to release by hand).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from index_builder.validate import validate_index
from service.decode.retrieve import RetrievalIndex
from service.decode.static_engine import StaticBeamSearch
from service.post import PostStage


@dataclass(frozen=True)
class ServingIndex:
    version: str
    path: Path
    manifest: dict[str, Any]
    retrieval: RetrievalIndex  # trie tables on the compute device, vocabulary, ad -> SID
    post: PostStage | None = None  # the C++ post stage over this index's ad arrays
    loaded_at: float = field(default_factory=time.time)
    # GPU only: the fixed-shape decode engine bound to these tables, its CUDA graphs
    # captured before the version serves (`Stages.prepare`); None on CPU.
    engine: StaticBeamSearch | None = None


def load_serving_index(
    path: Path,
    *,
    tokenizer_fingerprint: str | None,
    device: str = "cpu",
    expect_version: str | None = None,
) -> ServingIndex:
    """Validate everything (raises IndexValidationError), then prepare the tables.

    The arrays are read into private memory, each file once with its checksum over the
    same bytes (`index_builder/npy_private.py`), not memory-mapped: the files on disk may be
    truncated, overwritten or removed while the version serves without reaching it.
    `expect_version`: the version name the manifest must carry (the watcher passes the
    directory's name).
    """
    index = validate_index(
        Path(path),
        expect_tokenizer=tokenizer_fingerprint,
        expect_version=expect_version,
        mmap=False,
    )
    return ServingIndex(
        version=index.manifest["index_version"],
        path=index.path,
        manifest=index.manifest,
        retrieval=RetrievalIndex.from_arrays(index.arrays, device),
        post=PostStage(index.arrays.ads),
    )


class IndexHolder:
    """The current index; swaps are atomic with respect to `current`."""

    def __init__(self, index: ServingIndex | None = None) -> None:
        self._lock = threading.Lock()
        self._index = index
        self.swaps = 0

    @property
    def current(self) -> ServingIndex:
        with self._lock:
            if self._index is None:
                raise RuntimeError("no index loaded yet")
            return self._index

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._index is not None

    def swap(self, index: ServingIndex) -> ServingIndex | None:
        with self._lock:
            old, self._index = self._index, index
            self.swaps += 1
        return old
