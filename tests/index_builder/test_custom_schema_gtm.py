"""GTM and the exact stage over random targeting schemas, not only the default: random
enum, bucket and set attributes (include and exclude lists, narrow Bloom families), a
catalog of them read from a JSON Lines file by the schema, the index built, and random
requests. The invariant: GTM never drops a prefix that holds an eligible ad, and the post
stage keeps exactly the eligible ads — both against an oracle on the strings
(docs/FORMAT.md §1 "Eligibility")."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.index_format import SID_LENGTH
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import EncodedRequests, codec
from contracts.targeting_schema import Attribute, TargetingSchema
from contracts.tensors import RequestTensors
from index_builder.build import build_arrays
from index_builder.catalog import read_catalog
from kernels.gtm_mask import lookup
from service.index.loaded import LoadedIndex
from tests.index_builder.test_gtm import node_prefixes

SET_POOL = tuple(f"v{i}" for i in range(12))


@st.composite
def schemas(draw: st.DrawFn) -> TargetingSchema:
    attrs: list[Attribute] = []
    for i in range(draw(st.integers(0, 2))):
        n = draw(st.integers(1, 5))
        attrs.append(Attribute(name=f"e{i}", kind="enum", catalog_field=f"e{i}s",
                               values=tuple(f"x{j}" for j in range(n))))  # fmt: skip
    if draw(st.booleans()):
        buckets = {"hi": (30, None), "lo": (0, 9), "mid": (10, 19)}  # bits: by range
        attrs.append(Attribute(name="b", kind="bucket", catalog_field="bs", buckets=buckets))
    for i in range(draw(st.integers(0, 3))):
        bits = draw(st.sampled_from([64, 128]))
        hashes = draw(st.integers(1, 3))
        attrs.append(Attribute(name=f"s{i}", kind="set", catalog_field=f"s{i}s", bloom_bits=bits,
                               bloom_hashes=hashes, max_request_values=8))  # fmt: skip
    order = draw(st.permutations(attrs))
    return TargetingSchema(attributes=tuple(order))


def labels(a: Attribute) -> tuple[str, ...]:
    return a.labels if a.kind != "set" else SET_POOL


@st.composite
def worlds(draw: st.DrawFn) -> tuple[TargetingSchema, list[dict], list[dict[str, list[str]]]]:
    schema = draw(schemas())
    tok = st.integers(0, 2)
    rows = []
    for ad_id in range(1, draw(st.integers(1, 30)) + 1):
        row: dict[str, Any] = {"ad_id": ad_id, "sid": list(draw(st.tuples(tok, tok, tok, tok)))}
        for a in schema.attributes:
            pool = labels(a)
            for field in (a.catalog_field, a.exclude_field):
                row[field] = draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
        rows.append(row)
    requests = [draw(request_values(schema)) for _ in range(draw(st.integers(1, 4)))]
    return schema, rows, requests


@st.composite
def request_values(draw: st.DrawFn, schema: TargetingSchema) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in schema.attributes:
        if a.kind == "set":
            out[a.name] = draw(st.lists(st.sampled_from((*SET_POOL, "unseen")), max_size=4))
        elif a.kind == "bucket":
            out[a.name] = draw(st.sampled_from([[], ["5"], ["15"], ["25"], ["31"]]))
        else:
            out[a.name] = draw(st.sampled_from([[], *([v] for v in a.values)]))
    return out


def label_of(a: Attribute, values: list[str]) -> str | None:
    """The request's value of an enum or bucket attribute as a catalog names it; None:
    unknown (missing, or a bucket value in no bucket)."""
    if not values:
        return None
    if a.kind == "enum":
        return values[0]
    number = int(values[0])
    for name, (lo, hi) in a.buckets.items():
        if lo <= number and (hi is None or number <= hi):
            return name
    return None


def eligible(schema: TargetingSchema, row: dict, req: dict[str, list[str]]) -> bool:
    for a in schema.attributes:
        include, exclude = row[a.catalog_field], row[a.exclude_field]
        if a.kind == "set":
            mine = set(req[a.name])
            if (include and not mine & set(include)) or mine & set(exclude):
                return False
        else:
            value = label_of(a, req[a.name])
            if (include and value not in include) or (value is not None and value in exclude):
                return False
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_gtm_never_drops_an_eligible_prefix_and_the_exact_stage_is_exact(world) -> None:
    schema, rows, requests = world
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        catalog = read_catalog(path, progress=False, schema=schema)
    arrays = build_arrays(catalog, catalog.sid.astype(np.int64))
    index = LoadedIndex.from_arrays(arrays, schema=schema)
    prefix = node_prefixes(arrays)
    inner = torch.arange(int(arrays.trie.level_offsets[SID_LENGTH]))
    leaves = np.arange(len(arrays.ads.leaf_sids), dtype=np.int64)
    encoded = codec(schema).encode_requests(requests)
    for b, req in enumerate(requests):
        row = slice(b, b + 1)
        one = RequestTensors.from_encoded(EncodedRequests(
            encoded.bitmask[row], encoded.blooms[row], encoded.n_blooms[row]))  # fmt: skip
        allowed, child = lookup(index.tables, inner, torch.zeros_like(inner), one,
                                FilterMode.CD_GTM)  # fmt: skip
        passed = {prefix[int(c)] for c in child[allowed].tolist()}
        good = [r for r in rows if eligible(schema, r, req)]
        for r in good:  # GTM never drops a prefix holding an eligible ad
            assert all(tuple(r["sid"][:n]) in passed for n in range(1, SID_LENGTH + 1)), req
        # the exact stage keeps exactly the eligible ads of every SID
        targeting = Targeting(attributes=tuple((k, tuple(v)) for k, v in req.items()))
        post = index.post_request(leaves, np.zeros(len(leaves), np.float32), targeting, 10**6)
        (result,) = index.post.run([post])
        assert set(result.ad_ids.tolist()) == {r["ad_id"] for r in good}, req
        assert result.ads_expanded == len(rows)
        assert result.ads_expanded == result.ads_eligible + sum(result.ads_removed.values())
