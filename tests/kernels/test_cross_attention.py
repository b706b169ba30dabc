"""The served beam-as-query cross-attention (`kernels.cross_attention`): the dispatcher, its
backends and our Triton kernel equal the torch reference (CPU: under TRITON_INTERPRET=1,
set by tests/conftest.py; GPU: every served backend at the paper's shape). The per-beam
layout (the equivalence of paper Appendix B) and the unserved backends (the persistent
kernel, SDPA pinned to flash): tests/bench/test_cross_attention_baselines.py."""

from __future__ import annotations

import pytest
import torch

from kernels.cross_attention import (
    BACKENDS,
    cross_attention,
    cross_attention_reference,
    default_backend,
)
from tests.helpers.kernel_inputs import ATTENTION_TOL, attention_inputs

try:
    import kernels._triton_cross_attention as triton_ca
except ImportError:  # no triton here: the layout tests still run
    triton_ca = None

needs_triton = pytest.mark.skipif(triton_ca is None, reason="needs triton")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_beam_rows_attend_only_their_own_request() -> None:
    h, d = 2, 8
    q = torch.randn(4, h, d)
    k, v = torch.randn(2, h, 3, d), torch.randn(2, h, 3, d)
    out = cross_attention(q, k, v)
    v2 = v.clone()
    v2[1] += 5.0  # change request 1's context only
    out2 = cross_attention(q, k, v2)
    torch.testing.assert_close(out[:2], out2[:2])  # request 0's rows unchanged
    assert not torch.allclose(out[2:], out2[2:])


# --- the Triton kernel (interpreter on CPU) -------------------------------------------


