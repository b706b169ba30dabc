"""The index files' reader: a malformed manifest is refused naming the key (one line, never
a KeyError), and the server's private-memory load serves exactly the bytes it checked."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.index_format import array_items, file_sha256, read_index_dir
from contracts.index_manifest import IndexFormatError, read_manifest
from contracts.index_validation import IndexValidationError, validate_index
from contracts.npy_private import NpyError, load_npy_private


def _edit_manifest(directory: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _entry(m: dict) -> dict:
    return m["arrays"]["trie.bloom_table"]


@pytest.mark.parametrize(
    ("edit", "fault"),
    [
        (lambda m: _entry(m).pop("sha256"), "'arrays.trie.bloom_table' needs a string 'sha256'"),
        (lambda m: _entry(m).update(sha256=None), "needs a string 'sha256'"),
        (lambda m: _entry(m).update(dtype=8), "needs a string 'dtype'"),
        (lambda m: _entry(m).pop("file"), "needs a string 'file'"),
        (lambda m: _entry(m).update(file="../../etc/passwd"), "not a file name"),
        (lambda m: _entry(m).update(shape="12,4"), "'shape' as a list of non-negative ints"),
        (lambda m: _entry(m).update(shape=[1.5, 4]), "'shape' as a list of non-negative ints"),
        (lambda m: _entry(m).update(shape=[-1, 4]), "'shape' as a list of non-negative ints"),
        (lambda m: m["arrays"].update({"trie.bloom_table": "x.npy"}), "must be an object"),
        (lambda m: m.update(arrays=list(m["arrays"].values())), "'arrays' must be an object"),
        (lambda m: m.update(tokenizer_fingerprint=None), "'tokenizer_fingerprint' must be a"),
        (lambda m: m.update(index_version=7), "'index_version' must be a string"),
        (lambda m: m.update(index_version="../x"), "is not a version name"),
        (lambda m: m.update(targeting=[]), "'targeting' must be an object"),
        (lambda m: m.update(created=12), "'created' must be an ISO-8601 string"),
        (lambda m: m.update(created="yesterday"), "'created' 'yesterday' is not an ISO-8601"),
        (lambda m: m.update(catalog="x"), "'catalog' must be an object"),
        (lambda m: m.update(counts=[1]), "'counts' must be an object"),
        (lambda m: m.update(kway=3), "'kway' must be an object or null"),
        (lambda m: m.update(format_version=True), "format_version True"),
        (lambda m: m.pop("targeting"), "manifest lacks 'targeting'"),
    ],
)
def test_malformed_manifest_is_refused_naming_the_key(published: Path, edit, fault) -> None:
    _edit_manifest(published, edit)
    with pytest.raises(IndexFormatError, match=f"^{published}.*{re.escape(fault)}") as err:
        read_manifest(published)
    assert "\n" not in str(err.value)
    with pytest.raises(IndexValidationError, match=re.escape(fault)):
        validate_index(published)


def test_a_sound_manifest_reads(published: Path) -> None:
    manifest = read_manifest(published)
    assert manifest["index_version"] == published.name
    assert set(manifest["arrays"]) >= {"trie.node_offsets", "ads.ad_ids"}


def test_private_load_equals_the_memory_map_and_is_immune_to_the_files(published: Path) -> None:
    """mmap=False holds read-only arrays in private memory: truncating or overwriting the
    files afterwards changes nothing the reader holds."""
    _, mapped = read_index_dir(published, mmap=True)
    _, private = read_index_dir(published, mmap=False)
    expected = {name: np.array(a) for name, a in array_items(mapped).items()}
    for path in published.glob("*.npy"):
        os.truncate(path, 0)
    held = array_items(private)
    assert held.keys() == expected.keys()
    for key, want in expected.items():
        got = held[key]
        assert not isinstance(got, np.memmap) and not got.flags.writeable
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)


def test_private_load_checks_the_bytes_it_serves(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(10, dtype=np.int64))
    good = file_sha256(path)
    np.testing.assert_array_equal(load_npy_private(path, good), np.arange(10))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(NpyError, match="checksum mismatch"):
        load_npy_private(path, good)


@pytest.mark.parametrize(
    ("content", "fault"),
    [
        (lambda: np.arange(10, dtype=np.int64), None),
        (lambda: np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)), None),
        (lambda: np.zeros((0, 5), dtype=np.uint64), None),
        (lambda: b"not an array at all", "not a .npy file"),
        (lambda: np.array([{"a": 1}], dtype=object), "Python objects"),
    ],
    ids=["int64", "fortran", "empty", "garbage", "objects"],
)
def test_private_load_parses_the_npy_header(tmp_path: Path, content, fault) -> None:
    path = tmp_path / "a.npy"
    value = content()
    if isinstance(value, bytes):
        path.write_bytes(value)
    else:
        np.save(path, value, allow_pickle=True)
    if fault is None:
        np.testing.assert_array_equal(load_npy_private(path), value)
    else:
        with pytest.raises(NpyError, match=re.escape(fault)):
            load_npy_private(path)


def test_private_load_of_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(100, dtype=np.int64))
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(NpyError, match="792 data bytes for 100 x int64"):
        load_npy_private(path)
