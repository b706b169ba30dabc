"""Feature preparation (pipeline stage 2): what the encoder sees of a request, and the
packed form in which stage 1 moves it to the GPU."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from contracts.index_arrays import AdArrays
from contracts.targeting import AGE_BUCKETS, GENDERS, Targeting
from contracts.targeting_schema import COUNTRIES
from service.model.config import PROFILES
from service.model.feature_packing import (
    PackedFeatureBatch,
    pack_features,
    packed_columns,
    unpack_features,
)
from service.model.features import (
    FeatureBatch,
    SidLookup,
    UserFeatures,
    gap_bucket,
    prepare_features,
    user_hash,
)

CONFIG = replace(PROFILES["tiny"], max_history=4)
# leaf i (SID (i, i+1, i+2, i+3)) holds ad AD_IDS[i]: ad ids unsorted in leaf order
AD_IDS = np.array([107, 100, 103, 101, 109, 102, 104, 108, 105, 106], np.int64)


def _ads() -> AdArrays:
    return AdArrays(
        leaf_sids=np.array([[i, i + 1, i + 2, i + 3] for i in range(10)], np.int16),
        leaf_ad_offsets=np.arange(11, dtype=np.int64),
        ad_ids=AD_IDS,
        ad_bitmask=np.zeros((10, 5), np.uint64),
    )


LOOKUP = SidLookup.from_ads(_ads())


def _sid(ad_id: int) -> list[int]:
    i = AD_IDS.tolist().index(ad_id)
    return [i, i + 1, i + 2, i + 3]


NO_TARGETING = Targeting()


def _user(ads, types=None, ts=None, uid=1, targeting=NO_TARGETING, now_ms=None) -> UserFeatures:
    n = len(ads)
    return UserFeatures(
        user_id=uid,
        targeting=targeting,
        history_ad_ids=np.array(ads, np.int64),
        history_types=np.array(types if types is not None else [1] * n, np.int8),
        history_ts_ms=np.array(ts if ts is not None else [1000 * (i + 1) for i in range(n)]),
        now_ms=now_ms,
    )


def test_lookup_maps_ads_to_their_leaf_sid_and_misses_unknown_ids():
    sids, found = LOOKUP.lookup(np.array([105, 100, 42, 109, 110, -1]))
    assert found.tolist() == [True, True, False, True, False, False]
    assert sids[0].tolist() == _sid(105)
    assert sids[1].tolist() == _sid(100)
    assert sids[3].tolist() == _sid(109)
    assert sids[2].tolist() == [0, 0, 0, 0]


def test_lookup_expands_leaves_holding_several_ads():
    ads = AdArrays(
        leaf_sids=np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int16),
        leaf_ad_offsets=np.array([0, 3, 4], np.int64),
        ad_ids=np.array([30, 10, 20, 5], np.int64),
        ad_bitmask=np.zeros((4, 5), np.uint64),
    )
    sids, found = SidLookup.from_ads(ads).lookup(np.array([5, 10, 20, 30]))
    assert found.all()
    assert sids.tolist() == [[5, 6, 7, 8]] + [[1, 2, 3, 4]] * 3


def test_keeps_the_newest_known_events_oldest_first():
    # 6 known events, shuffled in time, plus unknown ads; max_history = 4
    ads = [100, 101, 999, 102, 103, 104, 105, 998]
    ts = [10, 20, 65, 30, 40, 50, 60, 70]
    types = [1, 2, 1, 3, 1, 2, 3, 1]
    perm = [5, 2, 0, 7, 3, 1, 6, 4]
    u = _user([ads[i] for i in perm], [types[i] for i in perm], [ts[i] * 1000 for i in perm])
    f = prepare_features([u], LOOKUP, CONFIG)
    assert f.hist_mask.tolist() == [[True] * 4]
    assert f.hist_sid[0].tolist() == [_sid(a) for a in (102, 103, 104, 105)]
    assert f.hist_type[0].tolist() == [3, 1, 2, 3]


def test_rows_are_left_aligned_and_padding_is_zero():
    users = [_user([100, 101, 102]), _user([103]), _user([])]
    f = prepare_features(users, LOOKUP, CONFIG)
    assert f.hist_mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert f.hist_sid[1, 0].tolist() == _sid(103)
    assert (f.hist_sid[~f.hist_mask] == 0).all()
    assert (f.hist_type[~f.hist_mask] == 0).all()
    assert (f.hist_gap[~f.hist_mask] == 0).all()


def test_empty_and_all_unknown_histories_give_all_masked_rows():
    f = prepare_features([_user([]), _user([42, 43])], LOOKUP, CONFIG)
    assert f.hist_mask.shape == (2, 0)
    f = prepare_features([_user([]), _user([100])], LOOKUP, CONFIG, width=CONFIG.max_history)
    assert f.hist_mask.shape == (2, 4)
    assert not f.hist_mask[0].any()
    assert f.hist_sid.dtype == torch.int64 and f.hist_mask.dtype == torch.bool


def test_width_shorter_than_a_history_is_refused():
    with pytest.raises(ValueError, match="width"):
        prepare_features([_user([100, 101])], LOOKUP, CONFIG, width=1)


def test_bad_event_type_is_refused():
    with pytest.raises(ValueError, match="type"):
        prepare_features([_user([100], types=[0])], LOOKUP, CONFIG)


def test_time_gaps_are_relative_to_now_or_the_newest_event():
    day = 86_400_000
    u = _user([100, 101, 102], ts=[0, day - 60_000, day])
    f = prepare_features([u, replace(u, now_ms=100 * day)], LOOKUP, CONFIG)
    expect = gap_bucket(np.array([day, 60_000, 0]), CONFIG.time_gap_buckets)
    assert f.hist_gap[0].tolist() == expect.tolist()
    assert f.hist_gap[0, 2] == 0  # the newest event is the reference
    assert f.hist_gap[0, 0] > f.hist_gap[0, 1] > 0  # older events, larger buckets
    assert f.hist_gap[1].tolist() == [CONFIG.time_gap_buckets - 1] * 3  # past the horizon


def test_gap_buckets_are_log_scaled_and_bounded():
    g = gap_bucket(np.array([-5, 0, 999, 10**3, 10**5, 10**7, 10**9, 10**12]), 16)
    assert g[0] == g[1] == 0
    assert (np.diff(g) >= 0).all() and g[-1] == 15 and g.max() < 16


def test_categorical_buckets_including_unknowns():
    ts = [
        Targeting(country="US", age=30, gender="female"),
        Targeting(country="de", age=70, gender="male"),
        Targeting(country="", age=0, gender=""),
        Targeting(country="XX", age=12, gender=""),
        Targeting(country="ZW", age=13, gender="female"),
    ]
    f = prepare_features([_user([], targeting=t) for t in ts], LOOKUP, CONFIG)
    unknown_c = len(COUNTRIES)
    assert f.country.tolist() == [
        COUNTRIES.index("US"),
        COUNTRIES.index("DE"),
        unknown_c,
        unknown_c,
        COUNTRIES.index("ZW"),
    ]
    assert f.age_bucket.tolist() == [2, 6, len(AGE_BUCKETS), len(AGE_BUCKETS), 0]
    assert f.gender.tolist() == [0, 1, len(GENDERS), len(GENDERS), 0]


def _splitmix64_reference(x: int) -> int:
    """The documented hash, in plain Python integers."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_user_hash_follows_its_definition():
    ids = [0, 1, 12345, 2**62 + 7, -1, -(2**63)]
    got = user_hash(np.array(ids, np.int64), 4096).tolist()
    assert got == [_splitmix64_reference(i % 2**64) % 4096 for i in ids]
    f = prepare_features([_user([], uid=i) for i in ids], LOOKUP, CONFIG)
    assert f.user_hash.tolist() == [
        _splitmix64_reference(i % 2**64) % CONFIG.user_hash_buckets for i in ids
    ]


