"""On-disk index format: the one writer/reader pair for `<root>/<version>/` (ARCHITECTURE.md §3).

The index builder writes with `write_index_dir`; the server (into private memory,
checksumming the bytes it serves: `npy_private.py`) and `grace validate-index`
(memory-mapped) read with `read_index_dir`; nothing else touches the files. A version
directory holds `manifest.json` (`contracts/index_manifest.py` checks it key by key) and
one `.npy` per array of `contracts/index_arrays.py`; docs/FORMAT.md §3 describes each key
and array. The arrays' widths and the set attributes' arrays follow the targeting schema
the manifest stores. An index of the default schema without exclusions is written in the
layout readers before declared schemas know (format 1 or 2, its locations under
`ads.ad_loc_*`); any other in format 3 (each set attribute under `sets.<name>.*`).
Readers accept every format version up to `FORMAT_VERSION` and refuse newer ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from contracts.index_arrays import AdArrays, IndexArrays, PartitionArrays, SetArrays, TrieArrays
from contracts.index_manifest import (
    FORMAT_NAME,
    MANIFEST,
    IndexFormatError,
    legacy_schema_manifest,
    manifest_schema,
    read_manifest,
)
from contracts.npy_private import NpyError, load_npy_private
from contracts.targeting_schema import DEFAULT, TargetingSchema

SID_LENGTH = 4
VOCAB_SIZE = 512


# name -> (dtype, ndim, trailing width: a number, "bitmask" or "bloom" (the schema's
# words), or None); a set attribute's arrays are `_SET_SPECS`', named sets.<name>.<field>
_SPECS: dict[str, tuple[str, int, int | str | None]] = {
    "trie.node_offsets": ("int32", 1, None),
    "trie.csr_child_nodes": ("int32", 1, None),
    "trie.csr_tokens": ("int16", 1, None),
    "trie.bitmask_index": ("int32", 1, None),
    "trie.bloom_index": ("int32", 1, None),
    "trie.bitmask_table": ("uint64", 2, "bitmask"),
    "trie.bloom_table": ("uint64", 2, "bloom"),
    "trie.level_offsets": ("int64", 1, None),
    "ads.leaf_sids": ("int16", 2, SID_LENGTH),
    "ads.leaf_ad_offsets": ("int64", 1, None),
    "ads.ad_ids": ("int64", 1, None),
    "ads.ad_bitmask": ("uint64", 2, "bitmask"),
    "ads.ad_campaign_ids": ("int64", 1, None),
    "ads.ad_advertiser_ids": ("int64", 1, None),
    "ads.ad_exclude_bitmask": ("uint64", 2, "bitmask"),
    "kway.offsets": ("int64", 1, None),
    "kway.bitmask_index": ("int32", 1, None),
    "kway.bloom_index": ("int32", 1, None),
    "kway.bitmask_table": ("uint64", 2, "bitmask"),
    "kway.bloom_table": ("uint64", 2, "bloom"),
}
_SET_SPECS: dict[str, tuple[str, int, None]] = {
    "include_offsets": ("int64", 1, None),
    "include_ids": ("int32", 1, None),
    "vocab_offsets": ("int64", 1, None),
    "vocab_bytes": ("uint8", 1, None),
    "exclude_offsets": ("int64", 1, None),
    "exclude_ids": ("int32", 1, None),
}
# the layout before declared schemas: the default schema's locations under these names
_LEGACY_SET = "locations"
_LEGACY_NAMES = {
    "ads.ad_loc_offsets": "include_offsets",
    "ads.ad_loc_ids": "include_ids",
    "ads.loc_vocab_offsets": "vocab_offsets",
    "ads.loc_vocab_bytes": "vocab_bytes",
}
_GROUPS = {"trie": TrieArrays, "ads": AdArrays, "kway": PartitionArrays}


def _is_legacy(arrays: IndexArrays, schema: TargetingSchema) -> bool:
    """Whether the index fits the layout of readers before declared schemas."""
    ads = arrays.ads
    return (schema == DEFAULT and ads.ad_exclude_bitmask is None
            and all(s.exclude_offsets is None for s in ads.sets.values()))  # fmt: skip


def array_items(arrays: IndexArrays, legacy: bool = False) -> dict[str, np.ndarray]:
    """Every array of an index by its file name (less `.npy`), the optional ones it lacks
    left out; `legacy`: the default schema's locations under the names before schemas."""
    out: dict[str, np.ndarray] = {}
    for group in _GROUPS:
        part = getattr(arrays, group)
        if part is not None:
            for f in fields(part):
                value = getattr(part, f.name)
                if f.name == "sets":
                    for attr, arrs in value.items():
                        for g in fields(arrs):
                            if getattr(arrs, g.name) is not None:
                                out[f"sets.{attr}.{g.name}"] = getattr(arrs, g.name)
                elif value is not None:  # an optional array it lacks
                    out[f"{group}.{f.name}"] = value
    if legacy:
        for old, new in _LEGACY_NAMES.items():
            out[old] = out.pop(f"sets.{_LEGACY_SET}.{new}")
    return out


