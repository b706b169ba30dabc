"""Building an index by a targeting schema of one's own, as a team notices it (docs/FORMAT.md
§1 and §3, docs/DATA.md), on a small hand-written catalog of a `platform` enum, an `age`
bucket and two sets (`audiences`, `topics`), each with include and `<field>_exclude` lists:

* the catalog is read by the schema, JSON Lines and Parquet into identical arrays; a bad
  row (an unlisted enum value, an unknown bucket name, an empty set value, a non-list
  exclude field) is refused in one line naming its line or row and field, and `grace
  build-index` then publishes nothing; a field the schema does not declare is ignored
  with one warning naming it;
* a bad schema file (YAML syntax, an enum without values) stops `grace build-index` and
  `grace builder` with one line naming the file, no traceback, nothing published;
* the index: format 3 with the schema in its manifest, `grace validate-index` OK, and a
  corrupted set array refused naming its file; the default schema without exclusions
  still writes format 1 (2 with campaign ids) under the `ads.ad_loc_*` names older
  servers read, and format 3 with any exclusion;
* `grace builder --once --targeting-schema` publishes an index of the schema; the schema is
  part of the source fingerprint, so the sidecar rebuilds for another schema and not for
  the same one;
* the served side, in-process: `load_index` gives the file's schema and one vocabulary per
  set attribute, and the post stage keeps exactly the ads eligible by hand.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from contracts.index_format import file_sha256
from contracts.index_manifest import check_legacy_schema, legacy_schema_manifest, read_manifest
from contracts.targeting import Targeting
from contracts.targeting_codec import Ragged
from contracts.targeting_schema import DEFAULT, TargetingSchema, parse
from index_builder import sidecar
from index_builder.catalog import (
    Catalog,
    CatalogError,
    catalog_fingerprint,
    read_catalog,
    source_fingerprint,
)
from index_builder.publish import current_path, current_version
from index_builder.sidecar import BuilderConfig
from service.index.loaded import load_index
from tests.helpers.indexes import flip_byte, running_builder
from tests.helpers.waiting import wait_until
from tests.index_builder.test_catalog import FORMATS, assert_same, where, write_parquet

REPO = Path(__file__).resolve().parents[2]
SID_SPACE = "team-v1"
SCHEMA_YAML = """
version: 1
attributes:
  - {name: platform, kind: enum, catalog_field: platforms, values: [ios, android, web]}
  - name: age
    kind: bucket
    catalog_field: age_groups
    buckets: {young: [13, 29], old: [30, null]}
  - {name: audiences, kind: set, catalog_field: audiences, max_request_values: 16,
     bloom_bits: 64, bloom_hashes: 2}
  - {name: topics, kind: set, catalog_field: topics, bloom_bits: 128}
"""
SCHEMA = parse(yaml.safe_load(SCHEMA_YAML), "schema.yaml")
# the team adds an attribute: another schema for the same catalog
WIDER_YAML = SCHEMA_YAML + "  - {name: device, kind: enum, catalog_field: devices, values: [a]}\n"
WIDER = parse(yaml.safe_load(WIDER_YAML), "wider.yaml")

# bitmask bits of SCHEMA: platform ios 0, android 1, web 2, unknown 3; age young 4, old 5,
# unknown 6 (docs/FORMAT.md §1 "Layout")
PLATFORM_ALL, AGE_ALL = 0b0001111, 0b1110000
ROWS: list[dict[str, Any]] = [
    {"ad_id": 101, "sid": [0, 0, 0, 0], "platforms": ["ios"]},
    {"ad_id": 102, "sid": [0, 0, 0, 1], "platforms_exclude": ["web"]},
    {"ad_id": 103, "sid": [0, 1, 0, 0], "age_groups": ["young"]},
    {"ad_id": 104, "sid": [0, 1, 0, 0], "age_groups_exclude": ["old"]},  # 103's SID too
    {"ad_id": 105, "sid": [1, 0, 0, 0], "audiences": ["sports", "news", "sports"]},
    {"ad_id": 106, "sid": [1, 0, 1, 0], "audiences_exclude": ["sports"]},
    {"ad_id": 107, "sid": [1, 1, 0, 0], "platforms": ["android", "web"], "audiences": ["news"],
     "topics": ["cars"]},
    {"ad_id": 108, "sid": [2, 0, 0, 0]},
    {"ad_id": 109, "sid": [2, 0, 0, 1], "platforms": ["ios", "android"],
     "platforms_exclude": ["android"], "topics_exclude": ["cars", "boats"]},
]  # fmt: skip
# per ad, hand-written: (bitmask, bits its exclusions cleared, audiences include, exclude,
# topics include, exclude)
EXPECTED: dict[int, tuple[int, int, list[str], list[str], list[str], list[str]]] = {
    101: (0b0001 | AGE_ALL, 0, [], [], [], []),
    102: (0b1011 | AGE_ALL, 0b0100, [], [], [], []),
    103: (PLATFORM_ALL | 0b0010000, 0, [], [], [], []),
    104: (PLATFORM_ALL | 0b1010000, 0b0100000, [], [], [], []),
    105: (PLATFORM_ALL | AGE_ALL, 0, ["news", "sports"], [], [], []),
    106: (PLATFORM_ALL | AGE_ALL, 0, [], ["sports"], [], []),
    107: (0b0110 | AGE_ALL, 0, ["news"], [], ["cars"], []),
    108: (PLATFORM_ALL | AGE_ALL, 0, [], [], [], []),
    109: (0b0001 | AGE_ALL, 0b0010, [], [], [], ["boats", "cars"]),
}


def grace(*args: str) -> subprocess.CompletedProcess[str]:
    """The `grace` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_catalog(directory: Path, rows: list[dict[str, Any]], fmt: str) -> Path:
    if fmt == "jsonl":
        return write_jsonl(directory / "catalog.jsonl", rows)
    return write_parquet(directory / "catalog.parquet", rows)


