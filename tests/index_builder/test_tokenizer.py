"""SID tokenizer: RQ-KMeans prefixes, collision tokens, determinism and the on-disk format."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from index_builder.tokenizer import CollisionReport, SIDTokenizer, TokenizerConfig

SMALL = TokenizerConfig(levels=3, codebook_size=16, iterations=10, train_sample=5_000, seed=0)


def _blobs(n: int, clusters: int, dim: int = 8, spread: float = 0.05, seed: int = 0):
    """float32 [n, dim] points around `clusters` far-apart centres, and each point's cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)) * 10
    label = rng.integers(0, clusters, n)
    points = centres[label] + spread * rng.standard_normal((n, dim))
    return points.astype(np.float32), label


def _report_from(sids: np.ndarray, k: int) -> CollisionReport:
    """Reference report, counted with Counters over rows of `sids`."""
    prefixes = Counter(map(tuple, sids[:, :-1].tolist()))
    full = Counter(map(tuple, sids.tolist()))
    return CollisionReport(
        prefixes=len(prefixes),
        overflow_prefixes=sum(c > k for c in prefixes.values()),
        ads_sharing_sid=sum(c for c in full.values() if c > 1),
        max_group=max(prefixes.values()),
    )


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
    assert report == _report_from(sids, SMALL.codebook_size)
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
    residual = data - tok.reconstruct(sids[:, :1])
    norm = (residual**2).sum(1)
    for code in range(32):
        members = np.flatnonzero(sids[:, 0] == code)
        ranked = members[np.argsort(sids[members, 1])]
        assert sorted(sids[members, 1]) == list(range(len(members)))
        assert np.all(np.diff(norm[ranked]) >= 0)


def test_each_level_reduces_reconstruction_error(tokenizer, random_data):
    prefix = tokenizer.encode_prefix(random_data)
    errors = [
        float(((random_data - tokenizer.reconstruct(prefix[:, :level])) ** 2).sum(1).mean())
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
    assert report == _report_from(np.vstack([sids, reserved]), k)
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
    assert report == _report_from(np.vstack([sids, reserved]), SMALL.codebook_size)


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
