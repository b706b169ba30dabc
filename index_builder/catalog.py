"""Catalog input: read and validate an ad catalog into columns (docs/ARCHITECTURE.md §4).

Flow: **catalog file → `read_catalog` → `Catalog`** → index_builder build (sorts ads by
SID with `Catalog.take`, builds the trie and the per-ad indexes) → index on disk.

A catalog is JSON Lines (`.jsonl`, `.ndjson`, `.json`; one ad object per line) or Parquet
(`.parquet`). Both readers (`catalog_files.py`) produce the same Arrow columns, and one
shared, vectorised pass here validates them and encodes targeting with `targeting.py`, so
the two formats accept and reject the same catalogs and give identical arrays. Any bad
input raises `CatalogError` naming the file, the line (JSONL, 1-based) or row (Parquet,
0-based) and the field; nothing partial is returned. Unknown fields and columns are ignored.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from index_builder.catalog_files import (
    EXPECT,
    I64_MAX,
    JSONL_SUFFIXES,
    LIST_FIELDS,
    PARQUET_SUFFIXES,
    SID_LEVELS,
    SID_VOCAB,
    CatalogError,
    Source,
    read_jsonl,
    read_parquet,
)
from index_builder.targeting import (
    AGE_BUCKETS,
    BITMASK_WORDS,
    GENDERS,
    MAX_LOCATION_BYTES,
    Ragged,
    ad_bitmasks,
    age_bucket_value_index,
    country_index,
    gender_value_index,
)


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

    def __post_init__(self) -> None:
        n = len(self.ad_id)
        assert self.sid.shape == (n, SID_LEVELS), self.sid.shape
        assert self.embedding is None or len(self.embedding) == n
        assert self.bitmask.shape == (n, BITMASK_WORDS), self.bitmask.shape
        assert len(self.loc_offsets) == n + 1 and self.loc_offsets[-1] == len(self.loc_ids)

    @property
    def n(self) -> int:
        return len(self.ad_id)

    @property
    def has_sid(self) -> np.ndarray:  # bool [N]
        return self.sid[:, 0] >= 0

    def take(self, order: np.ndarray) -> Catalog:
        """Rows `order` (int indices, each at most once, or a bool mask) in that order;
        the location vocabulary is kept as is."""
        order = np.asarray(order)
        order = np.flatnonzero(order) if order.dtype == bool else order.astype(np.int64)
        if len(order) and (order.min() < 0 or order.max() >= self.n):
            raise IndexError(f"take: indices must lie in [0, {self.n})")
        if np.bincount(order, minlength=self.n).max(initial=0) > 1:
            raise ValueError("take: repeated rows would duplicate ad ids")
        counts = np.diff(self.loc_offsets)[order]
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        # gather each selected segment: source start + position within the segment
        src = np.repeat(self.loc_offsets[:-1][order] - offsets[:-1], counts)
        src += np.arange(offsets[-1])
        return Catalog(
            ad_id=self.ad_id[order],
            sid=self.sid[order],
            embedding=None if self.embedding is None else self.embedding[order],
            bitmask=self.bitmask[order],
            loc_offsets=offsets,
            loc_ids=self.loc_ids[src],
            locations=self.locations,
            source=self.source,
        )


def read_catalog(path: Path | str, *, progress: bool = True) -> Catalog:
    """Read and validate a JSON Lines or Parquet catalog; raise CatalogError on bad input."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        allowed = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise CatalogError(str(path), None, None, f"unknown suffix {suffix!r}; expected {allowed}")
    if not path.is_file():
        raise CatalogError(str(path), None, None, "no such file")
    if suffix in PARQUET_SUFFIXES:
        src = Source(str(path), lines=None)
        cols = read_parquet(path, src, progress)
    else:
        src, cols = read_jsonl(path, progress)
    return _build(cols, src)


