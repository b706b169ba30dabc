"""The fixed-shape (graphed on CUDA) encoder equals the eager encoder: padding requests,
masked history positions past a batch's width and stale rows of earlier batches change
nothing."""

from __future__ import annotations

import pytest
import torch

from service.model.static_encoder import StaticEncoder
from tests.service.model.test_encoder import CONFIG, _batch, stages


def model(device: str = "cpu") -> torch.nn.Sequential:
    torch.manual_seed(0)
    enc = stages().to(device).eval()
    with torch.no_grad():  # FiLM starts at the identity: give the cross-talk path weights
        for layer in enc[1].layers:
            layer.nonseq_to_seq.weight.normal_(std=0.05)
    return enc


@torch.no_grad()
def check(embed, encoder, static, lengths, seed, device="cpu", tol=None) -> None:
    x = embed(_batch(lengths, seed=seed).to(device))
    got, want = static(x), encoder(x)
    assert got.shape == want.shape == (len(lengths), CONFIG.t_ctx, CONFIG.d_model)
    torch.testing.assert_close(got, want, **(tol or {"rtol": 1e-5, "atol": 1e-5}))


def test_padded_buckets_equal_the_eager_encoder() -> None:
    embed, encoder = model()
    static = StaticEncoder(encoder, batch_buckets=(4, 8))
    m = CONFIG.max_history
    # a full bucket at full width, then smaller and narrower batches on the same buffers
    # (stale rows and positions must be wiped), an empty history, a batch over the buckets
    cases = [[m] * 8, [3, 0, m, 5, 1], [2, 7], [0], [1] * 4, [4] * 9]
    for i, lengths in enumerate(cases):
        check(embed, encoder, static, lengths, seed=i)
    assert sorted(static._plans) == [4, 8]  # the 9-request batch took the eager encoder


def test_warm_builds_every_bucket() -> None:
    _, encoder = model()
    static = StaticEncoder(encoder, batch_buckets=(2, 4))
    static.warm()
    assert sorted(static._plans) == [2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graphs_equal_the_eager_encoder(dtype: torch.dtype) -> None:
    embed, encoder = model("cuda")
    encoder = encoder.to(dtype)
    static = StaticEncoder(encoder, batch_buckets=(4, 16))
    static.warm()
    assert static.graphs == 2

    def embed_cast(f):
        x = embed(f)
        return type(x)(x.nonseq.to(dtype), x.seq.to(dtype), x.keys)

    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    m = CONFIG.max_history
    for i, lengths in enumerate([[m] * 16, [3, 0, 9], [m, 1, 2, 3, 4], [0]]):
        check(embed_cast, encoder, static, lengths, seed=i, device="cuda", tol=tol)
    assert static.graphs == 2  # serving captured nothing new
