"""Small published indexes for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index_builder.build import build_arrays
from index_builder.format import IndexArrays, write_index_dir
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
