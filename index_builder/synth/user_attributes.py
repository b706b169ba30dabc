"""Users' values of the world's extra attributes and their side of exact eligibility
(docs/SYNTH.md "Richer targeting").

Runs after the users stage, on streams of its own: each user gets one value per extra
enum (`EXTRA_ENUMS` weights) and its audience segments (`audiences.user_audiences`).
`UserAttributes` then completes a user's request for `histories` and `calibration` (the
extra enums' bits beside the default ones; audiences matched by segment id against the
advertisers' rules), writes the users.parquet columns and reads them back for
`load_world`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from contracts.targeting_codec import Ragged, any_in
from contracts.targeting_schema import LEGACY_FIELDS, TargetingSchema
from index_builder.parallel import take_segments
from index_builder.synth.advertisers import Topics
from index_builder.synth.attributes import AUDIENCES, ExtraRules
from index_builder.synth.audiences import Segments, user_audiences
from index_builder.synth.profiles import EXTRA_ENUMS, WorldProfile, stream
from index_builder.synth.users import Users


@dataclass(frozen=True)
class UserAttributes:
    """Every user's extra values, and the advertisers' audience rules they meet."""

    schema: TargetingSchema
    enums: tuple[np.ndarray, ...]  # int8 [U] per extra enum: index into its values
    request_bits: np.ndarray  # uint64 [U, words]: the extra enums' bits of each request
    audiences: Ragged | None  # per user: segment ids, sorted; None: no audiences
    segment_names: np.ndarray | None  # object [S]
    include: Ragged | None  # per advertiser: segments an ad of it needs one of
    exclude: Ragged | None  # per advertiser: segments that bar its ads

    def request(self, default: np.ndarray, u: int) -> np.ndarray:
        """User u's request bitmask: `default` (its country, age and gender bits) and the
        bits of its extra enum values."""
        return default | self.request_bits[u]

    def sets_pass(self, advertiser: np.ndarray, u: int) -> np.ndarray:
        """bool [n]: whether ads of `advertiser` (int [n]) pass user u's audiences."""
        ok = np.ones(len(advertiser), dtype=bool)
        if self.audiences is None:
            return ok
        assert self.include is not None and self.exclude is not None
        a = self.audiences
        mine = a.values[a.offsets[u] : a.offsets[u + 1]]
        offsets, flat = take_segments(self.include.offsets, advertiser)
        ok &= (np.diff(offsets) == 0) | any_in(offsets, self.include.values[flat], mine)
        offsets, flat = take_segments(self.exclude.offsets, advertiser)
        return ok & ~any_in(offsets, self.exclude.values[flat], mine)

    def columns(self, kept: np.ndarray) -> dict[str, pa.Array]:
        """users.parquet columns of users `kept`: one string column per extra enum, a
        list<string> column of audiences."""
        out = {}
        for (name, _, values, _), value in zip(EXTRA_ENUMS, self.enums, strict=False):
            out[name] = pa.array(np.array(values, dtype=object)[value[kept]], pa.string())
        if self.audiences is not None:
            assert self.segment_names is not None
            offsets, flat = take_segments(self.audiences.offsets, kept)
            names = self.segment_names[self.audiences.values[flat]].tolist()
            out[AUDIENCES.name] = pa.ListArray.from_arrays(
                pa.array(offsets.astype(np.int32)), pa.array(names, pa.string())
            )
        return out


def build_user_attributes(
    p: WorldProfile,
    topics: Topics,
    users: Users,
    seg: Segments | None,
    rules: ExtraRules | None,
    seed: int,
) -> UserAttributes | None:
    """The users' extra values (None for a world without richer targeting)."""
    if rules is None:
        return None
    schema, n = rules.schema, users.n
    bits = np.zeros((n, schema.bitmask_words), dtype=np.uint64)
    enums = []
    for k, (name, _, values, weights) in enumerate(EXTRA_ENUMS[: p.extra_enums]):
        w = np.asarray(weights)
        value = stream(seed, "user-enum", k).choice(len(values), size=n, p=w / w.sum())
        enums.append(value.astype(np.int8))
        bit = schema.bit_offsets[name] + value
        one = np.left_shift(np.uint64(1), (bit % 64).astype(np.uint64))
        np.bitwise_or.at(bits, (np.arange(n), bit // 64), one)
    audiences = include = exclude = None
    if seg is not None:
        rng = stream(seed, "user-audiences")
        audiences = user_audiences(p, seg, topics.centroids, users.interest, rng)
        include = rules.column(AUDIENCES.catalog_field).rules
        exclude = rules.column(AUDIENCES.exclude_field).rules
    names = None if seg is None else seg.names
    return UserAttributes(schema, tuple(enums), bits, audiences, names, include, exclude)


def read_attributes(
    table: pa.Table, schema: TargetingSchema
) -> list[tuple[tuple[str, tuple[str, ...]], ...]]:
    """Per row of a users.parquet table, its values of the schema's attributes beyond the
    four named ones (`Targeting.attributes`), in schema order."""
    columns = []
    for a in schema.attributes:
        if a.name in LEGACY_FIELDS or a.name not in table.column_names:
            continue
        values = table[a.name].to_pylist()
        if a.kind == "set":
            columns.append([(a.name, tuple(v or ())) for v in values])
        else:
            columns.append([(a.name, (v,) if v else ()) for v in values])
    return [tuple(row) for row in zip(*columns, strict=True)] or [()] * table.num_rows