def _spec(name: str) -> tuple[str, int, int | str | None] | None:
    if name.startswith("sets."):
        return _SET_SPECS.get(name.rsplit(".", 1)[-1])
    return _SPECS.get(name) or (_SET_SPECS[_LEGACY_NAMES[name]] if name in _LEGACY_NAMES else None)


def _check_spec(name: str, arr: np.ndarray, schema: TargetingSchema) -> None:
    spec = _spec(name)
    assert spec is not None, name
    dtype, ndim, width = spec
    if width == "bitmask":
        width = schema.bitmask_words
    elif width == "bloom":
        width = schema.bloom_words
    ok = arr.dtype == np.dtype(dtype) and arr.ndim == ndim
    if not ok or (width is not None and arr.shape[-1] != width):
        raise IndexFormatError(
            f"{name}: expected {dtype} with {ndim} dims"
            + (f" and width {width}" if width is not None else "")
            + f", got {arr.dtype} {arr.shape}"
        )


SHA_CHUNK = 64 << 20  # bytes hashed between two calls of `file_sha256`'s `between`


def file_sha256(path: Path, between: Callable[[], None] | None = None) -> str:
    """The file's sha256 hex digest; `between` (when given) is called after each
    SHA_CHUNK bytes (a model swap's pace, `service/pace.py`)."""
    with open(path, "rb") as fh:
        if between is None:
            return hashlib.file_digest(fh, "sha256").hexdigest()
        digest, buf = hashlib.sha256(), bytearray(SHA_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            digest.update(view[:n])
            between()
        return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so renames inside it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index_dir(
    directory: Path,
    arrays: IndexArrays,
    manifest: dict[str, Any],
    schema: TargetingSchema = DEFAULT,
) -> dict:
    """Write every array and then the manifest into an existing, empty `directory`; each
    file fsynced, the manifest (with checksums) last, so a directory without
    `manifest.json` is never a complete index. `schema`: the targeting schema the arrays
    were encoded with. Returns the full manifest."""
    if set(arrays.ads.sets) != {a.name for a in schema.families}:
        raise IndexFormatError(f"the ads' set attributes {sorted(arrays.ads.sets)} are not "
                               f"the schema's {[a.name for a in schema.families]}")  # fmt: skip
    legacy = _is_legacy(arrays, schema)
    entries = {}
    for name, arr in array_items(arrays, legacy).items():
        _check_spec(name, arr, schema)
        path = directory / f"{name}.npy"
        with open(path, "wb") as fh:
            np.save(fh, np.ascontiguousarray(arr), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        entries[name] = {
            "file": path.name,
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
            "sha256": file_sha256(path),
        }
    owners = arrays.ads.ad_campaign_ids is not None or arrays.ads.ad_advertiser_ids is not None
    full = {
        "format": FORMAT_NAME,
        "format_version": 3 if not legacy else 2 if owners else 1,  # what older readers take
        **manifest,
        "targeting": legacy_schema_manifest() if legacy else schema.to_manifest(),
        "sid_length": SID_LENGTH,
        "vocab_size": VOCAB_SIZE,
        "arrays": entries,
    }
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(full, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_path(directory)
    return full


def read_index_dir(
    directory: Path, *, verify_checksums: bool = True, mmap: bool = True
) -> tuple[dict[str, Any], IndexArrays]:
    """Open an index directory: manifest + arrays, memory-mapped (`mmap=True`) or read
    into private memory (`load_npy_private`: what the server serves). Checks presence,
    checksums (unless disabled), dtypes and shapes against the manifest; structural
    invariants are `contracts.index_validation`'s job."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    schema = manifest_schema(manifest, directory)
    families = {a.name for a in schema.families}
    loaded: dict[str, np.ndarray] = {}
    for name, entry in manifest["arrays"].items():
        attr = name.split(".")[1] if name.startswith("sets.") and name.count(".") == 2 else None
        if _spec(name) is None or (attr is not None and attr not in families):
            raise IndexFormatError(f"{directory}: unknown array {name!r} in manifest")
        path = directory / entry["file"]
        if not path.is_file():
            raise IndexFormatError(f"{path}: missing array file")
        arr = _load_array(path, entry["sha256"] if verify_checksums else None, mmap=mmap)
        if list(arr.shape) != entry["shape"] or str(arr.dtype) != entry["dtype"]:
            raise IndexFormatError(
                f"{path}: holds {arr.dtype} {list(arr.shape)}, manifest says "
                f"{entry['dtype']} {entry['shape']}"
            )
        _check_spec(name, arr, schema)
        loaded[name] = arr
    for old, new in _LEGACY_NAMES.items():
        if old in loaded:
            loaded[f"sets.{_LEGACY_SET}.{new}"] = loaded.pop(old)
    groups: dict[str, Any] = {}
    for group, cls in _GROUPS.items():
        names = [f"{group}.{f.name}" for f in fields(cls) if f.name != "sets"]
        present = [n for n in names if n in loaded]
        if not present and group == "kway":
            groups[group] = None
            continue
        optional = {f"{group}.{f.name}" for f in fields(cls) if f.default is None}
        missing = sorted(set(names) - set(present) - optional)
        if missing:
            raise IndexFormatError(f"{directory}: manifest lacks arrays {missing}")
        groups[group] = {n.split(".", 1)[1]: loaded[n] for n in present}
    groups["ads"]["sets"] = {a: _set_arrays(directory, a, loaded) for a in sorted(families)}
    groups = {g: v if v is None else _GROUPS[g](**v) for g, v in groups.items()}
    return manifest, IndexArrays(**groups)


def _set_arrays(directory: Path, attr: str, loaded: dict[str, np.ndarray]) -> SetArrays:
    mine = {f: loaded[f"sets.{attr}.{f}"] for f in _SET_SPECS if f"sets.{attr}.{f}" in loaded}
    missing = sorted(f"sets.{attr}.{f.name}" for f in fields(SetArrays)
                     if f.default is not None and f.name not in mine)  # fmt: skip
    if missing:
        raise IndexFormatError(f"{directory}: manifest lacks arrays {missing}")
    if ("exclude_offsets" in mine) != ("exclude_ids" in mine):
        raise IndexFormatError(f"{directory}: sets.{attr}: exclude_offsets and exclude_ids "
                               "come together")  # fmt: skip
    return SetArrays(**mine)


def _load_array(path: Path, sha256: str | None, *, mmap: bool) -> np.ndarray:
    try:
        if not mmap:
            return load_npy_private(path, sha256)
    except NpyError as exc:  # its message names the file and the fault
        raise IndexFormatError(str(exc)) from exc
    try:
        if sha256 is not None and file_sha256(path) != sha256:
            raise IndexFormatError(f"{path}: checksum mismatch (corrupted or truncated)")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except IndexFormatError:
        raise
    except (OSError, ValueError) as exc:
        raise IndexFormatError(f"{path}: unreadable array: {exc}") from exc
