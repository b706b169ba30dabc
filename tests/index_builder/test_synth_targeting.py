"""Richer targeting in the synthetic world (index_builder/synth: attributes.py,
audiences.py, user_attributes.py, blocks.py; docs/SYNTH.md "Richer targeting").

At their neutral values the knobs leave the world byte for byte as it was. With them on,
a tiny world writes its targeting schema, its catalog reads and builds an index by it,
and every exact check the served path makes agrees with an oracle written on the
catalog's strings from docs/FORMAT.md §1 "Eligibility" — not through the codec, so a
shared bug in the encoding cannot hide a world that breaks the contract.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from contracts.index_format import SID_LENGTH
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import (
    AdRules,
    EncodedRequests,
    RequestRules,
    codec,
    exact_eligible,
)
from contracts.targeting_schema import DEFAULT, TargetingSchema, load
from contracts.tensors import RequestTensors
from index_builder.build import build_index
from index_builder.catalog import read_catalog
from index_builder.synth import PROFILES, World, generate_world, load_world
from index_builder.synth.attributes import SCHEMA_FILE, load_world_schema
from index_builder.synth.profiles import MAX_USER_AUDIENCES, TARGETING_KNOBS
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from kernels.gtm_mask import lookup
from service.index.loaded import LoadedIndex, load_index
from tests.index_builder.test_synth import FILES, bucket_of
from tests.index_builder.test_synth_campaigns import TINY_STUDY

SEED = 13
KNOBS = {
    "n_audiences": 400,
    "extra_enums": 2,
    "country_exclude_share": 0.15,
    "age_exclude_share": 0.15,
    "block_ad_share": 0.3,
    "block_campaign_share": 0.3,
    "block_advertiser_share": 0.2,
}
RICH = replace(PROFILES["tiny"], name="tiny-rich", **KNOBS)
BLOCKS = ("exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rich")
    out = {name: root / name for name in ("plain", "rich", "rich2", "study")}
    generate_world("tiny", SEED, out["plain"], progress=False)
    generate_world(RICH, SEED, out["rich"], progress=False)
    generate_world(RICH, SEED, out["rich2"], progress=False, workers=2, jsonl=False)
    generate_world(replace(TINY_STUDY, **KNOBS), SEED, out["study"], progress=False)
    return out


@pytest.fixture(scope="module")
def world(worlds: dict[str, Path]) -> World:
    return load_world(worlds["rich"])


@pytest.fixture(scope="module")
def rows(worlds: dict[str, Path]) -> list[dict[str, Any]]:
    return pq.read_table(worlds["rich"] / "catalog.parquet").to_pylist()


def eligible(schema: TargetingSchema, row: dict[str, Any], t: Targeting, blocks: bool) -> bool:
    """docs/FORMAT.md §1 "Eligibility", on the strings: for every attribute, the include
    list empty or matched and the exclude list not matched; then the request's blocks."""
    values = dict(t.attributes) | {"country": (t.country,) if t.country else (),
                                   "gender": (t.gender,) if t.gender else (),
                                   "locations": t.locations}  # fmt: skip
    age = bucket_of(t.age)
    values["age"] = (age,) if age else ()
    for a in schema.attributes:
        include, exclude = row.get(a.catalog_field) or [], row.get(a.exclude_field) or []
        mine = set(values.get(a.name, ()))  # an enum's or bucket's one value, or none
        if (include and not mine & set(include)) or mine & set(exclude):
            return False
    if not blocks:
        return True
    return not (row["ad_id"] in t.exclude_ad_ids or row["campaign_id"] in t.exclude_campaign_ids
                or row["advertiser_id"] in t.exclude_advertiser_ids)  # fmt: skip


