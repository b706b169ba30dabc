"""Catalog files -> Arrow columns: the JSON Lines (plain or gzip) and Parquet readers,
`Source` (where a row came from) and `CatalogError`.

JSON Lines does here only what Arrow cannot say (valid JSON, an object, an int `ad_id`,
list-or-null fields); Parquet checks its column types and format version up front. Both
read the targeting fields the schema names (`targeting_fields`) and report the fields
they ignore (neither in `contracts.data_format` nor in the schema).
"""

from __future__ import annotations

import gc
import gzip
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from contracts.data_format import (
    CATALOG_FIELDS,
    CATALOG_FORMAT_VERSION,
    CATALOG_OWNERS,
    CATALOG_VERSION_KEY,
)
from contracts.targeting_schema import TargetingSchema
from index_builder.parquet_columns import read_columns

SID_LEVELS = 4
SID_VOCAB = 512
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def targeting_fields(schema: TargetingSchema) -> tuple[str, ...]:
    """The catalog's targeting fields under `schema`, each a list of strings (or null):
    every attribute's include list and its exclude list."""
    return tuple(f for a in schema.attributes for f in (a.catalog_field, a.exclude_field))


class CatalogError(ValueError):
    """Bad catalog input; names the source, the line (JSONL, 1-based) or row (Parquet,
    0-based), and the field."""

    def __init__(self, path: str, location: str | None, field: str | None, message: str) -> None:
        where = ": ".join(p for p in (path, location, field and f"field {field!r}") if p)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.location = location  # "line 17" / "row 16"; None for whole-file errors
        self.field = field
        self.message = message  # the reason alone


