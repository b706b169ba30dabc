"""Thread-parallel build helpers (index_builder/parallel.py) and the parallel index build:
every result must equal its serial numpy equivalent, whatever the worker count."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.index_arrays import IndexArrays
from contracts.index_format import array_items
from contracts.targeting_codec import Ragged
from contracts.targeting_schema import DEFAULT
from index_builder import parallel, trie
from index_builder.build import BuildReport, build_arrays
from index_builder.catalog import Catalog, SetRules
from index_builder.trie import dedup_rows


@pytest.fixture
def tiny_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split even test-sized arrays between threads (default: 65,536 rows per task)."""
    monkeypatch.setattr(parallel, "MIN_ROWS_PER_TASK", 7)


@pytest.mark.parametrize("n", [0, 1, 17, 1023])
@pytest.mark.parametrize("key_bits", [1, 9, 36, 62])
def test_stable_argsort_equals_numpy_stable_argsort(n: int, key_bits: int) -> None:
    rng = np.random.default_rng(n + key_bits)
    values = rng.integers(0, max(2, n // 3), n)  # many ties, so stability is tested
    shift = max(0, key_bits - int(values.max(initial=0)).bit_length())
    keys = np.minimum(values << shift, 2**key_bits - 1)  # use the high bits too
    got = parallel.stable_argsort(keys, key_bits)
    np.testing.assert_array_equal(got, np.argsort(keys, kind="stable"))


def test_stable_argsort_falls_back_for_keys_outside_their_bits() -> None:
    keys = np.array([5, -1, 5, 300, 0])
    np.testing.assert_array_equal(parallel.stable_argsort(keys, 8), [1, 4, 0, 2, 3])


def test_float_sort_bits_order_like_the_floats() -> None:
    x = np.array([0.5, 0.0, -0.0, np.inf, 1e-40, 3.0, 0.5], dtype=np.float32)
    bits = parallel.float_sort_bits(x)
    np.testing.assert_array_equal(
        np.argsort(bits, kind="stable"), np.argsort(x + np.float32(0), kind="stable")
    )
    assert bits[1] == bits[2]  # -0.0 sorts as +0.0
    with pytest.raises(ValueError, match=">= 0"):
        parallel.float_sort_bits(np.array([1.0, np.nan], np.float32))


@pytest.mark.parametrize("n", [1, 17, 1023])
@pytest.mark.parametrize("workers", [1, 3])
def test_take_and_or_reduceat_equal_numpy(tiny_tasks, n: int, workers: int) -> None:
    rng = np.random.default_rng(n)
    rows = rng.integers(0, 2**63, (n, 5), dtype=np.uint64)
    idx = rng.permutation(n)
    np.testing.assert_array_equal(parallel.take(rows, idx, workers), rows[idx])
    starts = np.flatnonzero(np.r_[True, rng.random(n - 1) < 0.3])
    np.testing.assert_array_equal(
        parallel.or_reduceat(rows, starts, workers), np.bitwise_or.reduceat(rows, starts, axis=0)
    )


@pytest.mark.parametrize("workers", [2, 5])
def test_dedup_rows_is_the_same_on_threads(tiny_tasks, workers: int) -> None:
    rng = np.random.default_rng(0)
    distinct = rng.integers(0, 2**64, (37, 4), dtype=np.uint64)
    rows = distinct[rng.integers(0, 37, 1001)]
    table, index = dedup_rows(rows, workers)
    serial_table, serial_index = dedup_rows(rows, 1)
    np.testing.assert_array_equal(table, serial_table)
    np.testing.assert_array_equal(index, serial_index)
    np.testing.assert_array_equal(table[index], rows)
    assert len(table) == len(np.unique(rows, axis=0))


def _catalog(n: int, seed: int) -> tuple[Catalog, np.ndarray]:
    """A catalog with shared prefixes, shared full SIDs and ragged location rules."""
    rng = np.random.default_rng(seed)
    sids = np.stack([rng.integers(0, hi, n) for hi in (5, 9, 13, 40)], axis=1)
    bitmask = rng.integers(0, 2**64, (n, DEFAULT.bitmask_words), dtype=np.uint64)
    bitmask &= rng.integers(0, 2**64, (n, DEFAULT.bitmask_words), dtype=np.uint64)  # sparser rows
    bitmask[rng.random(n) < 0.5] = bitmask[0]  # many equal matchers: dedup has work
    counts = rng.integers(0, 4, n) * (rng.random(n) < 0.4)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    locations = np.array(sorted(f"L{i}" for i in range(23)), dtype=object)
    cat = Catalog(
        ad_id=rng.permutation(10 * n)[:n].astype(np.int64),
        sid=sids.astype(np.int32),
        embedding=None,
        bitmask=bitmask,
        sets={
            "locations": SetRules(
                Ragged(
                    offsets.astype(np.int64),
                    rng.integers(0, len(locations), int(offsets[-1])).astype(np.int32),
                ),
                None,
                locations,
            )
        },
        source="test",
        campaign=rng.integers(0, 50, n).astype(np.int64),  # the owners travel with their ads
    )
    return cat, sids.astype(np.int64)


def _assert_same_arrays(a: IndexArrays, b: IndexArrays) -> None:
    left, right = array_items(a), array_items(b)
    assert left.keys() == right.keys()  # an optional array (advertisers here): both lack it
    for name, x in left.items():
        assert x.dtype == right[name].dtype, name
        np.testing.assert_array_equal(x, right[name], err_msg=name)


@pytest.mark.parametrize("n", [211, 3001])
@pytest.mark.parametrize("workers", [2, 7])
def test_parallel_build_equals_serial_build(tiny_tasks, n: int, workers: int) -> None:
    cat, sids = _catalog(n, seed=n)
    serial_report, report = BuildReport(), BuildReport()
    serial = build_arrays(cat, sids, report=serial_report, workers=1)
    threaded = build_arrays(cat, sids, report=report, workers=workers)
    _assert_same_arrays(serial, threaded)
    assert report.levels == serial_report.levels and report.counts == serial_report.counts
    # and the serial build is the plain-numpy definition: ads stably sorted by SID
    order = np.lexsort(sids.T[::-1])
    np.testing.assert_array_equal(serial.ads.ad_ids, cat.ad_id[order])
    assert serial.ads.leaf_ad_offsets[-1] == n


@pytest.mark.parametrize("hash_kind", ["low bits only", "constant"])
def test_dedup_rows_survives_hash_collisions(monkeypatch, hash_kind: str) -> None:
    """Distinct rows sharing the packed top hash bits (then the full hash): still exact."""
    rng = np.random.default_rng(1)
    distinct = rng.integers(0, 2**64, (9, 3), dtype=np.uint64)
    which = rng.integers(0, 9, 500)
    rows = distinct[which]
    fake = which.astype(np.uint64) if hash_kind == "low bits only" else np.zeros(500, np.uint64)
    monkeypatch.setattr(trie, "_row_hash", lambda r, w: fake.copy())
    table, index = dedup_rows(rows, 2)
    assert len(table) == 9
    np.testing.assert_array_equal(table[index], rows)