def test_neutral_knobs_leave_the_world_unchanged(worlds: dict[str, Path], tmp_path: Path) -> None:
    # the shares and shapes only matter once their switch is on: set them, leave it off
    inert = {"audiences_per_user": 9.0, "audience_rule_share": 0.9, "enum_rule_share": 0.9,
             "enum_exclude_share": 0.9, "blocks_per_request": 7.0}  # fmt: skip
    summary = generate_world(replace(PROFILES["tiny"], **inert), SEED, tmp_path / "n",
                             progress=False)  # fmt: skip
    for name in FILES:
        assert (tmp_path / "n" / name).read_bytes() == (worlds["plain"] / name).read_bytes()
    assert not (tmp_path / "n" / SCHEMA_FILE).exists() and "targeting" not in summary
    assert not set(summary["knobs"]) & set(TARGETING_KNOBS)  # world.json as before them
    assert load_world_schema(tmp_path / "n") is DEFAULT == load_world(tmp_path / "n").schema
    assert "campaign_id" not in pq.read_schema(tmp_path / "n" / "catalog.parquet").names


def test_the_world_is_the_same_however_drawn(worlds: dict[str, Path]) -> None:
    for name in ("catalog.parquet", "users.parquet", "heldout.parquet", SCHEMA_FILE):
        assert (worlds["rich"] / name).read_bytes() == (worlds["rich2"] / name).read_bytes()
    # its plain rules are the plain world's: the knobs draw on streams of their own
    rich, plain = (pq.read_table(worlds[k] / "catalog.parquet") for k in ("rich", "plain"))
    for col in ("ad_id", "advertiser_id", "embedding", "countries", "age_buckets", "genders",
                "locations"):  # fmt: skip
        assert rich[col].equals(plain[col]), col
    jsonl = read_catalog(worlds["rich"] / "catalog.jsonl", progress=False,
                         schema=load_world_schema(worlds["rich"]))  # fmt: skip
    parquet = read_catalog(worlds["rich"] / "catalog.parquet", progress=False, schema=jsonl.schema)
    assert np.array_equal(jsonl.bitmask, parquet.bitmask)
    for name, s in jsonl.sets.items():
        other = parquet.sets[name]
        assert np.array_equal(s.vocabulary, other.vocabulary)
        assert np.array_equal(s.include.values, other.include.values)
        assert np.array_equal(s.include.offsets, other.include.offsets)
        assert (s.exclude is None) == (other.exclude is None) == (name == "locations")
        if s.exclude is not None and other.exclude is not None:
            assert np.array_equal(s.exclude.values, other.exclude.values)
    assert np.array_equal(jsonl.campaign, parquet.campaign)


def test_the_schema_file_declares_the_new_attributes(worlds: dict[str, Path], world: World) -> None:
    schema = load(worlds["rich"] / SCHEMA_FILE)
    assert schema == world.schema
    assert [a.name for a in schema.attributes] == [
        "country", "age", "gender", "locations", "platform", "connection", "audiences"]  # fmt: skip
    assert schema.attributes[:4] == DEFAULT.attributes
    assert schema.attribute("audiences").max_request_values == MAX_USER_AUDIENCES
    summary = json.loads((worlds["rich"] / "world.json").read_text())
    assert SCHEMA_FILE in summary["files"] and summary["knobs"]["n_audiences"] == 400


def test_users_and_ads_carry_the_new_rules(world: World, rows: list[dict[str, Any]]) -> None:
    n = len(rows)
    for field, low, high in [("audiences", 0.05, 0.4), ("audiences_exclude", 0.005, 0.2),
                             ("platforms", 0.05, 0.4), ("platforms_exclude", 0.01, 0.3),
                             ("connections", 0.05, 0.4), ("connections_exclude", 0.01, 0.3),
                             ("countries_exclude", 0.03, 0.4),
                             ("age_buckets_exclude", 0.03, 0.4)]:  # fmt: skip
        assert low * n < sum(bool(r[field]) for r in rows) < high * n, field
    for r in rows:
        assert not set(r["audiences"]) & set(r["audiences_exclude"])
        assert not set(r["platforms"]) & set(r["platforms_exclude"])
        assert len(r["platforms"]) < 3 and len(r["connections"]) < 2
    attrs = [dict(t.attributes) for t in world.targeting]
    counts = np.array([len(a["audiences"]) for a in attrs])
    assert counts.max() <= MAX_USER_AUDIENCES and 5 < counts.mean() < 60
    assert all(len(a["platform"]) == 1 and len(a["connection"]) == 1 for a in attrs)
    assert {a["platform"][0] for a in attrs} == {"ios", "android", "web"}
    ids = {"exclude_ad_ids": {r["ad_id"] for r in rows},
           "exclude_campaign_ids": {r["campaign_id"] for r in rows},
           "exclude_advertiser_ids": {r["advertiser_id"] for r in rows} - {0}}  # fmt: skip
    for kind, share in zip(BLOCKS, (0.3, 0.3, 0.2), strict=True):
        lists = [getattr(t, kind) for t in world.targeting]
        assert share / 2 < np.mean([bool(x) for x in lists]) < share * 1.5, kind
        assert all(set(x) <= ids[kind] and len(x) == len(set(x)) for x in lists), kind
    # an advertiser runs several campaigns, each of a few ads
    assert len(ids["exclude_ad_ids"]) > len(ids["exclude_campaign_ids"]) > 1.3 * len(
        ids["exclude_advertiser_ids"])  # fmt: skip