def build(catalog: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return grace("build-index", "--catalog", str(catalog), "--out", str(out), "--sid-space",
                 SID_SPACE, "--no-progress", *flags)  # fmt: skip


def strings(rules: Ragged | None, vocabulary: np.ndarray, n: int) -> list[list[str]]:
    """Each ad's list as the strings it names (empty lists where `rules` is None)."""
    if rules is None:
        return [[] for _ in range(n)]
    off = rules.offsets
    return [[str(s) for s in vocabulary[rules.values[off[i] : off[i + 1]]]] for i in range(n)]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(schema file, published version directory) of the hand-written catalog, built with
    `grace build-index --targeting-schema`."""
    root = tmp_path_factory.mktemp("custom_build")
    schema_file = root / "schema.yaml"
    schema_file.write_text(SCHEMA_YAML)
    catalog = write_jsonl(root / "catalog.jsonl", ROWS)
    done = build(catalog, root / "index", "--targeting-schema", str(schema_file))
    assert done.returncode == 0, done.stderr
    path = current_path(root / "index")
    assert path is not None
    return schema_file, path


# ------------------------------------------------------------------ reading the catalog


def test_jsonl_and_parquet_read_the_schemas_fields_into_identical_arrays(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cats = [read_catalog(write_catalog(tmp_path / d, ROWS, fmt), progress=False, schema=SCHEMA)
            for d, fmt in (("a", "jsonl"), ("b", "parquet"))]  # fmt: skip
    assert_same(*cats)
    cat: Catalog = cats[0]
    assert cat.schema == SCHEMA and cat.ad_id.tolist() == list(EXPECTED)
    assert cat.bitmask.shape == (9, 1) and cat.exclude_bitmask is not None
    assert cat.bitmask[:, 0].tolist() == [e[0] for e in EXPECTED.values()]
    assert cat.exclude_bitmask[:, 0].tolist() == [e[1] for e in EXPECTED.values()]
    assert list(cat.sets) == ["audiences", "topics"]
    audiences, topics = cat.sets["audiences"], cat.sets["topics"]
    assert audiences.vocabulary.tolist() == ["news", "sports"]  # include and exclude values
    assert topics.vocabulary.tolist() == ["boats", "cars"]
    got = zip(strings(audiences.include, audiences.vocabulary, 9),
              strings(audiences.exclude, audiences.vocabulary, 9),
              strings(topics.include, topics.vocabulary, 9),
              strings(topics.exclude, topics.vocabulary, 9), strict=True)  # fmt: skip
    assert [list(g) for g in got] == [list(e[2:]) for e in EXPECTED.values()]


# (field, bad value, message fragment) put on the third ad (line 3 / row 2)
BAD_ROWS = {
    "unlisted_enum_exclude": ("platforms_exclude", ["ios", "tv"],
                              "unknown value 'tv'; expected one of ios, android, web"),
    "unknown_bucket": ("age_groups", ["teen"], "unknown value 'teen'; expected one of young, old"),
    "empty_set_exclude": ("audiences_exclude", ["news", ""],
                          "audiences value '' is empty: requests carry values of 1 to 256"),
    "overlong_set_include": ("topics", ["x" * 257], "is 257 bytes long"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_targeting_value_is_refused_naming_the_line_or_row_and_field(
    tmp_path: Path, fmt: str, case: str
) -> None:
    field, value, says = BAD_ROWS[case]
    rows = [*ROWS[:2], {"ad_id": 3, "sid": [3, 0, 0, 0], field: value}, *ROWS[2:]]
    path = write_catalog(tmp_path, rows, fmt)
    with pytest.raises(CatalogError) as caught:
        read_catalog(path, progress=False, schema=SCHEMA)
    err = caught.value
    assert (err.path, err.location, err.field) == (str(path), where(fmt, 2), field)
    assert str(err).startswith(f"{path}: {where(fmt, 2)}: field '{field}': ")
    assert says in str(err) and "\n" not in str(err)


@pytest.mark.parametrize(
    ("field", "value", "column_type"),
    [("platforms_exclude", "ios", "string"), ("audiences_exclude", 7, "int64")],
    ids=["enum", "set"],
)
def test_an_exclude_field_that_is_not_a_list_is_refused(
    tmp_path: Path, field: str, value: object, column_type: str
) -> None:
    """JSON Lines names the line; a Parquet column of another type is refused as a column."""
    rows = [{"ad_id": 1, "sid": [0, 0, 0, 0]}, {"ad_id": 2, "sid": [0, 0, 0, 1], field: value}]
    path = write_catalog(tmp_path, rows, "jsonl")
    with pytest.raises(CatalogError) as caught:
        read_catalog(path, progress=False, schema=SCHEMA)
    assert (caught.value.location, caught.value.field) == ("line 2", field)
    assert f"line 2: field '{field}': {value!r} is not a list of strings" in str(caught.value)
    path = write_catalog(tmp_path, rows, "parquet")
    with pytest.raises(CatalogError) as caught:
        read_catalog(path, progress=False, schema=SCHEMA)
    assert (caught.value.location, caught.value.field) == (None, field)
    assert f"field '{field}': column has type {column_type}; expected a list of strings" in str(
        caught.value
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_build_index_refuses_a_bad_row_in_one_line_and_publishes_nothing(
    tmp_path: Path, fmt: str
) -> None:
    (tmp_path / "schema.yaml").write_text(SCHEMA_YAML)
    rows = [*ROWS[:2], {"ad_id": 3, "sid": [3, 0, 0, 0], "platforms_exclude": ["tv"]}]
    path = write_catalog(tmp_path, rows, fmt)
    done = build(path, tmp_path / "index", "--targeting-schema", str(tmp_path / "schema.yaml"))
    assert done.returncode != 0
    line = one_line(done.stderr)
    assert line.startswith("grace build-index: error: ")
    assert f"{path}: {where(fmt, 2)}: field 'platforms_exclude': unknown value 'tv'" in line
    assert current_version(tmp_path / "index") is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_fields_the_schema_does_not_declare_are_ignored_with_one_warning(
    tmp_path: Path, fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`countries` is the default schema's field, not this one's (and the other way round:
    a catalog of this schema read without `--targeting-schema` ignores `platforms`)."""
    caplog.set_level(logging.WARNING, logger="grace.catalog")
    rows = [{**ROWS[0], "countries": ["US"], "countries_exclude": ["FR"]}, *ROWS[1:]]
    (tmp_path / "with").mkdir()
    (tmp_path / "plain").mkdir()
    path = write_catalog(tmp_path / "with", rows, fmt)
    plain = read_catalog(write_catalog(tmp_path / "plain", ROWS, fmt), progress=False,
                         schema=SCHEMA)  # fmt: skip
    caplog.clear()
    cat = read_catalog(path, progress=False, schema=SCHEMA)
    assert cat.ignored_fields == ("countries", "countries_exclude")
    assert_same(cat, plain)  # ignored: it changes nothing
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warned == [f"catalog {path}: fields not in the catalog format ignored: countries, "
                      "countries_exclude (docs/DATA.md)"]  # fmt: skip
    caplog.clear()
    default = read_catalog(path, progress=False)
    assert default.schema == DEFAULT and "platforms" in default.ignored_fields
    assert "countries" not in default.ignored_fields
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "age_groups, age_groups_exclude, audiences, audiences_exclude, platforms" in warning


# ------------------------------------------------------------------ bad schema files


@pytest.mark.parametrize("command", ["build-index", "builder"])
@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("version: 1\nattributes:\n  - {name: platform, kind: enum, catalog_field: platforms\n",
         "not YAML: line 4, column 1: "),
        ("version: 1\nattributes:\n  - {name: platform, kind: enum, catalog_field: platforms}\n",
         "attribute 'platform': an enum lists its values"),
    ],
    ids=["yaml-syntax", "enum-without-values"],
)  # fmt: skip
def test_a_bad_schema_file_stops_the_command_in_one_line(
    tmp_path: Path, command: str, text: str, says: str
) -> None:
    schema_file = tmp_path / "schema.yaml"
    schema_file.write_text(text)
    catalog = write_jsonl(tmp_path / "catalog.jsonl", ROWS)
    extra = ["--once"] if command == "builder" else ["--no-progress"]
    done = grace(command, "--catalog", str(catalog), "--out", str(tmp_path / "index"),
                 "--sid-space", SID_SPACE, "--targeting-schema", str(schema_file),
                 *extra)  # fmt: skip
    assert done.returncode != 0
    line = one_line(done.stderr)
    assert line.startswith(f"grace {command}: error: {schema_file}: {says}"), line
    assert not (tmp_path / "index").exists()


