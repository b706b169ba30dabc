"""A team's own users and interactions (docs/DATA.md, "Interactions and users") -> the
users, time-ordered histories and held-out events that training and evaluation read
(`training/data.py`).

    interactions (user_id, ad_id, event_type, timestamp_ms[, split]) ─┐
    users (user_id, country, age, gender, locations) ─────────────────┴─► UserData

Files are Parquet, CSV or JSON Lines; bad rows raise `DataError` naming the file, the row
(0-based data row) and the field. Event types are read through an `EventMap`; events on
ads or users the other files lack are dropped and counted (`UserData.dropped`), and too
many of them refuse the data. The split is the `split` column where there is one, else
leave-last-out. `UserData` is a `UserHistories`, as the synthetic world is, so the
training and evaluation code serve both alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from contracts.data_format import (
    DEFAULT_EVENT_MAP,
    EVENT_MAP_FLAG,
    EVENT_TYPE_NAMES,
    INTERACTION_SPLITS,
    MAX_DROPPED_SHARE,
    TABLE_SUFFIXES,
    UNMAPPED_FLAG,
    USER_FIELDS,
    EventMap,
)
from contracts.targeting import (
    MAX_LOCATION_BYTES,
    MAX_REQUEST_LOCATIONS,
    Targeting,
    age_bucket_index,
)
from contracts.targeting_codec import TargetingError, codec
from contracts.targeting_schema import DEFAULT
from index_builder.synth.reader import UserHistories

log = logging.getLogger("grace.user_data")


class DataError(ValueError):
    """Bad interactions or users input: names the file, row and field."""


@dataclass(frozen=True)
class UserData(UserHistories):
    """A team's users and interactions (`path`: the interactions file); the held-out event
    is each user's test event."""

    valid_index: np.ndarray  # int64 [U]: the validation event's position in the history; -1
    dropped: dict[str, int] = field(default_factory=dict)  # events dropped, by reason


