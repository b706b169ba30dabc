"""One loaded index version — everything a batch reads from it — and the holder of the
current one (docs/ARCHITECTURE.md §3, §4).

The hot-swap watcher (`service/index/watcher.py`) loads and fully validates a new version
in the background (`load_index`), the compute stage prepares its decode plans for it, and
`IndexHolder.swap` makes it current between batches. A batch takes `IndexHolder.current`
once, when it is dispatched, and keeps that object to the end, so no batch ever mixes two
versions; an old version is freed when the last batch holding it finishes (plain
reference counting — nothing to release by hand). A `LoadedIndex` holds data only: the
decode engine's plans for it (CUDA graphs, static buffers) belong to the compute stage.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from contracts.index_format import IndexArrays
from contracts.tensors import GtmTables
from index_builder.validate import validate_index
from service.model.features import SidLookup
from service.post import LocationVocabulary, PostStage


@dataclass(frozen=True, eq=False)  # identity equality: a version is one object
class LoadedIndex:
    version: str
    path: Path
    manifest: dict[str, Any]
    arrays: IndexArrays  # the version's arrays in private host memory
    tables: GtmTables  # the trie's lookup tables on the compute device
    level_offsets: torch.Tensor  # int64 [sid_length + 2]: nodes of each trie depth
    vocabulary: LocationVocabulary  # location string -> id (the post stage's exact rules)
    lookup: SidLookup  # ad id -> SID (stage 1: a user's history as SID tokens)
    post: PostStage  # the C++ post stage over this version's ad arrays
    loaded_at: float = field(default_factory=time.time)

    @classmethod
    def from_arrays(
        cls,
        arrays: IndexArrays,
        device: str = "cpu",
        *,
        version: str = "in-memory",
        path: Path = Path(),
        manifest: dict[str, Any] | None = None,
    ) -> LoadedIndex:
        """Prepare validated arrays (or arrays built in memory, as tests do)."""
        return cls(
            version=version,
            path=path,
            manifest=manifest or {},
            arrays=arrays,
            tables=GtmTables.from_arrays(arrays.trie, arrays.kway, device),
            level_offsets=torch.from_numpy(arrays.trie.level_offsets.copy()),
            vocabulary=LocationVocabulary(arrays.ads),
            lookup=SidLookup.from_ads(arrays.ads),
            post=PostStage(arrays.ads),
        )


def load_index(
    path: Path,
    *,
    tokenizer_fingerprint: str | None,
    device: str = "cpu",
    expect_version: str | None = None,
) -> LoadedIndex:
    """Validate everything (raises IndexValidationError), then prepare the tables.

    The arrays are read into private memory, each file once with its checksum over the
    same bytes (`contracts/npy_private.py`), not memory-mapped: the files on disk may be
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
    return LoadedIndex.from_arrays(
        index.arrays,
        device,
        version=index.manifest["index_version"],
        path=index.path,
        manifest=index.manifest,
    )


class IndexHolder:
    """The current index; swaps are atomic with respect to `current`."""

    def __init__(self, index: LoadedIndex | None = None) -> None:
        self._lock = threading.Lock()
        self._index = index

    @property
    def current(self) -> LoadedIndex:
        with self._lock:
            if self._index is None:
                raise RuntimeError("no index loaded yet")
            return self._index

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._index is not None

    def swap(self, index: LoadedIndex) -> LoadedIndex | None:
        with self._lock:
            old, self._index = self._index, index
        return old