# ------------------------------------------------------------------ the index on disk


def test_a_custom_schema_index_is_format_3_with_its_schema_and_validates(
    built: tuple[Path, Path],
) -> None:
    _, path = built
    manifest = read_manifest(path)
    assert manifest["format_version"] == 3
    assert TargetingSchema.from_manifest(manifest["targeting"]) == SCHEMA
    assert manifest["tokenizer_fingerprint"] == f"sid-space:{SID_SPACE}"
    catalog = Path(manifest["catalog"]["source"])
    assert manifest["catalog"]["fingerprint"] == source_fingerprint(catalog, SCHEMA)
    files = {p.name for p in path.glob("*.npy")}
    for name in ("audiences", "topics"):
        assert {f"sets.{name}.include_ids.npy", f"sets.{name}.vocab_bytes.npy"} <= files
    assert "sets.audiences.exclude_ids.npy" in files and "ads.ad_exclude_bitmask.npy" in files
    assert not any(f.startswith("ads.ad_loc_") or "loc_vocab" in f for f in files)
    checked = grace("validate-index", str(path.parent))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"OK {path} ") and "format 3" in checked.stdout


def _rewrite_array(path: Path, name: str, value: np.ndarray) -> None:
    """A buggy writer: new contents under the manifest's checksum of them."""
    np.save(path / f"{name}.npy", value, allow_pickle=False)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["arrays"][name].update(sha256=file_sha256(path / f"{name}.npy"),
                                    shape=list(value.shape))  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("corrupt", "says"),
    [
        (lambda p: flip_byte(p / "sets.audiences.include_ids.npy"),
         "sets.audiences.include_ids.npy: checksum mismatch"),
        (lambda p: _rewrite_array(p, "sets.topics.exclude_ids", np.array([0, 9], np.int32)),
         "sets.topics.exclude_ids out of range [0, 2)"),
        # ad 109 excludes boats (0) and cars (1): unsorted, the post stage would miss boats
        (lambda p: _rewrite_array(p, "sets.topics.exclude_ids", np.array([1, 0], np.int32)),
         "sets.topics.exclude_ids are not sorted ascending within each ad"),
    ],
    ids=["flipped-byte", "id-out-of-range", "ids-unsorted"],
)  # fmt: skip
def test_a_corrupted_set_array_is_refused_by_validate_index(
    built: tuple[Path, Path], tmp_path: Path, corrupt: Callable[[Path], None], says: str
) -> None:
    copy = tmp_path / built[1].name
    shutil.copytree(built[1], copy)
    corrupt(copy)
    checked = grace("validate-index", str(copy))
    assert checked.returncode != 0 and "OK" not in checked.stdout
    assert str(copy) in checked.stderr and says in checked.stderr, checked.stderr


