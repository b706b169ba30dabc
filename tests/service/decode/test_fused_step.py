"""`FusedDecoderStep` computes `SIDDecoder.step`: layer-0 QKV table, residual adds inside
the matmuls with pending biases, shifted LayerNorms, and (CUDA) the GELU epilogue."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kernels.gelu_linear as gelu_linear_module
from index_builder.lookup import FilterMode
from service.decode.fused_step import FusedDecoderStep
from service.decode.kv_cache import PagedKVCache
from service.decode.static_engine import DecodeOptions
from service.model.config import PROFILES, ModelConfig
from service.model.decoder import SIDDecoder
from tests.service.decode.test_engine import CONFIG, ctx_for, make_ads, requests, setup
from tests.service.decode.test_static_engine import TARGETING, assert_same, engine_for

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def decoder_with_biases(config: ModelConfig, device: str = "cpu", seed: int = 0) -> SIDDecoder:
    """Random weights and non-zero biases/LayerNorm affines: a pending bias that is lost
    or added twice must show."""
    torch.manual_seed(seed)
    decoder = SIDDecoder(config).to(device).eval()
    with torch.no_grad():
        for p in decoder.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.2)
    return decoder


def run_steps(decoder: SIDDecoder, step, batch: int, beams: tuple[int, ...], dtype, device):
    """Logits of every step of a 4-step search with random (seeded) parents and tokens."""
    c = decoder.config
    rows = [batch * m for m in beams]
    cache = PagedKVCache(
        c.decoder_layers, c.n_heads, c.d_head, rows, dtype=dtype, device=device, attention="gather"
    )
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(batch, c.t_ctx, c.d_model, generator=g).to(device, dtype)
    cross = decoder.cross_kv(ctx)
    tokens = torch.full((rows[0],), c.vocab_size, device=device)
    out = []
    with torch.no_grad():
        for t in range(len(beams)):
            out.append(step(tokens, t, cross, cache))
            if t + 1 < len(beams):
                m, n = beams[t], beams[t + 1]
                j = torch.randint(0, m, (batch * n,), generator=g)
                parent = torch.arange(batch * n) // n * m + j  # parents stay in their request
                cache.reorder(t, parent.to(device))
                tokens = torch.randint(0, c.vocab_size, (batch * n,), generator=g).to(device)
    return out


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_equals_the_decoder_step(activation: str) -> None:
    config = dataclasses.replace(CONFIG, ffn_activation=activation, decoder_layers=3)
    decoder = decoder_with_biases(config)
    fused = FusedDecoderStep(decoder)
    want = run_steps(decoder, decoder.step, 3, (1, 4, 6, 5), torch.float32, "cpu")
    got = run_steps(decoder, fused, 3, (1, 4, 6, 5), torch.float32, "cpu")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_triton_up_projection_equals_the_decoder_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ffn_up="triton"`: the up-projection + GELU goes through the persistent Triton GEMM
    (on CPU under the interpreter, bf16 as served; the epilogue switch forced on, as CUDA
    sets it) and the logits stay the decoder's."""
    config = dataclasses.replace(CONFIG, decoder_layers=2)
    decoder = decoder_with_biases(config).to(torch.bfloat16)
    fused = FusedDecoderStep(decoder, ffn_up="triton")
    fused.gelu_epilogue = True  # CPU leaves it off: cuBLASLt exists only on CUDA
    calls = []
    real = gelu_linear_module.triton_gelu_linear
    monkeypatch.setattr(
        gelu_linear_module, "triton_gelu_linear", lambda *a: calls.append(1) or real(*a)
    )
    got = run_steps(decoder, fused, 2, (1, 4, 4, 3), torch.bfloat16, "cpu")
    assert len(calls) == 4 * config.decoder_layers  # every layer of every step
    want = run_steps(decoder, decoder.step, 2, (1, 4, 4, 3), torch.bfloat16, "cpu")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=1e-1)
    with pytest.raises(ValueError, match="ffn_up"):
        FusedDecoderStep(decoder, ffn_up="cutlass")


def test_the_activation_changes_the_function() -> None:
    """The config's activation is really used: tanh and erf GELU give different logits."""
    a = decoder_with_biases(dataclasses.replace(CONFIG, ffn_activation="gelu"))
    b = decoder_with_biases(dataclasses.replace(CONFIG, ffn_activation="gelu_tanh"))
    la = run_steps(a, FusedDecoderStep(a), 2, (1, 3, 3, 2), torch.float32, "cpu")
    lb = run_steps(b, FusedDecoderStep(b), 2, (1, 3, 3, 2), torch.float32, "cpu")
    assert not torch.allclose(la[-1], lb[-1], rtol=0, atol=1e-7)


def test_engine_result_is_the_same_with_and_without_fused_layers() -> None:
    index, _, search = setup(make_ads(80, seed=11), seed=4)
    ctx, reqs, beams = ctx_for(3, seed=2), requests(TARGETING[:3]), (1, 5, 9, 6)
    want = search.run(ctx, reqs, beams, FilterMode.CD_GTM)
    for fused in (True, False):
        engine = engine_for(search, index, options=DecodeOptions(fused_layers=fused))
        assert_same(engine.run(ctx, reqs, beams, FilterMode.CD_GTM), want)


def test_checkpoints_without_the_field_keep_erf_gelu() -> None:
    data = PROFILES["tiny"].to_dict()
    assert data["ffn_activation"] == "gelu_tanh"  # what new models train with
    del data["ffn_activation"]
    assert ModelConfig.from_dict(data).ffn_activation == "gelu"
    with pytest.raises(ValueError, match="ffn_activation"):
        dataclasses.replace(PROFILES["tiny"], ffn_activation="relu")


@pytest.mark.gpu
@gpu
def test_gpu_gelu_epilogue_is_tanh_gelu() -> None:
    """cuBLASLt's GELU epilogue computes the tanh approximation the model trains with."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", generator=g, dtype=torch.bfloat16) / 32
    b = torch.randn(2048, device="cuda", generator=g, dtype=torch.bfloat16)
    got = torch._addmm_activation(b, x, w.t(), use_gelu=True).float()
    pre = torch.addmm(b.float(), x.float(), w.float().t())
    torch.testing.assert_close(got, F.gelu(pre, approximate="tanh"), atol=3e-2, rtol=2e-2)
    assert FusedDecoderStep(SIDDecoder(CONFIG).cuda().eval()).gelu_epilogue


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ffn_up", ["cublaslt", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_equals_the_decoder_step(dtype: torch.dtype, ffn_up: str) -> None:
    """On CUDA: the LayerNorm kernel, in-place addmm and the GELU epilogue (either GEMM;
    the Triton one takes bf16 only and falls back to the reference for fp32)."""
    config = dataclasses.replace(PROFILES["tiny"], decoder_layers=3)
    decoder = decoder_with_biases(config, "cuda").to(dtype)
    fused = FusedDecoderStep(decoder, ffn_up=ffn_up)
    assert fused.gelu_epilogue
    want = run_steps(decoder, decoder.step, 4, (1, 16, 32, 32), dtype, "cuda")
    got = run_steps(decoder, fused, 4, (1, 16, 32, 32), dtype, "cuda")
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
