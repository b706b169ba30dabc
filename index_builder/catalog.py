"""Catalog input: read and validate an ad catalog into columns (docs/ARCHITECTURE.md §4).

Flow: catalog file(s) → Arrow columns (`catalog_parts.py`, `catalog_files.py`) → the
field checks of `catalog_columns.py`, run in order here → `Catalog` → `build.py`. Both
formats go through the same vectorised checks, so they accept and reject the same
catalogs and give identical arrays; bad input raises `CatalogError` (docs/DATA.md).
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

from contracts.targeting import BITMASK_WORDS, ad_bitmasks
from index_builder.catalog_columns import (
    RULES,
    ad_ids,
    embeddings,
    first_true,
    list_column,
    locations,
    owner_ids,
    rule_ids,
    sids,
)
from index_builder.catalog_files import LIST_FIELDS, SID_LEVELS, CatalogError, Source
from index_builder.catalog_parts import catalog_files, read_parts

log = logging.getLogger("grace.catalog")


@dataclass(frozen=True)
class Catalog:
    """A validated catalog in columns, the index builder's input."""

    ad_id: np.ndarray  # int64 [N], unique, in input order
    sid: np.ndarray  # int32 [N, 4]; -1 rows where the ad carries no sid
    embedding: np.ndarray | None  # float32 [N, D]; None if no row has one; NaN rows where absent
    bitmask: np.ndarray  # uint64 [N, BITMASK_WORDS], exact low-cardinality rules
    loc_offsets: np.ndarray  # int64 [N + 1] into loc_ids
    loc_ids: np.ndarray  # int32 [nnz]: ids into `locations`, sorted and deduplicated per ad
    locations: np.ndarray  # object [V]: sorted unique location strings
    source: str  # path read
    ignored_fields: tuple[str, ...] = ()  # fields in the input the format does not know
    campaign: np.ndarray | None = None  # int64 [N], 0 = none; None: no row names one
    advertiser: np.ndarray | None = None  # int64 [N], 0 = none; None: no row names one

    def __post_init__(self) -> None:
        n = len(self.ad_id)
        assert self.sid.shape == (n, SID_LEVELS), self.sid.shape
        assert self.embedding is None or len(self.embedding) == n
        assert self.bitmask.shape == (n, BITMASK_WORDS), self.bitmask.shape
        assert len(self.loc_offsets) == n + 1 and self.loc_offsets[-1] == len(self.loc_ids)
        assert all(a is None or a.shape == (n,) for a in (self.campaign, self.advertiser))

    @property
    def n(self) -> int:
        return len(self.ad_id)

    @property
    def has_sid(self) -> np.ndarray:  # bool [N]
        return self.sid[:, 0] >= 0


def read_catalog(path: Path | str, *, progress: bool = True) -> Catalog:
    """Read and validate a catalog — a JSON Lines (plain or gzip) or Parquet file, or a
    directory of such parts; raise CatalogError on bad input."""
    src, cols, ignored = read_parts(Path(path), progress)
    catalog = _build(cols, src)
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


def _build(cols: dict[str, pa.Array], src: Source) -> Catalog:
    n = len(cols["ad_id"])
    if n == 0:
        raise src.error(None, None, "empty catalog")
    lists = {f: list_column(cols.get(f), n, f, src) for f in LIST_FIELDS}
    ad_id = ad_ids(cols["ad_id"], src)
    sid = sids(lists["sid"], n, src)
    embedding = embeddings(lists["embedding"], n, src)
    has_emb = np.zeros(n, bool) if embedding is None else ~np.isnan(embedding[:, 0])
    if (row := first_true((sid[:, 0] < 0) & ~has_emb)) is not None:
        raise src.error(row, "sid", "absent and no embedding to compute it from")
    rules = [rule_ids(lists[f], n, f, src) for f in RULES]
    loc_offsets, loc_ids, vocabulary = locations(lists["locations"], n, src)
    return Catalog(
        ad_id=ad_id,
        sid=sid,
        embedding=embedding,
        bitmask=ad_bitmasks(*rules),
        loc_offsets=loc_offsets,
        loc_ids=loc_ids,
        locations=vocabulary,
        source=src.path,
        campaign=owner_ids(cols.get("campaign_id"), "campaign_id", src),
        advertiser=owner_ids(cols.get("advertiser_id"), "advertiser_id", src),
    )
