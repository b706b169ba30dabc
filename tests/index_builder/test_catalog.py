"""Catalog reading and validation (index_builder/catalog.py, docs/ARCHITECTURE.md §4)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contracts import targeting
from contracts.targeting_codec import codec
from contracts.targeting_schema import COUNTRIES, DEFAULT
from index_builder.catalog import Catalog, CatalogError, catalog_fingerprint, read_catalog
from tests.helpers.catalogs import catalog_arrays

FORMATS = ("jsonl", "parquet")


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def write_parquet(
    path: Path,
    rows: list[dict],
    types: dict[str, pa.DataType] | None = None,
    row_group_size: int | None = None,
) -> Path:
    """Columns are the union of the rows' keys; a row without a key holds null there."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    types = types or {}
    table = pa.table({k: pa.array([r.get(k) for r in rows], type=types.get(k)) for k in keys})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write(tmp_path: Path, rows: list[dict], fmt: str) -> Path:
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "catalog.jsonl", rows)
    return write_parquet(tmp_path / "catalog.parquet", rows)


def ad(ad_id: int, **fields: object) -> dict:
    return {"ad_id": ad_id, "sid": [ad_id % 512, 1, 2, 3], **fields}


def where(fmt: str, row: int) -> str:
    return f"line {row + 1}" if fmt == "jsonl" else f"row {row}"


MIXED = [
    ad(
        10,
        countries=["US", "gb"],
        age_buckets=["18-24"],
        genders=["female"],
        locations=["paris", "berlin", "paris"],
        campaign="x",
    ),
    {"ad_id": 11, "embedding": [0.5, -1.0, 2.0], "countries": [], "locations": None},
    ad(
        12,
        embedding=[1.0, 2.0, 3.0],
        countries=None,
        age_buckets=["65+", "13-17"],
        genders=[],
        locations=["zürich"],
    ),
    {"ad_id": -5, "sid": [511, 0, 0, 0], "genders": ["male", "female"], "locations": []},
    ad(2**62, countries=["fr"], locations=["berlin", "a b"], extra={"nested": [1]}),
]


def assert_same(a: Catalog, b: Catalog) -> None:
    left, right = catalog_arrays(a), catalog_arrays(b)
    assert left.keys() == right.keys()
    for name, x in left.items():
        y = right[name]
        if x is None or y is None:
            assert x is None and y is None, name
        else:
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)


# --------------------------------------------------------------------------- good input


def test_jsonl_and_parquet_give_identical_arrays(tmp_path: Path) -> None:
    a = read_catalog(write(tmp_path, MIXED, "jsonl"), progress=False)
    b = read_catalog(write(tmp_path, MIXED, "parquet"), progress=False)
    assert_same(a, b)
    assert a.n == 5
    np.testing.assert_array_equal(a.ad_id, [10, 11, 12, -5, 2**62])
    assert a.ad_id.dtype == np.int64 and a.sid.dtype == np.int32
    np.testing.assert_array_equal(a.has_sid, [True, False, True, True, True])
    np.testing.assert_array_equal(a.sid[1], [-1, -1, -1, -1])
    np.testing.assert_array_equal(a.sid[3], [511, 0, 0, 0])
    assert a.embedding is not None and a.embedding.dtype == np.float32
    np.testing.assert_array_equal(a.embedding[1], [0.5, -1.0, 2.0])
    assert np.isnan(a.embedding[[0, 3, 4]]).all()


