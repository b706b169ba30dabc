"""Short-sequence self-attention kernels (fused dense, paged) vs the torch reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small,
awkward shapes, with each evaluation strategy of the tile forced by a fixed config; the
`gpu` tests run the autotuned dispatchers and every config at the paper's shape. The
coalesced variant (pre-gathered keys/values: `bench.baselines.kv_cache`'s
`prefix_self_attention_triton`, which only the benchmarks run) gets one cheap check here and
a GPU run.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from bench.baselines.kv_cache import prefix_self_attention_triton
from kernels._triton_self_attention import (
    CONFIGS,
    fp8_out_supported,
    fused_self_attention_triton,
)
from kernels.fp8 import quantize_rows_reference
from kernels.self_attention import (
    fused_self_attention,
    fused_self_attention_reference,
    prefix_self_attention_reference,
)

L = 4  # SID length: cache positions per row
NAN = float("nan")
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# the two ways to evaluate a tile: CUDA-core diagonal, tensor-core block-diagonal mask
TILES = {
    "diagonal": {"BLOCK_N": 16, "MASKED_DOT": False},
    "masked_dot": {"BLOCK_N": 32, "MASKED_DOT": True},
}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _skip_interpreter_bf16_dot(dtype: torch.dtype, tile: str) -> None:
    # the interpreter keeps bf16 as uint16 and tl.dot multiplies the raw bits
    # (triton-lang/triton#11584: not supported yet); fp16 covers the 16-bit dot path here
    if dtype == torch.bfloat16 and TILES[tile]["MASKED_DOT"]:
        pytest.skip("TRITON_INTERPRET: tl.dot on bf16 unsupported; the gpu tests cover it")


def _gen(*key: object, device: str = "cpu") -> torch.Generator:
    """Inputs are drawn on the generator's device (the GPU tests' tensors are large)."""
    return torch.Generator(device).manual_seed(zlib.crc32(repr(key).encode()))  # stable


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


def _poisoned_out(rows: int, heads: int, d_h: int, dtype: torch.dtype, device="cpu"):
    return torch.full((rows, heads, d_h), NAN, dtype=dtype, device=device)


def _qkv(rows: int, heads: int, d_h: int, dtype, gen) -> torch.Tensor:
    # a column slice of a wider buffer: the kernel must honour qkv's row stride
    return _randn(rows, 3 * heads * d_h + 16, gen=gen, dtype=dtype)[:, : 3 * heads * d_h]


def _paged_step(rows: int, t: int, heads: int, d_h: int, dtype, table_dtype, gen):
    """A shuffled pool and block table as after beam reorder at step t.

    Children share their parent's blocks 0..t-1; block t of every row is fresh (NaN until
    written); positions after t name a NaN spare block, never to be read.
    """
    parents = (rows + 1) // 2
    n_old, spare = parents * t, 3
    perm = torch.randperm(n_old + rows + spare, generator=gen, device=gen.device)
    old = perm[:n_old].view(parents, t)
    new, spares = perm[n_old : n_old + rows], perm[n_old + rows :]
    parent = torch.randint(parents, (rows,), generator=gen, device=gen.device)
    parent[-1] = parent[0]  # at least two rows on the same parent blocks when rows > 1
    table = spares[0].repeat(rows, L)
    table[:, :t] = old[parent]
    table[:, t] = new
    pools = []
    for _ in range(2):
        pool = _randn(len(perm), heads, d_h, gen=gen, dtype=dtype)
        pool[new] = NAN
        pool[spares] = NAN
        pools.append(pool)
    return pools[0], pools[1], table.to(table_dtype)


def _dense_cache(rows: int, t: int, heads: int, d_h: int, dtype, gen):
    k, v = (_randn(rows, L, heads, d_h, gen=gen, dtype=dtype) for _ in range(2))
    for c in (k, v):
        c[:, t:] = NAN  # t: to be written; after t: must never be read
    return k, v


# rows: one program, and several with a partial last tile; t: no cached token, a power of
# two of them, and T_PAD > T (3 tokens padded to 4); (heads, d_h): one head (a row is a
# query) and three (rows straddle tiles), two head dims
ROWS = pytest.mark.parametrize("rows", [1, 33])
STEPS = pytest.mark.parametrize("t", [0, 2, 3])
HEADS_D = pytest.mark.parametrize(("heads", "d_h"), [(1, 32), (3, 16)])
# fp16: the 16-bit tensor-core dot under the interpreter (bf16's is the GPU tests')
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])


@pytest.mark.parametrize("t", [0, 3])
@pytest.mark.parametrize("tile", list(TILES))
def test_coalesced_matches_reference(t, tile) -> None:
    rows, heads, d_h, dtype = 7, 3, 16, torch.float32
    gen = _gen("coalesced", rows, t, heads, d_h, dtype, tile)
    q = _randn(rows, heads, d_h, gen=gen, dtype=dtype)
    # k: a strided view into a dense cache (NaN past t); v: a gathered contiguous tensor
    cache = _randn(rows, L, heads, d_h, gen=gen, dtype=dtype)
    cache[:, t + 1 :] = NAN
    k = cache[:, : t + 1]
    v = _randn(rows, t + 1, heads, d_h, gen=gen, dtype=dtype)
    out = _poisoned_out(rows, heads, d_h, dtype)
    got = prefix_self_attention_triton(q, k, v, out=out, config=TILES[tile])
    assert got is out
    torch.testing.assert_close(got, prefix_self_attention_reference(q, k, v), **TOL[dtype])


@ROWS
@STEPS
@HEADS_D
@DTYPES
@pytest.mark.parametrize("tile", list(TILES))
def test_fused_dense_matches_reference(rows, t, heads, d_h, dtype, tile) -> None:
    _skip_interpreter_bf16_dot(dtype, tile)
    gen = _gen("dense", rows, t, heads, d_h, dtype, tile)
    qkv = _qkv(rows, heads, d_h, dtype, gen)
    k_cache, v_cache = _dense_cache(rows, t, heads, d_h, dtype, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = fused_self_attention_reference(qkv, k_ref, v_ref, t)
    out = _poisoned_out(rows, heads, d_h, dtype)
    got = fused_self_attention_triton(qkv, k_cache, v_cache, t, out=out, config=TILES[tile])
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the new k/v land at position t bit for bit; every other position is untouched
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}
    torch.testing.assert_close(k_cache, k_ref, **exact)
    torch.testing.assert_close(v_cache, v_ref, **exact)


@ROWS
@STEPS
@HEADS_D
@DTYPES
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tile", list(TILES))
def test_paged_matches_reference(rows, t, heads, d_h, dtype, table_dtype, tile) -> None:
    _skip_interpreter_bf16_dot(dtype, tile)
    gen = _gen("paged", rows, t, heads, d_h, dtype, table_dtype, tile)
    qkv = _qkv(rows, heads, d_h, dtype, gen)
    k_pool, v_pool, table = _paged_step(rows, t, heads, d_h, dtype, table_dtype, gen)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    want = fused_self_attention_reference(qkv, k_ref, v_ref, t, table)
    out = _poisoned_out(rows, heads, d_h, dtype)
    got = fused_self_attention_triton(qkv, k_pool, v_pool, t, table, out=out, config=TILES[tile])
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the write lands in blocks table[:, t] exactly; shared parent and spare blocks unchanged
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}
    torch.testing.assert_close(k_pool, k_ref, **exact)
    torch.testing.assert_close(v_pool, v_ref, **exact)
    assert not k_pool[table[:, t].long()].isnan().any()


@pytest.mark.parametrize("t", [0, 3])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("tile", list(TILES))
def test_store_false_attends_the_same_and_leaves_the_cache_alone(t, paged, tile) -> None:
    rows, heads, d_h, dtype = 7, 3, 16, torch.float32
    gen = _gen("no-store", t, paged, tile)
    qkv = _qkv(rows, heads, d_h, dtype, gen)
    if paged:
        k_cache, v_cache, table = _paged_step(rows, t, heads, d_h, dtype, torch.int64, gen)
    else:
        (k_cache, v_cache), table = _dense_cache(rows, t, heads, d_h, dtype, gen), None
    before = (k_cache.clone(), v_cache.clone())
    want = fused_self_attention_reference(qkv, k_cache.clone(), v_cache.clone(), t, table)
    ref = fused_self_attention_reference(qkv, k_cache, v_cache, t, table, store=False)
    out = _poisoned_out(rows, heads, d_h, dtype)
    got = fused_self_attention_triton(
        qkv, k_cache, v_cache, t, table, store=False, out=out, config=TILES[tile]
    )
    torch.testing.assert_close(ref, want, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}  # slot t still NaN: never written
    torch.testing.assert_close((k_cache, v_cache), before, **exact)


@pytest.mark.parametrize("t", [0, 2, 3])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("tile", list(TILES))
def test_rows_read_through_an_index_equal_the_gathered_rows(t, paged, tile) -> None:
    """qkv_rows (layer 0's QKV table): row r reads source row qkv_rows[r] — rows repeat
    and the source has fewer rows than the step — and the result, cache writes included,
    is the kernel's on the gathered copy."""
    rows, heads, d_h, dtype = 13, 3, 16, torch.float32
    gen = _gen("qkv-rows", t, paged, tile)
    source = _qkv(5, heads, d_h, dtype, gen)
    index = torch.randint(5, (rows,), generator=gen)
    index[1] = index[0]  # two rows on one entry
    if paged:
        k_cache, v_cache, table = _paged_step(rows, t, heads, d_h, dtype, torch.int32, gen)
    else:
        (k_cache, v_cache), table = _dense_cache(rows, t, heads, d_h, dtype, gen), None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = fused_self_attention_triton(
        source[index].contiguous(), k_ref, v_ref, t, table, config=TILES[tile]
    )
    out = _poisoned_out(rows, heads, d_h, dtype)
    got = fused_self_attention_triton(
        source, k_cache, v_cache, t, table, out=out, config=TILES[tile], qkv_rows=index
    )
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}
    torch.testing.assert_close(got, want, **exact)
    torch.testing.assert_close((k_cache, v_cache), (k_ref, v_ref), **exact)
    # and the reference's qkv_rows is the same gather
    ref = fused_self_attention_reference(source, k_ref.clone(), v_ref.clone(), t, table,
                                         qkv_rows=index)  # fmt: skip
    torch.testing.assert_close(ref, want, **TOL[dtype])


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)  # e4m3 bytes: equality without NaN / -0 subtleties


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("t", [0, 3])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", list(TILES))
def test_fp8_out_is_the_stored_output_quantised(t, paged, heads, dtype, tile) -> None:
    """With fp8_out the kernel writes each row's H·d_h outputs as e4m3 codes and one
    scale, byte for byte what `quantize_rows` makes of the output it would have stored
    (the FP8 out projection's input, with no pass of its own); the cache writes are the
    same. 7 rows: the last tile holds fewer rows than it has room for."""
    _skip_interpreter_bf16_dot(dtype, tile)
    rows, d_h = 7, 16
    gen = _gen("fp8-out", t, paged, heads, dtype, tile)
    qkv = _qkv(rows, heads, d_h, dtype, gen)
    if paged:
        k_cache, v_cache, table = _paged_step(rows, t, heads, d_h, dtype, torch.int32, gen)
    else:
        (k_cache, v_cache), table = _dense_cache(rows, t, heads, d_h, dtype, gen), None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    stored = fused_self_attention_triton(qkv, k_ref, v_ref, t, table, config=TILES[tile])
    want_q, want_scale = quantize_rows_reference(stored.reshape(rows, -1))
    got_q, got_scale = fused_self_attention_triton(
        qkv, k_cache, v_cache, t, table, config=TILES[tile], fp8_out=True
    )
    assert got_q.shape == (rows, heads * d_h) and got_q.dtype == torch.float8_e4m3fn
    assert torch.equal(_codes(got_q), _codes(want_q))
    assert torch.equal(got_scale, want_scale)
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}
    torch.testing.assert_close((k_cache, v_cache), (k_ref, v_ref), **exact)


