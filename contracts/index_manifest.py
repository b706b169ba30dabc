"""An index version's `manifest.json`: the format's name and version, the check of its
structure key by key (`read_manifest`), and the targeting schema it stores
(`manifest_schema`; an index from before declared schemas holds the default's fixed
layout). `contracts/index_format.py` writes manifests and reads the arrays they list.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from contracts.targeting_schema import DEFAULT, SchemaError, TargetingSchema

FORMAT_NAME = "grace-index"
# 2: may hold ads.ad_campaign_ids / ad_advertiser_ids; 3: a declared targeting schema,
# its set attributes under sets.<name>.*; each written only when needed
FORMAT_VERSION = 3
MANIFEST = "manifest.json"


class IndexFormatError(ValueError):
    """An index directory that cannot be read: missing, corrupt or incompatible."""


def manifest_sid_space(directory: Path) -> str | None:
    """The SID space a version's manifest names, or None when it cannot be read (a cheap
    look before a full load: `read_manifest` and validation report what is wrong)."""
    try:
        return str(json.loads((Path(directory) / MANIFEST).read_text())["tokenizer_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a version directory, its structure checked key by key: an
    IndexFormatError (one line, naming the key) for a missing or unreadable file, another
    format, a newer format version, or any key of the wrong type."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise IndexFormatError(f"{directory}: no {MANIFEST} (not an index, or an unfinished build)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise IndexFormatError(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"{path}: not a {FORMAT_NAME} manifest")
    version = manifest.get("format_version")
    if not _is_int(version) or not 1 <= version <= FORMAT_VERSION:
        raise IndexFormatError(
            f"{path}: format_version {version!r} is not readable by this build "
            f"(reads 1..{FORMAT_VERSION}); upgrade grace-serving"
        )
    fault = _manifest_fault(manifest)
    if fault is not None:
        raise IndexFormatError(f"{path}: {fault}")
    return manifest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# key -> (required, accepted types, what the message calls them)
_MANIFEST_KEYS: dict[str, tuple[bool, tuple[type, ...], str]] = {
    "index_version": (True, (str,), "a string"),
    "tokenizer_fingerprint": (True, (str,), "a string"),
    "targeting": (True, (dict,), "an object"),
    "arrays": (True, (dict,), "an object of array entries"),
    "created": (False, (str,), "an ISO-8601 string"),
    "catalog": (False, (dict,), "an object"),
    "counts": (False, (dict,), "an object"),
    "kway": (False, (dict, type(None)), "an object or null"),
}


def _manifest_fault(manifest: dict[str, Any]) -> str | None:
    """The first structural fault of a parsed manifest, as one line; None when sound."""
    for key, (required, types, what) in _MANIFEST_KEYS.items():
        if key not in manifest:
            if required:
                return f"manifest lacks {key!r}"
            continue
        if not isinstance(manifest[key], types):
            return f"manifest key {key!r} must be {what}, got {type(manifest[key]).__name__}"
    if not manifest["index_version"] or "/" in manifest["index_version"]:
        return f"manifest key 'index_version' {manifest['index_version']!r} is not a version name"
    if "created" in manifest:
        try:
            datetime.fromisoformat(manifest["created"])
        except ValueError:
            return f"manifest key 'created' {manifest['created']!r} is not an ISO-8601 time"
    for name, entry in manifest["arrays"].items():
        fault = _array_entry_fault(entry)
        if fault is not None:
            return f"manifest key 'arrays.{name}' {fault}"
    return None


def _array_entry_fault(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return f"must be an object, got {type(entry).__name__}"
    for key in ("file", "dtype", "sha256"):
        if not isinstance(entry.get(key), str):
            return f"needs a string {key!r}, got {entry.get(key)!r}"
    name = entry["file"]
    if name in ("", ".", "..") or os.sep in name or "/" in name:
        return f"'file' {name!r} is not a file name inside the version directory"
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        return f"needs 'shape' as a list of non-negative ints, got {shape!r}"
    return None


# the layout before declared schemas hashed its one Bloom family (locations) so
LEGACY_BLOOM_HASH = "blake2b-64: bit_i = digest[i], i < bloom_hashes"


def legacy_schema_manifest() -> dict[str, Any]:
    """The `targeting` key of an index in the layout before declared schemas: `DEFAULT`'s
    fixed layout (schema version 1), which those readers compare key by key."""
    locations = DEFAULT.attribute("locations")
    masked = [(DEFAULT.attribute(name), at) for name, at in DEFAULT.bit_offsets.items()]
    return {
        "version": 1,
        "bitmask_bits": DEFAULT.bitmask_bits,
        "bitmask_words": DEFAULT.bitmask_words,
        "bloom_bits": locations.bloom_bits,
        "bloom_words": locations.bloom_bits // 64,
        "bloom_hashes": locations.bloom_hashes,
        "bloom_hash": LEGACY_BLOOM_HASH,
        "max_request_locations": locations.max_request_values,
        "attributes": {
            a.name: {"offset": at, "values": list(a.labels), "unknown_bit": at + len(a.labels)}
            for a, at in masked
        },
    }


def check_legacy_schema(stored: dict[str, Any]) -> None:
    """Raise ValueError naming the first key where a manifest's `targeting` (an index from
    before declared schemas) differs from `legacy_schema_manifest()`."""
    for key, value in legacy_schema_manifest().items():
        if stored.get(key) != value:
            raise ValueError(
                f"targeting schema mismatch on {key!r}: index has {stored.get(key)!r}, "
                f"this build expects {value!r}"
            )


def manifest_schema(manifest: dict[str, Any], directory: Path | str = "") -> TargetingSchema:
    """The targeting schema a manifest stores: an index from before declared schemas was
    built with `DEFAULT` and must hold exactly its fixed layout; IndexFormatError (one
    line) for one this build cannot read."""
    stored = manifest.get("targeting")
    if not isinstance(stored, dict):
        raise IndexFormatError(f"{directory}: manifest key 'targeting' must be an object")
    if "schema" not in stored:
        try:
            check_legacy_schema(stored)
        except ValueError as exc:
            raise IndexFormatError(f"{directory}: {exc}") from exc
        return DEFAULT
    try:
        return TargetingSchema.from_manifest(stored)
    except SchemaError as exc:
        raise IndexFormatError(f"{directory}: targeting schema: {exc}") from exc