def layout_bitmask(
    countries: Sequence[str] = (), age_buckets: Sequence[str] = (), genders: Sequence[str] = ()
) -> np.ndarray:
    """One ad's matcher by the default layout as docs/FORMAT.md §1 draws it, bit by bit: a
    rule's values' bits, or without a rule every bit of the attribute, "unknown" included."""
    bits: set[int] = set()
    for values, labels, at in ((countries, COUNTRIES, 0), (age_buckets, targeting.AGE_BUCKETS, 250),
                               (genders, targeting.GENDERS, 258)):  # fmt: skip
        bits |= {at + labels.index(v) for v in values} or set(range(at, at + len(labels) + 1))
    words = np.zeros(5, dtype=np.uint64)
    for b in bits:
        words[b // 64] |= np.uint64(1) << np.uint64(b % 64)
    return words


def test_bitmask_rows_equal_the_documented_layout(tmp_path: Path) -> None:
    cat = read_catalog(write(tmp_path, MIXED, "jsonl"), progress=False)
    for row, r in zip(cat.bitmask, MIXED, strict=True):
        want = layout_bitmask(
            [c.upper() for c in r.get("countries") or ()],
            r.get("age_buckets") or (),
            r.get("genders") or (),
        )
        np.testing.assert_array_equal(row, want)


def test_locations_round_trip(tmp_path: Path) -> None:
    cat = read_catalog(write(tmp_path, MIXED, "parquet"), progress=False)
    locations = cat.sets["locations"]
    assert list(locations.vocabulary) == sorted({"paris", "berlin", "zürich", "a b"})
    rules = locations.include
    assert rules.values.dtype == np.int32 and rules.offsets.dtype == np.int64
    assert locations.exclude is None  # no ad excludes a location
    for i, r in enumerate(MIXED):
        ids = rules.values[rules.offsets[i] : rules.offsets[i + 1]]
        assert list(ids) == sorted(set(ids)), "sorted and deduplicated per ad"
        assert set(locations.vocabulary[ids]) == set(r.get("locations") or ())


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_null_and_empty_lists_mean_no_rule(tmp_path: Path, fmt: str) -> None:
    rows = [
        ad(1),
        ad(2, countries=None, age_buckets=None, genders=None, locations=None),
        ad(3, countries=[], age_buckets=[], genders=[], locations=[]),
    ]
    cat = read_catalog(write(tmp_path, rows, fmt), progress=False)
    for row in cat.bitmask:
        np.testing.assert_array_equal(row, codec(DEFAULT).full_bitmask)
        np.testing.assert_array_equal(row, layout_bitmask())
    np.testing.assert_array_equal(cat.sets["locations"].include.offsets, [0, 0, 0, 0])
    assert len(cat.sets["locations"].vocabulary) == 0 and cat.embedding is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_countries_are_case_normalised(tmp_path: Path, fmt: str) -> None:
    rows = [ad(1, countries=["us", "De"]), ad(2, countries=["US", "DE"])]
    cat = read_catalog(write(tmp_path, rows, fmt), progress=False)
    np.testing.assert_array_equal(cat.bitmask[0], cat.bitmask[1])
    np.testing.assert_array_equal(cat.bitmask[0], layout_bitmask(["US", "DE"]))


def test_blank_lines_skipped_and_line_numbers_kept(tmp_path: Path) -> None:
    path = tmp_path / "c.ndjson"
    path.write_bytes(
        b'{"ad_id": 1, "sid": [1,2,3,4], "new_field": {"a": [1]}}\n\n  \n'
        b'{"ad_id": 1, "sid": [1,2,3,4]}\n'
    )
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert e.value.location == "line 4" and "line 1" in str(e.value)


def test_parquet_column_variants_read_the_same(tmp_path: Path) -> None:
    """fixed-size and large lists, dictionary strings, uint ids, several row groups."""
    rows = [
        ad(i, countries=["US"] if i % 2 else [], genders=["male"], locations=[f"l{i % 3}", "x"])
        for i in range(50)
    ]
    plain = read_catalog(write_parquet(tmp_path / "a.parquet", rows), progress=False)
    types = {
        "ad_id": pa.uint32(),
        "sid": pa.list_(pa.int16(), 4),
        "countries": pa.large_list(pa.dictionary(pa.int8(), pa.string())),
        "genders": pa.list_(pa.large_string()),
        "locations": pa.list_(pa.dictionary(pa.int32(), pa.string())),
    }
    path = write_parquet(tmp_path / "b.parquet", rows, types, row_group_size=7)
    assert pq.ParquetFile(path).num_row_groups > 1
    assert_same(plain, read_catalog(path, progress=False))


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [ad(1)])
    first = catalog_fingerprint(path)
    assert catalog_fingerprint(path) == first
    st = path.stat()
    write_jsonl(path, [ad(2)])  # same size; pin mtime too, so only the bytes differ
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert catalog_fingerprint(path) != first
    with pytest.raises(CatalogError):
        catalog_fingerprint(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- bad input

# (rows, offending row, field, message fragment); written in both formats
BAD_BOTH = {
    "duplicate_id": ([ad(1), ad(2), ad(3), ad(2)], 3, "ad_id", "duplicate ad_id 2"),
    "missing_id": ([ad(1), {"sid": [1, 2, 3, 4]}], 1, "ad_id", "missing"),
    "sid_short": ([ad(1), {"ad_id": 2, "sid": [1, 2, 3]}], 1, "sid", "has 3 values"),
    "sid_long": ([{"ad_id": 2, "sid": [1, 2, 3, 4, 5]}], 0, "sid", "has 5 values"),
    "sid_512": ([ad(1), ad(2), {"ad_id": 3, "sid": [0, 512, 0, 0]}], 2, "sid", "512"),
    "sid_negative": ([ad(1), {"ad_id": 3, "sid": [0, 1, -1, 0]}], 1, "sid", "-1"),
    "no_sid_no_embedding": ([ad(1), {"ad_id": 2, "countries": ["US"]}], 1, "sid", "embedding"),
    "embedding_dim": (
        [ad(1, embedding=[1.0, 2.0]), ad(2), ad(3, embedding=[1.0, 2.0, 3.0])],
        2,
        "embedding",
        "dimension 3 differs from 2",
    ),
    "embedding_empty": ([ad(1, embedding=[])], 0, "embedding", "empty"),
    "embedding_inf": ([ad(1, embedding=[1.0]), ad(2, embedding=[1e39])], 1, "embedding", "finite"),
    "country": ([ad(1, countries=["US"]), ad(2, countries=["us", "XX"])], 1, "countries", "XX"),
    "age": ([ad(1, age_buckets=["18-25"])], 0, "age_buckets", "13-17, 18-24"),
    "gender": ([ad(1), ad(2, genders=["other"])], 1, "genders", "female, male"),
    "null_in_list": ([ad(1), ad(2, locations=["a", None])], 1, "locations", "null element"),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", BAD_BOTH)
def test_bad_rows_name_line_or_row_and_field(tmp_path: Path, fmt: str, case: str) -> None:
    rows, bad_row, field, fragment = BAD_BOTH[case]
    path = write(tmp_path, rows, fmt)
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    err = e.value
    assert (err.path, err.location, err.field) == (str(path), where(fmt, bad_row), field)
    assert fragment in str(err) and where(fmt, bad_row) in str(err) and str(path) in str(err)
    if case == "duplicate_id":
        assert where(fmt, 1) in str(err), "names the first occurrence too"


# JSON-only mistakes: raw lines, (offending line, field, fragment)
BAD_JSONL = {
    "not_json": ([b'{"ad_id": 1, "sid": [1,2,3,4]}', b'{"ad_id": 2,'], 2, None, "invalid JSON"),
    "not_object": ([b'{"ad_id": 1, "sid": [1,2,3,4]}', b"[1, 2]"], 2, None, "JSON object"),
    "id_bool": ([b'{"ad_id": true, "sid": [1,2,3,4]}'], 1, "ad_id", "True"),
    "id_float": ([b'{"ad_id": 1.0, "sid": [1,2,3,4]}'], 1, "ad_id", "int64"),
    "id_string": ([b'{"ad_id": "7", "sid": [1,2,3,4]}'], 1, "ad_id", "'7'"),
    "id_too_big": ([b'{"ad_id": 9223372036854775808, "sid": [1,2,3,4]}'], 1, "ad_id", "int64"),
    "id_null": ([b'{"ad_id": null, "sid": [1,2,3,4]}'], 1, "ad_id", "missing"),
    "sid_float": (
        [b'{"ad_id": 1, "sid": [1,2,3,4]}', b'{"ad_id": 2, "sid": [1,2,3,4.5]}'],
        2,
        "sid",
        "4.5",
    ),
    "sid_bool": ([b'{"ad_id": 2, "sid": [1,2,3,true]}'], 1, "sid", "True"),
    "sid_string": ([b'{"ad_id": 2, "sid": "1234"}'], 1, "sid", "list of 4 ints"),
    "sid_huge": ([b'{"ad_id": 2, "sid": [1,2,3,100000000000000000000]}'], 1, "sid", "list"),
    "embedding_text": ([b'{"ad_id": 2, "embedding": [1.0, "a"]}'], 1, "embedding", "numbers"),
    "embedding_bool": ([b'{"ad_id": 2, "embedding": [true, 1.0]}'], 1, "embedding", "numbers"),
    "countries_string": (
        [b'{"ad_id": 2, "sid": [1,2,3,4], "countries": "US"}'],
        1,
        "countries",
        "list of strings",
    ),
    "genders_ints": (
        [b'{"ad_id": 1, "sid": [1,2,3,4]}', b'{"ad_id": 2, "sid": [1,2,3,4], "genders": [1]}'],
        2,
        "genders",
        "list of strings",
    ),
}


@pytest.mark.parametrize("case", BAD_JSONL)
def test_bad_jsonl_lines(tmp_path: Path, case: str) -> None:
    lines, line, field, fragment = BAD_JSONL[case]
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert (e.value.location, e.value.field) == (f"line {line}", field)
    assert fragment in str(e.value)


BAD_PARQUET_COLUMNS = {
    "ad_id": (pa.array([1.0, 2.0]), "double"),
    "sid": (pa.array([[1.0, 2.0, 3.0, 4.0]] * 2), "double"),
    "embedding": (pa.array([["a"], ["b"]]), "string"),
    "countries": (pa.array([[1], [2]]), "int64"),
    "locations": (pa.array(["paris", "rome"]), "string"),
}


@pytest.mark.parametrize("column", BAD_PARQUET_COLUMNS)
def test_bad_parquet_column_types(tmp_path: Path, column: str) -> None:
    bad, type_text = BAD_PARQUET_COLUMNS[column]
    cols = {"ad_id": pa.array([1, 2]), "sid": pa.array([[1, 2, 3, 4]] * 2), column: bad}
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table(cols), path)
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert (e.value.location, e.value.field) == (None, column)
    assert type_text in str(e.value)


def test_parquet_nan_embedding(tmp_path: Path) -> None:
    rows = [ad(1, embedding=[1.0, 2.0]), ad(2, embedding=[0.0, float("nan")])]
    with pytest.raises(CatalogError, match="finite") as e:
        read_catalog(write_parquet(tmp_path / "c.parquet", rows), progress=False)
    assert (e.value.location, e.value.field) == ("row 1", "embedding")


def test_long_values_are_clipped_in_messages(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"ad_id": 1, "embedding": ["x" * 1000]}])
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert e.value.field == "embedding" and len(str(e.value)) < 300


