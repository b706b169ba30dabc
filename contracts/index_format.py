"""On-disk index format: the one writer/reader pair for `<root>/<version>/` (ARCHITECTURE.md §3).

The index builder writes with `write_index_dir`; the server (into private memory,
checksumming the bytes it serves: `npy_private.py`) and `grace validate-index`
(memory-mapped) read with `read_index_dir`; nothing else touches the files. A version
directory holds `manifest.json` (every key checked by `read_manifest`) and one `.npy` per
array (the dataclasses below); docs/FORMAT.md §3 describes each key and array. Readers
accept every format version up to `FORMAT_VERSION` and refuse newer ones. One
writer/reader pair in one module, by design (FAISS's rule): it runs past the house's ~300
lines rather than split the format across files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from contracts import targeting as legacy
from contracts.npy_private import NpyError, load_npy_private
from contracts.targeting_codec import AdRules, Ragged
from contracts.targeting_schema import DEFAULT, SchemaError, TargetingSchema

FORMAT_NAME = "grace-index"
# 2: may hold ads.ad_campaign_ids / ad_advertiser_ids; 3: a declared targeting schema,
# its set attributes under sets.<name>.*; each written only when needed
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
SID_LENGTH = 4
VOCAB_SIZE = 512


class IndexFormatError(ValueError):
    """An index directory that cannot be read: missing, corrupt or incompatible."""


@dataclass(frozen=True)
class TrieArrays:
    """The GTM SID trie in CSR form (paper Appendix A). Entry j leads to node j + 1."""

    node_offsets: np.ndarray  # int32 [num_nodes + 1]: node i's entries [off[i], off[i+1])
    csr_child_nodes: np.ndarray  # int32 [E]
    csr_tokens: np.ndarray  # int16 [E]
    bitmask_index: np.ndarray  # int32 [E]
    bloom_index: np.ndarray  # int32 [E]
    bitmask_table: np.ndarray  # uint64 [R_bm, bitmask_words], deduplicated
    bloom_table: np.ndarray  # uint64 [R_bl, bloom_words], deduplicated
    level_offsets: np.ndarray  # int64 [SID_LENGTH + 2]: depth d's nodes [lo[d], lo[d+1])

    @property
    def num_nodes(self) -> int:
        return len(self.node_offsets) - 1

    @property
    def num_entries(self) -> int:
        return len(self.csr_tokens)


@dataclass(frozen=True)
class SetArrays:
    """One set attribute's exact rules over N ads: its include and exclude lists as sorted
    ids into its vocabulary (empty = no rule), and the vocabulary, every value either
    list names (sorted, unique, UTF-8)."""

    include_offsets: np.ndarray  # int64 [N + 1]
    include_ids: np.ndarray  # int32 [nnz]
    vocab_offsets: np.ndarray  # int64 [V + 1]
    vocab_bytes: np.ndarray  # uint8 [total bytes]
    exclude_offsets: np.ndarray | None = None  # int64 [N + 1]; None: no ad excludes
    exclude_ids: np.ndarray | None = None  # int32 [nnz]

    @property
    def include(self) -> Ragged:
        return Ragged(self.include_offsets, self.include_ids)

    @property
    def exclude(self) -> Ragged | None:
        if self.exclude_offsets is None or self.exclude_ids is None:
            return None
        return Ragged(self.exclude_offsets, self.exclude_ids)

    def strings(self) -> list[str]:
        """The vocabulary, decoded (sorted, unique)."""
        raw = self.vocab_bytes.tobytes()
        off = self.vocab_offsets
        return [raw[off[i] : off[i + 1]].decode("utf-8") for i in range(len(off) - 1)]

    @classmethod
    def from_strings(
        cls, include: Ragged, exclude: Ragged | None, vocabulary: list[str]
    ) -> SetArrays:
        """Lists of ids into `vocabulary` (sorted, unique strings)."""
        raw = [s.encode("utf-8") for s in vocabulary]
        offsets = np.zeros(len(raw) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in raw], out=offsets[1:])
        return cls(
            include_offsets=include.offsets.astype(np.int64),
            include_ids=include.values.astype(np.int32),
            vocab_offsets=offsets,
            vocab_bytes=np.frombuffer(b"".join(raw), dtype=np.uint8),
            exclude_offsets=None if exclude is None else exclude.offsets.astype(np.int64),
            exclude_ids=None if exclude is None else exclude.values.astype(np.int32),
        )


@dataclass(frozen=True)
class AdArrays:
    """SID -> ad index and the exact ad targeting index, both in leaf (SID) order."""

    leaf_sids: np.ndarray  # int16 [num_leaves, SID_LENGTH]: SID of leaf node lo[-2] + i
    leaf_ad_offsets: np.ndarray  # int64 [num_leaves + 1]: leaf i's ads [off[i], off[i+1])
    ad_ids: np.ndarray  # int64 [N]
    ad_bitmask: np.ndarray  # uint64 [N, bitmask_words]: enum/bucket rules, exclusions in
    # each set attribute of the schema, by name (the default schema's: locations)
    sets: Mapping[str, SetArrays] = field(default_factory=dict)
    # each ad's campaign and advertiser, 0 = none (None: the catalog named none, and a
    # request's block on them cannot be applied)
    ad_campaign_ids: np.ndarray | None = None  # int64 [N]
    ad_advertiser_ids: np.ndarray | None = None  # int64 [N]
    # uint64 [N, bitmask_words]: the bits each ad's enum/bucket exclusions cleared (what
    # tells an exclusion from an include failure in the post stage's counts); None: none
    ad_exclude_bitmask: np.ndarray | None = None

    @property
    def num_ads(self) -> int:
        return len(self.ad_ids)

    def rules(self) -> AdRules:
        """The ads' exact targeting, as `targeting_codec.exact_eligible` reads it."""
        return AdRules(
            bitmask=self.ad_bitmask,
            include={name: s.include for name, s in self.sets.items()},
            exclude={name: x for name, s in self.sets.items() if (x := s.exclude) is not None},
            campaign=self.ad_campaign_ids,
            advertiser=self.ad_advertiser_ids,
        )


