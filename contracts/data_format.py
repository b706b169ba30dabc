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
