"""The data a team brings, as files: the catalog's fields, file kinds and format version
(docs/DATA.md). The catalog reader (`index_builder/catalog.py`) accepts exactly these;
writers of the format (`grace synth`) stamp the version into what they write.
"""

from __future__ import annotations

CATALOG_FORMAT_VERSION = 1
# Parquet schema metadata key holding the catalog format version a writer followed; a
# file stamped with a newer version than this reader knows is refused
CATALOG_VERSION_KEY = b"grace.catalog.format_version"
CATALOG_FIELDS = ("ad_id", "sid", "embedding", "countries", "age_buckets", "genders", "locations")
# fields of the format that serving does not read: accepted without a warning, not kept
CATALOG_INFORMATIONAL = ("advertiser_id",)
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
# Users: one row per user; `age` 0 or missing = unknown; `locations` a list (Parquet,
# JSON Lines) or a `|`-separated string (CSV)
USER_FIELDS = ("user_id", "country", "age", "gender", "locations")
TABLE_SUFFIXES = (".parquet", ".csv", ".jsonl")  # interactions and users files
# events on ads not in the catalog, or on users not in the users file, are dropped and
# counted; more than this share of them refuses the data (a mismatched pair of files)
MAX_DROPPED_SHARE = 0.05