def catalog_fingerprint(path: Path | str) -> str:
    """sha256 over the size, mtime_ns and the bytes of the file: changes when the content
    does (and, conservatively, when the file is merely touched)."""
    try:
        st = os.stat(path)
        h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise CatalogError(str(path), None, None, f"cannot read: {e.strerror}") from e
    return f"sha256:{h.hexdigest()}"


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class _Lists:
    """A list column, flattened: row i's values are values[offsets[i]:offsets[i+1]]."""

    valid: np.ndarray  # bool [N]: the row carries the field (null = absent)
    offsets: np.ndarray  # int64 [N + 1]; null rows are empty
    values: pa.Array  # [nnz], no nulls

    @property
    def lengths(self) -> np.ndarray:  # int64 [N]
        return np.diff(self.offsets)

    def row_of(self, flat: int) -> int:
        return int(np.searchsorted(self.offsets, flat, side="right") - 1)


def _lists(arr: pa.Array | None, n: int, field: str, src: Source) -> _Lists | None:
    if arr is None or pa.types.is_null(arr.type):
        return None
    if isinstance(arr, pa.ChunkedArray):  # pa.array() chunks columns beyond 2 GiB
        arr = arr.combine_chunks()
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy().astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = _Lists(arr.is_valid().to_numpy(zero_copy_only=False), offsets, arr.flatten())
    if out.values.null_count:
        flat = int(np.flatnonzero(out.values.is_null().to_numpy(zero_copy_only=False))[0])
        raise src.error(out.row_of(flat), field, f"null element; expected {EXPECT[field][1]}")
    return out


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _ad_ids(arr: pa.Array | None, src: Source) -> np.ndarray:
    if arr is None or arr.null_count or pa.types.is_null(arr.type):
        raise src.error(
            None if arr is None else _first(arr.is_null().to_numpy(zero_copy_only=False)),
            "ad_id",
            "missing",
        )
    if pa.types.is_uint64(arr.type) and (row := _first(arr.to_numpy() > I64_MAX)) is not None:
        raise src.error(row, "ad_id", f"{arr[row].as_py()} is not {EXPECT['ad_id'][1]}")
    ids = arr.cast(pa.int64()).to_numpy()
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order[1:]] == ids[order[:-1]])
    if len(dup):
        # the earliest second occurrence; with a stable sort its predecessor is the first
        k = dup[np.argmin(order[dup + 1])]
        later, first = int(order[k + 1]), int(order[k])
        msg = f"duplicate ad_id {ids[later]} (first seen on {src.where(first)})"
        raise src.error(later, "ad_id", msg)
    return ids


def _sids(lists: _Lists | None, n: int, src: Source) -> np.ndarray:
    sid = np.full((n, SID_LEVELS), -1, dtype=np.int32)
    if lists is None:
        return sid
    expect = EXPECT["sid"][1]
    if (row := _first(lists.valid & (lists.lengths != SID_LEVELS))) is not None:
        raise src.error(row, "sid", f"has {lists.lengths[row]} values; expected {expect}")
    values = lists.values.to_numpy()
    if (flat := _first((values < 0) | (values >= SID_VOCAB))) is not None:
        raise src.error(lists.row_of(flat), "sid", f"value {values[flat]} is out of range [0, 512)")
    sid[lists.valid] = values.reshape(-1, SID_LEVELS)
    return sid


def _embeddings(lists: _Lists | None, n: int, src: Source) -> np.ndarray | None:
    if lists is None or not lists.valid.any():
        return None
    first = int(np.argmax(lists.valid))
    dim = int(lists.lengths[first])
    if dim == 0:
        raise src.error(first, "embedding", "is empty")
    if (row := _first(lists.valid & (lists.lengths != dim))) is not None:
        msg = f"dimension {lists.lengths[row]} differs from {dim} of the first embedding"
        raise src.error(row, "embedding", f"{msg} ({src.where(first)})")
    with np.errstate(over="ignore"):  # beyond float32 range becomes inf, rejected below
        values = lists.values.to_numpy().astype(np.float32, copy=False)
    if (flat := _first(~np.isfinite(values))) is not None:
        msg = f"value {lists.values[flat].as_py()} is not a finite float32"
        raise src.error(lists.row_of(flat), "embedding", msg)
    if lists.valid.all():
        return values.reshape(n, dim)
    out = np.full((n, dim), np.nan, dtype=np.float32)
    out[lists.valid] = values.reshape(-1, dim)
    return out


