"""Catalog columns → validated arrays: one check-and-convert step per catalog field, run
in order by `catalog.read_catalog`. Each step is vectorised over the whole column and
raises `CatalogError` (via `Source.error`) naming the first offending line or row — or,
given `Bad` (a bad-row budget, `bad_rows.py`), records every offending row with the same
message and goes on, so one pass finds them all. One module for every field's step (a
few lines past the house's ~300): each is short, and they share the error helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from contracts.targeting_codec import Codec, Ragged
from contracts.targeting_schema import MAX_VALUE_BYTES, Attribute
from index_builder import parallel
from index_builder.catalog_files import I64_MAX, SID_LEVELS, SID_VOCAB, Source, expect


@dataclass(frozen=True)
class ListColumn:
    """A list column, flattened: row i's values are values[offsets[i]:offsets[i+1]]."""

    valid: np.ndarray  # bool [N]: the row carries the field (null = absent)
    offsets: np.ndarray  # int64 [N + 1]; null rows are empty
    values: pa.Array  # [nnz], no nulls

    @property
    def lengths(self) -> np.ndarray:  # int64 [N]
        return np.diff(self.offsets)

    def row_of(self, flat: int) -> int:
        return int(np.searchsorted(self.offsets, flat, side="right") - 1)


def list_column(arr: pa.Array | None, n: int, field: str, src: Source) -> ListColumn | None:
    if arr is None or pa.types.is_null(arr.type):
        return None
    if isinstance(arr, pa.ChunkedArray):  # pa.array() chunks columns beyond 2 GiB
        arr = arr.combine_chunks()
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(pc.list_value_length(arr).fill_null(0).to_numpy(), dtype=np.int64, out=offsets[1:])
    out = ListColumn(arr.is_valid().to_numpy(zero_copy_only=False), offsets, arr.flatten())
    if out.values.null_count:
        flat = int(np.flatnonzero(out.values.is_null().to_numpy(zero_copy_only=False))[0])
        raise src.error(out.row_of(flat), field, f"null element; expected {expect(field)[1]}")
    return out


def check_elements(arr: pa.Array | None, n: int, field: str, src: Source) -> None:
    """Raise `list_column`'s error for a list column with a null element (no other check
    can run on it), without making its offsets: `catalog._build` checks every list column
    so before converting any, then makes one `ListColumn` at a time."""
    if arr is None or pa.types.is_null(arr.type):
        return
    if pc.list_flatten(arr).null_count:
        list_column(arr, n, field, src)


