"""The cross-attention baselines (`bench.baselines.cross_attention`): the per-beam layout
equals beam-as-query (paper Appendix B), and the persistent Triton kernel
(`bench.baselines._triton_cross_attention_persistent`) and the unserved SDPA backend
equal the torch reference (CPU: the kernel under TRITON_INTERPRET=1, set by
tests/conftest.py, on CPU_PROGRAMS programs; GPU: at the paper's shape)."""

from __future__ import annotations

import pytest
import torch

from bench.baselines.cross_attention import (
    BACKENDS,
    TRITON_BACKENDS,
    cross_attention_per_beam,
    cross_attention_variant,
)
from kernels.cross_attention import BACKENDS as SERVED_BACKENDS
from kernels.cross_attention import cross_attention, cross_attention_reference
from tests.helpers.kernel_inputs import ATTENTION_TOL, attention_inputs

try:
    import bench.baselines._triton_cross_attention_persistent as triton_pca
except ImportError:  # no triton here: the layout tests still run
    triton_pca = None

needs_triton = pytest.mark.skipif(triton_pca is None, reason="needs triton")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("t_ctx", [5, 33])
def test_beam_as_query_equals_per_beam(b: int, m: int, t_ctx: int) -> None:
    g = torch.Generator().manual_seed(b * 100 + m + t_ctx)
    h, d = 4, 16
    q = torch.randn(b * m, h, d, generator=g)
    k = torch.randn(b, h, t_ctx, d, generator=g)
    v = torch.randn(b, h, t_ctx, d, generator=g)
    torch.testing.assert_close(cross_attention(q, k, v), cross_attention_per_beam(q, k, v))


def test_backend_lists() -> None:
    """The baselines' backends are the served ones plus the unserved kernels."""
    assert set(SERVED_BACKENDS) <= set(BACKENDS)
    assert {"triton_persistent", "sdpa_flash"} <= set(BACKENDS) - set(SERVED_BACKENDS)
    assert set(TRITON_BACKENDS) == {"triton", "triton_persistent"}


def test_variant_on_cpu_is_the_served_reference() -> None:
    q, k, v = attention_inputs(2, 3, 2, 5, 16, torch.float32)
    got = cross_attention_variant(q, k, v, "reference")
    assert torch.equal(got, cross_attention_reference(q, k, v))


# --- the persistent kernel (interpreter on CPU: CPU_PROGRAMS programs) -------------------


@needs_triton
def test_persistent_reads_a_strided_q() -> None:
    """q may be a slice of a fused QKV projection: rows 3·H·d_h apart."""
    b, m, h, d = 2, 17, 2, 16
    qkv = torch.randn(b * m, 3 * h * d)
    q = qkv[:, : h * d].view(b * m, h, d)  # [B * M, H, d_h], stride(0) = 3·H·d_h
    _, k, v = attention_inputs(b, m, h, 33, d, torch.float32)
    torch.testing.assert_close(
        cross_attention_variant(q, k, v, "triton_persistent"),
        cross_attention_reference(q, k, v),
        **ATTENTION_TOL[torch.float32],
    )


@needs_triton
def test_persistent_reads_kv_as_the_decoder_makes_them() -> None:
    """K/V are a permuted view of the fused context projection [B, T, 2, H, d_h]."""
    b, m, h, t_ctx, d = 3, 5, 2, 7, 16
    kv = torch.randn(b, t_ctx, 2, h, d).permute(2, 0, 3, 1, 4)  # [2, B, H, T_ctx, d_h]
    q = torch.randn(b * m, h, d)
    torch.testing.assert_close(
        cross_attention_variant(q, kv[0], kv[1], "triton_persistent"),
        cross_attention_reference(q, kv[0], kv[1]),
        **ATTENTION_TOL[torch.float32],
    )


@needs_triton
def test_persistent_rows_attend_only_their_own_request() -> None:
    q, k, v = attention_inputs(3, 17, 2, 33, 16, torch.float32)
    out = cross_attention_variant(q, k, v, "triton_persistent")
    k2, v2 = k.clone(), v.clone()
    k2[1] *= -3.0  # change request 1's context only
    v2[1] += 5.0
    out2 = cross_attention_variant(q, k2, v2, "triton_persistent")
    rows = torch.arange(q.shape[0]) // 17  # request of each row
    assert torch.equal(out[rows != 1], out2[rows != 1])  # bit-identical elsewhere
    assert not torch.isclose(out[rows == 1], out2[rows == 1]).any()


