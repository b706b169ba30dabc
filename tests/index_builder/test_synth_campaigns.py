"""Creatives and campaigns in the synthetic world (index_builder/synth/campaigns.py).

With the knobs on, ads of one creative must be near-identical in content and differ in
targeting; with the knobs at their neutral values, or with one knob group on, nothing
else in the world may move; and the world stays deterministic however it is drawn.
Creatives are recovered from the written catalog (near-identical embeddings of one
advertiser), not read from the generator's state.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from index_builder.synth import PROFILES, WorldProfile, generate_world, load_world
from tests.index_builder.test_synth import FILES, eligible

SEED = 11
TARGETING = ("countries", "age_buckets", "genders", "locations")
TINY = PROFILES["tiny"]
CREATIVES = {"ads_per_creative": 6.0, "creative_noise": 0.002}
CAMPAIGNS = {"campaign_geo_share": 0.6, "campaign_demo_share": 0.4}
TINY_STUDY = replace(TINY, name="tiny-study", **CREATIVES, **CAMPAIGNS)


def _gen(profile: WorldProfile | str, out: Path, **kw: Any) -> dict[str, Any]:
    return generate_world(profile, SEED, out, progress=False, **kw)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("campaigns")
    profiles: dict[str, WorldProfile | str] = {
        "plain": "tiny",
        "study": TINY_STUDY,
        "creatives": replace(TINY, name="tiny-creatives", **CREATIVES),
        "campaigns": replace(TINY, name="tiny-campaigns", **CAMPAIGNS),
    }
    for name, profile in profiles.items():
        _gen(profile, root / name)
    return {name: root / name for name in profiles}


def _catalog(path: Path) -> dict[str, Any]:
    return pq.read_table(path / "catalog.parquet").to_pydict()


def _creatives(cat: dict[str, Any]) -> list[np.ndarray]:
    """Ad rows grouped by creative: ads of one advertiser with (near-)equal embeddings."""
    emb = np.array(cat["embedding"], dtype=np.float64)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    adv = np.array(cat["advertiser_id"])
    groups = []
    for a in np.unique(adv):
        rows = np.flatnonzero(adv == a)
        left = set(range(len(rows)))
        cos = emb[rows] @ emb[rows].T
        while left:
            i = min(left)
            members = [j for j in left if cos[i, j] > 0.9999]
            left -= set(members)
            groups.append(rows[members])
    return groups


def test_neutral_knobs_leave_the_world_unchanged(worlds: dict[str, Path], tmp_path: Path) -> None:
    # creative_noise only matters with creatives: at ads_per_creative = 1 it is ignored
    neutral = replace(TINY, ads_per_creative=1.0, creative_noise=0.5, campaign_geo_share=0.0)
    _gen(neutral, tmp_path / "neutral")
    for name in FILES:
        assert (tmp_path / "neutral" / name).read_bytes() == (worlds["plain"] / name).read_bytes()
    assert "creatives" not in load_world(worlds["plain"]).summary


def test_each_knob_group_changes_only_its_own_columns(worlds: dict[str, Path]) -> None:
    plain = _catalog(worlds["plain"])
    creatives, campaigns = _catalog(worlds["creatives"]), _catalog(worlds["campaigns"])
    for col in ("ad_id", "advertiser_id", *TARGETING):  # creatives: new content only
        assert creatives[col] == plain[col], col
    assert creatives["embedding"] != plain["embedding"]
    for col in ("ad_id", "advertiser_id", "embedding"):  # campaigns: new targeting only
        assert campaigns[col] == plain[col], col
    changed = sum(
        any(campaigns[c][i] != plain[c][i] for c in TARGETING) for i in range(len(plain["ad_id"]))
    )
    assert 0.4 * len(plain["ad_id"]) < changed < 0.9 * len(plain["ad_id"])


def test_creatives_share_content_but_not_targeting(worlds: dict[str, Path]) -> None:
    cat = _catalog(worlds["study"])
    groups = _creatives(cat)
    sizes = np.array([len(g) for g in groups])
    assert 4.0 < sizes.mean() < 7.0 and (sizes >= 3).sum() > 100
    differ = [
        len({tuple(tuple(cat[c][i]) for c in TARGETING) for i in g}) > 1
        for g in groups
        if len(g) > 1
    ]
    assert np.mean(differ) > 0.9  # one SID's worth of content, several targetings
    reported = load_world(worlds["study"]).summary["creatives"]
    assert reported["creatives"] == len(groups)
    assert reported["share_multi_targeting_of_multi_ad"] == pytest.approx(np.mean(differ))


def test_campaign_markets_keep_to_the_contract(worlds: dict[str, Path]) -> None:
    world = load_world(worlds["study"])
    cat = _catalog(worlds["study"])
    single = 0
    for countries, locations in zip(cat["countries"], cat["locations"], strict=True):
        if locations:  # a location rule lies inside the ad's (first) country
            assert all(s[:2] == countries[0] for s in locations)
        single += len(countries) == 1 and len(locations) <= 1
    assert single > 0.5 * len(cat["ad_id"])
    rows = [dict(zip(cat, values, strict=True)) for values in zip(*cat.values(), strict=True)]
    by_id = {r["ad_id"]: r for r in rows}
    for u, t in enumerate(world.targeting):  # histories still hold eligible ads only
        for ad_id in [*world.history(u)[0].tolist(), int(world.heldout_ad_ids[u])]:
            assert eligible(by_id[ad_id], t), (u, ad_id, t)


def test_same_seed_same_world_however_drawn(worlds: dict[str, Path], tmp_path: Path) -> None:
    _gen(TINY_STUDY, tmp_path / "again")
    _gen(TINY_STUDY, tmp_path / "forked", workers=3)  # 4 chunks on 3 processes
    for name in FILES:
        want = (worlds["study"] / name).read_bytes()
        assert (tmp_path / "again" / name).read_bytes() == want, name
        assert (tmp_path / "forked" / name).read_bytes() == want, name
    kw: dict[str, Any] = {"n_ads": 7_500, "n_users": 40}  # 15 chunks, refilled in order
    _gen(TINY_STUDY, tmp_path / "one", workers=1, **kw)
    _gen(TINY_STUDY, tmp_path / "two", workers=2, **kw)
    for name in FILES:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_markets_by_creative_are_shared_by_a_creatives_ads(
    worlds: dict[str, Path], tmp_path: Path
) -> None:
    """`campaign_geo_by_creative`: the ads of one creative mostly carry one geo rule
    (countries and locations; 91 % against 6 % per ad) while their demographics still
    differ; content and ids are those of
    the per-ad world, and without creatives the knob changes nothing."""
    by_creative = replace(TINY_STUDY, name="tiny-study-byc", campaign_geo_by_creative=True)
    _gen(by_creative, tmp_path / "byc")
    cat, per_ad = _catalog(tmp_path / "byc"), _catalog(worlds["study"])
    for col in ("ad_id", "advertiser_id", "embedding"):
        assert cat[col] == per_ad[col], col
    groups = [g for g in _creatives(cat) if len(g) > 1]
    geo = [
        len({(tuple(cat["countries"][i]), tuple(cat["locations"][i])) for i in g}) for g in groups
    ]
    demo = [
        len({(tuple(cat["age_buckets"][i]), tuple(cat["genders"][i])) for i in g}) for g in groups
    ]
    # one market per creative; the rest differ only by the per-ad jitter of an
    # advertiser's own rule (slot_keep), which creatives without a campaign market keep
    assert np.mean(np.array(geo) == 1) > 0.8
    assert np.mean(np.array(demo) > 1) > 0.5  # demographics still differ within most
    per_ad_geo = [len({(tuple(per_ad["countries"][i]), tuple(per_ad["locations"][i])) for i in g})
                  for g in _creatives(per_ad) if len(g) > 1]  # fmt: skip
    assert np.mean(np.array(per_ad_geo) == 1) < 0.2  # per ad, creatives span markets
    neutral = replace(TINY, campaign_geo_by_creative=True)  # no creatives: nothing to share
    _gen(neutral, tmp_path / "neutral")
    for name in FILES:
        assert (tmp_path / "neutral" / name).read_bytes() == (worlds["plain"] / name).read_bytes()


def test_study_profile_is_in_the_papers_regime(tmp_path: Path) -> None:
    """A scaled-down `study` world: creatives of several ads in one market each, of
    several targetings; eligibility sparse by design (~1 % of the catalog per user); 40 %
    of the creatives launched after the log, some held-out ads among them."""
    s = _gen("study", tmp_path / "study", n_ads=20_000, n_users=200, jsonl=False)
    assert PROFILES["demo"].n_ads < PROFILES["study"].n_ads < PROFILES["paper"].n_ads
    assert s["creatives"]["mean_ads_per_creative"] > 5
    assert s["creatives"]["share_multi_targeting_of_multi_ad"] > 0.9
    assert 0.005 < s["eligibility"]["mean_eligible_share"] < 0.05
    assert 0.3 < s["fresh"]["share_of_ads"] < 0.5
    assert 0.0 < s["fresh"]["heldout_share"] < 1.0


@pytest.mark.parametrize(
    "knobs",
    [
        {"ads_per_creative": 0.5},
        {"creative_noise": -0.1},
        {"campaign_geo_share": 1.5},
        {"campaign_demo_share": -0.2},
        {"fresh_share": 1.0},
        {"fresh_share": -0.1},
    ],
)
def test_profile_refuses_bad_campaign_knobs(knobs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        replace(TINY, **knobs)


def test_grace_synth_offers_every_profile(tmp_path: Path) -> None:
    """`grace synth --profile` lists every world profile (study included), and a scaled
    study world comes out of the CLI."""
    from cli import main

    with pytest.raises(SystemExit):
        main(["synth", "--profile", "no-such-profile", "--out", str(tmp_path / "x")])
    assert set(PROFILES) == {"tiny", "demo", "study", "paper"}  # what the CLI offers
    out = tmp_path / "study"
    assert main(["synth", "--profile", "study", "--ads", "3000", "--users", "60",
                 "--out", str(out), "--no-jsonl", "--workers", "1"]) in (0, None)  # fmt: skip
    world = json.loads((out / "world.json").read_text())
    assert world["profile"] == "study" and world["creatives"]["creatives"] > 0


def test_grace_synth_sets_knobs_and_refuses_bad_ones_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`grace synth --set KNOB=VALUE` overrides a profile's knobs (numbers, tuples,
    booleans), world.json records them, and a wrong knob or value is one line on stderr
    before anything is written."""
    from cli import main

    out = tmp_path / "set"
    argv = ["synth", "--profile", "tiny", "--out", str(out), "--no-progress", "--workers", "1",
            "--set", "fresh_share=0.3", "--set", "style_mix=0.15,0.05,0.5,0.3",
            "--set", "campaign_geo_by_creative=true", "--set", "history_len_max=64"]  # fmt: skip
    assert main(argv) == 0
    world = json.loads((out / "world.json").read_text())
    knobs = world["knobs"]
    assert knobs["fresh_share"] == 0.3 and knobs["style_mix"] == [0.15, 0.05, 0.5, 0.3]
    assert knobs["campaign_geo_by_creative"] is True and knobs["history_len_max"] == 64
    assert 0.2 < world["fresh"]["share_of_ads"] < 0.4
    capsys.readouterr()
    for bad, says in [
        ("nope=1", "unknown knob 'nope'"),
        ("fresh_share=abc", "knob fresh_share: 'abc' is not float"),
        ("style_mix=0.5,0.5", "is not 4 comma-separated numbers"),
        ("history_len_max=6.5", "is not int"),
        ("campaign_geo_by_creative=maybe", "is not bool"),
        ("fresh_share", "--set takes KNOB=VALUE"),
        ("fresh_share=1.5", "fresh_share must lie in [0, 1)"),
    ]:
        target = tmp_path / bad.replace("=", "_")
        assert main(["synth", "--profile", "tiny", "--out", str(target), "--set", bad]) != 0
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
        assert not target.exists()


