"""The targeting schema: which attributes an ads team targets on, declared in one file
(docs/FORMAT.md §1 "Targeting schema"). Builder, server, clients and tests read it through
this module; each index stores it in its manifest (`to_manifest`), and the server takes
it from the index it serves. `contracts/targeting_codec.py` encodes ads and requests by
it.

Kinds: `enum` (named values; a request carries one; bitmask bits, exact in GTM), `bucket`
(an integer the request carries, mapped to named ranges; bitmask bits) and `set`
(strings; a request carries many; one Bloom family each in GTM, exact ids after). The
built-in `DEFAULT` is exactly the paper's demonstration targeting — country, age, gender,
locations — with the bit layout every index before the schema was built with.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1
NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
MAX_VALUE_BYTES = 256  # a set value, or an enum value: non-empty, at most this many bytes
MAX_BLOOM_HASHES = 8
# a request's set values hash with blake2b; each hash takes one digest byte (families of
# at most 256 bits) or two, little-endian (up to 65,536 bits), modulo the family's bits
BLOOM_HASH = (
    "blake2b: digest_size 8 (<= 256 bits) or 16; bit_i = digest[i] or "
    "u16le(digest[2i:2i+2]), mod bits"
)

# ISO 3166-1 alpha-2, officially assigned codes (249): the default `country` values
COUNTRIES: tuple[str, ...] = tuple(
    """
    AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO
    BQ BR BS BT BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ
    DK DM DO DZ EC EE EG EH ER ES ET FI FJ FK FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP
    GQ GR GS GT GU GW GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG
    KH KI KM KN KP KR KW KY KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML
    MM MN MO MP MQ MR MS MT MU MV MW MX MY MZ NA NC NE NF NG NI NL NO NP NR NU NZ OM PA PE
    PF PG PH PK PL PM PN PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL
    SM SN SO SR SS ST SV SX SY SZ TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM
    US UY UZ VA VC VE VG VI VN VU WF WS YE YT ZA ZM ZW
    """.split()
)


# the RPC Targeting's fields 1-4 (also the model's user features): each fills the schema's
# attribute of its name, when it has one
LEGACY_FIELDS = ("country", "age", "gender", "locations")


class SchemaError(ValueError):
    """A schema file that cannot be used, in one line naming the attribute."""


class Attribute(BaseModel):
    """One targeted attribute. The request names it `name` (in `Targeting.attributes`);
    the catalog holds an ad's include list under `catalog_field` and its exclude list
    under `<catalog_field>_exclude`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["enum", "bucket", "set"]
    catalog_field: str
    values: tuple[str, ...] = ()  # enum: the named values, in bit order
    # bucket: name -> [low, high] inclusive, high null = open; a value in none is unknown
    buckets: dict[str, tuple[int, int | None]] = Field(default_factory=dict)
    case: Literal["exact", "upper"] = "exact"  # enum: compare values upper-cased
    # enum: a request value the schema does not list is an error (INVALID_ARGUMENT
    # naming the field), or is read as unknown
    unlisted: Literal["error", "unknown"] = "error"
    max_request_values: int = Field(64, ge=1, le=4096)  # set: per request
    bloom_bits: int = 256  # set: the family's width (a power of two, 64..65536)
    bloom_hashes: int = Field(3, ge=1, le=MAX_BLOOM_HASHES)

    @model_validator(mode="after")
    def _check(self) -> Attribute:
        for label, name in (("name", self.name), ("catalog_field", self.catalog_field)):
            if not NAME.match(name):
                raise ValueError(f"{label} {name!r} must be lower-case letters, digits or _")
        if self.kind == "enum":
            if not self.values:
                raise ValueError("an enum lists its values")
            _unique(self.values, "values")
            for v in self.values:
                if not v or len(v.encode()) > MAX_VALUE_BYTES:
                    raise ValueError(f"value {v!r}: 1 to {MAX_VALUE_BYTES} bytes")
                if self.case == "upper" and v != v.upper():
                    raise ValueError(f"value {v!r} must be upper-case (case: upper)")
        elif self.values or self.case != "exact" or self.unlisted != "error":
            raise ValueError("values, case and unlisted are for enum attributes")
        if self.kind == "bucket":
            if not self.buckets:
                raise ValueError("a bucket attribute lists its buckets")
            spans = sorted((lo, hi, n) for n, (lo, hi) in self.buckets.items())
            for (lo, hi, n), nxt in zip(spans, [*spans[1:], None], strict=True):
                if lo < 0 or (hi is not None and hi < lo):
                    raise ValueError(f"bucket {n!r}: [{lo}, {hi}] is not a range of values >= 0")
                if nxt is not None and (hi is None or hi >= nxt[0]):
                    raise ValueError(f"buckets {n!r} and {nxt[2]!r} overlap")
        elif self.buckets:
            raise ValueError("buckets are for bucket attributes")
        if self.kind == "set":
            bits = self.bloom_bits
            if bits < 64 or bits > 65536 or bits & (bits - 1):
                raise ValueError(f"bloom_bits {bits}: a power of two from 64 to 65536")
        return self

    @property
    def exclude_field(self) -> str:
        return f"{self.catalog_field}_exclude"

    @cached_property
    def spans(self) -> tuple[tuple[str, int, int | None], ...]:
        """A bucket attribute's (name, low, high) in ascending order of their ranges: its
        bit order, whatever order a file (or a manifest's JSON object) lists them in."""
        return tuple(sorted(((n, lo, hi) for n, (lo, hi) in self.buckets.items()),
                            key=lambda span: span[1]))  # fmt: skip

    @property
    def labels(self) -> tuple[str, ...]:
        """The named values in bit order (enum: values in file order; bucket: buckets in
        ascending order of their ranges)."""
        return self.values if self.kind == "enum" else tuple(n for n, _, _ in self.spans)


