"""`DecoderStep` computes `SIDDecoder.forward_train` one position at a time: layer-0 QKV
table, residual adds inside the matmuls with pending biases, shifted LayerNorms, and
(CUDA) the GELU epilogue — checked by teacher forcing every beam row's own prefix through
a search with random parents (the paged KV cache's reorder included)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from service.decode.fp8_step import FP8DecoderStep, decoder_step
from service.decode.step import DecoderStep
from service.model.config import PROFILES, ModelConfig
from service.model.decoder import SIDDecoder
from service.model.precision import quantize_decoder
from tests.service.decode.cases import CONFIG, decoder_with_biases, run_steps

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_equals_teacher_forcing(activation: str) -> None:
    config = dataclasses.replace(CONFIG, ffn_activation=activation, decoder_layers=3)
    decoder = decoder_with_biases(config)
    step = DecoderStep(decoder)
    assert not step.gelu_epilogue  # CPU: the reference GELU
    got, want = run_steps(decoder, step, 3, (1, 4, 6, 5), torch.float32, "cpu")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_fp8_step_tracks_the_fp32_function() -> None:
    """A decoder made FP8 at load (service/model/precision.py) runs the FP8 step, whose
    linear layers cost ~1 % of the logits' norm on a random decoder with biases, and keep
    the top tokens of every row."""
    config = dataclasses.replace(PROFILES["tiny"], decoder_layers=3)
    decoder = decoder_with_biases(config)
    fp8 = quantize_decoder(copy.deepcopy(decoder))
    step = decoder_step(fp8)
    assert type(step) is FP8DecoderStep and type(decoder_step(decoder)) is DecoderStep
    got, _ = run_steps(fp8, step, 2, (1, 16, 32, 32), torch.float32, "cpu")
    _, want = run_steps(decoder, DecoderStep(decoder), 2, (1, 16, 32, 32), torch.float32, "cpu")
    for g, w in zip(got, want, strict=True):
        rel = ((g - w).norm() / w.norm()).item()
        assert 1e-4 < rel < 0.03  # quantised for real, and close
        top_g, top_w = g.topk(10, dim=-1).indices, w.topk(10, dim=-1).indices
        pairs = zip(top_g.tolist(), top_w.tolist(), strict=True)
        kept = sum(len(set(a) & set(b)) for a, b in pairs)
        assert kept >= 0.95 * top_w.numel()


def test_the_activation_changes_the_function() -> None:
    """The config's activation is really used: tanh and erf GELU give different logits."""
    a = decoder_with_biases(dataclasses.replace(CONFIG, ffn_activation="gelu"))
    b = decoder_with_biases(dataclasses.replace(CONFIG, ffn_activation="gelu_tanh"))
    la, _ = run_steps(a, DecoderStep(a), 2, (1, 3, 3, 2), torch.float32, "cpu")
    lb, _ = run_steps(b, DecoderStep(b), 2, (1, 3, 3, 2), torch.float32, "cpu")
    assert not torch.allclose(la[-1], lb[-1], rtol=0, atol=1e-7)


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
    assert DecoderStep(SIDDecoder(CONFIG).cuda().eval()).gelu_epilogue
    erf = dataclasses.replace(CONFIG, ffn_activation="gelu")
    assert not DecoderStep(SIDDecoder(erf).cuda().eval()).gelu_epilogue


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_equals_teacher_forcing(dtype: torch.dtype) -> None:
    """On CUDA: the LayerNorm kernel, in-place addmm, the fused self-attention kernel and
    the cuBLASLt GELU epilogue."""
    config = dataclasses.replace(PROFILES["tiny"], decoder_layers=3)
    decoder = decoder_with_biases(config, "cuda").to(dtype)
    step = DecoderStep(decoder)
    assert step.gelu_epilogue
    got, want = run_steps(decoder, step, 4, (1, 16, 32, 32), dtype, "cuda")
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
