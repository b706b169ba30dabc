"""The served beam-as-query cross-attention (`kernels.cross_attention`): the dispatcher and
its backends equal the torch reference (CPU: the reference itself, checked against the
attention written out; GPU: every backend at the paper's shape and the dispatcher's
choice at awkward ones). The per-beam layout (the equivalence of paper Appendix B) and the
unserved backends: tests/bench/test_cross_attention_baselines.py."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.cross_attention import (
    BACKENDS,
    cross_attention,
    cross_attention_reference,
    default_backend,
)
from tests.helpers.kernel_inputs import ATTENTION_TOL, attention_inputs

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_beam_rows_attend_only_their_own_request() -> None:
    q, k, v = attention_inputs(3, 17, 2, 33, 16, torch.float32)
    out = cross_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[1] *= -3.0  # change request 1's context only
    v2[1] += 5.0
    out2 = cross_attention(q, k2, v2)
    rows = torch.arange(q.shape[0]) // 17  # request of each row
    assert torch.equal(out[rows != 1], out2[rows != 1])  # bit-identical elsewhere
    assert not torch.isclose(out[rows == 1], out2[rows == 1]).any()


def test_reference_is_each_rows_softmax_attention_over_its_request() -> None:
    """Row b·M + m attends request b's T_ctx keys: softmax(q·kᵀ / √d_h)·v per head, with
    q a column slice of a fused projection (rows 3·H·d_h apart) and K/V a permuted view of
    the decoder's [B, T, 2, H, d_h] context projection, as the decoder step hands them."""
    b, m, h, t_ctx, d = 3, 5, 2, 7, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b * m, 3 * h * d, generator=g)[:, : h * d].view(b * m, h, d)
    kv = torch.randn(b, t_ctx, 2, h, d, generator=g).permute(2, 0, 3, 1, 4)
    k, v = kv[0], kv[1]  # [B, H, T_ctx, d_h] views
    got = cross_attention_reference(q, k, v)
    req = torch.arange(b * m) // m
    scores = torch.einsum("rhd,rhtd->rht", q, k[req]) / math.sqrt(d)
    want = torch.einsum("rht,rhtd->rhd", scores.softmax(dim=-1), v[req])
    torch.testing.assert_close(got, want, **ATTENTION_TOL[torch.float32])
    assert torch.equal(cross_attention(q, k, v), got)


def test_dispatcher_on_cpu_is_the_reference() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = attention_inputs(2, 3, 2, 5, 16, dtype)
        out = cross_attention(q, k, v)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        assert default_backend(q, k) == "reference"
        assert torch.equal(out, cross_attention_reference(q, k, v))
        assert torch.equal(cross_attention(q, k, v, backend="reference"), out)
    with pytest.raises(AssertionError, match="unknown backend"):
        cross_attention(q, k, v, backend="triton")


# --- GPU ------------------------------------------------------------------------------

FULL = {"b": 16, "m": 1024, "h": 16, "t_ctx": 128, "d": 128}  # DESIGN §9, paper Table 4


def _cuda_or_skip(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    try:
        return cross_attention(q, k, v, backend=backend)
    except RuntimeError as e:  # an SDPA backend this build, dtype or shape does not offer
        if backend.startswith("sdpa_"):  # ("No available kernel"); wrong answers assert
            pytest.skip(f"{backend} unavailable: {e}")
        raise


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backend_at_full_shape(backend: str, dtype: torch.dtype) -> None:
    s = FULL
    q, k, v = attention_inputs(s["b"], s["m"], s["h"], s["t_ctx"], s["d"], dtype, "cuda")
    got = _cuda_or_skip(backend, q, k, v)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17, 1000])
@pytest.mark.parametrize(("t_ctx", "d"), [(5, 128), (300, 128), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_dispatcher_at_awkward_shapes(b: int, m: int, t_ctx: int, d: int, dtype) -> None:
    """The dispatcher's own choice (cuDNN for bf16, memory-efficient for fp32) at one
    request or a few, one beam or a ragged many, short and long contexts."""
    q, k, v = attention_inputs(b, m, 4, t_ctx, d, dtype, "cuda")
    got = cross_attention(q, k, v)
    torch.testing.assert_close(got, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@gpu
@needs_cuda
def test_gpu_default_backend() -> None:
    """cuDNN for 16-bit inputs; SDPA's memory-efficient kernel for fp32 (cuDNN has none)."""
    for dtype, want in [
        (torch.bfloat16, "sdpa_cudnn"),
        (torch.float16, "sdpa_cudnn"),
        (torch.float32, "sdpa_efficient"),
    ]:
        q, k, _ = attention_inputs(1, 4, 2, 300, 128, dtype, "cuda")
        assert default_backend(q, k) == want, dtype