DEFAULT_ROWS: list[dict[str, Any]] = [
    {"ad_id": 1, "sid": [0, 0, 0, 0], "countries": ["US"], "locations": ["paris"]},
    {"ad_id": 2, "sid": [0, 0, 0, 1], "genders": ["female"], "locations": ["berlin", "paris"]},
    {"ad_id": 3, "sid": [0, 0, 1, 0]},
]
LEGACY_FILES = {"ads.ad_loc_offsets.npy", "ads.ad_loc_ids.npy", "ads.loc_vocab_offsets.npy",
                "ads.loc_vocab_bytes.npy"}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "version"),
    [
        ({}, 1),
        ({"campaign_id": 7}, 2),
        ({"countries_exclude": ["FR"]}, 3),
        ({"locations_exclude": ["rome"]}, 3),
    ],
    ids=["plain", "campaigns", "enum-exclusion", "set-exclusion"],
)
def test_the_default_schema_keeps_the_old_layout_until_an_exclusion_needs_format_3(
    tmp_path: Path, extra: dict[str, Any], version: int
) -> None:
    rows = [DEFAULT_ROWS[0], {**DEFAULT_ROWS[1], **extra}, DEFAULT_ROWS[2]]
    done = build(write_jsonl(tmp_path / "catalog.jsonl", rows), tmp_path / "index")
    assert done.returncode == 0, done.stderr
    path = current_path(tmp_path / "index")
    assert path is not None
    manifest = read_manifest(path)
    assert manifest["format_version"] == version
    files = {p.name for p in path.glob("*.npy")}
    if version < 3:  # what a server from before declared schemas reads
        assert files >= LEGACY_FILES and not any(f.startswith("sets.") for f in files)
        assert "ads.ad_exclude_bitmask.npy" not in files
        assert manifest["targeting"] == legacy_schema_manifest()
        check_legacy_schema(manifest["targeting"])
    else:
        assert not files & LEGACY_FILES and "sets.locations.include_ids.npy" in files
        assert TargetingSchema.from_manifest(manifest["targeting"]) == DEFAULT
    assert manifest["catalog"]["fingerprint"] == catalog_fingerprint(tmp_path / "catalog.jsonl")
    checked = grace("validate-index", str(tmp_path / "index"))
    assert checked.returncode == 0 and f"format {version}" in checked.stdout, checked.stderr