def test_fp8_out_needs_whole_rows_in_a_tile_and_the_dispatcher_quantises_otherwise() -> None:
    """A head count that does not divide the tiles (3) has no FP8 output in the kernel;
    the dispatcher then quantises the output itself, so callers get the same pair. Off
    CUDA it quantises the reference's output."""
    assert fp8_out_supported(1) and fp8_out_supported(16)
    assert not fp8_out_supported(3) and not fp8_out_supported(32)
    gen = _gen("fp8-out-dispatch")
    qkv = _qkv(5, 3, 16, torch.float32, gen)
    k_cache, v_cache = _dense_cache(5, 2, 3, 16, torch.float32, gen)
    with pytest.raises(AssertionError, match="no FP8 output"):
        fused_self_attention_triton(qkv, k_cache.clone(), v_cache.clone(), 2, fp8_out=True)
    want = fused_self_attention_reference(qkv, k_cache.clone(), v_cache.clone(), 2)
    got_q, got_scale = fused_self_attention(qkv, k_cache, v_cache, 2, fp8_out=True)
    want_q, want_scale = quantize_rows_reference(want.reshape(5, -1))
    assert torch.equal(_codes(got_q), _codes(want_q)) and torch.equal(got_scale, want_scale)


@pytest.mark.parametrize("tile", list(TILES))
def test_query_sees_only_its_own_row(tile: str) -> None:
    """The block-diagonal mask: changing row 1's cached keys/values leaves rows 0 and 2
    alone (bit for bit)."""
    gen = _gen("own-row", tile)
    qkv = _qkv(3, 2, 16, torch.float32, gen)
    k, v = (_randn(3, L, 2, 16, gen=gen, dtype=torch.float32) for _ in range(2))
    before = fused_self_attention_triton(qkv, k, v, 3, store=False, config=TILES[tile])
    k[1] += 3.0
    v[1] -= 5.0
    after = fused_self_attention_triton(qkv, k, v, 3, store=False, config=TILES[tile])
    assert torch.equal(before[[0, 2]], after[[0, 2]])
    assert not torch.allclose(before[1], after[1])


