"""Catalog input: read and validate an ad catalog into columns (docs/ARCHITECTURE.md §4).

Flow: catalog file(s) → Arrow columns (`catalog_parts.py`, `catalog_files.py`) → the
field checks of `catalog_columns.py`, run in order here → `Catalog` → `build.py`. The
targeting fields are the ones the targeting schema declares (`contracts/
targeting_schema.py`; the default's without one). Both formats go through the same
vectorised checks, so they accept and reject the same catalogs and give identical arrays;
bad input raises `CatalogError` (docs/DATA.md). Each Arrow column is let go as it is
converted, and the enum/bucket rules become the bitmask a block of ads at a time, so a
read peaks near the size of the `Catalog` it returns (~195 bytes per paper-world ad).
The reader's steps stay in order in this one module, a few lines past the house's ~300.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from contracts.data_format import CATALOG_FIELDS
from contracts.targeting_codec import Codec, Ragged, codec
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder import parallel
from index_builder.bad_rows import isolate, sub_source, take
from index_builder.catalog_columns import (
    Bad,
    ListColumn,
    ad_ids,
    check_elements,
    embeddings,
    first_true,
    list_column,
    owner_ids,
    rule_ids,
    set_rules,
    sids,
)
from index_builder.catalog_files import (
    SID_LEVELS,
    BadLines,
    CatalogError,
    Source,
    targeting_fields,
)
from index_builder.catalog_parts import catalog_files, read_parts
from index_builder.postgres_source import is_postgres, shown, table_seq

log = logging.getLogger("grace.catalog")


@dataclass(frozen=True)
class SetRules:
    """One set attribute's rules over the catalog's ads, as ids into `vocabulary`."""

    include: Ragged  # each ad's include list, sorted and deduplicated (empty = no rule)
    exclude: Ragged | None  # each ad's exclude list; None: no ad excludes
    vocabulary: np.ndarray  # object [V]: every value either names, sorted, unique


@dataclass(frozen=True)
class Catalog:
    """A validated catalog in columns, the index builder's input."""

    ad_id: np.ndarray  # int64 [N], unique, in input order
    sid: np.ndarray  # int32 [N, 4]; -1 rows where the ad carries no sid (read-only, and
    # no memory, when no row carries one: `catalog_columns.sids`)
    embedding: np.ndarray | None  # float32 [N, D]; None if no row has one; NaN rows where absent
    bitmask: np.ndarray  # uint64 [N, bitmask_words]: enum/bucket rules, exclusions folded in
    sets: dict[str, SetRules]  # per set attribute of `schema`
    source: str  # path read
    schema: TargetingSchema = DEFAULT  # the targeting schema it was read by
    ignored_fields: tuple[str, ...] = ()  # fields in the input the format does not know
    campaign: np.ndarray | None = None  # int64 [N], 0 = none; None: no row names one
    advertiser: np.ndarray | None = None  # int64 [N], 0 = none; None: no row names one
    # uint64 [N, bitmask_words]: the bits enum/bucket exclusions cleared; None: none did
    exclude_bitmask: np.ndarray | None = None
    rejected: tuple[CatalogError, ...] = ()  # bad rows left out (a bad-row budget), in order

    def __post_init__(self) -> None:
        n = len(self.ad_id)
        assert self.sid.shape == (n, SID_LEVELS), self.sid.shape
        assert self.embedding is None or len(self.embedding) == n
        assert self.bitmask.shape == (n, self.schema.bitmask_words), self.bitmask.shape
        assert list(self.sets) == [a.name for a in self.schema.families], list(self.sets)
        for s in self.sets.values():
            assert s.include.n == n and (s.exclude is None or s.exclude.n == n)
        assert all(a is None or a.shape == (n,) for a in (self.campaign, self.advertiser))

    @property
    def n(self) -> int:
        return len(self.ad_id)

    @property
    def has_sid(self) -> np.ndarray:  # bool [N]
        return self.sid[:, 0] >= 0


def read_catalog(
    path: Path | str,
    *,
    progress: bool = True,
    schema: TargetingSchema = DEFAULT,
    bad_row_budget: float = 0.0,
) -> Catalog:
    """Read and validate a catalog — a JSON Lines (plain or gzip) or Parquet file, or a
    directory of such parts — with the targeting fields `schema` declares; raise
    CatalogError on bad input. With `bad_row_budget` > 0 (a share of the rows) the bad
    rows are left out while they are at most that share (`Catalog.rejected` names each);
    past it CatalogError says how many and names the first (`bad_rows.py`)."""
    bad = BadLines() if bad_row_budget > 0 else None
    src, cols, ignored = read_parts(Path(path), progress, targeting_fields(schema), bad)
    if bad is None:
        catalog = _build(cols, src, schema, consume=True)  # frees each column once converted
    else:
        catalog = _build_within(cols, src, schema, bad, bad_row_budget)
    if ignored:
        log.warning("catalog %s: fields not in the catalog format ignored: %s (docs/DATA.md)",
                    path, ", ".join(sorted(ignored)))  # fmt: skip
    return dataclasses.replace(catalog, ignored_fields=tuple(sorted(ignored)))