# ------------------------------------------------------------------ the builder sidecar


def test_the_builder_builds_by_the_schema_and_rebuilds_only_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.builder")
    schema_file = tmp_path / "schema.yaml"
    schema_file.write_text(SCHEMA_YAML)
    catalog, root = write_jsonl(tmp_path / "catalog.jsonl", ROWS), tmp_path / "index"
    done = grace("builder", "--once", "--targeting-schema", str(schema_file), "--sid-space",
                 SID_SPACE, "--catalog", str(catalog), "--out", str(root))  # fmt: skip
    assert done.returncode == 0, done.stderr
    first = current_path(root)
    assert first is not None
    manifest = read_manifest(first)
    assert TargetingSchema.from_manifest(manifest["targeting"]) == SCHEMA
    assert manifest["tokenizer_fingerprint"] == f"sid-space:{SID_SPACE}"
    # the schema is part of what the index is built from
    custom, default = source_fingerprint(catalog, SCHEMA), source_fingerprint(catalog)
    assert custom != default and default == catalog_fingerprint(catalog)
    assert custom != source_fingerprint(catalog, WIDER)
    assert manifest["catalog"]["fingerprint"] == custom

    checks: list[int] = []  # one source fingerprint a check: checks counted, not timed
    real = sidecar.source_fingerprint
    monkeypatch.setattr(sidecar, "source_fingerprint",
                        lambda *a: (checks.append(1), real(*a))[1])  # fmt: skip
    same = BuilderConfig(catalog=catalog, out=root, interval=0.01, sid_space=SID_SPACE,
                         schema=parse(yaml.safe_load(SCHEMA_YAML), str(schema_file)))  # fmt: skip
    with running_builder(same) as result:
        wait_until(lambda: len(checks) >= 3, "three checks")
    assert result["stats"].builds == 0 and result["stats"].failures == 0
    assert current_path(root) == first
    assert any("is up to date" in r.getMessage() for r in caplog.records)

    wider = BuilderConfig(catalog=catalog, out=root, interval=0.01, sid_space=SID_SPACE,
                          schema=WIDER)  # fmt: skip
    with running_builder(wider) as result:
        wait_until(lambda: current_path(root) != first, "a rebuild for the new schema")
        checks.clear()
        wait_until(lambda: len(checks) >= 3, "three more checks")  # and no further build
    assert result["stats"].builds == 1 and result["stats"].failures == 0
    rebuilt = read_manifest(current_path(root))
    assert TargetingSchema.from_manifest(rebuilt["targeting"]) == WIDER
    assert rebuilt["catalog"]["fingerprint"] == source_fingerprint(catalog, WIDER)


