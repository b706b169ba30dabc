"""World files: catalog (Parquet, and JSONL unless turned off), users, held-out events,
interactions, `world.json`; atomic publish (docs/SYNTH.md "Files").

The catalog is the docs/DATA.md format plus an `advertiser_id` column, streamed one chunk
at a time. Everything is written into a hidden staging directory beside `out`,
`world.json` last, and renamed into place only when complete, so an interrupted run
never leaves a world that looks finished.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from contracts.data_format import CATALOG_FORMAT_VERSION, CATALOG_VERSION_KEY
from contracts.targeting import AGE_BUCKETS, GENDERS
from contracts.targeting_codec import Ragged
from contracts.targeting_schema import COUNTRIES
from index_builder.parallel import take_segments
from index_builder.synth.ads import AdRules, AdState
from index_builder.synth.attributes import Column
from index_builder.synth.geography import Geography
from index_builder.synth.histories import Histories
from index_builder.synth.users import Users

CATALOG_JSONL = "catalog.jsonl"
CATALOG_PARQUET = "catalog.parquet"
USERS_PARQUET = "users.parquet"
HELDOUT_PARQUET = "heldout.parquet"
INTERACTIONS_PARQUET = "interactions.parquet"  # the same events in the docs/DATA.md format
WORLD_JSON = "world.json"
# a world's files in world.json's order, but for catalog.jsonl (first, when written)
FILES = (CATALOG_PARQUET, USERS_PARQUET, HELDOUT_PARQUET, INTERACTIONS_PARQUET)

_COUNTRY_NAMES = np.array(COUNTRIES, dtype=object)
_AGE_NAMES = np.array(AGE_BUCKETS, dtype=object)
_GENDER_NAMES = np.array(GENDERS, dtype=object)


_ROW = (
    b'{"ad_id":%d,"advertiser_id":%d,"embedding":[%b],"countries":[%b],'
    b'"age_buckets":[%b],"genders":[%b],"locations":[%b]}'
)


def _split_rows(nested: bytes) -> list[bytes]:
    """`[[r0],[r1],...]` as serialised JSON -> the inner bytes of each row (safe: no value
    contains `],[`, numbers and strings checked by `CatalogWriter`)."""
    return nested[2:-2].split(b"],[")


def _list_column(offsets: np.ndarray, values: object, typ: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, typ))


def _ragged_column(r: Ragged, names: pa.Array) -> pa.ListArray:
    offsets = pa.array((r.offsets - r.offsets[0]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, names.take(pa.array(r.values)))


def _extra_fields(
    columns: tuple[Column, ...], extra: tuple[Ragged, ...], campaign: np.ndarray
) -> list[bytes]:
    """Per row, the richer-targeting fields as JSON members (each after a comma)."""
    parts = [[b',"campaign_id":%d' % c for c in campaign.tolist()]]
    for c, r in zip(columns, extra, strict=True):
        values, o = c.names[r.values].tolist(), (r.offsets - r.offsets[0]).tolist()
        lists = _split_rows(orjson.dumps([values[o[i] : o[i + 1]] for i in range(r.n)]))
        parts.append([b',"%b":[%b]' % (c.field.encode(), x) for x in lists])
    return [b"".join(row) for row in zip(*parts, strict=True)]


def jsonl_chunk(
    location_names: np.ndarray,  # object [V]: location vocabulary
    ad_id: np.ndarray,  # int64 [n]
    advertiser: np.ndarray,  # int [n]
    emb: np.ndarray,  # float32 [n, d], C-contiguous
    rules: AdRules,
    extra_columns: tuple[Column, ...] = (),  # richer targeting: the extra list columns
    extra: tuple[Ragged, ...] = (),  # their rules of these ads
    campaign: np.ndarray | None = None,  # int64 [n]: with richer targeting or blocks
) -> bytes:
    """The JSON Lines of one catalog chunk (each row ends in a newline); a free function,
    so that the ad-drawing workers serialise their own chunks."""
    # One orjson call per column for the whole chunk, split into rows, then one %-format
    # per row: 2-3x faster than one orjson call per row dict.
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
    if campaign is not None:  # richer targeting or blocks: their fields before the "}"
        more = _extra_fields(extra_columns, extra, campaign)
        rows = [r[:-1] + x + b"}" for r, x in zip(rows, more, strict=True)]
    rows.append(b"")
    return b"\n".join(rows)


class CatalogWriter:
    """Streams catalog chunks into catalog.parquet (one row group each) and, unless
    `jsonl=False`, catalog.jsonl; with richer targeting also `campaign_id` and the extra
    list `columns`."""

    def __init__(
        self,
        directory: Path,
        location_names: np.ndarray,
        dim: int,
        jsonl: bool = True,
        columns: tuple[Column, ...] = (),
        campaigns: bool = False,
    ) -> None:
        self._names = {
            "countries": pa.array(COUNTRIES, pa.string()),
            "age_buckets": pa.array(AGE_BUCKETS, pa.string()),
            "genders": pa.array(GENDERS, pa.string()),
            "locations": pa.array(location_names.tolist(), pa.string()),
        }
        self._columns = columns
        self._extra_names = [pa.array(c.names.tolist(), pa.string()) for c in columns]
        self._campaigns = campaigns
        if any("]" in n for n in location_names.tolist()):
            raise ValueError("location names must not contain ']' (see _split_rows)")
        self._loc_names = location_names
        self._dim = dim
        self.schema = pa.schema(
            [
                ("ad_id", pa.int64()),
                ("advertiser_id", pa.int64()),
                *((("campaign_id", pa.int64()),) if campaigns else ()),
                ("embedding", pa.list_(pa.float32())),
                *((k, pa.list_(pa.string())) for k in self._names),
                *((c.field, pa.list_(pa.string())) for c in columns),
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
        extra: tuple[Ragged, ...] = (),  # per extra column: these ads' rules
        campaign: np.ndarray | None = None,  # int64 [n], when the writer has campaigns
    ) -> None:
        n = len(ad_id)
        emb = np.ascontiguousarray(embedding, dtype=np.float32)
        columns = [
            pa.array(ad_id, pa.int64()),
            pa.array(advertiser.astype(np.int64)),
            *((pa.array(campaign, pa.int64()),) if self._campaigns else ()),
            _list_column(np.arange(0, (n + 1) * self._dim, self._dim), emb.ravel(), pa.float32()),
            *(_ragged_column(getattr(rules, k), names) for k, names in self._names.items()),
            *(_ragged_column(r, names) for r, names in zip(extra, self._extra_names, strict=True)),
        ]
        self._parquet.write_table(pa.Table.from_arrays(columns, schema=self.schema))
        if self._jsonl is not None:
            if jsonl is None:
                jsonl = jsonl_chunk(self._loc_names, ad_id, advertiser, emb, rules,
                                    self._columns, extra, campaign)  # fmt: skip
            self._jsonl.write(jsonl)

    def close(self) -> None:
        self._parquet.close()
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> CatalogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_users(
    directory: Path,
    geo: Geography,
    users: Users,
    ads: AdState,
    hist: Histories,
    fresh: np.ndarray | None,  # bool [N]: launched after the log (`campaigns.fresh_ads`)
    extra: dict[str, pa.Array] | None = None,  # richer targeting: more users.parquet columns
) -> None:
    """users.parquet (the kept users, each history without its held-out event, then the
    `extra` columns), heldout.parquet (a `fresh` column only with fresh ads) and
    interactions.parquet: every event in the docs/DATA.md format, split `train` (history) /
    `test` (held out), so the world's files train like a team's own data."""
    kept = hist.user
    last = hist.offsets[1:] - 1  # each user's held-out event
    logged = np.ones(len(hist.ad), dtype=bool)
    logged[last] = False
    loc_offsets, loc_sel = take_segments(users.loc_offsets, kept)
    loc_names = geo.names[users.loc_ids[loc_sel]].tolist()
    hist_offsets = hist.offsets - np.arange(len(hist.offsets))
    gender = np.array([*GENDERS, ""], dtype=object)[users.gender[kept]]  # -1 -> ""
    user_id = pa.array(users.user_id[kept], pa.int64())
    people = {
        "user_id": user_id,
        "country": pa.array([geo.codes[c] for c in users.country[kept]], pa.string()),
        "age": pa.array(users.age[kept], pa.int32()),
        "gender": pa.array(gender.tolist(), pa.string()),
        "locations": _list_column(loc_offsets, loc_names, pa.string()),
        "history_ad_id": _list_column(hist_offsets, ads.ad_id[hist.ad[logged]], pa.int64()),
        "history_type": _list_column(hist_offsets, hist.type[logged], pa.int8()),
        "history_ts": _list_column(hist_offsets, hist.ts[logged], pa.int64()),
        **(extra or {}),
    }
    pq.write_table(pa.table(people), directory / USERS_PARQUET)
    heldout = {
        "user_id": user_id,
        "ad_id": pa.array(ads.ad_id[hist.ad[last]], pa.int64()),
        "type": pa.array(hist.type[last], pa.int8()),
        "timestamp_ms": pa.array(hist.ts[last], pa.int64()),
    }
    if fresh is not None:
        heldout["fresh"] = pa.array(fresh[hist.ad[last]], pa.bool_())
    pq.write_table(pa.table(heldout), directory / HELDOUT_PARQUET)
    events = {
        "user_id": pa.array(np.repeat(users.user_id[kept], np.diff(hist.offsets)), pa.int64()),
        "ad_id": pa.array(ads.ad_id[hist.ad], pa.int64()),
        "event_type": pa.array(hist.type, pa.int8()),
        "timestamp_ms": pa.array(hist.ts, pa.int64()),
        "split": pa.array(np.where(logged, "train", "test").astype(object), pa.string()),
    }
    pq.write_table(pa.table(events), directory / INTERACTIONS_PARQUET)


def write_summary(directory: Path, summary: dict[str, object]) -> None:
    with open(directory / WORLD_JSON, "wb") as f:
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