def test_every_event_is_eligible_and_the_next_one_despite_blocks(
    world: World, rows: list[dict[str, Any]]
) -> None:
    by_id = {r["ad_id"]: r for r in rows}
    blocked_in_history = 0
    for u, t in enumerate(world.targeting):
        ad_ids, _, _ = world.history(u)
        for ad_id in ad_ids.tolist():
            assert eligible(world.schema, by_id[ad_id], t, blocks=False), (u, ad_id)
            blocked_in_history += not eligible(world.schema, by_id[ad_id], t, blocks=True)
        assert eligible(world.schema, by_id[int(world.heldout_ad_ids[u])], t, blocks=True), u
    assert blocked_in_history > 100  # blocks bar ads each user was shown


def test_audiences_follow_what_users_interact_with(
    world: World, rows: list[dict[str, Any]]
) -> None:
    """The users in an ad's audience like what it sells: their history (the ads without
    audience rules) lies nearer its content than that of the users outside it."""
    emb = {r["ad_id"]: np.array(r["embedding"]) for r in rows if not r["audiences"]}
    taste = []
    for u in range(world.n_users):
        shown = [emb[a] for a in world.history(u)[0].tolist() if a in emb]
        v = np.mean(shown, axis=0) if shown else np.zeros(len(rows[0]["embedding"]))
        taste.append(v / max(np.linalg.norm(v), 1e-9))
    segs = [set(dict(t.attributes)["audiences"]) for t in world.targeting]
    inside, outside = [], []
    for r in rows:
        if r["audiences"]:
            member = np.array([bool(set(r["audiences"]) & s) for s in segs])
            near = np.array(taste) @ np.array(r["embedding"])
            inside.append(near[member].mean())
            outside.append(near[~member].mean())
    assert np.mean(inside) > np.mean(outside) + 0.1, (np.mean(inside), np.mean(outside))


def _request(schema: TargetingSchema, vocab: dict[str, Any], t: Targeting) -> RequestRules:
    values = t.values()
    ids = {}
    for a in schema.families:
        known = [v for v in values.get(a.name, ()) if v in vocab[a.name]]
        ids[a.name] = np.array(sorted(vocab[a.name][v] for v in known), dtype=np.int32)
    return RequestRules(codec(schema).request_bitmask(values), ids,
                        *(np.array(getattr(t, k), dtype=np.int64) for k in BLOCKS))  # fmt: skip


def test_the_catalog_read_by_its_schema_is_exact(world: World, rows: list[dict[str, Any]]) -> None:
    cat = read_catalog(world.catalog_parquet, progress=False, schema=world.schema)
    assert cat.campaign is not None and cat.advertiser is not None
    vocab = {name: {v: i for i, v in enumerate(s.vocabulary)} for name, s in cat.sets.items()}
    ads = AdRules(cat.bitmask, {n: s.include for n, s in cat.sets.items()},
                  {n: s.exclude for n, s in cat.sets.items() if s.exclude is not None},
                  cat.campaign, cat.advertiser)  # fmt: skip
    assert [r["ad_id"] for r in rows] == cat.ad_id.tolist()
    shares = []
    for t in world.targeting[::3]:
        ok = exact_eligible(world.schema, cat.ad_id, ads, _request(world.schema, vocab, t))
        assert ok.tolist() == [eligible(world.schema, r, t, blocks=True) for r in rows], t
        shares.append(ok.mean())
    assert 0.03 < np.mean(shares) < 0.5