# ------------------------------------------------------------------ the served side


def targeting_of(platform: str | None, age: int, audiences: tuple[str, ...] = (),
                 topics: tuple[str, ...] = ()) -> Targeting:  # fmt: skip
    attrs = [("audiences", audiences), ("topics", topics)]
    if platform is not None:
        attrs.append(("platform", (platform,)))
    return Targeting(age=age, attributes=tuple(attrs))


@pytest.mark.parametrize(
    ("request_", "eligible", "removed"),
    [
        # 106 excludes sports; 107 wants android or web (and news, and cars)
        (targeting_of("ios", 25, ("sports",)), {101, 102, 103, 104, 105, 108, 109},
         {"block": 0, "targeting": 1, "exclusion": 1}),
        # 101 wants ios, 103 young; 104 excludes old, 109 android (and topic cars)
        (targeting_of("android", 70, ("news", "unheard-of"), ("cars",)),
         {102, 105, 106, 107, 108}, {"block": 0, "targeting": 2, "exclusion": 2}),
        # nothing known (age 9 is in no bucket): only ads without include rules
        (targeting_of(None, 9), {102, 104, 106, 108},
         {"block": 0, "targeting": 5, "exclusion": 0}),
        # a request's blocks still apply
        (Targeting(age=25, exclude_ad_ids=(102, 108)), {103, 104, 106},
         {"block": 2, "targeting": 4, "exclusion": 0}),
    ],
    ids=["ios-young-sports", "android-old-news-cars", "unknown", "blocked"],
)  # fmt: skip
def test_the_loaded_index_keeps_exactly_the_eligible_ads(
    built: tuple[Path, Path], request_: Targeting, eligible: set[int], removed: dict[str, int]
) -> None:
    schema_file, path = built
    index = load_index(path)
    assert index.schema == parse(yaml.safe_load(schema_file.read_text()), str(schema_file))
    assert {name: len(v) for name, v in index.vocabularies.items()} == {"audiences": 2,
                                                                        "topics": 2}  # fmt: skip
    leaves = np.arange(len(index.arrays.ads.leaf_sids), dtype=np.int64)
    post = index.post_request(leaves, np.zeros(len(leaves), np.float32), request_, 1000)
    (result,) = index.post.run([post])
    assert set(result.ad_ids.tolist()) == eligible
    assert result.ads_expanded == len(ROWS) and result.ads_eligible == len(eligible)
    assert result.ads_removed == {**removed, "not_live": 0}


def test_the_tokenizer_reads_a_catalog_of_its_own_attributes_without_warning(
    tmp_path: Path,
) -> None:
    """`grace train-tokenizer --targeting-schema`: the catalog's own fields are the
    schema's, so none is reported ignored (without the flag, each one is)."""
    rng = np.random.default_rng(0)
    rows = [{**{k: v for k, v in r.items() if k != "sid"}, "embedding": rng.normal(size=4).tolist()}
            for r in ROWS * 4]  # fmt: skip
    for i, r in enumerate(rows):
        r["ad_id"] = 1000 + i
    catalog = write_jsonl(tmp_path / "c.jsonl", rows)
    (tmp_path / "schema.yaml").write_text(SCHEMA_YAML)
    common = ("train-tokenizer", "--catalog", str(catalog), "--codebook-size", "2",
              "--iterations", "1", "--no-progress")  # fmt: skip
    plain = grace(*common, "--out", str(tmp_path / "a"))
    assert plain.returncode == 0 and "ignored: age_groups" in plain.stderr, plain.stderr
    own = grace(*common, "--out", str(tmp_path / "b"), "--targeting-schema",
                str(tmp_path / "schema.yaml"))  # fmt: skip
    assert own.returncode == 0, own.stderr
    assert "ignored" not in own.stderr and (tmp_path / "b").is_dir()