def test_user_hash_is_stable_across_processes():
    code = (
        "import numpy as np; from service.model.features import user_hash; "
        "print(user_hash(np.array([987654321, 42]), 65536).tolist())"
    )
    # another interpreter with its own str-hash salt gives the documented values
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    expect = [_splitmix64_reference(987654321) % 65536, _splitmix64_reference(42) % 65536]
    assert out == f"{expect}\n"


def test_large_batches_match_one_request_at_a_time():
    rng = np.random.default_rng(0)
    users = []
    for uid in range(50):
        n = int(rng.integers(0, 9))
        users.append(
            _user(
                rng.integers(95, 112, n).tolist(),
                rng.integers(1, 4, n).tolist(),
                rng.integers(0, 10**9, n).tolist(),
                uid=uid,
            )
        )
    whole = prepare_features(users, LOOKUP, CONFIG, width=CONFIG.max_history)
    for b, u in enumerate(users):
        one = prepare_features([u], LOOKUP, CONFIG, width=CONFIG.max_history)
        for name in ("hist_sid", "hist_type", "hist_gap", "hist_mask", "user_hash"):
            assert torch.equal(getattr(whole, name)[b], getattr(one, name)[0]), name


def test_to_moves_every_field():
    f = prepare_features([_user([100])], LOOKUP, CONFIG).to("cpu")
    assert f.hist_sid.device.type == "cpu" and f.batch_size == 1