def read_table(path: Path) -> pa.Table:
    """A Parquet, CSV or JSON Lines file as an Arrow table."""
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise DataError(f"{path}: unknown suffix {suffix!r}; expected {', '.join(TABLE_SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        if suffix == ".parquet":
            return pq.read_table(path)
        if suffix == ".csv":
            opts = pcsv.ConvertOptions(strings_can_be_null=True)
            return pcsv.read_csv(path, convert_options=opts)
        return pjson.read_json(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not readable: {' '.join(str(e).split())}") from None


def _column(table: pa.Table, path: Path, name: str, required: bool = True) -> pa.Array | None:
    if name not in table.column_names:
        if required:
            raise DataError(f"{path}: field {name!r}: missing column")
        return None
    return table.column(name).combine_chunks()


def _ints(arr: pa.Array, path: Path, name: str) -> np.ndarray:
    """An integer column as int64; the first null or non-integer row is named."""
    if arr.null_count:
        row = int(pc.index(pc.is_null(arr), True).as_py())
        raise DataError(f"{path}: row {row}: field {name!r}: missing")
    if not pa.types.is_integer(arr.type):
        for row, value in enumerate(arr.to_pylist()):  # the first value that is no integer
            if not (
                isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit())
            ):
                raise DataError(f"{path}: row {row}: field {name!r}: {value!r} is not an integer")
        raise DataError(f"{path}: field {name!r}: column has type {arr.type}; expected integers")
    return arr.to_numpy().astype(np.int64)


def _event_types(arr: pa.Array, path: Path, events: EventMap) -> tuple[np.ndarray, dict]:
    """Event types by name or number through `events` -> int8 1..3, 0 where a row is to be
    skipped; and the skipped rows counted by type (lower case)."""
    if arr.null_count:
        row = int(pc.index(pc.is_null(arr), True).as_py())
        raise DataError(f"{path}: row {row}: field 'event_type': missing")
    try:  # each distinct spelling looked up once: logs hold few types and millions of rows
        names = pc.utf8_lower(arr.cast(pa.string())).dictionary_encode()
    except pa.ArrowException:
        raise DataError(f"{path}: field 'event_type': column has type {arr.type}") from None
    spelled = names.dictionary.to_pylist()
    codes = events.codes()
    rows = names.indices.to_numpy()
    values = np.array([codes.get(n, 0) for n in spelled], dtype=np.int8)[rows]
    unknown = values == 0
    if unknown.any() and events.unmapped == "refuse":
        row = int(np.flatnonzero(unknown)[0])
        known = ", ".join([f"{k} ({v})" for k, v in EVENT_TYPE_NAMES.items()]
                          + [f"{s} ({t})" for s, t in events.renames])  # fmt: skip
        raise DataError(
            f"{path}: row {row}: field 'event_type': {arr[row].as_py()!r} is not one of "
            f"{known} (map it with {EVENT_MAP_FLAG}, or {UNMAPPED_FLAG} skip: docs/DATA.md)"
        )
    counts = np.bincount(rows[unknown], minlength=len(spelled))
    return values, {n: int(c) for n, c in zip(spelled, counts, strict=True) if c}


def read_users(path: Path) -> tuple[np.ndarray, tuple[Targeting, ...]]:
    """User ids (unique) and their targeting attributes."""
    path = Path(path)
    table = read_table(path)
    ids = _ints(_column(table, path, "user_id"), path, "user_id")
    if len(ids) == 0:
        raise DataError(f"{path}: no users")
    order = np.argsort(ids, kind="stable")
    if len(dup := np.flatnonzero(ids[order[1:]] == ids[order[:-1]])):
        row = int(order[dup[0] + 1])
        raise DataError(f"{path}: row {row}: field 'user_id': duplicate {ids[row]}")
    cols = {f: _column(table, path, f, required=False) for f in USER_FIELDS[1:]}
    values = {f: ([None] * len(ids) if c is None else c.to_pylist()) for f, c in cols.items()}
    return ids, tuple(_targeting(values, row, path) for row in range(len(ids)))


def _targeting(values: dict[str, list], row: int, path: Path) -> Targeting:
    locations = values["locations"][row]
    if isinstance(locations, str):  # CSV: "a|b|c"
        locations = [s for s in locations.split("|") if s]
    age = values["age"][row]
    where = f"{path}: row {row}: field"
    if not isinstance(age, int | None):
        raise DataError(f"{where} 'age': {age!r} is not an integer")
    locations = tuple(locations or ())
    if len(locations) > MAX_REQUEST_LOCATIONS:
        raise DataError(f"{where} 'locations': {len(locations)}, more than {MAX_REQUEST_LOCATIONS}")
    for loc in locations:
        if not isinstance(loc, str) or not 0 < len(loc.encode()) <= MAX_LOCATION_BYTES:
            raise DataError(f"{where} 'locations': {loc!r} is not 1 to {MAX_LOCATION_BYTES} bytes")
    t = Targeting(values["country"][row] or "", age or 0, values["gender"][row] or "", locations)
    try:
        # a well-formed code the schema does not list is read as unknown, as in requests
        if t.country and (len(t.country) != 2 or not t.country.isalpha()):
            raise TargetingError("country", f"expected an ISO 3166-1 alpha-2 code, got "
                                 f"{t.country!r}")  # fmt: skip
        age_bucket_index(t.age)  # refuses a negative age
        codec(DEFAULT).request_bitmask(t.values())  # gender, as the default schema reads it
    except TargetingError as e:
        raise DataError(f"{where} {e.field!r}: {str(e).partition(': ')[2]}") from None
    return t


def read_user_data(
    interactions: Path, users: Path, ad_ids: np.ndarray, events: EventMap = DEFAULT_EVENT_MAP
) -> UserData:
    """Join the two files over the catalog's `ad_ids`, order events by time, split; event
    types read through `events`."""
    interactions = Path(interactions)
    user_ids, targeting = read_users(users)
    table = read_table(interactions)

    def ints(name: str) -> np.ndarray:
        return _ints(_column(table, interactions, name), interactions, name)

    uid, ad, ts = ints("user_id"), ints("ad_id"), ints("timestamp_ms")
    etype, skipped = _event_types(_column(table, interactions, "event_type"), interactions, events)
    split_col = _column(table, interactions, "split", required=False)
    split = _splits(split_col, interactions, len(uid))
    if skipped:
        log.warning("%s: %d events skipped, of event types not mapped (%s skip): %s",
                    interactions, sum(skipped.values()), UNMAPPED_FLAG,
                    ", ".join(f"{k} {v}" for k, v in skipped.items()))  # fmt: skip
        mapped = etype > 0
        uid, ad, etype, ts, split = (x[mapped] for x in (uid, ad, etype, ts, split))
    n = len(uid)
    if n == 0:
        raise DataError(f"{interactions}: no events")
    user_pos = positions(user_ids, uid)
    known_ad = np.isin(ad, ad_ids)
    dropped = {"unknown_user": int((user_pos < 0).sum()), "unknown_ad": int((~known_ad).sum())}
    keep = (user_pos >= 0) & known_ad
    share = 1 - keep.mean()
    if share > MAX_DROPPED_SHARE:
        raise DataError(
            f"{interactions}: {dropped['unknown_user']} events on users not in {users} and "
            f"{dropped['unknown_ad']} on ads not in the catalog: {share:.1%} of {n}, more than "
            f"{MAX_DROPPED_SHARE:.0%} (do the files belong together?)"
        )
    user_pos, ad, etype, ts, split = (x[keep] for x in (user_pos, ad, etype, ts, split))
    order = np.lexsort((ts, user_pos))  # per user, oldest first
    user_pos, ad, etype, ts, split = (x[order] for x in (user_pos, ad, etype, ts, split))
    test, valid = _held_events(user_pos, split if split_col is not None else None, interactions)
    u = len(user_ids)
    held_ad = np.full(u, -1, dtype=np.int64)
    held_type = np.zeros(u, dtype=np.int8)
    held_ts = np.zeros(u, dtype=np.int64)
    held_ad[user_pos[test]], held_type[user_pos[test]] = ad[test], etype[test]
    held_ts[user_pos[test]] = ts[test]
    hist = ~test
    counts = np.bincount(user_pos[hist], minlength=u)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    valid_index = np.full(u, -1, dtype=np.int64)
    at = np.flatnonzero(valid[hist])  # positions among the history events
    valid_index[user_pos[hist][at]] = at - offsets[user_pos[hist][at]]
    summary = {
        "source": str(interactions),
        "users": u,
        "events": len(ad),
        "history_events": int(hist.sum()),
        "test_events": int(test.sum()),
        "valid_events": int(valid.sum()),
        "dropped": dropped,
        "skipped_event_types": skipped,  # rows of unmapped types, by type (--unmapped skip)
    }
    return UserData(
        path=interactions,
        summary=summary,
        user_ids=user_ids,
        targeting=targeting,
        history_offsets=offsets,
        history_ad_ids=ad[hist],
        history_types=etype[hist],
        history_ts=ts[hist],
        heldout_ad_ids=held_ad,
        heldout_types=held_type,
        heldout_ts=held_ts,
        valid_index=valid_index,
        dropped=dropped,
    )


def _splits(arr: pa.Array | None, path: Path, n: int) -> np.ndarray:
    """Per event: 0 train, 1 valid, 2 test; -1 for all when there is no split column."""
    if arr is None:
        return np.full(n, -1, dtype=np.int8)
    names = arr.to_pylist()
    index = {s: i for i, s in enumerate(INTERACTION_SPLITS)}
    out = np.array([index.get(str(v).lower(), -9) if v is not None else -9 for v in names])
    if (bad := np.flatnonzero(out == -9)).size:
        row = int(bad[0])
        raise DataError(
            f"{path}: row {row}: field 'split': {names[row]!r} is not one of "
            + ", ".join(INTERACTION_SPLITS)
        )
    return out.astype(np.int8)


def positions(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """int64: the position of each of `wanted` in `ids` (unique); -1 where it is absent."""
    order = np.argsort(ids)
    pos = np.minimum(np.searchsorted(ids[order], wanted), len(ids) - 1)
    found = ids[order][pos] == wanted
    return np.where(found, order[pos], -1)


def _held_events(
    user_pos: np.ndarray, split: np.ndarray | None, path: Path
) -> tuple[np.ndarray, np.ndarray]:
    """bool per (sorted) event: (held out for test, the validation target)."""
    if split is None:  # leave-last-out: the last event, and the second-last for validation
        start = np.r_[0, np.flatnonzero(user_pos[1:] != user_pos[:-1]) + 1]
        count = np.diff(np.r_[start, len(user_pos)])
        test, valid = np.zeros(len(user_pos), bool), np.zeros(len(user_pos), bool)
        test[(start + count - 1)[count >= 2]] = True  # one event only: kept for training
        valid[(start + count - 2)[count >= 3]] = True
        return test, valid
    test, valid = split == 2, split == 1
    for kind, mark in (("test", test), ("valid", valid)):
        users = user_pos[mark]
        if len(users) != len(np.unique(users)):
            raise DataError(f"{path}: field 'split': a user has more than one {kind} event")
    return test, valid
