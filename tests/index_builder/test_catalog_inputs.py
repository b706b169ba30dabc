"""Catalog inputs a team brings (docs/DATA.md): gzip JSON Lines, a directory of parts
(JSON Lines or Parquet, hive partitions too), fields the format does not know, a format
version stamped in Parquet; errors keep naming the file (the part), row and field."""

from __future__ import annotations

import gzip
import logging
import shutil
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contracts.data_format import CATALOG_VERSION_KEY
from index_builder.build import build_index
from index_builder.catalog import Catalog, CatalogError, catalog_fingerprint, read_catalog
from tests.helpers.catalogs import catalog_arrays

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "catalog.jsonl"
ROWS = [orjson.loads(line) for line in EXAMPLE.read_bytes().splitlines() if line.strip()]


def same(a: Catalog, b: Catalog) -> None:
    left, right = catalog_arrays(a), catalog_arrays(b)
    for field in ("ad_id", "sid", "bitmask", "locations.include.offsets",
                  "locations.include.values", "locations.vocabulary"):  # fmt: skip
        np.testing.assert_array_equal(left[field], right[field], err_msg=field)


def write_jsonl(path: Path, rows: list[dict], compress: bool = False) -> Path:
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_parquet(path: Path, rows: list[dict], metadata: dict | None = None) -> Path:
    fields = ("ad_id", "sid", "countries", "age_buckets", "genders", "locations")
    cols = {f: [r.get(f) for r in rows] for f in fields}
    table = pa.table(cols)
    if metadata:
        table = table.replace_schema_metadata(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def test_the_example_catalog_builds_and_publishes_an_index(tmp_path: Path) -> None:
    version, report = build_index(EXAMPLE, tmp_path / "idx", progress=False)
    assert (tmp_path / "idx" / "CURRENT").read_text().strip() == version
    assert report.counts["ads"] == len(ROWS)


def test_gzip_jsonl_reads_as_the_plain_file(tmp_path: Path) -> None:
    plain = read_catalog(EXAMPLE, progress=False)
    packed = read_catalog(write_jsonl(tmp_path / "c.jsonl.gz", ROWS, compress=True), progress=False)
    same(plain, packed)
    assert len(plain.ad_id) == len(ROWS)


def test_a_directory_of_parts_reads_as_one_catalog(tmp_path: Path) -> None:
    plain = read_catalog(EXAMPLE, progress=False)
    for i, chunk in enumerate((ROWS[:5], ROWS[5:9], ROWS[9:])):
        write_jsonl(tmp_path / "jsonl" / f"part-{i}.jsonl{'.gz' if i == 1 else ''}", chunk, i == 1)
    (tmp_path / "jsonl" / "_SUCCESS").write_text("")  # a job marker: skipped
    same(plain, read_catalog(tmp_path / "jsonl", progress=False))
    # Parquet parts under hive partition directories; the partition key is not a field
    for i, chunk in enumerate((ROWS[:4], ROWS[4:])):
        write_parquet(tmp_path / "pq" / f"day=2026-12-0{i + 1}" / "part.parquet", chunk)
    (tmp_path / "pq" / "README.txt").write_text("not a part")  # other files: not parts
    got = read_catalog(tmp_path / "pq", progress=False)
    same(plain, got)


def test_a_bad_row_in_a_part_names_that_part_and_its_row(tmp_path: Path) -> None:
    write_parquet(tmp_path / "d" / "a.parquet", ROWS[:3])
    bad = [*ROWS[3:6]]
    bad[1] = {**bad[1], "age_buckets": ["18-25"]}
    write_parquet(tmp_path / "d" / "b.parquet", bad)
    with pytest.raises(CatalogError, match=r"b\.parquet: row 1: field 'age_buckets'") as e:
        read_catalog(tmp_path / "d", progress=False)
    assert e.value.path.endswith("b.parquet") and e.value.location == "row 1"
    write_jsonl(tmp_path / "j" / "1.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "j" / "2.jsonl", [ROWS[5], ROWS[0]])  # ROWS[0] again
    with pytest.raises(
        CatalogError, match=r"2\.jsonl: line 2: field 'ad_id'.*line 1 of .*1\.jsonl"
    ):
        read_catalog(tmp_path / "j", progress=False)


def test_fields_the_format_does_not_know_are_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{**r, "advertiser": "acme"} if i % 2 else {**r, "bid": 1.5} for i, r in enumerate(ROWS)]
    with caplog.at_level(logging.WARNING, logger="grace.catalog"):
        cat = read_catalog(write_jsonl(tmp_path / "c.jsonl", rows), progress=False)
    assert cat.ignored_fields == ("advertiser", "bid")
    assert [r.message for r in caplog.records if "advertiser, bid" in r.message]
    same(read_catalog(EXAMPLE, progress=False), cat)  # and nothing else changes


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("empty", "no catalog files"),
        ("mixed", "mixes JSON Lines and Parquet parts"),
        ("newer", "written for catalog format '2'"),
        ("corrupt", "cannot decompress"),
        ("mismatch", "does not combine with the other parts"),
    ],
)
def test_unreadable_inputs_are_refused_with_one_line(
    tmp_path: Path, layout: str, message: str
) -> None:
    path = tmp_path / "cat"
    path.mkdir()
    if layout == "mixed":
        write_jsonl(path / "a.jsonl", ROWS[:2])
        write_parquet(path / "b.parquet", ROWS[2:])
    elif layout == "newer":
        path = write_parquet(tmp_path / "c.parquet", ROWS, {CATALOG_VERSION_KEY: b"2"})
    elif layout == "corrupt":
        path = tmp_path / "c.jsonl.gz"
        path.write_bytes(gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))[:-30])
    elif layout == "mismatch":  # uint64 SIDs beyond int64 in one part: no common type
        write_parquet(path / "a.parquet", ROWS[:2])
        sid = pa.array([[2**63, 0, 0, 0]], type=pa.list_(pa.uint64()))
        pq.write_table(pa.table({"ad_id": [5000], "sid": sid}), path / "b.parquet")
    with pytest.raises(CatalogError, match=message) as e:
        read_catalog(path, progress=False)
    assert "\n" not in str(e.value)


def test_the_fingerprint_follows_every_part(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write_jsonl(d / "a.jsonl", ROWS[:6])
    first = catalog_fingerprint(d)
    assert catalog_fingerprint(d) == first
    write_jsonl(d / "b.jsonl", ROWS[6:])
    second = catalog_fingerprint(d)
    assert second != first
    shutil.copy(d / "a.jsonl", tmp_path / "a.bak")
    write_jsonl(d / "a.jsonl", ROWS[:5])
    assert catalog_fingerprint(d) not in (first, second)