def test_dispatchers_take_the_reference_off_cuda() -> None:
    gen = _gen("dispatch")
    qkv = _qkv(5, 2, 16, torch.float32, gen)
    k_cache, v_cache = _dense_cache(5, 2, 2, 16, torch.float32, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    got = fused_self_attention(qkv, k_cache, v_cache, 2)
    assert torch.equal(got, fused_self_attention_reference(qkv, k_ref, v_ref, 2))
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("t", [0, 1, 3])
def test_prefix_self_attention_matches_sdpa(t: int) -> None:
    r, h, d = 7, 3, 16
    q = torch.randn(r, h, d)
    k, v = torch.randn(r, t + 1, h, d), torch.randn(r, t + 1, h, d)
    want = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2)
    ).squeeze(2)
    torch.testing.assert_close(prefix_self_attention_reference(q, k, v), want)


# ---- GPU: the paper's shape, B = 16 requests × M = 1024 beams, H = 16, d_h = 128 --------

ROWS, HEADS, D_H = 16 * 1024, 16, 128


def _gpu_inputs(t: int, variant: str, dtype=torch.bfloat16, rows: int = ROWS):
    gen = _gen("gpu", t, variant, dtype, rows, device="cuda")
    qkv = _qkv(rows, HEADS, D_H, dtype, gen)
    if variant == "paged":
        return qkv, *_paged_step(rows, t, HEADS, D_H, dtype, torch.int32, gen)
    return qkv, *_dense_cache(rows, t, HEADS, D_H, dtype, gen), None


