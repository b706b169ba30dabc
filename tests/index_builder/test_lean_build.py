"""The build's memory-saving steps give what the plain steps they replace gave (issue #48):
the trie's matchers deduplicated depth by depth, never holding every entry's rows
(`trie._dedup_by_depth`), the statistics counted from the tables, the SIDs assigned with
the embeddings freed once encoded (`build._assign_handed`), the bitmask made a block of
ads at a time (`catalog._bitmasks`), the catalog sorted column by column and the ragged
gathers made in blocks; and `build_index` leaves the process's Arrow pool as it found it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from contracts.index_format import SID_LENGTH, VOCAB_SIZE
from contracts.targeting_codec import Ragged, codec
from contracts.targeting_schema import DEFAULT
from contracts.tokenizer_format import TokenizerConfig
from index_builder import catalog as catalog_module
from index_builder import parallel, trie
from index_builder.build import _assign_handed, assign_sids, build_arrays, build_index
from index_builder.catalog import Catalog, SetRules
from index_builder.tokenizer import SIDTokenizer
from index_builder.trie import build_trie, dedup_rows, matcher_fill, storage_stats
from tests.helpers.peak_memory import write_catalog


def _small_blocks(n: int, size: int = 0) -> list[tuple[int, int]]:
    """`parallel.blocks` of 700 rows whatever the size asked: many blocks in a test."""
    return [(lo, min(n, lo + 700)) for lo in range(0, n, 700)]


def _leaves(n: int, seed: int, bloom_words: int = 4) -> tuple[np.ndarray, ...]:
    """Sorted SIDs sharing prefixes (and full SIDs), and per-ad matcher rows with many
    repeats within and across depths."""
    rng = np.random.default_rng(seed)
    sids = np.stack([rng.integers(0, hi, n) for hi in (3, 7, 11, VOCAB_SIZE)], axis=1)
    sids = sids[np.lexsort(sids.T[::-1])]
    pool = rng.integers(0, 2**64, (9, 5), dtype=np.uint64) & rng.integers(
        0, 2**64, (9, 5), dtype=np.uint64
    )
    bitmask = pool[rng.integers(0, len(pool), n)]
    bloom = rng.integers(0, 2**64, (n, bloom_words), dtype=np.uint64)
    bloom[rng.random(n) < 0.7] = bloom[0]
    return sids, bitmask, bloom


def _reference(sids: np.ndarray, bitmask: np.ndarray, bloom: np.ndarray) -> dict:
    """The trie's figures the plain way: every entry's subtree OR, one global dedup."""
    keys = parallel.digit_keys(sids, VOCAB_SIZE)
    leaf_first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    leaf_sids = sids[leaf_first]
    leaf_bm = np.bitwise_or.reduceat(bitmask, leaf_first, axis=0)
    leaf_bl = np.bitwise_or.reduceat(bloom, leaf_first, axis=0) if bloom.shape[1] else None
    firsts, counts, parents, node_of_leaf = [np.zeros(1, np.int64)], [], [], None
    for depth in range(1, SID_LENGTH + 1):
        prefix = parallel.digit_keys(leaf_sids[:, :depth], VOCAB_SIZE)
        _, first, node = np.unique(prefix, return_index=True, return_inverse=True)
        parents.append(np.zeros(len(first), np.int64) if node_of_leaf is None
                       else node_of_leaf[first])  # fmt: skip
        node_of_leaf = node + sum(len(f) for f in firsts)
        firsts.append(first)
    first_leaf = np.concatenate(firsts)
    for f in firsts:
        counts.append(np.diff(np.append(f, len(leaf_sids))))
    parent = np.concatenate(parents)
    entry_bm = np.concatenate([np.bitwise_or.reduceat(leaf_bm, f, axis=0) for f in firsts[1:]])
    out = {
        "node_offsets": np.r_[0, np.cumsum(np.bincount(parent, minlength=len(first_leaf)))],
        "node_first_leaf": first_leaf,
        "node_leaf_count": np.concatenate(counts),
        "bitmask": dedup_rows(entry_bm),
        "entry_bm": entry_bm,
        "firsts": firsts,
    }
    if leaf_bl is not None:
        out["entry_bl"] = np.concatenate(
            [np.bitwise_or.reduceat(leaf_bl, f, axis=0) for f in firsts[1:]]
        )
        out["bloom"] = dedup_rows(out["entry_bl"])
    return out


@pytest.mark.parametrize(("n", "seed"), [(1, 0), (57, 1), (4000, 2)])
def test_trie_dedup_by_depth_equals_one_global_dedup(n: int, seed: int) -> None:
    sids, bitmask, bloom = _leaves(n, seed)
    built = build_trie(sids, bitmask, bloom, workers=3)
    ref = _reference(sids, bitmask, bloom)
    t = built.trie
    for got, want in (((t.bitmask_table, t.bitmask_index), ref["bitmask"]),
                      ((t.bloom_table, t.bloom_index), ref["bloom"])):  # fmt: skip
        np.testing.assert_array_equal(got[0], want[0])  # the same rows in the same order
        np.testing.assert_array_equal(got[1], want[1])
        assert got[1].dtype == np.int32 and got[0].dtype == np.uint64
    np.testing.assert_array_equal(t.node_offsets, ref["node_offsets"])
    assert t.node_offsets.dtype == np.int32
    np.testing.assert_array_equal(built.node_first_leaf, ref["node_first_leaf"])
    np.testing.assert_array_equal(built.node_leaf_count, ref["node_leaf_count"])
    np.testing.assert_array_equal(built.entry_bitmask, ref["entry_bm"])
    np.testing.assert_array_equal(built.entry_bloom, ref["entry_bl"])


def test_trie_of_rows_without_words_and_with_colliding_hashes(monkeypatch) -> None:
    """Bloom rows of no words (no set attribute), and hashes that collide everywhere
    (dedup falls back to numpy's row-wise unique): still the global dedup's tables."""
    sids, bitmask, _ = _leaves(300, 3)
    empty = np.zeros((len(sids), 0), dtype=np.uint64)
    built = build_trie(sids, bitmask, empty, workers=2)
    assert built.trie.bloom_table.shape == (1, 0) and not built.trie.bloom_index.any()
    monkeypatch.setattr(trie, "_row_hash", lambda rows, workers: np.zeros(len(rows), np.uint64))
    collided = build_trie(sids, bitmask, empty, workers=2)
    ref = _reference(sids, bitmask, empty)["bitmask"]
    np.testing.assert_array_equal(collided.trie.bitmask_table, ref[0])
    np.testing.assert_array_equal(collided.trie.bitmask_index, ref[1])


def test_storage_stats_are_the_entry_rows_figures() -> None:
    sids, bitmask, bloom = _leaves(3000, 4)
    built = build_trie(sids, bitmask, bloom)
    ref = _reference(sids, bitmask, bloom)
    at = 0
    for depth, level in enumerate(storage_stats(built, DEFAULT, workers=2), 1):
        n = len(ref["firsts"][depth])
        bm, bl = ref["entry_bm"][at : at + n], ref["entry_bl"][at : at + n]
        fill_bm, fill_bl = matcher_fill(bm, bl, DEFAULT)
        sl = slice(at, at + n)
        assert level == {
            "step": depth,
            "entries": n,
            "bitmask_bytes": bm.nbytes,
            "bitmask_bytes_dedup": len(np.unique(built.trie.bitmask_index[sl])) * bm.shape[1] * 8,
            "bloom_bytes": bl.nbytes,
            "bloom_bytes_dedup": len(np.unique(built.trie.bloom_index[sl])) * bl.shape[1] * 8,
            "bitmask_fill": fill_bm,
            "bloom_fill": fill_bl,
        }
        at += n


def _embedded_catalog(n: int, dim: int, seed: int) -> Catalog:
    rng = np.random.default_rng(seed)
    return Catalog(
        ad_id=np.arange(n, dtype=np.int64) * 3 + 1,
        sid=np.broadcast_to(np.int32(-1), (n, 4)),
        embedding=rng.normal(size=(n, dim)).astype(np.float32),
        bitmask=np.zeros((n, DEFAULT.bitmask_words), dtype=np.uint64),
        sets={"locations": SetRules(Ragged.empty(n), None, np.array([], dtype=object))},
        source="<test>",
    )


@pytest.mark.parametrize("last_token", ["rank", "code"])
def test_assign_handed_gives_the_tokenizers_sids(last_token: str) -> None:
    config = TokenizerConfig(levels=3, codebook_size=8, last_token=last_token)
    rng = np.random.default_rng(5)
    codebooks = rng.normal(size=(config.rq_levels, 8, 6)).astype(np.float32)
    tok = SIDTokenizer(config, codebooks)
    cat = _embedded_catalog(5000, 6, seed=6)
    want, summary = assign_sids(cat, tok, workers=2)
    held = [cat]
    rest, got, got_summary = _assign_handed(held, tok, "cpu", 3)
    assert held == [] and rest.embedding is None and rest.n == cat.n
    np.testing.assert_array_equal(got, want)
    assert got_summary == summary


def test_bitmasks_a_block_at_a_time_are_the_codecs(monkeypatch) -> None:
    """Enum/bucket rules with exclusions, over several blocks: the codec's arrays."""
    monkeypatch.setattr(parallel, "blocks", _small_blocks)
    rng = np.random.default_rng(7)
    by, n = codec(DEFAULT), 4321
    include, exclude = {}, {}
    for a in by.masked:
        k = rng.integers(0, 3, n)
        offsets = np.r_[0, np.cumsum(k)].astype(np.int64)
        include[a.name] = Ragged(offsets, rng.integers(0, len(a.labels), offsets[-1], np.int32))
    k = rng.integers(0, 2, n) * (rng.random(n) < 0.2)
    offsets = np.r_[0, np.cumsum(k)].astype(np.int64)
    exclude["country"] = Ragged(offsets, rng.integers(0, 50, offsets[-1], np.int32))
    narrow = {k: catalog_module._narrow(r) for k, r in include.items()}
    assert all(r.offsets.dtype == np.int32 for r in narrow.values())
    bitmask, cleared = catalog_module._bitmasks(by, narrow, exclude, n)
    np.testing.assert_array_equal(bitmask, by.ad_bitmasks(include, exclude, n))
    want = by.ad_bitmasks(include, {}, n) & ~by.ad_bitmasks(include, exclude, n)
    np.testing.assert_array_equal(cleared, want)
    assert catalog_module._bitmasks(by, narrow, {}, n)[1] is None


def test_take_segments_in_blocks_is_the_plain_gather(monkeypatch) -> None:
    rng = np.random.default_rng(8)
    n = 5000
    counts = rng.integers(0, 4, n) * (rng.random(n) < 0.4)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    rows = rng.permutation(n)
    monkeypatch.setattr(parallel, "blocks", _small_blocks)
    got_offsets, got_flat = parallel.take_segments(offsets, rows)
    want_offsets = np.r_[0, np.cumsum(counts[rows])]
    want_flat = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in rows])
    np.testing.assert_array_equal(got_offsets, want_offsets)
    np.testing.assert_array_equal(got_flat, want_flat)
    assert got_flat.dtype == np.int64


