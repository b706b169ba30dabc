"""Synthetic ads world (index_builder/synth): determinism, eligibility, realism, files.

Eligibility is re-checked here by brute force on the strings, written from the docs/ARCHITECTURE.md
§3 rules directly rather than through `targeting_codec.exact_eligible`, so a shared bug in the
encoding cannot hide a world that violates the contract.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from contracts.targeting import AGE_BUCKETS, GENDERS, Targeting
from contracts.targeting_schema import COUNTRIES
from index_builder.synth import PROFILES, World, generate_world, load_world

SEED = 7
FILES = (
    "catalog.jsonl",
    "catalog.parquet",
    "users.parquet",
    "heldout.parquet",
    "interactions.parquet",
)
# docs/ARCHITECTURE.md §3 buckets as (lowest age, name); age 0 / under 13 = unknown.
BUCKET_LOWER = ((65, "65+"), (55, "55-64"), (45, "45-54"), (35, "35-44"), (25, "25-34"),
                (18, "18-24"), (13, "13-17"))  # fmt: skip


def bucket_of(age: int) -> str | None:
    return next((name for lower, name in BUCKET_LOWER if age >= lower), None)


def eligible(ad: dict[str, Any], t: Targeting) -> bool:
    """docs/ARCHITECTURE.md §3, on the strings: every rule empty or satisfied."""
    if ad["countries"] and t.country not in ad["countries"]:
        return False
    if ad["age_buckets"] and bucket_of(t.age) not in ad["age_buckets"]:
        return False
    if ad["genders"] and t.gender not in ad["genders"]:
        return False
    return not ad["locations"] or bool(set(ad["locations"]) & set(t.locations))


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth")
    out = {"a": root / "a", "b": root / "b", "other": root / "other"}
    generate_world("tiny", SEED, out["a"], progress=False)
    generate_world("tiny", SEED, out["b"], progress=False)
    generate_world("tiny", SEED + 1, out["other"], progress=False)
    return out


@pytest.fixture(scope="module")
def world(worlds: dict[str, Path]) -> World:
    return load_world(worlds["a"])


@pytest.fixture(scope="module")
def catalog(worlds: dict[str, Path]) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for line in (worlds["a"] / "catalog.jsonl").read_bytes().split(b"\n")
        if line
    ]


@pytest.fixture(scope="module")
def by_id(catalog: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {row["ad_id"]: row for row in catalog}


def test_same_seed_same_world_other_seed_differs(worlds: dict[str, Path]) -> None:
    for name in FILES:
        assert (worlds["a"] / name).read_bytes() == (worlds["b"] / name).read_bytes(), name
    a = pq.read_table(worlds["a"] / "catalog.parquet")
    other = pq.read_table(worlds["other"] / "catalog.parquet")
    assert not a.equals(other)
    assert not np.array_equal(a["ad_id"].to_numpy(), other["ad_id"].to_numpy())


def test_world_dir_is_complete_and_nothing_is_left_behind(worlds: dict[str, Path]) -> None:
    assert sorted(p.name for p in worlds["a"].iterdir()) == sorted([*FILES, "world.json"])
    assert not [p for p in worlds["a"].parent.iterdir() if p.name.startswith(".")]


def test_every_history_and_heldout_event_is_eligible(
    world: World, by_id: dict[int, dict[str, Any]]
) -> None:
    assert world.n_users == world.summary["counts"]["users"] > 0.9 * PROFILES["tiny"].n_users
    n_events = 0
    for u, t in enumerate(world.targeting):
        ad_ids, types, ts = world.history(u)
        assert len(ad_ids) >= PROFILES["tiny"].history_len_min - 1
        for ad_id in [*ad_ids.tolist(), int(world.heldout_ad_ids[u])]:
            assert eligible(by_id[ad_id], t), (u, ad_id, t)
            n_events += 1
        assert set(types.tolist()) <= {1, 2, 3}
        assert np.all(np.diff(ts) > 0) and world.heldout_ts[u] > ts[-1]  # time-ordered
    assert n_events > 2_000


def test_ad_ids_unique_and_not_dense(catalog: list[dict[str, Any]]) -> None:
    ids = np.array([row["ad_id"] for row in catalog], dtype=np.int64)
    assert len(ids) == PROFILES["tiny"].n_ads == len(np.unique(ids))
    assert ids.min() > 0 and ids.max() > 1000 * len(ids)


def test_catalog_rows_use_only_contract_values(catalog: list[dict[str, Any]]) -> None:
    loc = re.compile(r"^[A-Z]{2}(/R\d{2}(/C\d{4}(/N\d+)?)?)?$")
    for row in catalog:
        assert set(row) == {"ad_id", "advertiser_id", "embedding", "countries", "age_buckets",
                            "genders", "locations"}  # fmt: skip
        assert set(row["countries"]) <= set(COUNTRIES)
        assert set(row["genders"]) <= set(GENDERS)
        assert all(loc.match(s) for s in row["locations"])
        if row["age_buckets"]:  # contiguous ranges of buckets
            idx = sorted(AGE_BUCKETS.index(b) for b in row["age_buckets"])
            assert idx == list(range(idx[0], idx[-1] + 1))
        if row["locations"]:  # regional / local ads stay inside their home country
            assert row["countries"] == [row["locations"][0][:2]]


def test_targeting_styles_and_rules_are_all_present(catalog: list[dict[str, Any]]) -> None:
    n = len(catalog)
    no_geo = sum(not r["countries"] and not r["locations"] for r in catalog)
    national = sum(bool(r["countries"]) and not r["locations"] for r in catalog)
    regional = sum(any(s.count("/") == 1 for s in r["locations"]) for r in catalog)
    local = sum(any(s.count("/") >= 2 for s in r["locations"]) for r in catalog)
    assert min(no_geo, national, regional, local) > 0.02 * n
    assert 0.1 * n < sum(bool(r["age_buckets"]) for r in catalog) < 0.6 * n
    assert 0.02 * n < sum(bool(r["genders"]) for r in catalog) < 0.3 * n


def test_user_locations_are_clustered_and_capped(world: World) -> None:
    lengths = [len(t.locations) for t in world.targeting]
    assert max(lengths) <= 64 and np.mean(lengths) > 4
    for t in world.targeting:
        assert t.locations[0] == t.country  # country string first, then home region, city
        assert t.locations[1].startswith(t.country + "/") and t.locations[1].count("/") == 1
        assert t.locations[2].startswith(t.locations[1] + "/")
    genders = Counter(t.gender for t in world.targeting)
    assert genders["female"] > 100 and genders["male"] > 100
    assert 0 < sum(t.age == 0 for t in world.targeting) < 0.15 * world.n_users


def test_advertiser_sizes_are_zipf_like(catalog: list[dict[str, Any]]) -> None:
    sizes = np.array(sorted(Counter(r["advertiser_id"] for r in catalog).values()))
    assert sizes[-1] >= 10 * np.median(sizes)
    assert sizes[-10:].sum() > 0.3 * sizes.sum()  # a head of big advertisers


def test_jsonl_and_parquet_hold_the_same_rows(
    worlds: dict[str, Path], catalog: list[dict[str, Any]]
) -> None:
    table = pq.read_table(worlds["a"] / "catalog.parquet")
    assert table.num_rows == len(catalog)
    for col in ("ad_id", "advertiser_id", "countries", "age_buckets", "genders", "locations"):
        assert table[col].to_pylist() == [r[col] for r in catalog], col
    emb_parquet = np.array(table["embedding"].to_pylist(), dtype=np.float32)
    emb_jsonl = np.array([r["embedding"] for r in catalog], dtype=np.float32)
    assert emb_parquet.shape == (len(catalog), PROFILES["tiny"].embedding_dim)
    np.testing.assert_array_equal(emb_parquet, emb_jsonl)


def test_embeddings_cluster_by_advertiser(catalog: list[dict[str, Any]]) -> None:
    emb = np.array([r["embedding"] for r in catalog], dtype=np.float32)
    adv = np.array([r["advertiser_id"] for r in catalog])
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    same = [emb[adv == a] for a in np.unique(adv)[:20] if (adv == a).sum() > 1]
    within = np.mean([(e @ e.T).mean() for e in same])
    overall = (emb[:500] @ emb[:500].T).mean()
    assert within > 0.8 and within > overall + 0.5


def test_targeting_bites_for_a_typical_user(world: World, catalog: list[dict[str, Any]]) -> None:
    shares = [np.mean([eligible(ad, t) for ad in catalog]) for t in world.targeting[:60]]
    assert 0.05 < np.median(shares) < 0.6  # a sizeable share of ads is not eligible
    reported = world.summary["eligibility"]["mean_eligible_share"]
    assert abs(np.mean(shares) - reported) < 0.06  # world.json agrees with brute force


def test_load_world_refuses_an_incomplete_dir(worlds: dict[str, Path], tmp_path: Path) -> None:
    for name in FILES:
        (tmp_path / name).write_bytes((worlds["a"] / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"world\.json"):
        load_world(tmp_path)
    with pytest.raises(FileExistsError):  # never replaces a directory that is not a world
        generate_world("tiny", SEED, tmp_path, progress=False)


def test_counts_override_and_rewrite_in_place(tmp_path: Path) -> None:
    out = tmp_path / "w"
    generate_world("tiny", 1, out, n_ads=300, n_users=20, progress=False)
    summary = generate_world("tiny", 1, out, n_ads=500, n_users=30, progress=False)
    assert summary["counts"]["ads"] == 500
    assert pq.read_table(out / "catalog.parquet").num_rows == 500
    assert load_world(out).summary == orjson.loads((out / "world.json").read_bytes())


def test_worker_processes_and_parquet_only_write_the_same_world(
    worlds: dict[str, Path], tmp_path: Path
) -> None:
    # 4 chunks of the tiny profile on 3 processes: the same bytes as one process
    generate_world("tiny", SEED, tmp_path / "forked", progress=False, workers=3)
    for name in FILES:
        assert (tmp_path / "forked" / name).read_bytes() == (worlds["a"] / name).read_bytes()
    summary = generate_world("tiny", SEED, tmp_path / "pq", progress=False, workers=2, jsonl=False)
    assert not (tmp_path / "pq" / "catalog.jsonl").exists()
    assert "catalog.jsonl" not in summary["files"]
    for name in FILES[1:]:
        assert (tmp_path / "pq" / name).read_bytes() == (worlds["a"] / name).read_bytes()
    assert load_world(tmp_path / "pq").n_users == load_world(worlds["a"]).n_users


def test_more_chunks_than_workers_in_flight(tmp_path: Path) -> None:
    """15 chunks on 2 workers (at most 4 in flight): chunks are refilled in order."""
    kw = {"n_ads": 7_500, "n_users": 40, "progress": False}
    generate_world("tiny", 3, tmp_path / "one", workers=1, **kw)
    generate_world("tiny", 3, tmp_path / "two", workers=2, **kw)
    for name in FILES:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