def _check_gpu(t: int, variant: str, config: dict | None, dtype=torch.bfloat16, rows=ROWS):
    qkv, k_cache, v_cache, table = _gpu_inputs(t, variant, dtype, rows)
    q = qkv[:, : HEADS * D_H].view(rows, HEADS, D_H)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = fused_self_attention_reference(qkv, k_ref, v_ref, t, table)
    out = _poisoned_out(rows, HEADS, D_H, dtype, "cuda")
    if variant == "coalesced":
        k, v = k_ref[:, : t + 1], v_ref[:, : t + 1]  # gathered by the reference's write
        got = prefix_self_attention_triton(q, k, v, out=out, config=config)
    else:
        got = fused_self_attention_triton(qkv, k_cache, v_cache, t, table, out=out, config=config)
        exact = {"atol": 0, "rtol": 0, "equal_nan": True}
        torch.testing.assert_close(k_cache, k_ref, **exact)
        torch.testing.assert_close(v_cache, v_ref, **exact)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [0, 1, 2, 3])
@pytest.mark.parametrize("variant", ["coalesced", "dense", "paged"])
def test_gpu_autotuned_matches_reference(t: int, variant: str) -> None:
    _check_gpu(t, variant, None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("variant", ["coalesced", "dense", "paged"])
def test_gpu_every_config_at_t3(config, variant: str) -> None:
    fixed = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    _check_gpu(3, variant, fixed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("variant", ["coalesced", "dense", "paged"])
def test_gpu_fp32(tile: str, variant: str) -> None:
    _check_gpu(2, variant, TILES[tile], torch.float32, rows=1000)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["dense", "paged"])
def test_gpu_last_position_without_store(variant: str) -> None:
    qkv, k_cache, v_cache, table = _gpu_inputs(3, variant)
    before = (k_cache.clone(), v_cache.clone())
    want = fused_self_attention_reference(qkv, k_cache.clone(), v_cache.clone(), 3, table)
    with torch.no_grad():
        got = fused_self_attention(qkv, k_cache, v_cache, 3, table, store=False)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    torch.testing.assert_close((k_cache, v_cache), before, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gpu_fp8_out_at_the_paper_heads(config) -> None:
    """The paper's 16 heads of 128 at t = 3, paged, every tile config: the FP8 output is
    the stored bf16 output quantised, byte for byte (the compiled casts, not the
    interpreter's)."""
    fixed = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    qkv, k_cache, v_cache, table = _gpu_inputs(3, "paged")
    stored = fused_self_attention_triton(qkv, k_cache.clone(), v_cache.clone(), 3, table,
                                         config=fixed)  # fmt: skip
    want_q, want_scale = quantize_rows_reference(stored.reshape(ROWS, -1))
    got_q, got_scale = fused_self_attention_triton(qkv, k_cache, v_cache, 3, table,
                                                   config=fixed, fp8_out=True)  # fmt: skip
    assert torch.equal(_codes(got_q), _codes(want_q))
    assert torch.equal(got_scale, want_scale)


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatchers_run_the_kernels() -> None:
    qkv, k_cache, v_cache, table = _gpu_inputs(3, "paged")
    with torch.no_grad():
        got = fused_self_attention(qkv, k_cache, v_cache, 3, table)
    want = fused_self_attention_reference(qkv, k_cache.clone(), v_cache.clone(), 3, table)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


def test_tuning_key_is_the_queries_rounded_up_to_a_power_of_two(monkeypatch) -> None:
    """N_BUCKET (after the softmax scale) is the autotune key: R·H queries rounded up to a
    power of two, so the row counts of other graph buckets reuse a tuning."""
    import kernels._triton_self_attention as mod

    seen: list[tuple] = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(args)

    monkeypatch.setattr(mod, "_self_attn_kernel", Spy())
    for rows in (3, 5, 8):
        qkv = torch.randn(rows, 3 * 2 * 16)
        k_cache = torch.randn(rows, L, 2, 16)
        mod.fused_self_attention_triton(qkv, k_cache, k_cache.clone(), 2)
    assert [(args[9], args[-1]) for args in seen] == [(6, 8), (10, 16), (16, 16)]