def test_parquet_uint64_id_beyond_int64(tmp_path: Path) -> None:
    rows = [ad(1), {"ad_id": 2**63, "sid": [1, 2, 3, 4]}]
    path = write_parquet(tmp_path / "c.parquet", rows, {"ad_id": pa.uint64()})
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert (e.value.location, e.value.field) == ("row 1", "ad_id")


def test_parquet_without_ad_id_column(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"sid": pa.array([[1, 2, 3, 4]])}), path)
    with pytest.raises(CatalogError, match=r"ad_id.*missing column"):
        read_catalog(path, progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_catalog(tmp_path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_bytes(b"\n")
    else:
        path = write_parquet(tmp_path / "c.parquet", [ad(1)])
        pq.write_table(pq.read_table(path).slice(0, 0), path)
    with pytest.raises(CatalogError, match="empty catalog"):
        read_catalog(path, progress=False)


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("c.csv", b"ad_id\n1\n", "unknown suffix '.csv'"),
        ("missing.jsonl", None, "no such file"),
        ("c.parquet", b"not parquet at all", "not a readable Parquet file"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, content: bytes | None, fragment: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CatalogError) as e:
        read_catalog(path, progress=False)
    assert fragment in str(e.value) and e.value.location is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("location", "why"),
    [("", "is empty"), ("é" * 129, "is 258 bytes long")],
    ids=["empty", "over-256-bytes"],
)
def test_a_location_no_request_could_carry_is_refused(
    tmp_path: Path, fmt: str, location: str, why: str
) -> None:
    """Requests carry locations of 1 to 256 UTF-8 bytes (service/validation.py): an ad
    targeting any other string could never be served, so the catalog names it."""
    ok = "x" * targeting.MAX_LOCATION_BYTES  # the longest a request may carry: accepted
    rows = [ad(1, locations=[ok]), ad(2, locations=["paris", location]), ad(3)]
    with pytest.raises(CatalogError, match=f"{where(fmt, 1)}: field 'locations'") as e:
        read_catalog(write(tmp_path, rows, fmt), progress=False)
    assert why in str(e.value) and "no request could match it" in str(e.value)
    cat = read_catalog(write(tmp_path, [rows[0], rows[2]], fmt), progress=False)
    assert list(cat.sets["locations"].vocabulary) == [ok]


@pytest.mark.parametrize("fmt", FORMATS)
def test_campaign_and_advertiser_ids_are_kept_null_as_none(tmp_path: Path, fmt: str) -> None:
    rows = [ad(1, campaign_id=7, advertiser_id=3), ad(2, campaign_id=None), ad(3)]
    cat = read_catalog(write(tmp_path, rows, fmt), progress=False)
    assert cat.campaign.tolist() == [7, 0, 0] and cat.advertiser.tolist() == [3, 0, 0]
    plain = read_catalog(write(tmp_path, [ad(1), ad(2)], fmt), progress=False)
    assert plain.campaign is None and plain.advertiser is None  # no block can be applied
    bad = [ad(1, campaign_id=7 if fmt == "jsonl" else "7"), ad(2, campaign_id="x")]
    says = f"{where(fmt, 1)}: field 'campaign_id': 'x' is not an integer" if fmt == "jsonl" else (
        "field 'campaign_id': column has type string")  # fmt: skip
    with pytest.raises(CatalogError, match=says):
        read_catalog(write(tmp_path, bad, fmt), progress=False)


def test_parquet_owner_ids_beyond_int64_are_refused(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "c.parquet", [ad(1, advertiser_id=2**63)],
                         types={"advertiser_id": pa.uint64()})  # fmt: skip
    with pytest.raises(CatalogError, match="row 0: field 'advertiser_id': 9223372036854775808"):
        read_catalog(path, progress=False)