class TargetingSchema(BaseModel):
    """The attributes, in order: enum and bucket attributes take consecutive bitmask bits
    (each its values, then its "unknown" bit; words of 64, LSB first), set attributes
    consecutive Bloom families (each `bloom_bits / 64` words)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = SCHEMA_VERSION
    attributes: tuple[Attribute, ...]

    @model_validator(mode="after")
    def _check(self) -> TargetingSchema:
        _unique([a.name for a in self.attributes], "attribute names")
        fields = [f for a in self.attributes for f in (a.catalog_field, a.exclude_field)]
        _unique(fields, "catalog fields")
        if reserved := {"ad_id", "sid", "embedding", "advertiser_id", "campaign_id"} & set(fields):
            raise ValueError(f"catalog field {sorted(reserved)[0]!r} is the catalog's own")
        return self

    def attribute(self, name: str) -> Attribute:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(name)

    @cached_property
    def bit_offsets(self) -> dict[str, int]:
        """First bitmask bit of each enum/bucket attribute (its unknown bit follows its
        values)."""
        out, at = {}, 0
        for a in self.attributes:
            if a.kind != "set":
                out[a.name] = at
                at += len(a.labels) + 1
        return out

    @cached_property
    def bitmask_bits(self) -> int:
        return sum(len(a.labels) + 1 for a in self.attributes if a.kind != "set")

    @property
    def bitmask_words(self) -> int:
        return max(1, (self.bitmask_bits + 63) // 64)

    @cached_property
    def families(self) -> tuple[Attribute, ...]:
        """The set attributes: one Bloom family each, in order."""
        return tuple(a for a in self.attributes if a.kind == "set")

    @cached_property
    def family_words(self) -> tuple[tuple[int, int], ...]:
        """(first word, words) of each family in a concatenated Bloom row."""
        out, at = [], 0
        for a in self.families:
            out.append((at, a.bloom_bits // 64))
            at += a.bloom_bits // 64
        return tuple(out)

    @property
    def bloom_words(self) -> int:
        return sum(w for _, w in self.family_words)

    def to_manifest(self) -> dict[str, Any]:
        """What an index stores: the schema as declared, and the layout it implies."""
        return {
            "schema": self.model_dump(mode="json", exclude_defaults=False),
            "bitmask_bits": self.bitmask_bits,
            "bitmask_words": self.bitmask_words,
            "bloom_words": self.bloom_words,
            "bloom_hash": BLOOM_HASH,
        }

    @classmethod
    def from_manifest(cls, stored: dict[str, Any]) -> TargetingSchema:
        """The schema a manifest's `targeting` key declares (`to_manifest`); one from
        before declared schemas is `contracts.index_format.manifest_schema`'s to read."""
        if "schema" not in stored:
            raise SchemaError("the index stores no declared targeting schema")
        schema = parse(stored["schema"], "the index manifest")
        if stored.get("bloom_hash") != BLOOM_HASH:
            raise SchemaError(f"the index hashes Bloom values as {stored.get('bloom_hash')!r}")
        return schema


def _unique(items: Any, what: str) -> None:
    seen: set[Any] = set()
    for x in items:
        if x in seen:
            raise ValueError(f"{what}: {x!r} appears twice")
        seen.add(x)


def parse(data: Any, source: str) -> TargetingSchema:
    """A schema from parsed YAML/JSON; SchemaError in one line naming the attribute."""
    try:
        return TargetingSchema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = list(err["loc"])
        if len(where) >= 2 and where[0] == "attributes" and isinstance(where[1], int):
            attrs = data.get("attributes") if isinstance(data, dict) else None
            i = where[1]
            named = attrs[i].get("name") if isinstance(attrs, list) and i < len(attrs) and (
                isinstance(attrs[i], dict)) else None  # fmt: skip
            where = [f"attribute {named or i!r}", *where[2:]]
        place = ", ".join(str(p) for p in where)
        message = err["msg"].removeprefix("Value error, ")
        if isinstance(err.get("input"), bool):  # YAML 1.1: bare no/yes/on/off are booleans
            message += f', got {err["input"]} (quote a value such as "NO" in YAML)'
        raise SchemaError(f"{source}: {place + ': ' if place else ''}{message}") from None


def load(path: Path) -> TargetingSchema:
    """The schema file at `path` (.yaml, .yml or .json); SchemaError in one line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SchemaError(f"{path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise SchemaError(f"{path}: not {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{where}{str(exc).splitlines()[0]}") from None  # fmt: skip
    return parse(data, str(path))


# fmt: off
DEFAULT = TargetingSchema(attributes=(
    Attribute(name="country", kind="enum", catalog_field="countries", values=COUNTRIES,
              case="upper", unlisted="unknown"),
    Attribute(name="age", kind="bucket", catalog_field="age_buckets",
              buckets={"13-17": (13, 17), "18-24": (18, 24), "25-34": (25, 34),
                       "35-44": (35, 44), "45-54": (45, 54), "55-64": (55, 64),
                       "65+": (65, None)}),
    Attribute(name="gender", kind="enum", catalog_field="genders", values=("female", "male")),
    Attribute(name="locations", kind="set", catalog_field="locations",
              max_request_values=64, bloom_bits=256, bloom_hashes=3),
))
# fmt: on
