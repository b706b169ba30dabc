"""One loaded index version: everything a batch reads from it (docs/ARCHITECTURE.md §3).
The rollout (`service/rollout/`) loads and validates it off the request path; the decode
plans made for it belong to the model runtime (`service/pipeline/runtime.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contracts.index_arrays import IndexArrays
from contracts.index_manifest import manifest_schema
from contracts.index_validation import validate_index
from contracts.targeting import Targeting
from contracts.targeting_codec import RequestRules, TargetingError
from contracts.targeting_schema import DEFAULT, TargetingSchema
from contracts.tensors import GtmTables
from service.index.live import LiveEligibility, LiveState
from service.index.placed import DEFAULT_SPARE_ROWS, Placing
from service.index.prune import Pruning, Subtrees, with_spare_rows
from service.model.features import SidLookup
from service.post import PostRequest, PostResult, PostStage, Vocabulary, request_rules


@dataclass(frozen=True, eq=False)  # identity equality: a version is one object
class LoadedIndex:
    version: str
    path: Path
    manifest: dict[str, Any]
    arrays: IndexArrays  # the version's arrays in private host memory
    tables: GtmTables  # the trie's lookup tables on the compute device
    level_offsets: torch.Tensor  # int64 [sid_length + 2]: nodes of each trie depth
    schema: TargetingSchema  # the targeting schema it was built with
    # per set attribute: value string -> id (the post stage's exact rules)
    vocabularies: dict[str, Vocabulary]
    lookup: SidLookup  # ad id -> SID (stage 1: a user's history as SID tokens)
    post: PostStage  # the C++ post stage over this version's ad arrays
    live: LiveEligibility  # the live changes published over it, as applied so far
    pruning: Pruning  # its subtrees with no live ad, barred in `tables` (stage 3's)
    loaded_at: float = field(default_factory=time.time)

    def request_rules(self, targeting: Targeting) -> RequestRules:
        """A request's side of the exact test by this index's schema and vocabularies
        (`service.post.request_rules`), its blocks included."""
        return request_rules(targeting, self.schema, self.vocabularies)

    def post_request(
        self, leaves: np.ndarray, scores: np.ndarray, targeting: Targeting, max_ads: int
    ) -> PostRequest:
        """A request's generated leaves and its targeting as this index's post stage
        reads them (`request_rules`, `PostRequest.from_rules`)."""
        try:
            rules = self.request_rules(targeting)
        except TargetingError:  # checked against the index served before a swap, whose
            # schema read a value this one's does not (an enum value it dropped): no ads
            rules, leaves, scores = self.request_rules(Targeting()), leaves[:0], scores[:0]
        return PostRequest.from_rules(leaves, scores, rules, self.schema, max_ads)

    def answer(self, requests: Sequence[PostRequest], live: LiveState) -> list[PostResult]:
        """Stage 4's exact answer of a batch at one live state: the version's post stage,
        then the upserts served in place at that state merged in (placed.py). A request
        whose blocks this index cannot apply (it was checked against the index served
        then) gets no ads rather than one its block may bar."""
        requests = [r if self.post.applies(r) else dataclasses.replace(
            r, leaves=r.leaves[:0], scores=r.scores[:0]) for r in requests]  # fmt: skip
        posts = self.post.run(requests, live.not_live)
        if live.overlay is not None:
            posts = live.overlay.merge(requests, posts)
        return posts

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
        schema: TargetingSchema = DEFAULT,
        spare_rows: int = DEFAULT_SPARE_ROWS,
    ) -> LoadedIndex:
        """Prepare validated arrays (or arrays built in memory, as tests do, by `schema`:
        the default unless given); a manifest's targeting schema that cannot be read is an
        IndexFormatError here, before it serves. `spare_rows`: matcher rows per table for
        the upserts served in place (service/index/placed.py)."""
        if manifest is not None and "targeting" in manifest:
            schema = manifest_schema(manifest, path)
        families = schema.family_words
        order = np.argsort(arrays.ads.ad_ids)  # once, for the SID lookup and the live state
        lookup = SidLookup.from_ads(arrays.ads, order)
        # a zero matcher row in each table (where a subtree with no live ad points) and the
        # spare rows of the upserts served in place
        spare = 0 if arrays.kway is not None else spare_rows
        tables = GtmTables.from_arrays(with_spare_rows(arrays.trie, spare), arrays.kway, device,
                                       families=families)  # fmt: skip
        post = PostStage(arrays.ads, schema=schema)
        subtrees = Subtrees(arrays.trie, arrays.ads)
        kway = arrays.kway is not None
        return cls(
            version=version,
            path=path,
            manifest=manifest or {},
            arrays=arrays,
            tables=tables,
            level_offsets=torch.from_numpy(arrays.trie.level_offsets.copy()),
            schema=schema,
            vocabularies={a: Vocabulary(s.strings()) for a, s in arrays.ads.sets.items()},
            lookup=lookup,
            post=post,
            # an index root's version follows the segments published over it
            live=LiveEligibility(
                arrays.ads.ad_ids,
                version,
                path.parent if manifest is not None else None,
                _built_at(manifest),
                by_id=(order, lookup.ad_ids),
                subtrees=subtrees,
                placing=Placing(arrays.ads, arrays.trie, schema, post, subtrees, spare, kway=kway),
            ),
            pruning=Pruning(arrays.trie, tables, arrays.kway),
        )


def _built_at(manifest: dict[str, Any] | None) -> int:
    """The last live change a version was built with (`catalog.seq`; 0: none)."""
    seq = ((manifest or {}).get("catalog") or {}).get("seq", 0)
    return seq if isinstance(seq, int) and seq >= 0 else 0


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
    the SID space it must be built for (None: any; the rollout checks each pair). The live
    changes published over it so far are applied (`service/index/live.py`)."""
    index = validate_index(
        Path(path),
        expect_tokenizer=tokenizer_fingerprint,
        expect_version=expect_version,
        mmap=False,
    )
    loaded = LoadedIndex.from_arrays(
        index.arrays,
        device,
        version=index.manifest["index_version"],
        path=index.path,
        manifest=index.manifest,
    )
    loaded.live.catch_up()  # the changes published so far, before it serves
    return loaded