@needs_triton
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("t_ctx", [5, 33])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(b: int, m: int, t_ctx: int, d: int, dtype: torch.dtype) -> None:
    q, k, v = attention_inputs(b, m, 2, t_ctx, d, dtype)
    out = torch.full_like(q, float("nan"))  # any row or lane the kernel skips stays NaN
    got = triton_ca.triton_cross_attention(q, k, v, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    torch.testing.assert_close(got, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("d", [24])  # not a power of two: the head dim is masked too
def test_triton_masks_odd_head_dim(d: int) -> None:
    q, k, v = attention_inputs(2, 5, 2, 7, d, torch.float32)
    out = torch.full_like(q, float("nan"))
    triton_ca.triton_cross_attention(q, k, v, out=out)
    torch.testing.assert_close(
        out, cross_attention_reference(q, k, v), **ATTENTION_TOL[torch.float32]
    )


@needs_triton
def test_triton_reads_a_strided_q() -> None:
    """q may be a slice of a fused QKV projection: rows 3·H·d_h apart."""
    b, m, h, d = 2, 17, 2, 16
    qkv = torch.randn(b * m, 3 * h * d)
    q = qkv[:, : h * d].view(b * m, h, d)  # [B * M, H, d_h], stride(0) = 3·H·d_h
    _, k, v = attention_inputs(b, m, h, 33, d, torch.float32)
    torch.testing.assert_close(
        cross_attention(q, k, v, backend="triton"),
        cross_attention_reference(q, k, v),
        **ATTENTION_TOL[torch.float32],
    )


@needs_triton
def test_triton_reads_kv_as_the_decoder_makes_them() -> None:
    """K/V are a permuted view of the fused context projection [B, T, 2, H, d_h]."""
    b, m, h, t_ctx, d = 3, 5, 2, 7, 16
    kv = torch.randn(b, t_ctx, 2, h, d).permute(2, 0, 3, 1, 4)  # [2, B, H, T_ctx, d_h]
    q = torch.randn(b * m, h, d)
    torch.testing.assert_close(
        cross_attention(q, kv[0], kv[1], backend="triton"),
        cross_attention_reference(q, kv[0], kv[1]),
        **ATTENTION_TOL[torch.float32],
    )


@needs_triton
def test_triton_rows_attend_only_their_own_request() -> None:
    q, k, v = attention_inputs(3, 17, 2, 33, 16, torch.float32)
    out = cross_attention(q, k, v, backend="triton")
    k2, v2 = k.clone(), v.clone()
    k2[1] *= -3.0  # change request 1's context only
    v2[1] += 5.0
    out2 = cross_attention(q, k2, v2, backend="triton")
    rows = torch.arange(q.shape[0]) // 17  # request of each row
    assert torch.equal(out[rows != 1], out2[rows != 1])  # bit-identical elsewhere
    assert not torch.isclose(out[rows == 1], out2[rows == 1]).any()


def test_dispatcher_on_cpu_is_the_reference() -> None:
    q, k, v = attention_inputs(2, 3, 2, 5, 16, torch.bfloat16)
    out = cross_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert torch.equal(out, cross_attention_reference(q, k, v))
    assert default_backend(q, k) == "reference"
    for dtype in (torch.float32, torch.float16):
        q, k, v = attention_inputs(2, 3, 2, 5, 16, dtype)
        assert default_backend(q, k) == "reference"
        assert torch.equal(cross_attention(q, k, v), cross_attention_reference(q, k, v))


@needs_triton
@pytest.mark.parametrize("m", [1, 17, 512, 1024, 5000])
@pytest.mark.parametrize("t_ctx", [5, 128, 256])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autotune_pruning_keeps_a_fitting_config(
    m: int, t_ctx: int, d: int, dtype: torch.dtype
) -> None:
    """The GPU config space pruned at any supported shape leaves configs that fit."""
    if not triton_ca.supports(t_ctx, d, dtype):
        assert dtype == torch.float32 and t_ctx * d > 128 * 128  # only big fp32 tiles
        return
    configs = triton_ca._gpu_configs()
    block_t, block_d = max(16, 1 << (t_ctx - 1).bit_length()), max(16, d)
    q = torch.empty(0, dtype=dtype)
    kept = triton_ca._prune(configs, {"M": m, "q_ptr": q}, BLOCK_T=block_t, BLOCK_D=block_d)
    assert kept and all(c in configs for c in kept)
    for c in kept:
        assert c.kwargs["BLOCK_M"] * c.kwargs["TILES"] <= max(32, 1 << (m - 1).bit_length())
        smem = triton_ca._smem(c.kwargs["BLOCK_M"], c.num_stages, block_t, block_d, q.itemsize)
        assert smem <= triton_ca.SMEM_BYTES


# --- GPU: every backend at the paper's shape ------------------------------------------

FULL = {"b": 16, "m": 1024, "h": 16, "t_ctx": 128, "d": 128}  # DESIGN §9, paper Table 4


def _cuda_or_skip(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    try:
        return cross_attention(q, k, v, backend=backend)
    except RuntimeError as e:  # an SDPA backend this build, dtype or shape does not offer
        if backend.startswith("sdpa_"):  # ("No available kernel"); wrong answers assert
            pytest.skip(f"{backend} unavailable: {e}")
        raise


@needs_triton
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


@needs_triton
@gpu
@needs_cuda
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17, 1000])
@pytest.mark.parametrize("t_ctx", [5, 200])  # 128: the full-shape test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_awkward_shapes(b: int, m: int, t_ctx: int, dtype: torch.dtype) -> None:
    if not triton_ca.supports(t_ctx, 128, dtype):
        pytest.skip("fp32 K/V of this length do not fit shared memory; SDPA takes it")
    q, k, v = attention_inputs(b, m, 16, t_ctx, 128, dtype, "cuda")
    out = torch.full_like(q, float("nan"))
    triton_ca.triton_cross_attention(q, k, v, out=out)
    torch.testing.assert_close(out, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@needs_triton
@gpu
@needs_cuda
def test_gpu_dispatcher_default_and_long_context() -> None:
    for dtype, t_ctx in [(torch.bfloat16, 300), (torch.float32, 256)]:  # not for the kernel
        q, k, v = attention_inputs(2, 64, 4, t_ctx, 128, dtype, "cuda")
        got = cross_attention(q, k, v)  # SDPA: cuDNN for bf16, memory-efficient for fp32
        torch.testing.assert_close(got, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])
    q, k, v = attention_inputs(2, 64, 4, 128, 64, torch.bfloat16, "cuda")
    torch.testing.assert_close(
        cross_attention(q, k, v),
        cross_attention_reference(q, k, v),
        **ATTENTION_TOL[torch.bfloat16],
    )


@gpu
@needs_cuda
def test_gpu_default_backend() -> None:
    """cuDNN for 16-bit inputs; fp32 through our kernel while the context fits one block,
    SDPA's memory-efficient kernel past it."""
    for dtype, t_ctx, want in [
        (torch.bfloat16, 128, "sdpa_cudnn"),
        (torch.float16, 300, "sdpa_cudnn"),
        (torch.float32, 128, "triton" if triton_ca is not None else "sdpa_efficient"),
        (torch.float32, 300, "sdpa_efficient"),
    ]:
        q, k, _ = attention_inputs(1, 4, 2, t_ctx, 128, dtype, "cuda")
        assert default_backend(q, k) == want, (dtype, t_ctx)
