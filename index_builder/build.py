"""Index build: catalog -> SIDs -> trie, matchers, SID -> ad and targeting indexes -> a
published version (docs/ARCHITECTURE.md §3-4). `grace build-index` and the sidecar call
`build_index`; training, tests and benchmarks call `build_arrays` on an in-memory catalog.
The build's phases stay in order in this one module (SIDs, the sorted catalog, Blooms,
arrays, publish), past the house's ~300 lines; the catalog, the Blooms, the trie, k-way,
the bad rows and the publish protocol are modules of their own. At paper scale the build
frees each large input once used (the embeddings once RQ-encoded, the catalog in input
order column by column as it is sorted, the arrays once written), and `build_index` has
the allocators return freed memory at once, so its peak stays near one copy of the
catalog and the index (`build_index`'s figures).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from contracts import sid_space as sid_spaces
from contracts.index_arrays import AdArrays, IndexArrays, SetArrays
from contracts.index_format import SID_LENGTH, VOCAB_SIZE, write_index_dir
from contracts.index_validation import validate_index
from contracts.targeting_codec import Ragged
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder import parallel
from index_builder.bad_rows import REJECTS, write_rejects
from index_builder.blooms import ad_blooms as ad_blooms  # re-exported: its old home
from index_builder.blooms import index_blooms, leaf_blooms
from index_builder.catalog import Catalog, SetRules, read_catalog, source_fingerprint
from index_builder.kway import KwaySpec, build_partitions
from index_builder.publish import publish
from index_builder.trie import build_trie, leaf_runs, storage_stats, trie_of_leaves

if TYPE_CHECKING:
    from index_builder.tokenizer import SIDTokenizer

log = logging.getLogger("grace.index_builder")
NO_TOKENIZER = "none: SIDs taken from the catalog"
# glibc's malloc maps blocks of this many bytes and more on their own and unmaps them when
# freed; its default (128 KiB, rising to 32 MiB as such blocks are freed) leaves most of a
# paper-scale build's freed arrays in a heap the process keeps
MMAP_THRESHOLD = 64 << 10
# ... and while publishing, glibc's own ceiling: validation's block temporaries are reused
# from the heap, not mapped afresh (half its time), and the arrays it frees were mapped
PUBLISH_MMAP_THRESHOLD = 32 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc <malloc.h>)


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
    rejected_rows: int = 0  # bad catalog rows left out (a bad-row budget)

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
    tokenizer = _tokenizer_for(catalog, tokenizer, has)
    if has.any():
        new, report = tokenizer.assign(
            catalog.embedding[~has], reserved=catalog.sid[has], device=device, workers=workers
        )
        sid = catalog.sid.astype(np.int64)
        sid[~has] = new
    else:  # no copy of a 30 M-row embedding matrix just to select every row
        new, report = tokenizer.assign(catalog.embedding, device=device, workers=workers)
        sid = new.astype(np.int64)  # made once the tokenizer's own arrays are freed
    return sid, report.summary()


def _tokenizer_for(
    catalog: Catalog, tokenizer: SIDTokenizer | None, has: np.ndarray
) -> SIDTokenizer:
    """`tokenizer`, if it can compute the SIDs the ads lack (`has`: bool [N]) from their
    embeddings; else BuildError."""
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
    return tokenizer


def _assign_handed(
    held: list[Catalog], tokenizer: SIDTokenizer | None, device: str, workers: int | None
) -> tuple[Catalog, np.ndarray, str]:
    """`assign_sids` of held = [catalog], emptied here: the catalog without its embeddings,
    the SIDs (int [N, 4]) and the tokenizer's summary. When every ad needs a SID (the
    paper-scale case) the embeddings, most of the catalog's bytes (128 per ad at dim 32),
    are handed to `SIDTokenizer.assign`, which frees them once RQ-encoded."""
    catalog = held.pop()
    has = catalog.has_sid
    if tokenizer is None or has.any():
        sids, summary = assign_sids(catalog, tokenizer, device=device, workers=workers)
        return dataclasses.replace(catalog, embedding=None), sids, summary
    tokenizer = _tokenizer_for(catalog, tokenizer, has)
    handed = [catalog.embedding]
    catalog = dataclasses.replace(catalog, embedding=None)
    sids, report = tokenizer.assign(handed, device=device, workers=workers)
    return catalog, sids, report.summary()


@contextmanager
def _returning_freed_memory() -> Iterator[None]:
    """Inside, memory the build frees leaves the process at once, so that its peak RSS is
    what it holds, not what allocators keep: glibc's malloc maps blocks from
    MMAP_THRESHOLD bytes on their own (`_mmap_threshold`; PUBLISH_MMAP_THRESHOLD from
    publishing on, and after), and Arrow allocates through it (its default pool, mimalloc
    or jemalloc, caches freed memory; restored on the way out)."""
    _mmap_threshold(MMAP_THRESHOLD)
    pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(pool)
        _mmap_threshold(PUBLISH_MMAP_THRESHOLD)


def _mmap_threshold(nbytes: int) -> None:
    """glibc's malloc maps blocks of `nbytes` and more on their own, unmapped when freed
    (`mallopt`, process-wide; nothing with another C library)."""
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or no such name
        glibc = ""
    if glibc.startswith("glibc"):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes)


def _sorted_catalog(held: list[Any], order: np.ndarray, workers: int) -> Catalog:
    """The rows of held = [catalog, sids] (emptied here; `sids` int32 [N, 4] in catalog
    order becomes the `sid` column) in the order of the permutation `order`, gathered by
    `workers` threads, without the embeddings (the build needs none once SIDs exist).
    Column by column, each input column let go once gathered: with no other reference
    held, the build holds one copy of the catalog and one column, not two copies."""
    sids = held.pop()
    catalog = held.pop()
    columns = {f.name: getattr(catalog, f.name) for f in dataclasses.fields(catalog)}
    del catalog
    columns["sid"] = parallel.take(sids, order, workers)
    del sids
    columns["embedding"] = None

    def take_lists(lists: Ragged) -> Ragged:
        offsets, flat = parallel.take_segments(lists.offsets, order)
        return Ragged(offsets, parallel.take(lists.values, flat, workers))

    for name in ("ad_id", "bitmask", "campaign", "advertiser", "exclude_bitmask"):
        if columns[name] is not None:
            columns[name] = parallel.take(columns[name], order, workers)
    unsorted = dict(columns["sets"])  # the catalog's own dict stays as it was
    columns["sets"] = sets = {}
    for name in list(unsorted):
        s = unsorted.pop(name)
        sets[name] = SetRules(take_lists(s.include), None if s.exclude is None else
                              take_lists(s.exclude), s.vocabulary)  # fmt: skip
        del s
    return Catalog(**columns)


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
    return _build_handed([catalog, sids], kway, report, should_stop, workers)


def _build_handed(
    held: list[Any],
    kway: KwaySpec | None,
    report: BuildReport | None,
    should_stop: Callable[[], bool],
    workers: int | None,
) -> IndexArrays:
    """`build_arrays` of `held` = [catalog, sids], emptied here: once the caller holds no
    other reference, the catalog in input order and its SIDs are freed as soon as they are
    sorted (`build_index` hands them over; at 30 M ads each copy is gigabytes)."""
    report = report if report is not None else BuildReport()
    workers = parallel.default_workers() if workers is None else workers
    t = time.perf_counter()
    # ads sorted by SID, ties in catalog order (a stable sort)
    keys = parallel.digit_keys(held[1], VOCAB_SIZE)
    order = parallel.stable_argsort(keys, SID_LENGTH * (VOCAB_SIZE - 1).bit_length())
    del keys
    held[1] = held[1].astype(np.int32, copy=False)  # tokens < VOCAB_SIZE: half of int64's
    cat = _sorted_catalog(held, order, workers)
    del order
    leaf_ad_offsets, leaf_sids = leaf_runs(cat.sid)
    leaf_first_ad = leaf_ad_offsets[:-1]
    leaf_bm = parallel.or_reduceat(cat.bitmask, leaf_first_ad, workers)
    leaf_bl = leaf_blooms(cat.schema, {k: s.include for k, s in cat.sets.items()},
                          {k: list(s.vocabulary) for k, s in cat.sets.items()},
                          leaf_first_ad, workers)  # fmt: skip
    t = report.phase("encode", t)
    built = trie_of_leaves(leaf_ad_offsets, leaf_sids, leaf_bm, leaf_bl, workers)
    del leaf_ad_offsets, leaf_first_ad, leaf_sids, leaf_bm, leaf_bl
    t = report.phase("trie", t)
    if should_stop():
        raise BuildCancelled("stopped before k-way partitioning")
    partitions = None
    if kway is not None:
        partitions, report.kway_levels = build_partitions(built, kway, cat.schema)
        t = report.phase("kway", t)
    ads = AdArrays(
        leaf_sids=built.leaf_sids,
        leaf_ad_offsets=built.leaf_ad_offsets,
        ad_ids=cat.ad_id.astype(np.int64, copy=False),
        ad_bitmask=cat.bitmask,
        sets={k: SetArrays.from_strings(s.include, s.exclude, list(s.vocabulary))
              for k, s in cat.sets.items()},
        ad_campaign_ids=cat.campaign,
        ad_advertiser_ids=cat.advertiser,
        ad_exclude_bitmask=cat.exclude_bitmask,
    )  # fmt: skip
    report.levels = storage_stats(built, cat.schema, workers)
    trie = built.trie
    report.counts.update(
        ads=cat.n,
        sids=len(built.leaf_sids),
        nodes=trie.num_nodes,
        child_entries=trie.num_entries,
        bitmask_rows=len(trie.bitmask_table),
        bloom_rows=len(trie.bloom_table),
        **{f"{k}_values": len(s.vocabulary) for k, s in cat.sets.items()},
        matcher_table_bytes=trie.bitmask_table.nbytes + trie.bloom_table.nbytes,
    )
    report.phase("stats", t)
    return IndexArrays(trie=built.trie, ads=ads, kway=partitions)


def with_partitions(
    arrays: IndexArrays, spec: KwaySpec, schema: TargetingSchema = DEFAULT
) -> IndexArrays:
    """The same index with k-way partitions added, rebuilt from its own ad arrays (for
    studies comparing partitionings of one published index without its catalog)."""
    ads = arrays.ads
    sids = np.repeat(ads.leaf_sids.astype(np.int64), np.diff(ads.leaf_ad_offsets), axis=0)
    built = build_trie(sids, ads.ad_bitmask, index_blooms(ads, schema))
    partitions, _ = build_partitions(built, spec, schema)
    return IndexArrays(trie=built.trie, ads=ads, kway=partitions)


@_returning_freed_memory()
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
    schema: TargetingSchema = DEFAULT,
    bad_row_budget: float = 0.0,
    catalog_seq: int | None = None,
    source: str | None = None,
    fingerprint: str | None = None,
) -> tuple[str, BuildReport]:
    """Read, build, validate in full (`validate_index`: raises IndexValidationError and
    publishes nothing) and atomically publish one index version; returns (version, report).
    `device`: the torch device computing SIDs from embeddings ("cuda" at paper scale);
    `workers`: CPU threads for SIDs and the build (None: every CPU); `schema`: the
    targeting schema the catalog is read and the index encoded by (stored in it);
    `bad_row_budget`: the share of bad rows left out rather than failing the build
    (`read_catalog`), each written to `<out_root>/catalog-rejects.jsonl` once it publishes
    and counted in the manifest (`catalog.rejected_rows`) and the report. A snapshot of a
    database (`postgres_source.snapshot`) passes its `catalog_seq` (the last change it
    holds: the change feed goes on after it), `source` and `fingerprint`.

    Memory: a paper-world catalog (dim-32 embeddings, SIDs from the tokenizer) peaks at
    ~220 bytes of RSS per ad above the process's baseline at 10 M and 30 M ads — the
    catalog as read (~195: 128 of them embeddings) plus its enum rules until the bitmask
    is made, or plus the RQ codes while SIDs are assigned; 30 M ads peak at 6.4 GiB in
    all (the target: 8 GiB). The build before peaked at ~430 per ad at 10 M (10.4 GiB at
    30 M even with the allocators set from the environment)."""
    if tokenizer_path and sid_space:
        raise BuildError("give a SID tokenizer or a SID space name, not both")
    named_space = sid_spaces.named(sid_space) if sid_space else None
    report = BuildReport()
    t0 = t = time.perf_counter()
    fingerprint = fingerprint or source_fingerprint(catalog_path, schema)
    catalog = read_catalog(
        catalog_path, progress=progress, schema=schema, bad_row_budget=bad_row_budget
    )
    rejected = catalog.rejected
    report.rejected_rows = len(rejected)
    t = report.phase("read", t)
    tokenizer = None
    if tokenizer_path:
        from index_builder.tokenizer import SIDTokenizer  # torch: only when needed

        tokenizer = SIDTokenizer.load(Path(tokenizer_path))
    held: list[Any] = [catalog]  # handed over: the embeddings are freed once encoded
    del catalog
    catalog, sids, report.collisions = _assign_handed(held, tokenizer, device, workers)
    t = report.phase("tokenize", t)
    if should_stop():
        raise BuildCancelled("stopped before building the trie")
    held = [catalog, sids]  # handed over: freed once sorted
    del catalog, sids
    unwritten = [_build_handed(held, kway, report, should_stop, workers)]
    t = time.perf_counter()
    # the SID space (contracts/sid_space.py): the tokenizer's, the team's name, or legacy
    tokenizer_fingerprint = tokenizer.fingerprint if tokenizer else named_space or NO_TOKENIZER

    def write(directory: Path, version: str) -> None:
        if should_stop():
            raise BuildCancelled("stopped before publishing")
        write_index_dir(
            directory,
            unwritten.pop(),  # freed once written: validation reads the files back
            {
                "index_version": version,
                "created": datetime.now(UTC).isoformat(),
                "tokenizer_fingerprint": tokenizer_fingerprint,
                "catalog": {
                    "source": source or str(catalog_path),
                    "fingerprint": fingerprint,
                    "rejected_rows": len(rejected),
                    **({} if catalog_seq is None else {"seq": catalog_seq}),
                },
                "kway": kway.to_manifest() if kway else None,
                "counts": report.counts,
                "build": {
                    "seconds": report.seconds,
                    "levels": report.levels,
                    "kway_levels": report.kway_levels,
                    "collisions": report.collisions,
                },
            },
            schema,
        )

    def check(directory: Path, version: str) -> None:
        started = time.perf_counter()
        validate_index(directory, expect_tokenizer=tokenizer_fingerprint, expect_version=version)
        report.seconds["validate"] = round(time.perf_counter() - started, 3)

    _mmap_threshold(PUBLISH_MMAP_THRESHOLD)
    version = publish(Path(out_root), write, keep=keep, check=check)
    write_rejects(Path(out_root) / REJECTS, rejected)
    if rejected:
        log.warning("index %s left out %d bad catalog rows (within the bad-row budget of "
                    "%.2f%%), listed in %s; the first: %s", version, len(rejected),
                    100 * bad_row_budget, Path(out_root) / REJECTS, rejected[0])  # fmt: skip
    report.phase("write", t)
    report.seconds["total"] = round(time.perf_counter() - t0, 3)
    counts = " ".join(f"{k}={v}" for k, v in report.counts.items())
    log.info("published index %s: %s; seconds %s", version, counts, report.seconds)
    return version, report
