"""A catalog given as a file or a directory of part files -> one set of Arrow columns
and a `Source` that knows which part (and line or row in it) each row came from.

A directory holds parts of one kind, read in sorted path order, hidden files (`.`/`_`)
skipped (docs/DATA.md "Files"); each part is read by `catalog_files.py`, and a field's
arrays are cast to one type where parts differ (ints and floats of an embedding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from contracts.data_format import JSONL_SUFFIXES, PARQUET_SUFFIXES, catalog_kind
from index_builder.catalog_files import BadLines, CatalogError, Source, read_jsonl, read_parquet

Columns = dict[str, pa.Array]
SUFFIXES = ", ".join((*JSONL_SUFFIXES, *(s + ".gz" for s in JSONL_SUFFIXES), *PARQUET_SUFFIXES))


def catalog_files(path: Path) -> list[Path]:
    """The files of the catalog at `path`: itself, or a directory's parts in order."""
    if path.is_file():
        if catalog_kind(path.name) is None:
            msg = f"unknown suffix {path.suffix.lower()!r}; expected {SUFFIXES}"
            raise CatalogError(str(path), None, None, msg)
        return [path]
    if not path.is_dir():
        raise CatalogError(str(path), None, None, "no such file or directory")
    found = sorted(
        p for p in path.rglob("*")
        if p.is_file() and not any(s.startswith((".", "_")) for s in p.relative_to(path).parts)
    )  # fmt: skip
    kinds = {catalog_kind(p.name) for p in found} - {None}
    if not kinds:
        raise CatalogError(str(path), None, None, f"no catalog files ({SUFFIXES}) in it")
    if "parquet" in kinds and len(kinds) > 1:
        raise CatalogError(str(path), None, None, "mixes JSON Lines and Parquet parts")
    if kinds == {"parquet"}:  # pyarrow's discovery: hive partitions, its own file rules
        try:
            dataset = ds.dataset(
                path, format="parquet", partitioning="hive", exclude_invalid_files=True
            )
        except (pa.ArrowException, OSError) as e:
            raise CatalogError(str(path), None, None, f"not a Parquet dataset: {e}") from None
        return sorted(Path(f) for f in dataset.files if catalog_kind(Path(f).name) == "parquet")
    return [p for p in found if catalog_kind(p.name) is not None]


def read_parts(
    path: Path, progress: bool, strings: tuple[str, ...], bad: BadLines | None = None
) -> tuple[Source, Columns, set[str]]:
    """The columns of every part (`strings`: the targeting fields to read), concatenated;
    the Source; the fields ignored. `bad`: what the readers skipped (`read_jsonl`), its
    rows counted over all parts."""
    files = catalog_files(path)
    sources, tables, ignored = [], [], set()
    before = 0
    for f in files:
        if catalog_kind(f.name) == "parquet":
            src, (cols, unknown) = Source(str(f), lines=None), read_parquet(f, progress, strings)
        else:
            part = None if bad is None else BadLines()
            src, cols, unknown = read_jsonl(f, progress, strings, part)
            if bad is not None and part is not None:
                bad.errors += part.errors
                bad.rows += [before + r for r in part.rows]
        before += len(cols["ad_id"])
        sources.append(src)
        tables.append(cols)
        ignored |= unknown
    if len(files) == 1:
        return sources[0], tables[0], ignored
    sizes = [len(cols["ad_id"]) for cols in tables]
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    lines = None
    if sources[0].lines is not None:
        lines = np.concatenate([s.lines for s in sources if s.lines is not None])
    src = Source(str(path), lines=lines, parts=tuple(s.path for s in sources), starts=starts)
    return src, _concat(tables, sizes, src), ignored


def _concat(tables: list[Columns], sizes: list[int], src: Source) -> Columns:
    """One array per field over all parts (nulls where a part lacks the field)."""
    out: Columns = {}
    for field in dict.fromkeys(f for cols in tables for f in cols):
        arrays = [cols.get(field) for cols in tables]
        present = [a for a in arrays if a is not None and not pa.types.is_null(a.type)]
        target = _common_type([a.type for a in present])
        if target is None:  # the field is null everywhere
            out[field] = pa.nulls(sum(sizes))
            continue
        chunks = []
        for i, (a, n) in enumerate(zip(arrays, sizes, strict=True)):
            if a is None or pa.types.is_null(a.type):
                chunks.append(pa.nulls(n, type=target))
                continue
            try:
                chunks.append(a if a.type == target else a.cast(target))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                msg = f"column type {a.type} does not combine with the other parts' {target}: {e}"
                raise CatalogError(src.parts[i], None, field, msg) from None
        out[field] = pa.concat_arrays(chunks)
    return out


def _common_type(types: list[pa.DataType]) -> pa.DataType | None:
    """One type for a field's parts: the first part's, widened to float64 items where the
    parts mix integers and floats, and to large lists of large strings for strings."""
    if not types:
        return None
    if all(t == types[0] for t in types):
        return types[0]
    items = [t.value_type for t in types if hasattr(t, "value_type")]
    if len(items) == len(types):
        if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in items):
            floats = any(pa.types.is_floating(t) for t in items)
            return pa.large_list(pa.float64() if floats else pa.int64())
        return pa.large_list(pa.large_string())
    if all(pa.types.is_integer(t) for t in types):
        return pa.int64()
    return types[0]