def test_fresh_creatives_launch_after_the_log(worlds: dict[str, Path], tmp_path: Path) -> None:
    """`fresh_share`: whole creatives launch after the interaction log. No logged event
    shows one, a held-out next interaction may (flagged in heldout.parquet), and the
    catalog is the catalog without the knob."""
    summary = _gen(replace(TINY_STUDY, name="tiny-study-fresh", fresh_share=0.3), tmp_path / "f")
    world, cat = load_world(tmp_path / "f"), _catalog(tmp_path / "f")
    assert cat == _catalog(worlds["study"])
    assert 0.2 < summary["fresh"]["share_of_ads"] < 0.4
    flagged = world.heldout_fresh
    assert flagged is not None and 0.05 < flagged.mean() < 0.6
    assert summary["fresh"]["heldout_share"] == pytest.approx(flagged.mean())
    logged = set(world.history_ad_ids.tolist())
    fresh_ids = set(world.heldout_ad_ids[flagged].tolist())
    assert fresh_ids and not fresh_ids & logged
    assert set(world.heldout_ad_ids[~flagged].tolist()) & logged  # old ads recur
    touched = 0
    for g in _creatives(cat):  # a creative launches as a whole: none of its ads is logged
        ids = {cat["ad_id"][i] for i in g}
        if ids & fresh_ids:
            touched += 1
            assert not ids & logged
    assert touched >= len(fresh_ids) // 2
    assert load_world(worlds["study"]).heldout_fresh is None  # no column without the knob
