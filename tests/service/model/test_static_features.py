"""The fixed-shape (graphed on CUDA) feature embedder equals the eager embedder on the
batch's rows and history positions, with masked zeros past them; padding requests, stale
rows of earlier batches and the packed stage-1 form change nothing, and neither does the
encoder's output."""

from __future__ import annotations

import pytest
import torch

from service.model.embeddings import NUM_NONSEQ_TOKENS, EmbeddedFeatures
from service.model.feature_packing import pack_features, unpack_features
from service.model.features import FeatureBatch
from service.model.static_encoder import StaticEncoder
from service.model.static_features import StaticFeatures
from tests.service.model.test_encoder import CONFIG, _batch, _pad
from tests.service.model.test_static_encoder import model

M = CONFIG.max_history
# batches of 1..16 requests: empty, full and in-between histories, in a fixed mix
LENGTHS = [[(0, M, 1, 7, M - 1, 3)[(b + i) % 6] for i in range(b)] for b in range(1, 17)]


def assert_padded_equal(got: EmbeddedFeatures, want: EmbeddedFeatures, tol=None) -> None:
    """`got` (width max_history) is `want` (its batch's width) followed by masked zeros."""
    b, w = want.seq.shape[:2]
    n = NUM_NONSEQ_TOKENS
    assert got.seq.shape == (b, M, CONFIG.d_model) and got.keys.shape == (b, n + M)
    if tol is None:  # on CPU the same kernels on the same values: the same bits
        assert torch.equal(got.nonseq, want.nonseq)
        assert torch.equal(got.seq[:, :w], want.seq)
    else:
        torch.testing.assert_close(got.nonseq, want.nonseq, **tol)
        torch.testing.assert_close(got.seq[:, :w], want.seq, **tol)
    assert torch.equal(got.keys[:, : n + w], want.keys)
    assert not got.seq[:, w:].any() and not got.keys[:, n + w :].any()


def _packed(f: FeatureBatch) -> FeatureBatch:
    """What stage 1 hands stage 2 on GPU."""
    return unpack_features(pack_features(f), CONFIG.sid_length)


@torch.no_grad()
def test_padded_buckets_equal_the_eager_embedder() -> None:
    embed, _ = model()
    static = StaticFeatures(embed, CONFIG, batch_buckets=(4, 16))
    # largest first, so that later batches run on buffers holding stale rows and positions
    for i, lengths in enumerate(reversed(LENGTHS)):
        f = _batch(lengths, seed=i)
        assert_padded_equal(static(f), embed(f))
        assert_padded_equal(static(_packed(f)), embed(f))
        full = _pad(f, M, 0)  # at max_history, as prepare_features(..., width=M) gives it
        assert_padded_equal(static(full), embed(f))
    assert sorted(static._plans) == [4, 16]
    over = _batch([3] * 17)
    assert torch.equal(static(over).seq, embed(over).seq)  # over the buckets: eager, as it is


@torch.no_grad()
def test_the_encoder_output_for_real_rows_is_unchanged() -> None:
    embed, encoder = model()
    static = StaticFeatures(embed, CONFIG, batch_buckets=(4, 16))
    static_encoder = StaticEncoder(encoder, batch_buckets=(4, 16))
    tol = {"rtol": 1e-5, "atol": 1e-5}
    for i, lengths in enumerate([LENGTHS[15], LENGTHS[4], [0], [M, 2]]):
        f = _batch(lengths, seed=i)
        want = encoder(embed(f))
        torch.testing.assert_close(encoder(static(f)), want, **tol)
        torch.testing.assert_close(static_encoder(static(_packed(f))), want, **tol)


def test_warm_builds_every_bucket() -> None:
    embed, _ = model()
    static = StaticFeatures(embed, CONFIG, batch_buckets=(2, 4))
    static.warm()
    assert sorted(static._plans) == [2, 4] and static.graphs == 0  # CPU: nothing captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graphs_equal_the_eager_embedder(dtype: torch.dtype) -> None:
    embed, _ = model("cuda")
    embed = embed.to(dtype)
    static = StaticFeatures(embed, CONFIG, batch_buckets=(4, 16))
    static.warm()
    assert static.graphs == 2
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    with torch.no_grad():
        for i, lengths in enumerate([LENGTHS[15], [3, 0, 9], [M, 1, 2, 3, 4], [0]]):
            f = _batch(lengths, seed=i).to("cuda")
            assert_padded_equal(static(f), embed(f), tol)
            packed = unpack_features(pack_features(f.to("cpu")).to("cuda"), CONFIG.sid_length)
            assert_padded_equal(static(packed), embed(f), tol)  # stage 1's form on GPU
    assert static.graphs == 2  # serving captured nothing new
