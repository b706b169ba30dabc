"""Index build: catalog -> SIDs -> trie, matchers, SID -> ad and targeting indexes -> a
published version (docs/ARCHITECTURE.md §3-4). `grace build-index` and the sidecar call
`build_index`; training, tests and benchmarks call `build_arrays` on an in-memory catalog.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts import sid_space as sid_spaces
from contracts.index_format import SID_LENGTH, VOCAB_SIZE, AdArrays, IndexArrays, write_index_dir
from contracts.index_validation import validate_index
from contracts.targeting import BLOOM_WORDS, Ragged, ad_blooms, location_blooms
from index_builder import parallel
from index_builder.catalog import Catalog, catalog_fingerprint, read_catalog
from index_builder.kway import KwaySpec, build_partitions
from index_builder.publish import publish
from index_builder.trie import build_trie, storage_stats

if TYPE_CHECKING:
    from index_builder.tokenizer import SIDTokenizer

log = logging.getLogger("grace.index_builder")
NO_TOKENIZER = "none: SIDs taken from the catalog"


class BuildCancelled(RuntimeError):
    """The build was asked to stop (SIGTERM); nothing was published."""


class BuildError(ValueError):
    """The inputs cannot make an index (e.g. SIDs missing and no tokenizer given)."""


@dataclass
class BuildReport:
    """What a build did: counts, per-phase seconds and the paper Table 1/2 statistics."""

    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    levels: list[dict[str, Any]] = field(default_factory=list)
    kway_levels: list[dict[str, Any]] = field(default_factory=list)
    collisions: str = ""

    def phase(self, name: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[name] = round(now - start, 3)
        return now


def assign_sids(
    catalog: Catalog,
    tokenizer: SIDTokenizer | None,
    *,
    device: str = "cpu",
    workers: int | None = None,
) -> tuple[np.ndarray, str]:
    """SIDs for every ad: explicit ones kept, the rest from the tokenizer (computed on
    `device`, see `SIDTokenizer.assign`)."""
    has = catalog.has_sid
    if has.all():
        return catalog.sid.astype(np.int64), ""
    if tokenizer is None:
        raise BuildError(
            f"{catalog.source}: {int((~has).sum())} ads carry no sid; pass a SID tokenizer "
            "(grace train-tokenizer) to compute them from their embeddings"
        )
    if catalog.embedding is None or catalog.embedding.shape[1] != tokenizer.dim:
        dim = None if catalog.embedding is None else catalog.embedding.shape[1]
        raise BuildError(
            f"catalog embeddings have dim {dim}; the tokenizer expects {tokenizer.dim}"
        )
    sid = catalog.sid.astype(np.int64)
    if has.any():
        new, report = tokenizer.assign(
            catalog.embedding[~has], reserved=catalog.sid[has], device=device, workers=workers
        )
        sid[~has] = new
    else:  # no copy of a 30 M-row embedding matrix just to select every row
        new, report = tokenizer.assign(catalog.embedding, device=device, workers=workers)
        sid[:] = new
    return sid, report.summary()


def _sorted_catalog(catalog: Catalog, order: np.ndarray, workers: int) -> Catalog:
    """The catalog's rows in the order of the permutation `order`, gathered by `workers`
    threads, without the embeddings (the build needs none once SIDs exist)."""
    offsets, flat = parallel.take_segments(catalog.loc_offsets, order)

    def take(owners: np.ndarray | None) -> np.ndarray | None:
        return None if owners is None else parallel.take(owners, order, workers)

    return Catalog(
        ad_id=parallel.take(catalog.ad_id, order, workers),
        sid=parallel.take(catalog.sid, order, workers),
        embedding=None,
        bitmask=parallel.take(catalog.bitmask, order, workers),
        loc_offsets=offsets,
        loc_ids=parallel.take(catalog.loc_ids, flat, workers),
        locations=catalog.locations,
        source=catalog.source,
        campaign=take(catalog.campaign),
        advertiser=take(catalog.advertiser),
    )


def _ad_blooms(cat: Catalog, workers: int) -> np.ndarray:
    """`targeting.ad_blooms` of every ad: uint64 [N, BLOOM_WORDS], rows split over threads."""
    vocab = location_blooms(list(cat.locations))
    out = np.empty((cat.n, BLOOM_WORDS), dtype=np.uint64)

    def part(lo: int, hi: int) -> None:
        off = cat.loc_offsets[lo : hi + 1]
        rows = Ragged(off - off[0], cat.loc_ids[off[0] : off[-1]])
        out[lo:hi] = ad_blooms(rows, vocab)

    parallel.run(part, parallel.ranges(cat.n, workers), workers)
    return out


def build_arrays(
    catalog: Catalog,
    sids: np.ndarray,  # int [N, 4], one SID per catalog row
    kway: KwaySpec | None = None,
    report: BuildReport | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    workers: int | None = None,
) -> IndexArrays:
    """All index arrays for a validated catalog and its SIDs; `workers` threads (None:
    every CPU) share the gathers, subtree ORs and hashing, and the arrays are the same for
    any count."""
    report = report if report is not None else BuildReport()
    workers = parallel.default_workers() if workers is None else workers
    t = time.perf_counter()
    # ads sorted by SID, ties in catalog order (a stable sort)
    keys = parallel.digit_keys(sids, VOCAB_SIZE)
    order = parallel.stable_argsort(keys, SID_LENGTH * (VOCAB_SIZE - 1).bit_length())
    cat, sids = _sorted_catalog(catalog, order, workers), parallel.take(sids, order, workers)
    del order
    ad_bloom = _ad_blooms(cat, workers)
    t = report.phase("encode", t)
    built = build_trie(sids, cat.bitmask, ad_bloom, workers)
    del sids, ad_bloom
    t = report.phase("trie", t)
    if should_stop():
        raise BuildCancelled("stopped before k-way partitioning")
    partitions = None
    if kway is not None:
        partitions, report.kway_levels = build_partitions(built, kway)
        t = report.phase("kway", t)
    vocab = [s.encode("utf-8") for s in cat.locations]
    vocab_offsets = np.zeros(len(vocab) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in vocab], out=vocab_offsets[1:])
    ads = AdArrays(
        leaf_sids=built.leaf_sids,
        leaf_ad_offsets=built.leaf_ad_offsets,
        ad_ids=cat.ad_id.astype(np.int64),
        ad_bitmask=cat.bitmask,
        ad_loc_offsets=cat.loc_offsets.astype(np.int64),
        ad_loc_ids=cat.loc_ids.astype(np.int32),
        loc_vocab_offsets=vocab_offsets,
        loc_vocab_bytes=np.frombuffer(b"".join(vocab), dtype=np.uint8),
        ad_campaign_ids=cat.campaign,
        ad_advertiser_ids=cat.advertiser,
    )
    report.levels = storage_stats(built, workers)
    trie = built.trie
    report.counts.update(
        ads=cat.n,
        sids=len(built.leaf_sids),
        nodes=trie.num_nodes,
        child_entries=trie.num_entries,
        bitmask_rows=len(trie.bitmask_table),
        bloom_rows=len(trie.bloom_table),
        locations=len(vocab),
        matcher_table_bytes=trie.bitmask_table.nbytes + trie.bloom_table.nbytes,
    )
    report.phase("stats", t)
    return IndexArrays(trie=built.trie, ads=ads, kway=partitions)


def with_partitions(arrays: IndexArrays, spec: KwaySpec) -> IndexArrays:
    """The same index with k-way partitions added, rebuilt from its own ad arrays (for
    studies comparing partitionings of one published index without its catalog)."""
    ads = arrays.ads
    sids = np.repeat(ads.leaf_sids.astype(np.int64), np.diff(ads.leaf_ad_offsets), axis=0)
    vocab = location_blooms(ads.location_strings())
    built = build_trie(
        sids, ads.ad_bitmask, ad_blooms(Ragged(ads.ad_loc_offsets, ads.ad_loc_ids), vocab)
    )
    partitions, _ = build_partitions(built, spec)
    return IndexArrays(trie=built.trie, ads=ads, kway=partitions)


def build_index(
    catalog_path: Path | str,
    out_root: Path | str,
    *,
    tokenizer_path: Path | str | None = None,
    kway: KwaySpec | None = None,
    keep: int = 3,
    progress: bool = True,
    should_stop: Callable[[], bool] = lambda: False,
    device: str = "cpu",
    workers: int | None = None,
    sid_space: str | None = None,
) -> tuple[str, BuildReport]:
    """Read, build, validate in full (`validate_index`: raises IndexValidationError and
    publishes nothing) and atomically publish one index version; returns (version, report).
    `device`: the torch device computing SIDs from embeddings ("cuda" at paper scale);
    `workers`: CPU threads for SIDs and the build (None: every CPU)."""
    if tokenizer_path and sid_space:
        raise BuildError("give a SID tokenizer or a SID space name, not both")
    named_space = sid_spaces.named(sid_space) if sid_space else None
    report = BuildReport()
    t0 = t = time.perf_counter()
    fingerprint = catalog_fingerprint(catalog_path)
    catalog = read_catalog(catalog_path, progress=progress)
    t = report.phase("read", t)
    tokenizer = None
    if tokenizer_path:
        from index_builder.tokenizer import SIDTokenizer  # torch: only when needed

        tokenizer = SIDTokenizer.load(Path(tokenizer_path))
    sids, report.collisions = assign_sids(catalog, tokenizer, device=device, workers=workers)
    t = report.phase("tokenize", t)
    if should_stop():
        raise BuildCancelled("stopped before building the trie")
    arrays = build_arrays(catalog, sids, kway, report, should_stop, workers)
    del catalog, sids
    t = time.perf_counter()
    # the SID space (contracts/sid_space.py): the tokenizer's, the team's name, or legacy
    tokenizer_fingerprint = tokenizer.fingerprint if tokenizer else named_space or NO_TOKENIZER

    def write(directory: Path, version: str) -> None:
        if should_stop():
            raise BuildCancelled("stopped before publishing")
        write_index_dir(
            directory,
            arrays,
            {
                "index_version": version,
                "created": datetime.now(UTC).isoformat(),
                "tokenizer_fingerprint": tokenizer_fingerprint,
                "catalog": {"source": str(catalog_path), "fingerprint": fingerprint},
                "kway": kway.to_manifest() if kway else None,
                "counts": report.counts,
                "build": {
                    "seconds": report.seconds,
                    "levels": report.levels,
                    "kway_levels": report.kway_levels,
                    "collisions": report.collisions,
                },
            },
        )

    def check(directory: Path, version: str) -> None:
        started = time.perf_counter()
        validate_index(directory, expect_tokenizer=tokenizer_fingerprint, expect_version=version)
        report.seconds["validate"] = round(time.perf_counter() - started, 3)

    version = publish(Path(out_root), write, keep=keep, check=check)
    report.phase("write", t)
    report.seconds["total"] = round(time.perf_counter() - t0, 3)
    counts = " ".join(f"{k}={v}" for k, v in report.counts.items())
    log.info("published index %s: %s; seconds %s", version, counts, report.seconds)
    return version, report