def test_sorting_a_lent_catalog_leaves_it_as_it_was() -> None:
    """`build_arrays` on a catalog its caller keeps: the caller's catalog is unchanged."""
    rng = np.random.default_rng(9)
    n = 800
    sids = np.stack([rng.integers(0, 5, n) for _ in range(4)], axis=1)
    counts = rng.integers(0, 3, n)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    values = rng.integers(0, 4, offsets[-1]).astype(np.int32)
    vocab = np.array(["a", "b", "c", "d"], dtype=object)
    cat = Catalog(
        ad_id=np.arange(n, dtype=np.int64),
        sid=sids.astype(np.int32),
        embedding=None,
        bitmask=rng.integers(0, 2**64, (n, DEFAULT.bitmask_words), dtype=np.uint64),
        sets={"locations": SetRules(Ragged(offsets, values), None, vocab)},
        source="<test>",
    )
    before = {k: v.copy() for k, v in (("ad_id", cat.ad_id), ("bitmask", cat.bitmask))}
    first = build_arrays(cat, sids.astype(np.int64), workers=2)
    second = build_arrays(cat, sids.astype(np.int64), workers=1)
    assert cat.sets["locations"].include.offsets is offsets
    np.testing.assert_array_equal(cat.ad_id, before["ad_id"])
    np.testing.assert_array_equal(cat.bitmask, before["bitmask"])
    np.testing.assert_array_equal(first.ads.ad_ids, second.ads.ad_ids)
    np.testing.assert_array_equal(
        first.ads.sets["locations"].include_ids, second.ads.sets["locations"].include_ids
    )


def test_build_index_restores_the_arrow_pool(tmp_path: Path) -> None:
    write_catalog(tmp_path, 3000)
    pool = pa.default_memory_pool()
    build_index(tmp_path / "catalog.parquet", tmp_path / "out", tokenizer_path=tmp_path / "tok",
                progress=False, workers=2)  # fmt: skip
    assert pa.default_memory_pool().backend_name == pool.backend_name
