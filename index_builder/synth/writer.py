"""World files: catalog (Parquet, and JSONL unless turned off), users, held-out events,
atomic publish.

Last stage of the synth flow. The catalog is exactly the docs/ARCHITECTURE.md §4 contract
(`ad_id`, `embedding`, `countries`, `age_buckets`, `genders`, `locations`; empty list =
no rule) plus an `advertiser_id` column, streamed one chunk at a time into both files.
JSONL costs ~4 s and ~512 bytes per 1 k ads; paper-scale worlds skip it (`jsonl=False`):
every reader in the project takes the Parquet file.
Everything is written into a hidden staging directory beside `out`, `world.json` last,
and the directory is renamed into place only when complete, so an interrupted run never
leaves a world that looks finished (and `load_world` also requires `world.json`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from contracts.data_format import CATALOG_FORMAT_VERSION, CATALOG_VERSION_KEY
from contracts.targeting import AGE_BUCKETS, COUNTRIES, GENDERS, Ragged
from index_builder.synth.ads import AdRules

CATALOG_JSONL = "catalog.jsonl"
CATALOG_PARQUET = "catalog.parquet"
USERS_PARQUET = "users.parquet"
HELDOUT_PARQUET = "heldout.parquet"
INTERACTIONS_PARQUET = "interactions.parquet"  # the same events in the docs/DATA.md format
WORLD_JSON = "world.json"

_COUNTRY_NAMES = np.array(COUNTRIES, dtype=object)
_AGE_NAMES = np.array(AGE_BUCKETS, dtype=object)
_GENDER_NAMES = np.array(GENDERS, dtype=object)


_ROW = (
    b'{"ad_id":%d,"advertiser_id":%d,"embedding":[%b],"countries":[%b],'
    b'"age_buckets":[%b],"genders":[%b],"locations":[%b]}'
)


def _split_rows(nested: bytes) -> list[bytes]:
    """`[[r0],[r1],...]` as serialised JSON -> the inner bytes of each row.

    Safe because no value contains `],[` (numbers, and strings checked at construction).
    """
    return nested[2:-2].split(b"],[")


def _str_list(offsets: np.ndarray, strings: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), strings)


def _ragged_column(r: Ragged, names: pa.Array) -> pa.ListArray:
    return _str_list(r.offsets - r.offsets[0], names.take(pa.array(r.values)))


def jsonl_chunk(
    location_names: np.ndarray,  # object [V]: location vocabulary
    ad_id: np.ndarray,  # int64 [n]
    advertiser: np.ndarray,  # int [n]
    emb: np.ndarray,  # float32 [n, d], C-contiguous
    rules: AdRules,
) -> bytes:
    """The JSON Lines of one catalog chunk (each row ends in a newline).

    A free function so that the ad-drawing worker processes can serialise their own chunks.
    """
    # Serialise each column for the whole chunk in one orjson call and split it into
    # rows (~1 us/row for 32 floats), then splice rows with one %-format each:
    # 2-3x faster than one orjson call per row dict.
    if not len(ad_id):
        return b""
    columns = [_split_rows(orjson.dumps(emb, option=orjson.OPT_SERIALIZE_NUMPY))]
    ragged = (rules.countries, rules.age_buckets, rules.genders, rules.locations)
    names = (_COUNTRY_NAMES, _AGE_NAMES, _GENDER_NAMES, location_names)
    for r, n, key in zip(ragged, names, rules.row_keys, strict=True):
        # serialise each distinct list once: ads of one advertiser share their rules
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        values, o = n[r.values].tolist(), (r.offsets - r.offsets[0]).tolist()
        lists = [values[o[i] : o[i + 1]] for i in first.tolist()]
        distinct = np.array(_split_rows(orjson.dumps(lists)), dtype=object)
        columns.append(distinct[inverse].tolist())
    rows = [
        _ROW % (i, a, e, c, ab, g, loc)
        for i, a, e, c, ab, g, loc in zip(
            ad_id.tolist(), advertiser.tolist(), *columns, strict=True
        )
    ]
    rows.append(b"")
    return b"\n".join(rows)


class CatalogWriter:
    """Streams catalog chunks into catalog.parquet (one row group each) and, unless
    `jsonl=False`, catalog.jsonl."""

    def __init__(
        self, directory: Path, location_names: np.ndarray, dim: int, jsonl: bool = True
    ) -> None:
        self._names = {
            "countries": pa.array(COUNTRIES, pa.string()),
            "age_buckets": pa.array(AGE_BUCKETS, pa.string()),
            "genders": pa.array(GENDERS, pa.string()),
            "locations": pa.array(location_names.tolist(), pa.string()),
        }
        if any("]" in n for n in location_names.tolist()):
            raise ValueError("location names must not contain ']' (see _split_rows)")
        self._loc_names = location_names
        self._dim = dim
        self.schema = pa.schema(
            [
                ("ad_id", pa.int64()),
                ("advertiser_id", pa.int64()),
                ("embedding", pa.list_(pa.float32())),
                *((k, pa.list_(pa.string())) for k in self._names),
            ],
            metadata={CATALOG_VERSION_KEY: str(CATALOG_FORMAT_VERSION).encode()},
        )
        self._parquet = pq.ParquetWriter(directory / CATALOG_PARQUET, self.schema)
        self._jsonl = open(directory / CATALOG_JSONL, "wb") if jsonl else None  # noqa: SIM115

    def write(
        self,
        ad_id: np.ndarray,  # int64 [n]
        advertiser: np.ndarray,  # int [n]
        embedding: np.ndarray,  # float32 [n, d]
        rules: AdRules,
        jsonl: bytes | None = None,  # this chunk's JSON Lines if already serialised
    ) -> None:
        n = len(ad_id)
        emb = np.ascontiguousarray(embedding, dtype=np.float32)
        ragged = {
            "countries": rules.countries,
            "age_buckets": rules.age_buckets,
            "genders": rules.genders,
            "locations": rules.locations,
        }
        columns = [
            pa.array(ad_id, pa.int64()),
            pa.array(advertiser.astype(np.int64)),
            pa.ListArray.from_arrays(
                pa.array(np.arange(0, (n + 1) * self._dim, self._dim, dtype=np.int32)),
                pa.array(emb.ravel()),
            ),
            *(_ragged_column(ragged[k], self._names[k]) for k in self._names),
        ]
        self._parquet.write_table(pa.Table.from_arrays(columns, schema=self.schema))
        if self._jsonl is not None:
            if jsonl is None:
                jsonl = jsonl_chunk(self._loc_names, ad_id, advertiser, emb, rules)
            self._jsonl.write(jsonl)

    @property
    def files(self) -> list[str]:
        return [CATALOG_PARQUET] + ([CATALOG_JSONL] if self._jsonl is not None else [])

    def close(self) -> None:
        self._parquet.close()
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> CatalogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _list_column(offsets: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, typ))


def write_users(
    directory: Path,
    user_id: np.ndarray,  # int64 [U]
    country: list[str],
    age: np.ndarray,  # int32 [U]
    gender: list[str],
    loc_offsets: np.ndarray,  # int64 [U+1]
    loc_names: list[str],
    hist_offsets: np.ndarray,  # int64 [U+1], held-out event excluded
    hist_ad: np.ndarray,  # int64 [E]
    hist_type: np.ndarray,  # int8 [E]
    hist_ts: np.ndarray,  # int64 [E]
) -> None:
    table = pa.table(
        {
            "user_id": pa.array(user_id, pa.int64()),
            "country": pa.array(country, pa.string()),
            "age": pa.array(age, pa.int32()),
            "gender": pa.array(gender, pa.string()),
            "locations": _list_column(loc_offsets, loc_names, pa.string()),
            "history_ad_id": _list_column(hist_offsets, hist_ad, pa.int64()),
            "history_type": _list_column(hist_offsets, hist_type, pa.int8()),
            "history_ts": _list_column(hist_offsets, hist_ts, pa.int64()),
        }
    )
    pq.write_table(table, directory / USERS_PARQUET)


def write_heldout(
    directory: Path,
    user_id: np.ndarray,
    ad_id: np.ndarray,
    typ: np.ndarray,
    ts: np.ndarray,
    fresh: np.ndarray | None = None,
) -> None:
    """heldout.parquet; a `fresh` column (the ad launched after the log) only when given."""
    columns = {
        "user_id": pa.array(user_id, pa.int64()),
        "ad_id": pa.array(ad_id, pa.int64()),
        "type": pa.array(typ, pa.int8()),
        "timestamp_ms": pa.array(ts, pa.int64()),
    }
    if fresh is not None:
        columns["fresh"] = pa.array(fresh, pa.bool_())
    pq.write_table(pa.table(columns), directory / HELDOUT_PARQUET)


def write_summary(directory: Path, summary: dict[str, object]) -> None:
    path = directory / WORLD_JSON
    with open(path, "wb") as f:
        f.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        f.flush()
        os.fsync(f.fileno())


def staging_dir(out: Path) -> Path:
    """A fresh hidden directory beside `out`; refuses to later replace a non-world dir."""
    if out.exists() and any(out.iterdir()) and not (out / WORLD_JSON).exists():
        raise FileExistsError(f"{out} exists, is not empty and holds no {WORLD_JSON}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Move a complete staging directory to `out`, replacing an older world there."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def write_interactions(
    directory: Path,
    user_id: np.ndarray,  # int64 [E]
    ad_id: np.ndarray,  # int64 [E]
    typ: np.ndarray,  # int8 [E]: 1 view, 2 click, 3 conversion
    ts: np.ndarray,  # int64 [E]
    test: np.ndarray,  # bool [E]: the held-out event of its user
) -> None:
    """Every event, history and held-out, as the interactions file of docs/DATA.md (with
    the world's split: `train` history, `test` held out), so the world's catalog,
    `users.parquet` and this file train like a team's own data."""
    split = np.where(test, "test", "train").astype(object)
    table = pa.table(
        {
            "user_id": pa.array(user_id, pa.int64()),
            "ad_id": pa.array(ad_id, pa.int64()),
            "event_type": pa.array(typ, pa.int8()),
            "timestamp_ms": pa.array(ts, pa.int64()),
            "split": pa.array(split, pa.string()),
        }
    )
    pq.write_table(table, directory / INTERACTIONS_PARQUET)