@dataclass(frozen=True)
class Source:
    """Where the rows came from: one file, or the parts of a directory in order."""

    path: str  # the catalog as given (a file or a directory)
    lines: np.ndarray | None  # JSONL: int64 [N] line of each row in its file; None: Parquet
    parts: tuple[str, ...] = ()  # a directory's files; () for a single file
    starts: np.ndarray | None = None  # int64 [len(parts)]: the first row of each part

    def _where(self, row: int) -> tuple[str, str]:
        """(file, "row N" or "line N" within it) of catalog row `row`."""
        path, local = self.path, row
        if self.parts and self.starts is not None:
            i = int(np.searchsorted(self.starts, row, side="right")) - 1
            path, local = self.parts[i], row - int(self.starts[i])
        return path, f"row {local}" if self.lines is None else f"line {self.lines[row]}"

    def where(self, row: int) -> str:
        """Row `row` as a reader finds it: "line 17", or "row 3 of <part>" in a directory."""
        path, where = self._where(row)
        return f"{where} of {path}" if self.parts else where

    def error(self, row: int | None, field: str | None, message: str) -> CatalogError:
        if row is None:
            return CatalogError(self.path, None, field, message)
        path, where = self._where(row)
        return CatalogError(path, where, field, message)


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_string(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _list_of(item: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    def accept(t: pa.DataType) -> bool:
        if pa.types.is_null(t):  # a column of nulls: the field is absent everywhere
            return True
        listlike = pa.types.is_list(t) or pa.types.is_large_list(t)
        if not (listlike or pa.types.is_fixed_size_list(t)):
            return False
        return pa.types.is_null(t.value_type) or item(t.value_type)

    return accept


# field -> (accepted Arrow type, what a value must be); any other field is a targeting
# field (`targeting_fields`), a list of strings
_EXPECT: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "ad_id": (pa.types.is_integer, "an integer in int64 range"),
    "sid": (_list_of(pa.types.is_integer), f"a list of {SID_LEVELS} ints in [0, {SID_VOCAB})"),
    "embedding": (_list_of(_is_number), "a list of finite numbers"),
    **{f: (pa.types.is_integer, "an integer in int64 range, or null") for f in CATALOG_OWNERS},
}
_STRINGS = (_list_of(_is_string), "a list of strings")


def expect(field: str) -> tuple[Callable[[pa.DataType], bool], str]:
    """(accepted Arrow type, what a value must be) of a catalog field."""
    return _EXPECT.get(field, _STRINGS)


def show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Millions of new lists retrigger the cyclic GC over everything built so far; none of
    them can form a cycle, so pausing it roughly halves the JSONL parse time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_jsonl(
    path: Path, progress: bool, strings: tuple[str, ...], bad: BadLines | None = None
) -> tuple[Source, dict[str, pa.Array], set[str]]:
    """One orjson parse per line into Python column lists, then Arrow conversion; a `.gz`
    file is decompressed on the fly. `strings`: the targeting fields to read. Returns the
    source, the columns and the fields seen that neither the format nor `strings` know
    (ignored). With `bad` a line it cannot read is recorded there and skipped, and a value
    that cannot be converted is recorded with its row (to drop) instead of raising."""
    name = str(path)
    known = frozenset(CATALOG_FIELDS + CATALOG_OWNERS + strings)
    unknown: set[str] = set()
    ids: list[int] = []
    lines: list[int] = []
    cols: dict[str, list[object]] = {f: [] for f in (*CATALOG_FIELDS[1:], *strings)}
    fields = tuple(cols.items())
    owners: dict[str, list[object]] = {f: [] for f in CATALOG_OWNERS}
    with (
        _gc_paused(),
        path.open("rb") as stored,
        gzip.GzipFile(fileobj=stored) if name.lower().endswith(".gz") else stored as fh,
        tqdm(total=path.stat().st_size, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        bar.set_description(f"catalog {path.name}")  # progress: bytes of the stored file
        try:
            for lineno, raw in enumerate(fh, 1):
                if not lineno & 0x3FFF:  # every 16k lines: bar updates are not free
                    bar.update(stored.tell() - bar.n)
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    if not raw.strip():
                        continue  # blank lines are allowed
                    err = CatalogError(name, f"line {lineno}", None, f"invalid JSON: {e}")
                else:
                    err = _line_error(obj, name, lineno, fields, owners)
                if err is not None:
                    if bad is None:
                        raise err
                    bad.errors.append(err)
                    continue
                if not obj.keys() <= known:
                    unknown.update(obj.keys() - known)
                ids.append(obj["ad_id"])
                lines.append(lineno)
                for field, col in fields:
                    col.append(obj.get(field))
                for field, col in owners.items():
                    col.append(obj.get(field))
        except (OSError, EOFError) as e:  # a corrupt or truncated gzip stream
            raise CatalogError(name, None, None, f"cannot decompress: {e}") from None
        bar.update(stored.tell() - bar.n)
    src = Source(name, lines=np.array(lines, dtype=np.int64))
    out = {"ad_id": pa.array(ids, type=pa.int64())}
    for field, col in cols.items():
        out[field] = _to_arrow(col, field, src, bad)
    for field, col in owners.items():
        if any(v is not None for v in col):
            out[field] = pa.array(col, type=pa.int64())
    return src, out, unknown


def _line_error(
    obj: object, name: str, lineno: int, fields: tuple, owners: dict[str, list[object]]
) -> CatalogError | None:
    """Why a parsed line is no catalog row (None: it is one, as far as a line can tell)."""
    where = f"line {lineno}"
    if type(obj) is not dict:
        return CatalogError(name, where, None, f"expected a JSON object, got {type(obj).__name__}")
    ad_id = obj.get("ad_id")
    if type(ad_id) is not int or not I64_MIN <= ad_id <= I64_MAX:  # bool is no int
        msg = "missing" if ad_id is None else f"{show(ad_id)} is not {expect('ad_id')[1]}"
        return CatalogError(name, where, "ad_id", msg)
    for key, _ in fields:
        value = obj.get(key)
        if value is not None and type(value) is not list:
            return CatalogError(name, where, key, f"{show(value)} is not {expect(key)[1]}")
    for key in owners:
        value = obj.get(key)
        if value is not None and (type(value) is not int or not I64_MIN <= value <= I64_MAX):
            return CatalogError(name, where, key, f"{show(value)} is not {expect(key)[1]}")
    return None


def _to_arrow(col: list[object], field: str, src: Source, bad: BadLines | None = None) -> pa.Array:
    """One Arrow array per field. String lists convert with their type given (twice as
    fast, and strict: values are lists by now, and a non-string element raises); numeric
    ones infer it, since a given int type would truncate 1.5 and a float type take `true`.
    If the column is unacceptable, find the first line whose value alone is too (with
    `bad`: every such line, recorded with its row and its value left out)."""
    accept, wanted = expect(field)
    given = None if field in CATALOG_FIELDS else pa.large_list(pa.large_string())
    try:
        arr = pa.array(col, type=given)
        if accept(arr.type):
            return arr
    except (pa.ArrowException, OverflowError):
        pass
    for row, value in enumerate(col):
        try:
            ok = value is None or accept(pa.array([value], type=given).type)
        except (pa.ArrowException, OverflowError):
            ok = False
        if not ok:
            err = src.error(row, field, f"{show(value)} is not {wanted}")
            if bad is None:
                raise err
            bad.errors.append(err)
            bad.rows.append(row)
            col[row] = None
    if bad is not None and bad.rows:
        return _to_arrow(col, field, src)
    raise src.error(None, field, f"values mix types; each must be {wanted}")


@dataclass
class BadLines:
    """What a reader skipped (`index_builder/bad_rows.py`): the errors of the lines it could
    not read, in order, and the rows whose values it could not convert (to drop)."""

    errors: list[CatalogError] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


def read_parquet(
    path: Path, progress: bool, strings: tuple[str, ...]
) -> tuple[dict[str, pa.Array], set[str]]:
    """The catalog's columns of one Parquet file (`strings`: the targeting fields to
    read), and the columns it ignores."""
    src = Source(str(path), lines=None)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise src.error(None, None, f"not a readable Parquet file: {e}") from None
    schema = pf.schema_arrow
    version = (schema.metadata or {}).get(CATALOG_VERSION_KEY)
    if version is not None and not (version.isdigit() and int(version) <= CATALOG_FORMAT_VERSION):
        msg = f"written for catalog format {version.decode(errors='replace')!r}; this reader "
        raise src.error(None, None, msg + f"knows versions up to {CATALOG_FORMAT_VERSION}")
    if "ad_id" not in schema.names:
        raise src.error(None, "ad_id", "missing column")
    known = (*CATALOG_FIELDS, *strings, *CATALOG_OWNERS)
    fields = [f for f in known if f in schema.names]
    for f in fields:  # column types first: the value checks below assume them
        accept, wanted = expect(f)
        if not (accept(schema.field(f).type) or pa.types.is_null(schema.field(f).type)):
            raise src.error(None, f, f"column has type {schema.field(f).type}; expected {wanted}")
    return read_columns(path, pf, fields, progress), set(schema.names) - set(known)
