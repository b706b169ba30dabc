"""SID tokenizer: RQ-KMeans prefixes, collision tokens, determinism and the on-disk format."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from index_builder.kmeans import DEVICE_TILE_ROWS, _encode_on_device, nearest, rq_encode
from index_builder.last_token import (
    CollisionReport,
    _collisions,
    _collisions_unreserved,
    _rank_order,
)
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from tests.helpers.collisions import reconstruct, reference_report

SMALL = TokenizerConfig(levels=3, codebook_size=16, iterations=10, train_sample=5_000, seed=0)


def _blobs(n: int, clusters: int, dim: int = 8, spread: float = 0.05, seed: int = 0):
    """float32 [n, dim] points around `clusters` far-apart centres, and each point's cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)) * 10
    label = rng.integers(0, clusters, n)
    points = centres[label] + spread * rng.standard_normal((n, dim))
    return points.astype(np.float32), label


@pytest.fixture(scope="module")
def random_data() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((3_000, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def tokenizer(random_data: np.ndarray) -> SIDTokenizer:
    return SIDTokenizer.train(random_data, SMALL, progress=False)


def test_sids_in_range_and_unique_without_overflow(tokenizer, random_data):
    sids, report = tokenizer.assign(random_data)
    assert sids.shape == (len(random_data), 4)
    assert sids.dtype == np.int32
    assert sids.min() >= 0 and sids.max() < SMALL.codebook_size
    assert report.overflow_prefixes == 0
    assert len(np.unique(sids, axis=0)) == len(sids)
    assert report == reference_report(sids, SMALL.codebook_size)
    assert report.ads_sharing_sid == 0
    np.testing.assert_array_equal(sids[:, :3], tokenizer.encode_prefix(random_data))


def test_overflowing_prefix_wraps_and_keeps_every_ad():
    k = 4
    same = np.tile(np.float32([[1.0, 2.0, 3.0]]), (10, 1))
    data = np.vstack([same, [[-5.0, 0.0, 5.0]]]).astype(np.float32)
    # 2 distinct points for 4 codes per level: spare codes are valid, just unused.
    tok = SIDTokenizer.train(data, TokenizerConfig(codebook_size=k, iterations=5), progress=False)
    sids, report = tok.assign(data)
    assert len(sids) == len(data)
    assert (sids[:10, :3] == sids[0, :3]).all()
    # Identical residuals rank by input order, and the rank wraps modulo the codebook size.
    assert sids[:10, 3].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert report == CollisionReport(
        prefixes=2, overflow_prefixes=1, ads_sharing_sid=10, max_group=10
    )
    assert "1 prefixes overflow" in report.summary()


def test_last_token_orders_by_residual_norm():
    rng = np.random.default_rng(3)
    data = rng.standard_normal((150, 4)).astype(np.float32)
    tok = SIDTokenizer.train(data, TokenizerConfig(levels=1, codebook_size=32), progress=False)
    sids, report = tok.assign(data)
    assert report.overflow_prefixes == 0
    residual = data - reconstruct(tok, sids[:, :1])
    norm = (residual**2).sum(1)
    for code in range(32):
        members = np.flatnonzero(sids[:, 0] == code)
        ranked = members[np.argsort(sids[members, 1])]
        assert sorted(sids[members, 1]) == list(range(len(members)))
        assert np.all(np.diff(norm[ranked]) >= 0)


def test_each_level_reduces_reconstruction_error(tokenizer, random_data):
    prefix = tokenizer.encode_prefix(random_data)
    errors = [
        float(((random_data - reconstruct(tokenizer, prefix[:, :level])) ** 2).sum(1).mean())
        for level in range(4)
    ]
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert errors[3] < 0.7 * errors[0]


def test_tight_clusters_share_their_first_token():
    data, label = _blobs(2_000, clusters=16)
    tok = SIDTokenizer.train(data, SMALL, progress=False)
    first = tok.encode_prefix(data)[:, 0]
    for cluster in range(16):
        assert len(np.unique(first[label == cluster])) == 1
    # ... and distinct clusters get distinct codes.
    assert len(np.unique(first)) == 16


def test_training_is_deterministic_for_a_seed(random_data, tokenizer):
    again = SIDTokenizer.train(random_data, SMALL, progress=False)
    np.testing.assert_array_equal(again.codebooks, tokenizer.codebooks)
    assert again.fingerprint == tokenizer.fingerprint
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = SIDTokenizer.train(random_data, SMALL, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert single.fingerprint == tokenizer.fingerprint
    other = TokenizerConfig(**{**SMALL.__dict__, "seed": 1})
    assert (
        SIDTokenizer.train(random_data, other, progress=False).fingerprint != tokenizer.fingerprint
    )


def test_train_sample_is_used_and_encoding_ignores_chunking(random_data):
    config = TokenizerConfig(codebook_size=8, iterations=5, train_sample=500)
    tok = SIDTokenizer.train(random_data, config, progress=False)
    whole = tok.encode_prefix(random_data)
    pieces = np.vstack([tok.encode_prefix(random_data[s : s + 37]) for s in range(0, 3_000, 37)])
    np.testing.assert_array_equal(whole, pieces)
    as_float64 = tok.encode_prefix(random_data.astype(np.float64))
    np.testing.assert_array_equal(whole, as_float64)


def test_save_load_round_trip(tokenizer, random_data, tmp_path: Path):
    tokenizer.save(tmp_path / "tok")
    loaded = SIDTokenizer.load(tmp_path / "tok")
    assert loaded.fingerprint == tokenizer.fingerprint
    assert loaded.config == tokenizer.config
    np.testing.assert_array_equal(loaded.assign(random_data)[0], tokenizer.assign(random_data)[0])


def test_tampered_files_are_refused(tokenizer, tmp_path: Path):
    tokenizer.save(tmp_path)
    codebooks = tmp_path / "codebooks.safetensors"
    raw = bytearray(codebooks.read_bytes())
    raw[-3] ^= 0x40  # flip a bit inside the last float
    codebooks.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        SIDTokenizer.load(tmp_path)

    tokenizer.save(tmp_path)
    meta = tmp_path / "tokenizer.json"
    meta.write_text(meta.read_text().replace('"seed": 0', '"seed": 7'))
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        SIDTokenizer.load(tmp_path)

    tokenizer.save(tmp_path)
    codebooks.write_bytes(codebooks.read_bytes()[:100])
    with pytest.raises(ValueError, match="unreadable codebooks"):
        SIDTokenizer.load(tmp_path)

    codebooks.unlink()
    with pytest.raises(FileNotFoundError, match=r"codebooks\.safetensors"):
        SIDTokenizer.load(tmp_path)


def test_reserved_sids_are_avoided_while_the_prefix_has_room():
    k = 4
    data = np.vstack([np.ones((3, 2)), -np.ones((1, 2))]).astype(np.float32)
    tok = SIDTokenizer.train(data, TokenizerConfig(codebook_size=k), progress=False)
    prefix = tok.encode_prefix(data[:1])[0]
    reserved = np.array([[*prefix, 0], [*prefix, 2]], np.int32)

    sids, report = tok.assign(data[:2], reserved)  # room: 2 free tokens for 2 ads
    assert sids[:, 3].tolist() == [1, 3]
    assert report == CollisionReport(
        prefixes=1, overflow_prefixes=0, ads_sharing_sid=0, max_group=4
    )

    sids, report = tok.assign(data, reserved)  # full: the third ad shares reserved token 0
    assert sids[:3, 3].tolist() == [1, 3, 0]
    assert sids[3, 3] == 0  # the other prefix holds no reservation
    assert report == reference_report(np.vstack([sids, reserved]), k)
    assert report.ads_sharing_sid == 2


def test_reserved_avoidance_at_scale(tokenizer, random_data):
    # Reserve token 0 and 1 of every prefix the first 500 ads use: the new ads then only
    # share a SID where their prefix holds more ads than free tokens.
    prefix = tokenizer.encode_prefix(random_data[:500])
    reserved = np.vstack([np.c_[prefix, np.zeros(500)], np.c_[prefix, np.ones(500)]])
    reserved = np.unique(reserved.astype(np.int32), axis=0)
    sids, report = tokenizer.assign(random_data, reserved)
    taken = {tuple(r) for r in reserved.tolist()}
    groups = Counter(map(tuple, sids[:, :3].tolist()))
    for row in sids.tolist():
        if groups[tuple(row[:3])] <= SMALL.codebook_size - 2:
            assert tuple(row) not in taken
    assert report == reference_report(np.vstack([sids, reserved]), SMALL.codebook_size)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.full((5, 8), np.nan, np.float32), "row 0 holds NaN or inf"),
        (np.where(np.arange(40).reshape(5, 8) == 25, np.inf, 0.0), "row 3 holds NaN or inf"),
        (np.zeros((5, 7), np.float32), "dim 7, this tokenizer expects 8"),
        (np.zeros(8, np.float32), "2-D array"),
    ],
)
def test_bad_embeddings_raise(tokenizer, bad, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.assign(bad)


def test_bad_inputs_to_train_and_config():
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        SIDTokenizer.train(np.array([[0.0], [np.nan]]), SMALL, progress=False)
    with pytest.raises(ValueError, match="0 embeddings"):
        SIDTokenizer.train(np.zeros((0, 4)), SMALL, progress=False)
    with pytest.raises(ValueError, match="codebook_size"):
        TokenizerConfig(codebook_size=0)


def test_bad_reserved_raise(tokenizer, random_data):
    with pytest.raises(ValueError, match="reserved row 1"):
        tokenizer.assign(random_data[:4], np.array([[0, 0, 0, 0], [0, 0, 16, 0]]))
    with pytest.raises(ValueError, match=r"int \[M, 4\]"):
        tokenizer.assign(random_data[:4], np.zeros((2, 3), np.int32))


def test_empty_input_gives_empty_sids(tokenizer):
    sids, report = tokenizer.assign(np.zeros((0, 8), np.float32))
    assert sids.shape == (0, 4)
    assert report == CollisionReport(
        prefixes=0, overflow_prefixes=0, ads_sharing_sid=0, max_group=0
    )


# --------------------------------------------------------------------------- at scale


@pytest.mark.parametrize("workers", [2, 5])
def test_threads_and_chunks_do_not_change_sids(tokenizer, workers):
    data = np.random.default_rng(4).standard_normal((9_000, 8)).astype(np.float32)
    whole = rq_encode(tokenizer.codebooks, data, workers=1)  # one 65,536-row chunk
    split = rq_encode(tokenizer.codebooks, data, workers=workers, chunk_rows=2048)
    np.testing.assert_array_equal(whole[0], split[0])
    np.testing.assert_array_equal(whole[1], split[1])
    sids, report = tokenizer.assign(data, workers=1)
    threaded, threaded_report = tokenizer.assign(data, workers=workers)
    np.testing.assert_array_equal(sids, threaded)
    assert report == threaded_report
    np.testing.assert_array_equal(nearest(data, tokenizer.codebooks[0], workers), whole[0][:, 0])


def test_training_is_the_same_on_threads(random_data, tokenizer):
    threaded = SIDTokenizer.train(random_data, SMALL, progress=False, workers=3)
    assert threaded.fingerprint == tokenizer.fingerprint


@pytest.mark.parametrize("n", [1, 17, 2_000])
def test_rank_order_is_lexsort(n):
    rng = np.random.default_rng(n)
    key = rng.integers(0, max(1, n // 5), n)  # shared prefixes
    norm = rng.choice(np.array([0.0, 0.25, 1.5, 7.0], np.float32), n)  # equal norms
    norm[: n // 3] = rng.random(n // 3).astype(np.float32)
    np.testing.assert_array_equal(_rank_order(key, norm, 27), np.lexsort((norm, key)))


@pytest.mark.parametrize("k", [4, 16])
def test_collision_report_without_reservations_counts_like_the_general_one(k):
    rng = np.random.default_rng(k)
    sizes = np.concatenate([rng.integers(1, 3 * k, 50), [k, k + 1, 2 * k - 1, 2 * k, 5 * k + 3]])
    sorted_key = np.repeat(np.arange(len(sizes)) * 7, sizes)
    first = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
    start = np.repeat(np.flatnonzero(first), sizes)
    token = (np.arange(len(sorted_key)) - start) % k  # rank mod k, as `assign` does
    assert _collisions_unreserved(first, k) == _collisions(sorted_key, token, k)


def test_device_path_is_chunking_invariant_and_agrees_with_the_cpu():
    data, _ = _blobs(5_000, clusters=12, spread=0.5)
    tok = SIDTokenizer.train(data, SMALL, progress=False)

    def on_device(chunk_rows: int) -> tuple[np.ndarray, np.ndarray]:
        codes, norm = np.empty((len(data), 3), np.int32), np.empty(len(data), np.float32)
        _encode_on_device(tok.codebooks, data, torch.device("cpu"), codes, norm, chunk_rows, 64)
        return codes, norm

    small, large = on_device(128), on_device(4096)
    np.testing.assert_array_equal(small[0], large[0])
    np.testing.assert_array_equal(small[1], large[1])
    cpu_codes, cpu_norm = rq_encode(tok.codebooks, data)
    np.testing.assert_array_equal(small[0], cpu_codes)  # blobs: no near-ties
    np.testing.assert_allclose(small[1], cpu_norm, rtol=1e-5, atol=1e-6)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_assignment_matches_the_cpu_at_scale():
    """1 M paper-like embeddings: the GPU path may differ only at near-ties."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4096, 32)).astype(np.float32)
    noise = 0.3 * rng.standard_normal((1_000_000, 32), dtype=np.float32)
    data = centres[rng.integers(0, 4096, 1_000_000)] + noise
    tok = SIDTokenizer.train(data, TokenizerConfig(train_sample=100_000), progress=False)
    cpu, cpu_report = tok.assign(data)
    gpu_sids, gpu_report = tok.assign(data, device="cuda")
    assert (cpu[:, :3] == gpu_sids[:, :3]).all(axis=1).mean() > 0.999
    assert abs(gpu_report.prefixes - cpu_report.prefixes) < 0.001 * cpu_report.prefixes
    chunked = rq_encode(tok.codebooks, data, device="cuda", chunk_rows=DEVICE_TILE_ROWS)
    whole = rq_encode(tok.codebooks, data, device="cuda", chunk_rows=16 * DEVICE_TILE_ROWS)
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[1], whole[1])