@dataclass(frozen=True)
class PartitionArrays:
    """k-way partitioned matchers, jagged: entry j has partitions [offsets[j], offsets[j+1])."""

    offsets: np.ndarray  # int64 [E + 1]
    bitmask_index: np.ndarray  # int32 [P]
    bloom_index: np.ndarray  # int32 [P]
    bitmask_table: np.ndarray  # uint64 [R, bitmask_words]
    bloom_table: np.ndarray  # uint64 [R, bloom_words]


@dataclass(frozen=True)
class IndexArrays:
    trie: TrieArrays
    ads: AdArrays
    kway: PartitionArrays | None = None


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


def legacy_schema_manifest() -> dict[str, Any]:
    """The `targeting` key of an index in the layout before declared schemas (the default
    schema's fixed layout, which those readers compare key by key)."""
    return legacy.TargetingSchema.current().to_manifest()


def manifest_schema(manifest: dict[str, Any], directory: Path | str = "") -> TargetingSchema:
    """The targeting schema a manifest stores: an index from before declared schemas was
    built with `DEFAULT` and must hold exactly its fixed layout; IndexFormatError (one
    line) for one this build cannot read."""
    stored = manifest.get("targeting")
    if not isinstance(stored, dict):
        raise IndexFormatError(f"{directory}: manifest key 'targeting' must be an object")
    if "schema" not in stored:
        try:
            legacy.TargetingSchema.current().check_compatible(stored)
        except ValueError as exc:
            raise IndexFormatError(f"{directory}: {exc}") from exc
        return DEFAULT
    try:
        return TargetingSchema.from_manifest(stored)
    except SchemaError as exc:
        raise IndexFormatError(f"{directory}: targeting schema: {exc}") from exc


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
