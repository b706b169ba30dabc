"""The world's targeting schema and its advertisers' extra rules (docs/SYNTH.md "Richer
targeting"): extra enum attributes (`EXTRA_ENUMS`), audience segments (`audiences.py`)
and exclusions on country and age.

Part of the ads stage. `build_extra_rules` draws every advertiser's extra rules once,
before the chunks, each kind on a stream of its own (the plain world's draws are
untouched); a chunk's ads take their advertiser's rules (`ExtraRules.take`), which the
chunk encodes with the default rules by the world's schema (`ExtraRules.bitmasks`) and
writes as catalog columns. A world without the knobs has none of it (`world_schema` is
None) and no schema file; one with them writes `SCHEMA_FILE` beside its catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from contracts.targeting import AGE_BUCKETS
from contracts.targeting_codec import Ragged, codec
from contracts.targeting_schema import COUNTRIES, DEFAULT, Attribute, TargetingSchema, load
from index_builder.parallel import take_segments
from index_builder.synth.ads import AdRules
from index_builder.synth.advertisers import Advertisers
from index_builder.synth.audiences import Segments, advertiser_rules, distinct_rows
from index_builder.synth.geography import Geography
from index_builder.synth.profiles import EXTRA_ENUMS, MAX_USER_AUDIENCES, WorldProfile, stream

SCHEMA_FILE = "targeting_schema.yaml"
AUDIENCES = Attribute(name="audiences", kind="set", catalog_field="audiences",
                      max_request_values=MAX_USER_AUDIENCES, bloom_bits=512)  # fmt: skip
# which age bucket an advertiser excludes (AGE_BUCKETS order): minors most often
AGE_EXCLUDES = (0.5, 0.05, 0.05, 0.05, 0.05, 0.1, 0.2)
ENUM_PAIR_SHARE = 0.3  # of extra-enum include rules, those naming two values (else one)


def world_schema(p: WorldProfile) -> TargetingSchema | None:
    """The default attributes, then the extra enums and audiences the knobs add; None for
    a world without richer targeting. The default's bits come first, as laid out alone."""
    if not p.richer_targeting:
        return None
    enums = tuple(Attribute(name=name, kind="enum", catalog_field=field, values=values)
                  for name, field, values, _ in EXTRA_ENUMS[: p.extra_enums])  # fmt: skip
    sets = (AUDIENCES,) if p.n_audiences else ()
    schema = TargetingSchema(attributes=(*DEFAULT.attributes, *enums, *sets))
    assert schema.bitmask_words == DEFAULT.bitmask_words, "extra enums overflow the default's words"
    return schema


class _Dumper(yaml.SafeDumper):
    """Block style, but flow lists of values: an enum's values or a bucket's range."""


def _list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    leaf = not any(isinstance(x, dict | list) for x in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=leaf)


_Dumper.add_representer(list, _list)
_SET_FIELDS = ("max_request_values", "bloom_bits", "bloom_hashes")


def write_schema(schema: TargetingSchema, directory: Path) -> None:
    """`SCHEMA_FILE` in the YAML of docs/FORMAT.md §1 (what a kind's defaults leave out;
    a set attribute's request cap and Bloom family always)."""
    attrs = []
    for a in schema.attributes:
        attr = a.model_dump(mode="json", exclude_defaults=True)
        attrs.append(attr | ({k: getattr(a, k) for k in _SET_FIELDS} if a.kind == "set" else {}))
    text = yaml.dump({"version": schema.version, "attributes": attrs}, Dumper=_Dumper,
                     sort_keys=False, width=100)  # fmt: skip
    (directory / SCHEMA_FILE).write_text(text)


def load_world_schema(directory: Path | str) -> TargetingSchema:
    """The targeting schema a world's catalog is read by: its `SCHEMA_FILE`, or the
    default for a world without one (what `build_index(..., schema=...)` takes)."""
    path = Path(directory) / SCHEMA_FILE
    return load(path) if path.is_file() else DEFAULT


@dataclass(frozen=True)
class Column:
    """One extra catalog list column: per advertiser, value indices into `names`."""

    field: str  # the catalog field: an attribute's `catalog_field` or `exclude_field`
    attribute: str
    exclude: bool
    names: np.ndarray  # object [V]: the values, by index
    rules: Ragged  # per advertiser


