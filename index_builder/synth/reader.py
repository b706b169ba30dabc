"""Read a generated world back (`load_world`): its users with their targeting — the
extra attributes and block lists of a world with richer targeting included — histories
and held-out next interactions, for tests, training and evaluation. `world.py` writes
what this reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from contracts.targeting import Targeting
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder.synth import writer
from index_builder.synth.attributes import load_world_schema
from index_builder.synth.blocks import KINDS
from index_builder.synth.user_attributes import read_attributes

WORLD_FORMAT = 1


@dataclass(frozen=True)
class UserHistories:
    """Users with their targeting, time-ordered histories and held-out next events, as
    training and evaluation read them: a generated `World`, or a team's own data
    (`training.user_data.UserData`)."""

    path: Path  # where they were read from
    summary: dict[str, Any]
    user_ids: np.ndarray  # int64 [U]
    targeting: tuple[Targeting, ...]  # [U]: the request attributes of each user
    history_offsets: np.ndarray  # int64 [U+1]: user u's events are [off[u], off[u+1])
    history_ad_ids: np.ndarray  # int64 [E], time-ordered per user
    history_types: np.ndarray  # int8 [E]: 1 view, 2 click, 3 conversion
    history_ts: np.ndarray  # int64 [E]: timestamp_ms
    heldout_ad_ids: np.ndarray  # int64 [U]: the next interaction; -1: the user has none
    heldout_types: np.ndarray  # int8 [U]
    heldout_ts: np.ndarray  # int64 [U]

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    def history(self, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ad_ids, types, timestamp_ms) of user position u, oldest first."""
        s = slice(self.history_offsets[u], self.history_offsets[u + 1])
        return self.history_ad_ids[s], self.history_types[s], self.history_ts[s]


@dataclass(frozen=True)
class World(UserHistories):
    """A generated world, read back (`path`: its directory; `summary`: its world.json)."""

    # bool [U]: the held-out ad launched after the log (worlds with `fresh_share` > 0)
    heldout_fresh: np.ndarray | None = None
    # the targeting schema its catalog is read by (`attributes.SCHEMA_FILE`, or the default)
    schema: TargetingSchema = DEFAULT

    @property
    def catalog_parquet(self) -> Path:
        return self.path / writer.CATALOG_PARQUET


def load_world(directory: Path | str) -> World:
    """Read a world written by `generate_world`; refuses a directory without world.json."""
    d = Path(directory)
    if not (d / writer.WORLD_JSON).is_file():
        raise FileNotFoundError(f"{d} is not a complete world: {writer.WORLD_JSON} missing")
    summary = json.loads((d / writer.WORLD_JSON).read_text())
    if summary.get("format") != WORLD_FORMAT:
        raise ValueError(f"{d}: world format {summary.get('format')!r}, expected {WORLD_FORMAT}")
    users = pq.read_table(d / writer.USERS_PARQUET)
    held = pq.read_table(d / writer.HELDOUT_PARQUET)
    user_ids = users["user_id"].to_numpy()
    if not np.array_equal(user_ids, held["user_id"].to_numpy()):
        raise ValueError(f"{d}: users and held-out events are not aligned")
    schema = load_world_schema(d)
    cols = [users[k].to_pylist() for k in ("country", "age", "gender", "locations")]
    extra = read_attributes(users, schema)
    blocks = [[tuple(ids) for ids in users[k].to_pylist()] if k in users.column_names
              else [()] * users.num_rows for k in KINDS]  # fmt: skip
    targeting = tuple(
        Targeting(c, a, g, tuple(loc), attrs, *block)
        for c, a, g, loc, attrs, *block in zip(*cols, extra, *blocks, strict=True)
    )
    hist = users["history_ad_id"].combine_chunks()
    lengths = hist.value_lengths().to_numpy(zero_copy_only=False)
    return World(
        path=d,
        summary=summary,
        user_ids=user_ids,
        targeting=targeting,
        history_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        history_ad_ids=hist.flatten().to_numpy(),
        history_types=users["history_type"].combine_chunks().flatten().to_numpy(),
        history_ts=users["history_ts"].combine_chunks().flatten().to_numpy(),
        heldout_ad_ids=held["ad_id"].to_numpy(),
        heldout_types=held["type"].to_numpy(),
        heldout_ts=held["timestamp_ms"].to_numpy(),
        heldout_fresh=held["fresh"].to_numpy() if "fresh" in held.column_names else None,
        schema=schema,
    )