def _ragged(lists: _Lists | None, n: int, field: str, src: Source) -> Ragged:
    """A low-cardinality rule as value indices (int32 [nnz]); looked up once per distinct
    string, so a million rows cost one dictionary encode."""
    if lists is None or len(lists.values) == 0:
        offsets = np.zeros(n + 1, dtype=np.int64) if lists is None else lists.offsets
        return Ragged(offsets, np.zeros(0, dtype=np.int32))
    lookup, allowed = _RULES[field]
    values = lists.values
    if not pa.types.is_dictionary(values.type):
        values = pc.dictionary_encode(values)
    table = [-1 if (i := lookup(v)) is None else i for v in values.dictionary.to_pylist()]
    ids = np.array(table, dtype=np.int32)[values.indices.to_numpy()]
    if (flat := _first(ids < 0)) is not None:
        msg = f"unknown value {lists.values[flat].as_py()!r}; expected {allowed}"
        raise src.error(lists.row_of(flat), field, msg)
    return Ragged(lists.offsets, ids)


# rule field -> (value index lookup, what is allowed); the order `ad_bitmasks` takes
_RULES: dict[str, tuple[Callable[[str], int | None], str]] = {
    "countries": (country_index, "an ISO 3166-1 alpha-2 code (any case)"),
    "age_buckets": (age_bucket_value_index, f"one of {', '.join(AGE_BUCKETS)}"),
    "genders": (gender_value_index, f"one of {', '.join(GENDERS)}"),
}


def _locations(
    lists: _Lists | None, n: int, src: Source
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loc_offsets int64 [N+1], loc_ids int32 [nnz], vocabulary object [V]). A string no
    request may carry (empty, or over MAX_LOCATION_BYTES) is refused: its ad could never
    be served."""
    if lists is None or len(lists.values) == 0:
        return np.zeros(n + 1, dtype=np.int64), np.zeros(0, np.int32), np.array([], dtype=object)
    enc = pc.dictionary_encode(lists.values.cast(pa.large_string()))
    words = np.array(enc.dictionary.to_pylist(), dtype=object)
    size = np.array([len(w.encode("utf-8")) for w in words])  # once per distinct string
    unservable = (size == 0) | (size > MAX_LOCATION_BYTES)
    if unservable.any():
        flat = _first(unservable[enc.indices.to_numpy()])
        assert flat is not None
        word = lists.values[flat].as_py()
        why = "is empty" if not word else f"is {len(word.encode())} bytes long"
        shown = word[:40] + ("…" if len(word) > 40 else "")
        msg = (
            f"location {shown!r} {why}: requests carry locations of 1 to "
            f"{MAX_LOCATION_BYTES} bytes, so no request could match it"
        )
        raise src.error(lists.row_of(flat), "locations", msg)
    order = np.argsort(words)
    rank = np.empty(len(words), dtype=np.int64)
    rank[order] = np.arange(len(words))
    # one sort of (row, id) keys both sorts each ad's ids and drops its duplicates
    rows = np.repeat(np.arange(n, dtype=np.int64), lists.lengths)
    keys = rows * len(words) + rank[enc.indices.to_numpy()]
    keys.sort(kind="stable")  # already ordered by row: timsort only sorts within each ad
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys // len(words), minlength=n), out=offsets[1:])
    return offsets, (keys % len(words)).astype(np.int32), words[order]


def _build(cols: dict[str, pa.Array], src: Source) -> Catalog:
    n = len(cols["ad_id"])
    if n == 0:
        raise src.error(None, None, "empty catalog")
    lists = {f: _lists(cols.get(f), n, f, src) for f in LIST_FIELDS}
    ad_id = _ad_ids(cols["ad_id"], src)
    sid = _sids(lists["sid"], n, src)
    embedding = _embeddings(lists["embedding"], n, src)
    has_emb = np.zeros(n, bool) if embedding is None else ~np.isnan(embedding[:, 0])
    if (row := _first((sid[:, 0] < 0) & ~has_emb)) is not None:
        raise src.error(row, "sid", "absent and no embedding to compute it from")
    rules = [_ragged(lists[f], n, f, src) for f in _RULES]
    loc_offsets, loc_ids, vocabulary = _locations(lists["locations"], n, src)
    return Catalog(
        ad_id=ad_id,
        sid=sid,
        embedding=embedding,
        bitmask=ad_bitmasks(*rules),
        loc_offsets=loc_offsets,
        loc_ids=loc_ids,
        locations=vocabulary,
        source=src.path,
    )