@dataclass(frozen=True)
class ExtraRules:
    """Every advertiser's extra rules; an ad carries its advertiser's."""

    schema: TargetingSchema
    columns: tuple[Column, ...]

    def take(self, advertiser: np.ndarray) -> tuple[Ragged, ...]:
        """Per column, the rules of ads whose advertisers are `advertiser`."""
        out = []
        for c in self.columns:
            offsets, flat = take_segments(c.rules.offsets, advertiser)
            out.append(Ragged(offsets, c.rules.values[flat]))
        return tuple(out)

    def bitmasks(self, rules: AdRules, extra: tuple[Ragged, ...]) -> np.ndarray:
        """uint64 [n, words]: the ads' enum and bucket rules, exclusions folded in,
        by the world's schema (`extra`: `take` of the same ads)."""
        include = {"country": rules.countries, "age": rules.age_buckets, "gender": rules.genders}
        exclude = {}
        for c, r in zip(self.columns, extra, strict=True):
            if c.attribute in self.schema.bit_offsets:
                (exclude if c.exclude else include)[c.attribute] = r
        return codec(self.schema).ad_bitmasks(include, exclude, rules.countries.n)

    def column(self, field: str) -> Column:
        return next(c for c in self.columns if c.field == field)


def _single(value: np.ndarray, on: np.ndarray) -> Ragged:
    return distinct_rows(value[:, None], on[:, None])


def build_extra_rules(
    p: WorldProfile, geo: Geography, adv: Advertisers, seg: Segments | None, seed: int
) -> ExtraRules | None:
    """The advertisers' extra rules (None without richer targeting): one excluded country
    (population-weighted, not the home country) on `country_exclude_share`, one excluded
    age bucket (`AGE_EXCLUDES`) on `age_exclude_share`; per extra enum, one or two values
    included on `enum_rule_share` and one other excluded on `enum_exclude_share`; audience
    segments by `audiences.advertiser_rules`."""
    schema = world_schema(p)
    if schema is None:
        return None
    n, cols = adv.n, []
    if p.country_exclude_share > 0:
        rng = stream(seed, "rules-country-exclude")
        on = rng.random(n) < p.country_exclude_share
        c = np.clip(np.searchsorted(geo.country_cum, rng.random(n), side="right") - 1,
                    0, geo.n_countries - 1)  # fmt: skip
        c = np.where(c == adv.home_country, (c + 1) % geo.n_countries, c)
        names = np.array(COUNTRIES, dtype=object)
        cols.append(Column("countries_exclude", "country", True, names,
                           _single(geo.iso_index[c], on)))  # fmt: skip
    if p.age_exclude_share > 0:
        rng = stream(seed, "rules-age-exclude")
        on = rng.random(n) < p.age_exclude_share
        bucket = rng.choice(len(AGE_BUCKETS), size=n, p=AGE_EXCLUDES)
        names = np.array(AGE_BUCKETS, dtype=object)
        cols.append(Column("age_buckets_exclude", "age", True, names, _single(bucket, on)))
    for k, (name, field, values, _) in enumerate(EXTRA_ENUMS[: p.extra_enums]):
        rng = stream(seed, "rules-enum", k)
        v = len(values)
        order = np.argsort(rng.random((n, v)), axis=1)  # a random order of the values
        count = np.minimum(1 + (rng.random(n) < ENUM_PAIR_SHARE), v - 1)
        on = (rng.random(n) < p.enum_rule_share)[:, None] & (np.arange(v) < count[:, None])
        off = rng.random(n) < p.enum_exclude_share  # the last in order: never included
        names = np.array(values, dtype=object)
        cols.append(Column(field, name, False, names, distinct_rows(order, on)))
        cols.append(Column(f"{field}_exclude", name, True, names, _single(order[:, -1], off)))
    if seg is not None:
        inc, exc = advertiser_rules(p, seg, adv.topic, stream(seed, "rules-audiences"))
        cols.append(Column(AUDIENCES.catalog_field, AUDIENCES.name, False, seg.names, inc))
        cols.append(Column(AUDIENCES.exclude_field, AUDIENCES.name, True, seg.names, exc))
    return ExtraRules(schema, tuple(cols))
