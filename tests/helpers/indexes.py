"""Small published indexes for tests, and writers / checks that make `publish` fail."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from contracts.index_arrays import IndexArrays
from contracts.index_format import file_sha256, write_index_dir
from contracts.index_validation import validate_index
from index_builder.build import build_arrays
from index_builder.sidecar import BuilderConfig, BuilderStats, run_builder
from tests.helpers.catalogs import catalog_from_ads
from tests.helpers.oracle import Ad


def small_index(n: int = 50) -> IndexArrays:
    ads = [
        Ad(
            100 + i,
            (i % 5, i % 7, i % 11, i),
            countries=("US",) if i % 2 else (),
            locations=(f"US/R{i % 3}",) if i % 3 else (),
        )
        for i in range(n)
    ]
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64))


def writer(arrays: IndexArrays, tokenizer: str = "test"):
    """A `publish` writer for fixed arrays."""

    def write(directory: Path, version: str) -> None:
        write_index_dir(
            directory, arrays, {"index_version": version, "tokenizer_fingerprint": tokenizer}
        )

    return write


Writer = Callable[[Path, str], None]


def validator(tokenizer: str = "test") -> Writer:
    """The `publish` check the builder uses: full validation for `tokenizer`, version name."""

    def check(directory: Path, version: str) -> None:
        validate_index(directory, expect_tokenizer=tokenizer, expect_version=version)

    return check


def rewrite_array(version: Path, name: str, arr: np.ndarray) -> None:
    """Replace an array of a version directory *and* its checksum: only the structural
    checks can object."""
    path = version / f"{name}.npy"
    np.save(path, arr)
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["arrays"][name].update(sha256=file_sha256(path), shape=list(arr.shape))
    (version / "manifest.json").write_text(json.dumps(manifest))


def flip_byte(path: Path, at: int = -1) -> None:
    """Flip one bit of one byte of a file in place (its checksum no longer matches)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def corrupting(write: Writer, array: str = "trie.bloom_table") -> Writer:
    """`write`, then one byte of `array`'s file flipped: a version that must not serve."""

    def corrupt(directory: Path, version: str) -> None:
        write(directory, version)
        flip_byte(directory / f"{array}.npy")

    return corrupt


def corrupt_builds(monkeypatch: pytest.MonkeyPatch, array_file: str) -> None:
    """From now on every `build_index` writes its version, then flips a byte of
    `array_file` in it (as a failing disk or a buggy writer would): the publisher's
    validation must catch it."""
    import index_builder.build as build_module

    real_write = build_module.write_index_dir

    def corrupt_write(directory: Path, arrays: IndexArrays, manifest: dict, *rest: object) -> dict:
        full = real_write(directory, arrays, manifest, *rest)
        flip_byte(directory / array_file)
        return full

    monkeypatch.setattr(build_module, "write_index_dir", corrupt_write)


@contextmanager
def running_builder(cfg: BuilderConfig) -> Iterator[dict[str, BuilderStats]]:
    """The builder sidecar (`run_builder`) in a thread; stopped on exit, its stats then
    under "stats"."""
    stop = threading.Event()
    result: dict[str, BuilderStats] = {}
    thread = threading.Thread(target=lambda: result.update(stats=run_builder(cfg, stop)))
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
