"""The C++ post stage (pipeline stage 4) against the Python reference post stage
(`tests.helpers.reference_post.expand_and_filter`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.index_arrays import AdArrays, IndexArrays
from contracts.index_format import read_index_dir, write_index_dir
from contracts.targeting import Targeting
from contracts.targeting_codec import codec
from contracts.targeting_schema import DEFAULT
from index_builder.build import build_arrays
from service.post import LocationVocabulary, PostRequest, PostResult, PostStage
from tests.helpers.catalogs import (
    COUNTRY_POOL,
    LOCATION_POOL,
    ads_strategy,
    catalog_from_ads,
    requests_strategy,
)
from tests.helpers.oracle import Ad, eligible
from tests.helpers.reference_post import expand_and_filter

# few distinct values so that ties (and -0.0 == 0.0) are common
SCORES = st.sampled_from([0.0, -0.0, -0.5, -1.0, -1.0000001, -3.25, float("-inf")])


def build(ads: list[Ad]) -> IndexArrays:
    cat = catalog_from_ads(ads)
    return build_arrays(cat, cat.sid.astype(np.int64))


def assert_same(got: PostResult, want: PostResult) -> None:
    for name in ("ad_ids", "scores", "sids"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert got.ads_expanded == want.ads_expanded
    assert got.ads_eligible == want.ads_eligible


def reference(
    ads: AdArrays, leaves: np.ndarray, scores: np.ndarray, req: Targeting, max_ads: int
) -> PostResult:
    return expand_and_filter(ads, LocationVocabulary(ads), leaves, scores, req, max_ads)


@settings(max_examples=120, deadline=None)
@given(ads=ads_strategy(max_ads=60), data=st.data())
def test_equals_reference_on_random_batches(ads: list[Ad], data: st.DataObject) -> None:
    index = build(ads)
    vocab = LocationVocabulary(index.ads)
    n_leaves = len(index.ads.leaf_sids)
    stage = PostStage(index.ads, threads=data.draw(st.integers(1, 4)))
    batch, want = [], []
    for _ in range(data.draw(st.integers(0, 6))):
        # leaf subsets in any order, repeats allowed (the reference expands them twice)
        leaves = np.array(
            data.draw(st.lists(st.integers(0, n_leaves - 1), max_size=2 * n_leaves)),
            dtype=np.int64,
        )
        scores = np.array(data.draw(st.lists(SCORES, min_size=len(leaves), max_size=len(leaves))))
        req = data.draw(requests_strategy)
        max_ads = data.draw(st.integers(0, len(ads) + 2))
        batch.append(PostRequest.from_targeting(leaves, scores, req, vocab, max_ads))
        want.append(reference(index.ads, leaves, scores, req, max_ads))
    got = stage.run(batch)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


@settings(max_examples=40, deadline=None)
@given(ads=ads_strategy(max_ads=60), req=requests_strategy)
def test_returns_exactly_the_eligible_ads(ads: list[Ad], req: Targeting) -> None:
    index = build(ads)
    leaves = np.arange(len(index.ads.leaf_sids))
    request = PostRequest.from_targeting(
        leaves, np.zeros(len(leaves)), req, LocationVocabulary(index.ads), 10**6
    )
    (out,) = PostStage(index.ads).run([request])
    assert sorted(out.ad_ids.tolist()) == sorted(a.ad_id for a in ads if eligible(a, req))
    assert out.ads_expanded == len(ads)


def random_ads(n: int, seed: int) -> list[Ad]:
    rng = np.random.default_rng(seed)

    def pick(pool: tuple[str, ...], k: int) -> tuple[str, ...]:
        return tuple(rng.choice(pool, size=rng.integers(0, k + 1), replace=False).tolist())

    return [
        Ad(
            10_000 + i,
            tuple(int(t) for t in rng.integers(0, 6, size=4)),
            countries=pick(COUNTRY_POOL, 2),
            genders=pick(("female", "male"), 1),
            locations=pick(LOCATION_POOL, 3),
        )
        for i in range(n)
    ]


def test_batch_of_sixteen_on_a_larger_catalog() -> None:
    index = build(random_ads(4000, seed=1))
    vocab = LocationVocabulary(index.ads)
    rng = np.random.default_rng(2)
    n_leaves = len(index.ads.leaf_sids)
    batch, want = [], []
    for b in range(16):
        leaves = rng.choice(n_leaves, size=min(n_leaves, 300), replace=False)
        scores = np.round(np.sort(rng.normal(size=len(leaves)))[::-1], 1)  # many ties
        req = Targeting(
            country=str(rng.choice(["US", "CA", "GB", "FR"])),
            gender=str(rng.choice(["", "female", "male"])),
            locations=tuple(rng.choice(LOCATION_POOL, size=b % 4, replace=False).tolist()),
        )
        batch.append(PostRequest.from_targeting(leaves, scores, req, vocab, 50 * (b + 1)))
        want.append(reference(index.ads, leaves, scores, req, 50 * (b + 1)))
    for threads in (1, 2, 5):
        for g, w in zip(PostStage(index.ads, threads).run(batch), want, strict=True):
            assert_same(g, w)


def test_empty_batch_and_requests_without_leaves() -> None:
    index = build(random_ads(50, seed=3))
    stage = PostStage(index.ads)
    assert stage.run([]) == []
    empty = PostRequest.from_targeting([], [], Targeting(), LocationVocabulary(index.ads), 10)
    (out,) = stage.run([empty])
    assert out.ad_ids.shape == (0,) and out.ad_ids.dtype == np.int64
    assert out.scores.shape == (0,) and out.scores.dtype == np.float32
    assert out.sids.shape == (0, 4) and out.sids.dtype == np.int16
    assert (out.ads_expanded, out.ads_eligible) == (0, 0)


def test_reads_a_read_only_memory_mapped_index(tmp_path) -> None:
    arrays = build(random_ads(300, seed=4))
    write_index_dir(tmp_path, arrays, {"index_version": "v", "tokenizer_fingerprint": "t"})
    _, mapped = read_index_dir(tmp_path)
    assert isinstance(mapped.ads.ad_bitmask, np.memmap)
    assert not mapped.ads.ad_bitmask.flags.writeable
    leaves = np.arange(len(mapped.ads.leaf_sids))[::-1]
    scores = -np.arange(len(leaves), dtype=np.float32)
    req = Targeting(country="US", locations=("US/R1", "DE"))
    request = PostRequest.from_targeting(leaves, scores, req, LocationVocabulary(mapped.ads), 100)
    (out,) = PostStage(mapped.ads).run([request])
    assert_same(out, reference(arrays.ads, leaves, scores, req, 100))


def test_refuses_arrays_it_would_have_to_copy() -> None:
    ads = build(random_ads(20, seed=5)).ads
    wrong_dtype = AdArrays(**{**ads.__dict__, "ad_ids": ads.ad_ids.astype(np.int32)})
    with pytest.raises(TypeError, match="ad_ids"):
        PostStage(wrong_dtype)
    strided = np.repeat(ads.ad_bitmask, 2, axis=0)[::2]
    with pytest.raises(ValueError, match="ad_bitmask"):
        PostStage(AdArrays(**{**ads.__dict__, "ad_bitmask": strided}))


def test_bad_requests_raise_clear_errors() -> None:
    ads = build(random_ads(20, seed=6)).ads
    stage = PostStage(ads)
    bitmask = codec(DEFAULT).request_bitmask(Targeting().values())
    n_leaves = len(ads.leaf_sids)
    with pytest.raises(IndexError, match="out of range"):
        stage.run([PostRequest([0, n_leaves], [0.0, 0.0], bitmask, [], 5)])
    with pytest.raises(IndexError, match="out of range"):
        stage.run([PostRequest([-1], [0.0], bitmask, [], 5)])
    with pytest.raises(ValueError, match="sorted"):
        PostRequest([0], [0.0], bitmask, [3, 1], 5)
    with pytest.raises(ValueError, match="words"):
        PostRequest([0], [0.0], bitmask[:-1], [], 5)
    with pytest.raises(ValueError, match="scores"):
        PostRequest([0, 1], [0.0], bitmask, [], 5)
    with pytest.raises(ValueError, match="max_ads"):
        PostRequest([0], [0.0], bitmask, [], -1)
    with pytest.raises(TypeError, match="leaves"):
        PostRequest([0.5], [0.0], bitmask, [], 5)


def test_gil_is_released_during_run() -> None:
    """Another Python thread keeps running while a big batch is in C++."""
    ads = [Ad(i, (0, 0, 0, 0), locations=("US/R1",) if i % 2 else ()) for i in range(1000)]
    index = build(ads)
    vocab = LocationVocabulary(index.ads)
    leaf = np.zeros(30_000, dtype=np.int64)  # leaf 0 (1000 ads) 30k times: 30M ads each
    req = Targeting(country="US", locations=("US/R1",))
    batch = [PostRequest.from_targeting(leaf, np.zeros(len(leaf)), req, vocab, 10)] * 4
    stage = PostStage(index.ads, threads=2)

    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1
            if count % 1000 == 0:
                stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        t0 = time.perf_counter()
        out = stage.run(batch)
        t1 = time.perf_counter()
    finally:
        stop.set()
        spinner.join()
    assert out[0].ads_expanded == 30_000_000 and out[0].ads_eligible == 30_000_000
    # with the GIL held for the call, no stamp could fall in its middle half
    lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
    assert sum(lo < s < hi for s in stamps) > 0, f"no progress during a {t1 - t0:.3f} s call"


def test_default_threads_and_bitmask_width() -> None:
    stage = PostStage(build(random_ads(5, seed=7)).ads)
    assert stage.threads >= 1
    assert stage._index.words == DEFAULT.bitmask_words == 5
