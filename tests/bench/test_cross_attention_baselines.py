"""The cross-attention baselines (`bench.baselines.cross_attention`): the per-beam layout
equals beam-as-query (paper Appendix B), and on a GPU each pinned SDPA backend equals the
fp32 reference (and, where served, the served dispatcher's call)."""

from __future__ import annotations

import pytest
import torch

from bench.baselines.cross_attention import (
    SDPA_BACKENDS,
    beam_as_query,
    cross_attention_per_beam,
)
from kernels.cross_attention import BACKENDS as SERVED_BACKENDS
from kernels.cross_attention import cross_attention, cross_attention_reference
from tests.helpers.kernel_inputs import ATTENTION_TOL, attention_inputs

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("t_ctx", [5, 33])
def test_beam_as_query_equals_per_beam(b: int, m: int, t_ctx: int) -> None:
    q, k, v = attention_inputs(b, m, 4, t_ctx, 16, torch.float32)
    torch.testing.assert_close(cross_attention(q, k, v), cross_attention_per_beam(q, k, v))


def test_per_beam_rows_attend_only_their_own_request() -> None:
    q, k, v = attention_inputs(3, 17, 2, 33, 16, torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[1] *= -3.0  # change request 1's context only
    v2[1] += 5.0
    out, out2 = cross_attention_per_beam(q, k, v), cross_attention_per_beam(q, k2, v2)
    rows = torch.arange(q.shape[0]) // 17  # request of each row
    assert torch.equal(out[rows != 1], out2[rows != 1])
    assert not torch.isclose(out[rows == 1], out2[rows == 1]).any()


def test_a_pinned_backend_that_cannot_run_raises() -> None:
    """No fallback: a backend the device lacks (cuDNN on a CPU) is an error, not SDPA's
    own choice, so the benchmark reports it instead of timing another kernel."""
    q, k, v = attention_inputs(2, 3, 2, 5, 16, torch.float32)
    with pytest.raises(RuntimeError):
        beam_as_query(q, k, v, "sdpa_cudnn")
    with pytest.raises(RuntimeError):
        cross_attention_per_beam(q, k, v, "sdpa_cudnn")


def _or_skip(fn, backend: str, *args: torch.Tensor) -> torch.Tensor:
    try:
        return fn(*args, backend)
    except RuntimeError as e:  # a backend this build, dtype or shape does not offer
        pytest.skip(f"{backend} unavailable: {e}")


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_pinned_backends_at_full_shape(backend: str, dtype: torch.dtype) -> None:
    """B 16, M 1,024, H 16, T_ctx 128, d_h 128: the Table 4 shape."""
    q, k, v = attention_inputs(16, 1024, 16, 128, 128, dtype, "cuda")
    got = _or_skip(beam_as_query, backend, q, k, v)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    want = cross_attention_reference(q, k, v)
    torch.testing.assert_close(got, want, **ATTENTION_TOL[dtype])
    if backend in SERVED_BACKENDS:  # pinning a served backend is the served call
        assert torch.equal(got, cross_attention(q, k, v, backend=backend))


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn"])
def test_gpu_per_beam_equals_beam_as_query(backend: str) -> None:
    q, k, v = attention_inputs(2, 64, 4, 128, 64, torch.bfloat16, "cuda")
    got = _or_skip(cross_attention_per_beam, backend, q, k, v)
    want = cross_attention(q, k, v)  # the served default: cuDNN for bf16
    torch.testing.assert_close(got, want, **ATTENTION_TOL[torch.bfloat16])