def first_true(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


class Bad:
    """The rows a collecting pass found bad: row -> (field, message), each row's first."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[str | None, str]] = {}

    def add(self, rows: np.ndarray, field: str | None, message: Callable[[int], str]) -> None:
        for row in np.unique(rows).tolist():
            if row not in self.rows:
                self.rows[row] = (field, message(row))


def first_flat(lists: ListColumn, mask: np.ndarray) -> dict[int, int]:
    """Row -> its first flat value index where `mask` (over the flat values) holds."""
    flats = np.flatnonzero(mask)
    rows = np.searchsorted(lists.offsets, flats, side="right") - 1
    return dict(zip(rows.tolist()[::-1], flats.tolist()[::-1], strict=True))


def ad_ids(arr: pa.Array | None, src: Source, bad: Bad | None = None) -> np.ndarray:
    if arr is None or arr.null_count or pa.types.is_null(arr.type):
        raise src.error(
            None if arr is None else first_true(arr.is_null().to_numpy(zero_copy_only=False)),
            "ad_id",
            "missing",
        )
    if pa.types.is_uint64(arr.type) and (row := first_true(arr.to_numpy() > I64_MAX)) is not None:
        raise src.error(row, "ad_id", f"{arr[row].as_py()} is not {expect('ad_id')[1]}")
    ids = arr.cast(pa.int64()).to_numpy()
    ordered = np.sort(ids)  # vectorised: several times the stable argsort's speed
    if not np.any(ordered[1:] == ordered[:-1]):
        return ids  # no duplicate (the usual case)
    del ordered
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order[1:]] == ids[order[:-1]])
    if len(dup) and bad is not None:  # every later occurrence, after its group's first
        starts = np.r_[True, ids[order[1:]] != ids[order[:-1]]]
        first_of = order[np.maximum.accumulate(np.where(starts, np.arange(len(ids)), 0))]
        later = {int(order[k + 1]): int(first_of[k + 1]) for k in dup.tolist()}
        bad.add(np.fromiter(later, np.int64), "ad_id", lambda r: f"duplicate ad_id {ids[r]} "
                f"(first seen on {src.where(later[r])})")  # fmt: skip
    elif len(dup):
        # the earliest second occurrence; with a stable sort its predecessor is the first
        k = dup[np.argmin(order[dup + 1])]
        later, first = int(order[k + 1]), int(order[k])
        msg = f"duplicate ad_id {ids[later]} (first seen on {src.where(first)})"
        raise src.error(later, "ad_id", msg)
    return ids


def sids(lists: ListColumn | None, n: int, src: Source, bad: Bad | None = None) -> np.ndarray:
    """int32 [N, SID_LEVELS], -1 rows where absent; without the column one read-only -1
    row broadcast over every ad (no memory: the usual case, SIDs from embeddings)."""
    if lists is None:
        return np.broadcast_to(np.int32(-1), (n, SID_LEVELS))
    sid = np.full((n, SID_LEVELS), -1, dtype=np.int32)
    wanted = expect("sid")[1]
    wrong = lists.valid & (lists.lengths != SID_LEVELS)
    values = lists.values.to_numpy()
    out = (values < 0) | (values >= SID_VOCAB)
    if bad is None:
        if (row := first_true(wrong)) is not None:
            raise src.error(row, "sid", f"has {lists.lengths[row]} values; expected {wanted}")
        if (flat := first_true(out)) is not None:
            msg = f"value {values[flat]} is out of range [0, 512)"
            raise src.error(lists.row_of(flat), "sid", msg)
        sid[lists.valid] = values.reshape(-1, SID_LEVELS)
        return sid
    bad.add(np.flatnonzero(wrong), "sid", lambda r: f"has {lists.lengths[r]} values; "
            f"expected {wanted}")  # fmt: skip
    at = first_flat(lists, out)
    bad.add(np.fromiter(at, np.int64), "sid",
            lambda r: f"value {values[at[r]]} is out of range [0, 512)")  # fmt: skip
    ok = np.flatnonzero(lists.valid & ~wrong)
    sid[ok] = values[lists.offsets[ok][:, None] + np.arange(SID_LEVELS)]
    return sid


def embeddings(
    lists: ListColumn | None, n: int, src: Source, bad: Bad | None = None
) -> np.ndarray | None:
    if lists is None or not lists.valid.any():
        return None
    first = int(np.argmax(lists.valid))
    dim = int(lists.lengths[first])
    if dim == 0:
        raise src.error(first, "embedding", "is empty")
    wrong = lists.valid & (lists.lengths != dim)

    def differs(row: int) -> str:
        msg = f"dimension {lists.lengths[row]} differs from {dim} of the first embedding"
        return f"{msg} ({src.where(first)})"

    with np.errstate(over="ignore"):  # beyond float32 range becomes inf, rejected below
        values = lists.values.to_numpy().astype(np.float32, copy=False)
    if bad is not None:
        bad.add(np.flatnonzero(wrong), "embedding", differs)
        at = first_flat(lists, ~np.isfinite(values))
        bad.add(
            np.fromiter(at, np.int64),
            "embedding",
            lambda r: f"value {lists.values[at[r]].as_py()} is not a finite float32",
        )
        out = np.full((n, dim), np.nan, dtype=np.float32)
        ok = np.flatnonzero(lists.valid & ~wrong)
        out[ok] = values[lists.offsets[ok][:, None] + np.arange(dim)]
        return out
    if (row := first_true(wrong)) is not None:
        raise src.error(row, "embedding", differs(row))
    if (flat := _first_nonfinite(values)) is not None:
        msg = f"value {lists.values[flat].as_py()} is not a finite float32"
        raise src.error(lists.row_of(flat), "embedding", msg)
    if lists.valid.all():
        return values.reshape(n, dim)
    out = np.full((n, dim), np.nan, dtype=np.float32)
    out[lists.valid] = values.reshape(-1, dim)
    return out


def _first_nonfinite(values: np.ndarray, block: int = 1 << 22) -> int | None:
    """first_true(~np.isfinite(values)) a block of values at a time: no bool per value (32
    bytes per ad at dim 32)."""
    for lo in range(0, len(values), block):
        finite = np.isfinite(values[lo : lo + block])
        if not finite.all():
            return lo + int(np.argmin(finite))
    return None


def rule_ids(
    lists: ListColumn | None, n: int, field: str, src: Source, attr: Attribute, codec: Codec,
    bad: Bad | None = None,
) -> Ragged:  # fmt: skip
    """An enum or bucket attribute's rule (`field`: its include or exclude list) as value
    indices (int32 [nnz]); looked up once per distinct string, so a million rows cost one
    dictionary encode."""
    if lists is None or len(lists.values) == 0:
        offsets = np.zeros(n + 1, dtype=np.int64) if lists is None else lists.offsets
        return Ragged(offsets, np.zeros(0, dtype=np.int32))
    values = lists.values
    if not pa.types.is_dictionary(values.type):
        values = pc.dictionary_encode(values)
    table = [-1 if (i := codec.value_index(attr, v)) is None else i
             for v in values.dictionary.to_pylist()]  # fmt: skip
    ids = np.array(table, dtype=np.int32)[values.indices.to_numpy()]
    if bad is not None:
        at = first_flat(lists, ids < 0)
        bad.add(np.fromiter(at, np.int64), field, lambda r: f"unknown value "
                f"{lists.values[at[r]].as_py()!r}; expected {_allowed(attr)}")  # fmt: skip
        ids[ids < 0] = 0  # the row is left out
    if (flat := first_true(ids < 0)) is not None:
        msg = f"unknown value {lists.values[flat].as_py()!r}; expected {_allowed(attr)}"
        raise src.error(lists.row_of(flat), field, msg)
    return Ragged(lists.offsets, ids)


def _allowed(attr: Attribute) -> str:
    labels = attr.labels
    if len(labels) <= 12:
        return "one of " + ", ".join(labels)
    case = " (any case)" if attr.case == "upper" else ""
    return f"one of the {len(labels)} values the schema lists for {attr.name}{case}"


def set_rules(
    include: ListColumn | None, exclude: ListColumn | None, n: int, src: Source,
    attr: Attribute, bad: Bad | None = None,
) -> tuple[Ragged, Ragged | None, np.ndarray]:  # fmt: skip
    """A set attribute's include and exclude lists as ids into one vocabulary, each ad's
    sorted and deduplicated: (include, exclude or None when no ad excludes, vocabulary
    object [V] of every value either names, sorted). A value no request may carry (empty,
    or over MAX_VALUE_BYTES) is refused: its rule could never match."""
    parts = [(f, c) for f, c in ((attr.catalog_field, include), (attr.exclude_field, exclude))
             if c is not None and len(c.values)]  # fmt: skip
    if not parts:
        return Ragged.empty(n), None, np.array([], dtype=object)
    enc = pc.dictionary_encode(pa.concat_arrays([c.values.cast(pa.large_string())
                                                 for _, c in parts]))  # fmt: skip
    words = np.array(enc.dictionary.to_pylist(), dtype=object)
    size = np.array([len(w.encode("utf-8")) for w in words])  # once per distinct string
    codes = enc.indices.to_numpy()
    unservable = ((size == 0) | (size > MAX_VALUE_BYTES))[codes]

    def unfit(c: ListColumn, flat: int) -> str:
        word = c.values[flat].as_py()
        why = "is empty" if not word else f"is {len(word.encode())} bytes long"
        shown = word[:40] + ("…" if len(word) > 40 else "")
        return (f"{attr.name} value {shown!r} {why}: requests carry values of 1 to "
                f"{MAX_VALUE_BYTES} bytes, so no request could match it")  # fmt: skip

    at = 0
    for field, c in parts:
        mask = unservable[at : at + len(c.values)]
        if bad is not None:
            hits = first_flat(c, mask)
            bad.add(np.fromiter(hits, np.int64), field,
                    lambda r, c=c, hits=hits: unfit(c, hits[r]))  # fmt: skip
        elif (flat := first_true(mask)) is not None:
            raise src.error(c.row_of(flat), field, unfit(c, flat))
        at += len(c.values)
    order = np.argsort(words)
    rank = np.empty(len(words), dtype=np.int64)
    rank[order] = np.arange(len(words))
    ranked, at, lists = rank[codes], 0, {}
    for field, c in parts:
        lists[field] = _per_ad(ranked[at : at + len(c.values)], c, n, len(words))
        at += len(c.values)
    inc = lists.get(attr.catalog_field) or Ragged.empty(n)
    return inc, lists.get(attr.exclude_field), words[order]


def _per_ad(ranked: np.ndarray, lists: ListColumn, n: int, vocab: int) -> Ragged:
    """Each ad's ids sorted and deduplicated: one sort of (row, id) keys does both. The
    temporaries are per value, not per ad (most ads name few values, or none)."""
    rows = np.searchsorted(lists.offsets, np.arange(len(ranked)), side="right") - 1
    keys = rows * vocab + ranked
    del rows
    keys.sort(kind="stable")  # already ordered by row: timsort only sorts within each ad
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]]
    ads = keys // vocab
    offsets = np.empty(n + 1, dtype=np.int64)  # an ad's first key: the keys of ads before
    for lo, hi in parallel.blocks(n + 1, 1 << 20):
        offsets[lo:hi] = np.searchsorted(ads, np.arange(lo, hi))
    return Ragged(offsets, (keys % vocab).astype(np.int32))


def owner_ids(
    arr: pa.Array | None, field: str, src: Source, bad: Bad | None = None
) -> np.ndarray | None:
    """An ad's campaign or advertiser (`CATALOG_OWNERS`): int64 [N], 0 where null; None
    when no row carries the field (no block on it can be applied)."""
    if arr is None or pa.types.is_null(arr.type) or arr.null_count == len(arr):
        return None
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_uint64(arr.type):
        big = pc.fill_null(arr, 0).to_numpy() > np.uint64(I64_MAX)
        if bad is not None:
            bad.add(np.flatnonzero(big), field,
                    lambda r: f"{arr[r].as_py()} is not {expect(field)[1]}")  # fmt: skip
            arr = pc.if_else(pa.array(big), pa.scalar(0, arr.type), arr)
        elif (row := first_true(big)) is not None:
            raise src.error(row, field, f"{arr[row].as_py()} is not {expect(field)[1]}")
    ids = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
    return ids.astype(np.int64, copy=False)