def catalog_fingerprint(path: Path | str) -> str:
    """sha256 over each file's name, size, mtime_ns and bytes (a directory's parts in
    order): changes when the content does (and, conservatively, when a file is merely
    touched)."""
    h = hashlib.sha256()
    for f in catalog_files(Path(path)):
        try:
            st = os.stat(f)
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
        except OSError as e:
            raise CatalogError(str(f), None, None, f"cannot read: {e.strerror}") from e
    return f"sha256:{h.hexdigest()}"


def source_fingerprint(
    catalog_path: Path | str, schema: TargetingSchema = DEFAULT, seq: int | None = None
) -> str:
    """What an index is built from, as its manifest's `catalog.fingerprint` records it
    (the sidecar rebuilds when it changes): the catalog's files — or a database table's
    last change_seq (`seq`, else read now) — and, for a targeting schema of one's own, the
    schema."""
    if is_postgres(catalog_path):
        url = str(catalog_path)
        fingerprint = f"{shown(url)}#change_seq={table_seq(url) if seq is None else seq}"
    else:
        fingerprint = catalog_fingerprint(catalog_path)
    if schema == DEFAULT:
        return fingerprint
    digest = hashlib.sha256(schema.model_dump_json().encode()).hexdigest()
    return f"{fingerprint};schema:sha256:{digest}"


def _build_within(
    cols: dict[str, pa.Array], src: Source, schema: TargetingSchema, bad: BadLines,
    budget: float,
) -> Catalog:  # fmt: skip
    """`_build` over the rows that pass, if the rows that do not are within `budget`."""
    n = len(cols["ad_id"])
    dropped = np.unique(np.asarray(bad.rows, dtype=np.int64))
    if not len(dropped) and not bad.errors:
        try:
            return _build(cols, src, schema)
        except CatalogError as exc:
            if exc.location is None:  # a whole-file fault: no row to leave out
                raise
    rows = np.setdiff1d(np.arange(n, dtype=np.int64), dropped, assume_unique=True)
    unreadable = len(bad.errors) - len(bad.rows)  # lines never parsed into a row
    total = n + unreadable
    limit = int(budget * total) - unreadable - len(dropped)  # bad rows the budget has left
    failing = _collect(cols, src, schema, rows)
    if failing is None:  # a fault no check can record by row: row by row, bisecting
        failing = isolate(cols, src, lambda c, s: _build(c, s, schema), rows, max(limit, 0))
    rejected = sorted([*bad.errors, *(e for _, e in failing)], key=_order)
    count = unreadable + len(dropped) + len(failing)  # bad rows (a row may err twice)
    if count > budget * total:
        first = rejected[0]
        # the search stops once the budget is spent: there may be more
        share = f"at least {count} bad rows of {total} ({count / total:.2%})"
        why = f"{first.message} — {share}, over the bad-row budget of {budget:.2%}"
        raise CatalogError(first.path, first.location, first.field, why)
    keep = np.setdiff1d(rows, np.array([r for r, _ in failing], dtype=np.int64))
    if not len(keep):
        raise src.error(None, None, "empty catalog: every row is bad")
    catalog = _build(take(cols, keep), sub_source(src, keep), schema, consume=True)
    return dataclasses.replace(catalog, rejected=tuple(rejected))


def _collect(
    cols: dict[str, pa.Array], src: Source, schema: TargetingSchema, rows: np.ndarray
) -> list[tuple[int, CatalogError]] | None:
    """Every bad row of `rows` in one collecting pass, and why; None when a fault cannot be
    recorded by row (a null inside a list, say) or the rows left still fail."""
    bad = Bad()
    whole = len(rows) == len(cols["ad_id"])
    sub = cols if whole else take(cols, rows)
    try:
        _build(sub, src if whole else sub_source(src, rows), schema, bad)
    except CatalogError:
        return None
    found = [(int(rows[r]), f, m) for r, (f, m) in sorted(bad.rows.items())]
    keep = np.setdiff1d(rows, np.array([r for r, _, _ in found], dtype=np.int64))
    try:
        if len(keep):
            _build(take(cols, keep), sub_source(src, keep), schema)
    except CatalogError:
        return None
    return [(r, src.error(r, f, m)) for r, f, m in found]