@pytest.fixture(scope="module")
def served(worlds: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> LoadedIndex:
    root, d = tmp_path_factory.mktemp("served"), worlds["study"]
    emb = read_catalog(d / "catalog.parquet", progress=False, schema=load_world_schema(d)).embedding
    config = TokenizerConfig(codebook_size=16, iterations=3, last_token="code")
    SIDTokenizer.train(emb, config, progress=False).save(root / "tok")
    version, _ = build_index(d / "catalog.parquet", root / "index", tokenizer_path=root / "tok",
                             progress=False, schema=load_world_schema(d))  # fmt: skip
    return load_index(root / "index" / version)


def test_the_index_built_by_the_schema_serves_exactly(
    worlds: dict[str, Path], served: LoadedIndex
) -> None:
    """On a study-like world (many ads per SID, of several targetings): the exact post
    stage keeps exactly the oracle's ads, blocks included, and GTM never drops a prefix
    that holds one."""
    from tests.index_builder.test_gtm import node_prefixes

    world, schema = load_world(worlds["study"]), served.schema
    assert schema == world.schema
    by_id = {r["ad_id"]: r for r in pq.read_table(worlds["study"] / "catalog.parquet").to_pylist()}
    ads = served.arrays.ads
    assert ads.ad_campaign_ids is not None and ads.ad_advertiser_ids is not None
    leaves = np.arange(len(ads.leaf_sids), dtype=np.int64)
    leaf_of = np.repeat(leaves, np.diff(ads.leaf_ad_offsets))
    prefix = node_prefixes(served.arrays)
    inner = torch.arange(int(served.arrays.trie.level_offsets[SID_LENGTH]))
    users = [u for u, t in enumerate(world.targeting) if any(getattr(t, k) for k in BLOCKS)]
    removed = 0
    for u in [*users[:25], *range(25)]:
        t = world.targeting[u]
        good = {a for a, r in by_id.items() if eligible(schema, r, t, blocks=True)}
        post = served.post_request(leaves, np.zeros(len(leaves), np.float32), t, 10**6)
        (result,) = served.post.run([post])
        assert set(result.ad_ids.tolist()) == good, u
        removed += result.ads_removed.get("block", 0) + result.ads_removed.get("exclusion", 0)
        enc = codec(schema).encode_requests([t.values()])
        one = RequestTensors.from_encoded(EncodedRequests(enc.bitmask, enc.blooms, enc.n_blooms))
        allowed, child = lookup(served.tables, inner, torch.zeros_like(inner), one,
                                FilterMode.CD_GTM)  # fmt: skip
        passed = {prefix[int(c)] for c in child[allowed].tolist()}
        for i in np.flatnonzero(np.isin(ads.ad_ids, list(good))):
            sid = tuple(int(x) for x in ads.leaf_sids[leaf_of[i]])
            assert all(sid[:n] in passed for n in range(1, SID_LENGTH + 1)), (u, sid)
    assert removed > 0


def test_grace_synth_turns_the_knobs_on_and_refuses_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli import main

    out = tmp_path / "w"
    argv = ["synth", "--profile", "tiny", "--out", str(out), "--no-progress", "--workers", "1",
            "--set", "n_audiences=100", "--set", "extra_enums=1",
            "--set", "block_advertiser_share=0.5"]  # fmt: skip
    assert main(argv) == 0
    schema = load(out / SCHEMA_FILE)
    assert [a.name for a in schema.attributes][4:] == ["platform", "audiences"]
    assert any(t.exclude_advertiser_ids for t in load_world(out).targeting)
    capsys.readouterr()
    for bad, says in [("extra_enums=3", "extra_enums must lie in [0, 2]"),
                      ("n_audiences=5", "n_audiences must be 0 or >= n_topics"),
                      ("block_ad_share=2", "block_ad_share must lie in [0, 1]")]:  # fmt: skip
        target = tmp_path / bad.replace("=", "_")
        assert main(["synth", "--profile", "tiny", "--out", str(target), "--set", bad]) != 0
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
        assert not target.exists()
