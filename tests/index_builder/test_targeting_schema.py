"""The targeting schema file (contracts/targeting_schema.py): the built-in default is
today's layout bit for bit; a file is read from YAML or JSON; a bad one is refused in one
line naming the attribute; an index's manifest gives its schema back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from contracts import targeting
from contracts.index_manifest import IndexFormatError, legacy_schema_manifest, manifest_schema
from contracts.targeting_codec import codec
from contracts.targeting_schema import (
    COUNTRIES,
    DEFAULT,
    SchemaError,
    TargetingSchema,
    load,
    parse,
)

RICH = """
version: 1
attributes:
  - {name: platform, kind: enum, catalog_field: platforms, values: [ios, android, web]}
  - name: age
    kind: bucket
    catalog_field: age_buckets
    buckets: {"13-17": [13, 17], "18-24": [18, 24], "65+": [65, null]}
  - {name: audiences, kind: set, catalog_field: audiences, max_request_values: 256,
     bloom_bits: 512, bloom_hashes: 4}
  - {name: interests, kind: set, catalog_field: interests, max_request_values: 32,
     bloom_bits: 128}
"""


def test_the_default_is_the_layout_every_index_was_built_with() -> None:
    assert DEFAULT.bitmask_bits == 261
    assert DEFAULT.bitmask_words == 5
    assert DEFAULT.bit_offsets == {"country": 0, "age": 250, "gender": 258}
    assert DEFAULT.attribute("country").values == COUNTRIES and len(COUNTRIES) == 249
    assert COUNTRIES[:3] == ("AD", "AE", "AF") and COUNTRIES.index("US") == 232
    ages = ("13-17", "18-24", "25-34", "35-44", "45-54", "55-64", "65+")
    assert DEFAULT.attribute("age").labels == targeting.AGE_BUCKETS == ages
    assert DEFAULT.attribute("gender").values == targeting.GENDERS == ("female", "male")
    assert DEFAULT.family_words == ((0, 4),)
    # an index from before declared schemas reads as the default
    legacy = {"targeting": legacy_schema_manifest()}
    assert manifest_schema(legacy) == DEFAULT
    legacy["targeting"]["bloom_hashes"] = 4  # a layout this build does not know
    with pytest.raises(IndexFormatError, match="bloom_hashes"):
        manifest_schema(legacy)


def test_a_schema_file_is_read_and_round_trips_through_a_manifest(tmp_path: Path) -> None:
    path = tmp_path / "rich.yaml"
    path.write_text(RICH)
    schema = load(path)
    assert [a.name for a in schema.attributes] == ["platform", "age", "audiences", "interests"]
    assert schema.bit_offsets == {"platform": 0, "age": 4}
    assert schema.bitmask_bits == 4 + 4 and schema.bitmask_words == 1
    assert schema.family_words == ((0, 8), (8, 2)) and schema.bloom_words == 10
    assert schema.attribute("audiences").exclude_field == "audiences_exclude"
    stored = json.loads(json.dumps(schema.to_manifest()))  # as a manifest holds it
    assert TargetingSchema.from_manifest(stored) == schema
    as_json = tmp_path / "rich.json"
    as_json.write_text(json.dumps(schema.model_dump(mode="json")))
    assert load(as_json) == schema


@pytest.mark.parametrize(
    ("attributes", "says"),
    [
        ([{"name": "Plat", "kind": "enum", "catalog_field": "p", "values": ["a"]}],
         "attribute 'Plat': name 'Plat' must be lower-case"),
        ([{"name": "p", "kind": "enum", "catalog_field": "p"}], "attribute 'p': an enum lists"),
        ([{"name": "p", "kind": "enum", "catalog_field": "p", "values": ["a", "a"]}],
         "values: 'a' appears twice"),
        ([{"name": "a", "kind": "bucket", "catalog_field": "a",
           "buckets": {"x": [0, 10], "y": [5, 20]}}], "buckets 'x' and 'y' overlap"),
        ([{"name": "s", "kind": "set", "catalog_field": "s", "bloom_bits": 100}],
         "attribute 's': bloom_bits 100: a power of two"),
        ([{"name": "s", "kind": "set", "catalog_field": "s", "bloom_hashes": 9}],
         "attribute 's', bloom_hashes"),
        ([{"name": "s", "kind": "set", "catalog_field": "ad_id"}], "'ad_id' is the catalog's own"),
        ([{"name": "s", "kind": "set", "catalog_field": "s", "colour": 1}],
         "attribute 's', colour: Extra inputs"),
        ([{"name": "s", "kind": "set", "catalog_field": "s"},
          {"name": "t", "kind": "set", "catalog_field": "s"}], "catalog fields: 's' appears"),
        ([{"name": "s", "kind": "set", "catalog_field": "s", "values": ["x"]}],
         "values, case and unlisted are for enum"),
    ],
)  # fmt: skip
def test_a_bad_schema_is_refused_in_one_line_naming_the_attribute(
    attributes: list, says: str
) -> None:
    with pytest.raises(SchemaError, match=r"^f\.yaml: ") as caught:
        parse({"version": 1, "attributes": attributes}, "f.yaml")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=r"missing\.yaml: No such file"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SchemaError, match=r"bad\.json: not JSON"):
        load(bad)


def test_bucket_bits_follow_the_ranges_not_the_order_a_file_or_manifest_lists_them() -> None:
    """A manifest is JSON written with sorted keys: buckets listed `young`, `old` come back
    `old`, `young`; their bits must not move (an index read with them swapped would match
    every request's age against the other bucket)."""
    young_first = parse({"attributes": [{"name": "age", "kind": "bucket", "catalog_field": "ages",
                         "buckets": {"young": [13, 29], "old": [30, None]}}]}, "a")  # fmt: skip
    stored = json.loads(json.dumps(young_first.to_manifest(), sort_keys=True))
    back = TargetingSchema.from_manifest(stored)
    assert list(back.attribute("age").buckets) == ["old", "young"]  # the JSON order changed
    assert back.attribute("age").labels == young_first.attribute("age").labels == ("young", "old")
    enc = [codec(s).request_bitmask({"age": ("30",)}) for s in (young_first, back)]
    np.testing.assert_array_equal(enc[0], enc[1])


def test_the_example_schema_file_is_the_built_in_default(tmp_path: Path) -> None:
    """examples/targeting_schema.yaml writes the default out as a file to start from; a
    bare NO (Norway) in YAML is a boolean, and the error says to quote it."""
    example = Path(__file__).resolve().parents[2] / "examples" / "targeting_schema.yaml"
    assert load(example) == DEFAULT
    bare = tmp_path / "bare.yaml"
    bare.write_text(example.read_text().replace('"NO"', "NO"))
    with pytest.raises(SchemaError, match=r"attribute 'country', values, \d+: .*got False "
                       r"\(quote a value such as \"NO\" in YAML\)"):  # fmt: skip
        load(bare)