@needs_triton
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17, 40])  # 40: runs of tiles start inside a (b, h)
@pytest.mark.parametrize("t_ctx", [5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_matches_reference(b: int, m: int, t_ctx: int, dtype: torch.dtype) -> None:
    """Default config (BLOCK_M 16) on 3 programs: each walks several (b, h) pairs,
    reloading K/V between them, with a ragged last tile per pair when M = 17 or 40."""
    q, k, v = attention_inputs(b, m, 2, t_ctx, 16, dtype)
    out = torch.full_like(q, float("nan"))  # any row or lane the kernel skips stays NaN
    got = triton_pca.triton_cross_attention_persistent(q, k, v, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    torch.testing.assert_close(got, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@needs_triton
@pytest.mark.parametrize(("tma", "ws"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("occupancy", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_configs_match_reference(
    tma: bool, ws: bool, occupancy: int, dtype: torch.dtype
) -> None:
    """TMA descriptors (emulated by the interpreter) and a wider grid give the same rows;
    q strided like a slice of a fused QKV projection. `WS` only reaches the kernel here
    (the interpreter ignores warp specialisation): its GPU effect is the bench's sweep."""
    b, m, h, d = 3, 32, 3, 32
    config = {"BLOCK_M": 16, "OCCUPANCY": occupancy, "USE_TMA": tma, "WS": ws}
    qkv = torch.randn(b * m, 3 * h * d).to(dtype)
    q = qkv[:, : h * d].view(b * m, h, d)  # [B * M, H, d_h], stride(0) = 3·H·d_h
    _, k, v = attention_inputs(b, m, h, 7, d, dtype)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    triton_pca.triton_cross_attention_persistent(q, k, v, out=out, config=config)
    torch.testing.assert_close(out, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@needs_triton
def test_persistent_tma_refuses_ragged_tiles() -> None:
    """A TMA box of the 2-D view would store into the next request's rows."""
    q, k, v = attention_inputs(2, 17, 2, 5, 16, torch.float32)
    config = {"BLOCK_M": 16, "OCCUPANCY": 1, "USE_TMA": True}
    with pytest.raises(AssertionError, match="whole tiles"):
        triton_pca.triton_cross_attention_persistent(q, k, v, config=config)


@needs_triton
@pytest.mark.parametrize("m", [1, 17, 1000, 1024])
@pytest.mark.parametrize("t_ctx", [5, 128, 256])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tma_ok", [False, True])
def test_persistent_pruning_keeps_a_fitting_config(
    m: int, t_ctx: int, d: int, dtype: torch.dtype, tma_ok: bool
) -> None:
    """At any supported shape the pruned GPU configs fit an SM OCCUPANCY times over, and
    TMA only where descriptors exist and tiles are whole."""
    if not triton_pca.supports(t_ctx, d, dtype):
        assert dtype == torch.float32 and t_ctx * d > 128 * 128  # only big fp32 tiles
        return
    configs = triton_pca._gpu_configs()
    block_t, block_d = max(16, 1 << (t_ctx - 1).bit_length()), max(16, d)
    q = torch.empty(0, dtype=dtype)
    kw = {"BLOCK_T": block_t, "BLOCK_D": block_d, "TMA_OK": tma_ok}
    kept = triton_pca._prune(configs, {"M": m, "q_ptr": q}, **kw)
    assert kept and all(c in configs for c in kept)
    for c in kept:
        bm, occ = c.kwargs["BLOCK_M"], c.kwargs["OCCUPANCY"]
        smem = triton_pca._smem_bytes(bm, c.num_stages, block_t, block_d, q.itemsize)
        assert occ * (smem + 1024) <= triton_pca.SM_SMEM_BYTES
        assert occ * c.num_warps * 32 * triton_pca.REGS_PER_THREAD <= triton_pca.SM_REGS
        assert not c.kwargs["USE_TMA"] or (tma_ok and m % bm == 0)


# --- GPU: the unserved backends at the paper's shape ------------------------------------

FULL = {"b": 16, "m": 1024, "h": 16, "t_ctx": 128, "d": 128}  # DESIGN §9, paper Table 4


def _cuda_or_skip(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    try:
        return cross_attention_variant(q, k, v, backend)
    except RuntimeError as e:  # an SDPA backend this build, dtype or shape does not offer
        if backend.startswith("sdpa_"):  # ("No available kernel"); wrong answers assert
            pytest.skip(f"{backend} unavailable: {e}")
        raise


@needs_triton
@gpu
@needs_cuda
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in SERVED_BACKENDS])
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
@pytest.mark.parametrize("backend", SERVED_BACKENDS)
def test_gpu_variant_of_a_served_backend_is_the_served_call(backend: str) -> None:
    """`cross_attention_variant` with a served backend is the served dispatcher's call."""
    q, k, v = attention_inputs(2, 64, 4, 128, 64, torch.bfloat16, "cuda")
    got = _cuda_or_skip(backend, q, k, v)
    assert torch.equal(got, cross_attention(q, k, v, backend=backend))


@needs_triton
@gpu
@needs_cuda
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17, 1000])
@pytest.mark.parametrize("t_ctx", [5, 200])  # 128: the full-shape test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_persistent_awkward_shapes(b: int, m: int, t_ctx: int, dtype: torch.dtype) -> None:
    if not triton_pca.supports(t_ctx, 128, dtype):
        pytest.skip("fp32 K/V of this length do not fit shared memory; SDPA takes it")
    q, k, v = attention_inputs(b, m, 16, t_ctx, 128, dtype, "cuda")
    out = torch.full_like(q, float("nan"))
    triton_pca.triton_cross_attention_persistent(q, k, v, out=out)
    torch.testing.assert_close(out, cross_attention_reference(q, k, v), **ATTENTION_TOL[dtype])


@gpu
@needs_cuda
def test_gpu_beam_as_query_equals_per_beam() -> None:
    """The served default (cuDNN for bf16) against the naive layout on the GPU."""
    q, k, v = attention_inputs(2, 64, 4, 128, 64, torch.bfloat16, "cuda")
    torch.testing.assert_close(
        cross_attention(q, k, v), cross_attention_per_beam(q, k, v), **ATTENTION_TOL[torch.bfloat16]
    )


def _persistent_gpu_configs() -> list:
    """The GPU configs the autotuner keeps at the paper's shape (bf16, descriptors)."""
    if triton_pca is None:
        return []
    q = torch.empty(0, dtype=torch.bfloat16)
    kw = {"BLOCK_T": FULL["t_ctx"], "BLOCK_D": FULL["d"], "TMA_OK": True}
    return triton_pca._prune(triton_pca._gpu_configs(), {"M": FULL["m"], "q_ptr": q}, **kw)


@needs_triton
@gpu
@needs_cuda
@pytest.mark.parametrize("config", _persistent_gpu_configs(), ids=str)
def test_gpu_persistent_every_config(config) -> None:
    """Every tuned config at the paper's shape (TMA, pipelining depth, occupancy) is exact."""
    s = FULL
    q, k, v = attention_inputs(s["b"], s["m"], s["h"], s["t_ctx"], s["d"], torch.bfloat16, "cuda")
    fixed = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    out = torch.full_like(q, float("nan"))
    triton_pca.triton_cross_attention_persistent(q, k, v, out=out, config=fixed)
    torch.testing.assert_close(
        out, cross_attention_reference(q, k, v), **ATTENTION_TOL[torch.bfloat16]
    )


@needs_triton
@gpu
@needs_cuda
def test_gpu_persistent_autotuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuned launch, whose pre-hook sizes the TMA boxes per config, is exact."""
    monkeypatch.setattr(triton_pca, "AUTOTUNE", True)
    q, k, v = attention_inputs(
        2, FULL["m"], FULL["h"], FULL["t_ctx"], FULL["d"], torch.bfloat16, "cuda"
    )
    got = triton_pca.triton_cross_attention_persistent(q, k, v)
    torch.testing.assert_close(
        got, cross_attention_reference(q, k, v), **ATTENTION_TOL[torch.bfloat16]
    )
    assert triton_pca._cross_attn_persistent_tuned.best_config is not None
