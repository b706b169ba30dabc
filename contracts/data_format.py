"""The data a team brings, as files: the catalog's fields, file kinds and format version;
the interactions' and users' fields and event types, with the map from a log's own event
type names (docs/DATA.md). The catalog reader (`index_builder/catalog.py`) and the
interactions and users reader (`training/user_data.py`) accept exactly these; writers of
the format (`grace synth`) stamp the version into what they write.
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOG_FORMAT_VERSION = 1
# Parquet schema metadata key holding the catalog format version a writer followed; a
# file stamped with a newer version than this reader knows is refused
CATALOG_VERSION_KEY = b"grace.catalog.format_version"
# beside these, each targeting attribute's include list (its `catalog_field`) and exclude
# list (`<catalog_field>_exclude`), as the targeting schema declares them
CATALOG_FIELDS = ("ad_id", "sid", "embedding")
# an ad's owners, each an int64 or null/absent (0: none): what a request's
# exclude_campaign_ids / exclude_advertiser_ids block (docs/FORMAT.md §1)
CATALOG_OWNERS = ("advertiser_id", "campaign_id")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")  # each also gzip-compressed, with ".gz"
PARQUET_SUFFIXES = (".parquet",)


def catalog_kind(name: str) -> str | None:
    """ "jsonl", "jsonl.gz" or "parquet" for a catalog file name; None for anything else."""
    lower = name.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(tuple(s + ".gz" for s in JSONL_SUFFIXES)):
        return "jsonl.gz"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


# Interactions: one event per row. `event_type` is the RPC's EventType by name or number
# (view 1, click 2, conversion 3); `split` is optional (train, valid, test).
INTERACTION_FIELDS = ("user_id", "ad_id", "event_type", "timestamp_ms")
INTERACTION_SPLITS = ("train", "valid", "test")
EVENT_TYPE_NAMES = {"view": 1, "click": 2, "conversion": 3}
# `grace train --event-map impression=view,purchase=conversion --unmapped skip`: a log's
# own event type names -> EVENT_TYPE_NAMES; a type the map does not name and that is no
# EventType is refused (the default: a typo in the map must not drop data) or skipped
EVENT_MAP_FLAG, UNMAPPED_FLAG = "--event-map", "--unmapped"
UNMAPPED_POLICIES = ("refuse", "skip")  # the first is the default
# Users: one row per user; `age` 0 or missing = unknown; `locations` a list (Parquet,
# JSON Lines) or a `|`-separated string (CSV)
USER_FIELDS = ("user_id", "country", "age", "gender", "locations")
TABLE_SUFFIXES = (".parquet", ".csv", ".jsonl")  # interactions and users files
# events on ads not in the catalog, or on users not in the users file, are dropped and
# counted; more than this share of them refuses the data (a mismatched pair of files)
MAX_DROPPED_SHARE = 0.05


@dataclass(frozen=True)
class EventMap:
    """The event types the interactions reader accepts: the RPC's names (any case) and
    numbers, and `renames`, which win over them."""

    renames: tuple[tuple[str, str], ...] = ()  # (source, target), lower case
    unmapped: str = UNMAPPED_POLICIES[0]  # what a row of any other type gets

    def __post_init__(self) -> None:
        if self.unmapped not in UNMAPPED_POLICIES:
            raise ValueError(f"{UNMAPPED_FLAG} {self.unmapped!r}: not one of {UNMAPPED_POLICIES}")
        for source, target in self.renames:
            if target not in EVENT_TYPE_NAMES:
                raise _bad_pair(f"{source}={target}", f"unknown target {target!r}")

    @classmethod
    def parse(cls, text: str, unmapped: str = UNMAPPED_POLICIES[0]) -> EventMap:
        """`SOURCE=TARGET[,SOURCE=TARGET…]`; a malformed pair, an unknown target or a
        source named twice raises ValueError naming the pair."""
        renames: dict[str, str] = {}
        for pair in text.split(","):
            source, eq, target = (s.strip().lower() for s in pair.partition("="))
            if not (source and eq and target) or "=" in target:
                raise _bad_pair(pair, "not SOURCE=TARGET")
            if source in renames:
                raise _bad_pair(pair, f"source {source!r} mapped twice")
            renames[source] = target
        return cls(tuple(renames.items()), unmapped)

    def codes(self) -> dict[str, int]:
        """Each accepted spelling (lower case; numbers as text) -> its EventType number."""
        names = {str(v): v for v in EVENT_TYPE_NAMES.values()} | EVENT_TYPE_NAMES
        return names | {s: EVENT_TYPE_NAMES[t] for s, t in self.renames}


DEFAULT_EVENT_MAP = EventMap()  # the RPC's names and numbers only; any other type refused


def _bad_pair(pair: str, problem: str) -> ValueError:
    return ValueError(f"{EVENT_MAP_FLAG} pair {pair!r}: {problem}; "
                      f"targets are {', '.join(EVENT_TYPE_NAMES)}")  # fmt: skip