def _order(e: CatalogError) -> tuple[str, int]:
    loc = e.location or ""
    return e.path, int(loc.split()[-1]) if loc[:4] in ("line", "row ") else -1


def _build(
    cols: dict[str, pa.Array], src: Source, schema: TargetingSchema, bad: Bad | None = None,
    *, consume: bool = False,
) -> Catalog:  # fmt: skip
    """The checks and conversions in order; with `bad` every bad row is recorded there
    instead of raising at the first (what cannot be recorded by row still raises). With
    `consume` (`read_catalog` hands its columns over) each Arrow column leaves `cols` as
    it is converted, so that a column's Arrow and numpy forms are rarely both held."""
    n = len(cols["ad_id"])
    if n == 0:
        raise src.error(None, None, "empty catalog")
    fields = (*CATALOG_FIELDS[1:], *targeting_fields(schema))
    for f in fields:  # a null inside a list first: no field's own checks could run on it
        check_elements(cols.get(f), n, f, src)
    column = cols.pop if consume else cols.get

    def lists(field: str) -> ListColumn | None:
        return list_column(column(field, None), n, field, src)

    ad_id = ad_ids(column("ad_id", None), src, bad)
    sid = sids(lists("sid"), n, src, bad)
    embedding = embeddings(lists("embedding"), n, src, bad)
    has_emb = np.zeros(n, bool) if embedding is None else ~np.isnan(embedding[:, 0])
    absent = (sid[:, 0] < 0) & ~has_emb
    del has_emb
    no_sid = "absent and no embedding to compute it from"
    if bad is not None:
        bad.add(np.flatnonzero(absent), "sid", lambda r: no_sid)
    elif (row := first_true(absent)) is not None:
        raise src.error(row, "sid", no_sid)
    del absent
    by = codec(schema)
    include, exclude = {}, {}
    for a in by.masked:  # held until the bitmask is made, so in half the bytes per ad
        rule = rule_ids(lists(a.catalog_field), n, a.catalog_field, src, a, by, bad)
        include[a.name] = _narrow(rule)
        gone = rule_ids(lists(a.exclude_field), n, a.exclude_field, src, a, by, bad)
        if len(gone.values):
            exclude[a.name] = _narrow(gone)
        del rule, gone
    sets = {}
    for a in schema.families:
        inc, exc, vocabulary = set_rules(
            lists(a.catalog_field), lists(a.exclude_field), n, src, a, bad
        )
        sets[a.name] = SetRules(inc, exc, vocabulary)
    bitmask, exclude_bitmask = _bitmasks(by, include, exclude, n)
    del include, exclude
    return Catalog(
        ad_id=ad_id,
        sid=sid,
        embedding=embedding,
        bitmask=bitmask,
        sets=sets,
        source=src.path,
        schema=schema,
        campaign=owner_ids(column("campaign_id", None), "campaign_id", src, bad),
        advertiser=owner_ids(column("advertiser_id", None), "advertiser_id", src, bad),
        exclude_bitmask=exclude_bitmask,
    )


def _bitmasks(
    by: Codec, include: dict[str, Ragged], exclude: dict[str, Ragged], n: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """`Codec.ad_bitmasks` of the enum/bucket rules (uint64 [N, words]) and, where some ad
    excludes a value, the bits the exclusions cleared (else None), a block of ads at a
    time: the codec's temporaries (a copy of rows per attribute) stay a few MB."""
    bitmask = np.empty((n, by.words), dtype=np.uint64)
    cleared = np.empty_like(bitmask) if exclude else None
    for lo, hi in parallel.blocks(n):
        inc = {k: _rows(r, lo, hi) for k, r in include.items()}
        exc = {k: _rows(r, lo, hi) for k, r in exclude.items()}
        bitmask[lo:hi] = by.ad_bitmasks(inc, exc, hi - lo)
        if cleared is not None:
            cleared[lo:hi] = by.ad_bitmasks(inc, {}, hi - lo) & ~bitmask[lo:hi]
    return bitmask, cleared


def _narrow(lists: Ragged) -> Ragged:
    """`lists` with int32 offsets where they fit (the bitmask's inputs, made per block)."""
    if lists.offsets[-1] > np.iinfo(np.int32).max:
        return lists
    return Ragged(lists.offsets.astype(np.int32), lists.values)


def _rows(lists: Ragged, lo: int, hi: int) -> Ragged:
    """Ads [lo, hi) of `lists`."""
    off = lists.offsets[lo : hi + 1]
    return Ragged(off - off[0], lists.values[off[0] : off[-1]])
