"""Catalog columns with more list values than 32-bit offsets reach (the embeddings of
~67 M ads at dim 32; a 100 M-ad build failed with "offset overflow while concatenating
arrays"): read as large lists, the same catalog as below the limit. The limit is lowered
here so that a few thousand rows cross it (`parquet_columns._I32_MAX`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from index_builder import parquet_columns
from index_builder.catalog import read_catalog


def write(path: Path, n: int, dim: int, odd_row: int | None = None) -> np.ndarray:
    """A catalog of `n` ads with embeddings (row `odd_row` one value short), in row
    groups of 500; the embeddings as written."""
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(n, dim)).astype(np.float32)
    rows = [e.tolist() for e in emb]
    if odd_row is not None:
        rows[odd_row] = rows[odd_row][:-1]
    table = pa.table({"ad_id": pa.array(np.arange(1, n + 1), pa.int64()),
                      "embedding": pa.array(rows, pa.list_(pa.float32()))})  # fmt: skip
    pq.write_table(table, path, row_group_size=500)
    return emb


@pytest.mark.parametrize("odd", [None, 2600])
def test_embeddings_past_32_bit_offsets_read_as_below_them(tmp_path: Path, monkeypatch,
                                                           odd: int | None) -> None:  # fmt: skip
    """Packed into one buffer (every row one width), or concatenated once a row of another
    width stops the packing (that row then a bad row within the budget)."""
    emb = write(tmp_path / "c.parquet", 3000, 8, odd)
    budget = 0.01 if odd is not None else 0.0
    below = read_catalog(tmp_path / "c.parquet", progress=False, bad_row_budget=budget)
    monkeypatch.setattr(parquet_columns, "_I32_MAX", 8 * 1000)  # crossed after 1,000 rows
    past = read_catalog(tmp_path / "c.parquet", progress=False, bad_row_budget=budget)
    path = tmp_path / "c.parquet"
    column = parquet_columns.read_columns(path, pq.ParquetFile(path), ["embedding"], False)
    assert pa.types.is_large_list(column["embedding"].type)  # the path past the limit
    assert past.embedding is not None and below.embedding is not None
    np.testing.assert_array_equal(past.embedding, below.embedding)
    np.testing.assert_array_equal(past.ad_id, below.ad_id)
    keep = np.ones(3000, bool)
    if odd is not None:
        keep[odd] = False
        assert [e.field for e in past.rejected] == ["embedding"]
    np.testing.assert_array_equal(past.embedding, emb[keep])