def _equal(a: FeatureBatch, b: FeatureBatch) -> None:
    for f in fields(FeatureBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert x.dtype == y.dtype and torch.equal(x, y), f.name


@settings(max_examples=100, deadline=None)
@given(b=st.integers(0, 5), width=st.integers(0, 6), sid_length=st.integers(1, 4), data=st.data())
def test_pack_then_unpack_gives_the_batch_back(b, width, sid_length, data):
    def ints(*shape: int) -> torch.Tensor:
        return torch.from_numpy(data.draw(hnp.arrays(np.int64, shape)))

    mask = torch.from_numpy(data.draw(hnp.arrays(np.bool_, (b, width))))
    f = FeatureBatch(
        ints(b), ints(b), ints(b), ints(b), ints(b, width, sid_length), ints(b, width),
        ints(b, width), mask,
    )  # fmt: skip
    packed = pack_features(f)
    assert packed.shape == (b, packed_columns(width, sid_length))
    assert packed.dtype == torch.int64
    back = unpack_features(packed, sid_length)
    _equal(back, f)
    # zero columns appended to the rows are masked, all-zero padding events
    wider = unpack_features(torch.nn.functional.pad(packed, (0, 2 * (sid_length + 3))), sid_length)
    assert wider.hist_mask.shape == (b, width + 2)
    narrowed = {k.name: getattr(wider, k.name) for k in fields(FeatureBatch)}
    for name in ("hist_sid", "hist_type", "hist_gap", "hist_mask"):
        assert not narrowed[name][:, width:].any(), name
        narrowed[name] = narrowed[name][:, :width]
    _equal(FeatureBatch(**narrowed), f)


def test_a_packed_batch_views_one_buffer_and_moves_as_one():
    f = prepare_features([_user([100, 101]), _user([])], LOOKUP, CONFIG, width=4)
    packed = unpack_features(pack_features(f), CONFIG.sid_length)
    _equal(packed, f)
    assert isinstance(packed, PackedFeatureBatch) and packed.batch_size == 2
    for name in ("user_hash", "gender", "hist_sid", "hist_gap"):
        assert getattr(packed, name)._base is packed.packed  # views, not copies
    moved = packed.to("cpu")
    assert isinstance(moved, PackedFeatureBatch)
    _equal(moved, f)


def test_unpacking_refuses_a_row_of_another_layout():
    with pytest.raises(ValueError, match="columns"):
        unpack_features(torch.zeros(2, 4 + 7 + 1, dtype=torch.int64), sid_length=4)
    with pytest.raises(ValueError, match="columns"):
        unpack_features(torch.zeros(2, 3, dtype=torch.int64), sid_length=4)
