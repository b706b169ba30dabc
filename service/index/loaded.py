"""One loaded index version: everything a batch reads from it (docs/ARCHITECTURE.md §3).
The rollout (`service/rollout/`) loads and validates it off the request path; the decode
plans made for it belong to the model runtime (`service/pipeline/runtime.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from contracts.index_format import IndexArrays
from contracts.index_validation import validate_index
from contracts.targeting_schema import DEFAULT, SchemaError, TargetingSchema
from contracts.tensors import GtmTables
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

    @cached_property
    def schema(self) -> TargetingSchema:
        """The targeting schema the index was built with (the default for an index built
        in memory without a manifest)."""
        stored = self.manifest.get("targeting")
        return DEFAULT if stored is None else TargetingSchema.from_manifest(stored)

    @property
    def blockable(self) -> tuple[str, ...]:
        """The request block lists this index can apply (`PostStage.blockable`)."""
        return self.post.blockable

    @property
    def sid_space(self) -> str:
        """The SID space the index was built for (contracts/sid_space.py); "" for an
        index built in memory without one."""
        return str(self.manifest.get("tokenizer_fingerprint", ""))

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
        """Prepare validated arrays (or arrays built in memory, as tests do); a manifest's
        targeting schema that cannot be read is a SchemaError here, before it serves."""
        stored = (manifest or {}).get("targeting")
        schema = DEFAULT if stored is None else TargetingSchema.from_manifest(stored)
        if schema != DEFAULT:  # the exact stage and the user features read the default's
            raise SchemaError("an index of a targeting schema of its own cannot serve yet: "
                              "this server serves the default one (docs/FORMAT.md §1)")  # fmt: skip
        families = schema.family_words
        return cls(
            version=version,
            path=path,
            manifest=manifest or {},
            arrays=arrays,
            tables=GtmTables.from_arrays(arrays.trie, arrays.kway, device, families=families),
            level_offsets=torch.from_numpy(arrays.trie.level_offsets.copy()),
            vocabulary=LocationVocabulary(arrays.ads),
            lookup=SidLookup.from_ads(arrays.ads),
            post=PostStage(arrays.ads),
        )


def load_index(
    path: Path,
    *,
    tokenizer_fingerprint: str | None = None,
    device: str = "cpu",
    expect_version: str | None = None,
) -> LoadedIndex:
    """Validate everything (raises IndexValidationError), then prepare the tables. The
    arrays are read into private memory, not memory-mapped, so the files on disk may be
    truncated, overwritten or removed while the version serves. `tokenizer_fingerprint`:
    the SID space it must be built for (None: any; the rollout checks each pair)."""
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
