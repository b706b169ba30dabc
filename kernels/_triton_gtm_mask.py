"""Triton body and launcher of the CD+GTM mask; `kernels.gtm_mask` dispatches here.

One program per beam row walks the row's trie node's child range (CSR `node_offsets`) in
chunks of BLOCK_C children: CD (the children exist), then in GTM mode the bitmask test
and, family after family (the K >= 0 Bloom families of the schema's `set` attributes,
`GtmTables.bloom_families`), only for the children that passed every test before, the
Bloom test ANY-of-many over the request's rows of the family (its `n_blooms` rows when
given, else all L). The layout is compile-time (`K`, `FAM_AT`, `FAM_W`): the family loop
and each family's word loop (up to 512 bits) unroll, so an index of one 4-word family
(the locations) compiles to the single-family kernel's instructions. It writes the whole
output row (−inf / −1, then the allowed tokens' logits and child nodes) and turns it
into the candidate scores in the same program, so the loop runs no separate cast,
log-softmax, add and fill passes over `[R, V]`. The masked softmax takes "allowed" as
"written with a finite logit": a NaN logit (a broken model) becomes a −inf candidate
here, where the unfused reference would carry the NaN; the unmasked one, like the
reference, carries a NaN anywhere in the row into the row's allowed candidates.
Fixed shapes, no host syncs: the launch can sit inside a CUDA graph (after one eager
warm-up call, which autotunes). Tables are int64 views: `contracts.tensors`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from contracts.index_format import VOCAB_SIZE
from contracts.request import SCORINGS, Scoring
from contracts.tensors import GtmTables, RequestTensors
from kernels._tuning import AUTOTUNE

# a family at most this wide (512 bits) unrolls its word loop; a wider one loops at run
# time, so a 65,536-bit family does not compile 1,024 copies of the body
UNROLL_WORDS = tl.constexpr(8)


@triton.jit
def _contains_word(contained, req_row, matcher_row, ls, n, need, w, W_BL: tl.constexpr):
    """`contained` [BLOCK_C, BLOCK_L] narrowed by Bloom word w: (matcher & row) == row for
    the request's rows `ls` (< n) and the children still searching (`need`)."""
    q = tl.load(req_row + ls * W_BL + w, mask=ls < n, other=0)
    m = tl.load(matcher_row + w, mask=need, other=0)
    return contained & ((m[:, None] & q[None, :]) == q[None, :])


@triton.jit
def _gtm_mask_kernel(
    logits_ptr,  # float32 (or bf16/fp16) [R, V], row stride `stride_logits`
    masked_ptr,  # float32 [R, V] out, contiguous: the masked logits, then the candidates
    child_out_ptr,  # int32 [R, V] out, contiguous
    node_ids_ptr,  # int64 [R]
    row_request_ptr,  # int64 [R]
    node_offsets_ptr,  # int32 [num_nodes + 1]
    child_nodes_ptr,  # int32 [E]
    tokens_ptr,  # int32 [E]
    bitmask_index_ptr,  # int32 [E]
    bloom_index_ptr,  # int32 [E]
    bitmask_table_ptr,  # int64 [R_bm, W_BM]
    bloom_table_ptr,  # int64 [R_bl, W_BL]
    req_bitmask_ptr,  # int64 [B, W_BM]
    req_blooms_ptr,  # int64 [B, L, W_BL]
    n_blooms_ptr,  # int32 [B, K]: rows of each family (read only if HAS_N)
    score_ptr,  # float32 [R]: accumulated score of each row
    stride_logits,
    R,  # rows rounded up to a power of two: an autotune key only
    L,  # Bloom rows per request (padding rows repeat the family's row 0)
    V: tl.constexpr,
    W_BM: tl.constexpr,
    W_BL: tl.constexpr,
    K: tl.constexpr,  # Bloom families
    FAM_AT: tl.constexpr,  # tuple [K]: each family's first word in a Bloom row
    FAM_W: tl.constexpr,  # tuple [K]: each family's words
    HAS_N: tl.constexpr,  # search each family's n_blooms rows, not all L
    GTM: tl.constexpr,
    UNMASKED: tl.constexpr,  # log-softmax over the whole logits row
    BLOCK_V: tl.constexpr,
    BLOCK_WBM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    out_row = r * V

    # The row is written in full, so no memset kernel and no stale values from the last
    # step: −inf / −1 first (2·V coalesced stores), then the allowed tokens on top. The
    # barrier orders the two stores to one address made by different threads.
    v = tl.arange(0, BLOCK_V)
    tl.store(masked_ptr + out_row + v, tl.full([BLOCK_V], float("-inf"), tl.float32), mask=v < V)
    tl.store(child_out_ptr + out_row + v, tl.full([BLOCK_V], -1, tl.int32), mask=v < V)
    tl.debug_barrier()

    node = tl.load(node_ids_ptr + r)
    start = tl.load(node_offsets_ptr + node)
    end = tl.load(node_offsets_ptr + node + 1)  # a leaf (dead rows park there): no children

    if GTM:
        req = tl.load(row_request_ptr + r)
        # stage the request's bitmask row once (one word per lane). A request sets one bit
        # per attribute, so most of its 5 words are 0 and pass trivially: those words'
        # matcher loads are masked off below (2-3 of 5 words are read per child).
        wb = tl.arange(0, BLOCK_WBM)
        q_bm = tl.load(req_bitmask_ptr + req * W_BM + wb, mask=wb < W_BM, other=0)
        w_needed = (wb < W_BM) & (q_bm != 0)
        lanes_l = tl.arange(0, BLOCK_L)
        req_blooms = req_blooms_ptr + req * L * W_BL

    for c0 in range(start, end, BLOCK_C):
        entry = c0 + tl.arange(0, BLOCK_C)
        ok = entry < end  # CD: every entry of the range is a catalog prefix
        if GTM:
            bm_row = tl.load(bitmask_index_ptr + entry, mask=ok, other=0)
            m_bm = tl.load(
                bitmask_table_ptr + bm_row[:, None] * W_BM + wb[None, :],
                mask=ok[:, None] & w_needed[None, :],
                other=0,
            )  # [BLOCK_C, BLOCK_WBM]; masked words read as 0 and match a 0 query word
            hit_bm = (m_bm & q_bm[None, :]) == q_bm[None, :]
            ok = ok & (tl.min(hit_bm.to(tl.int32), axis=1) > 0)
            if K > 0:
                # Blooms only where the bitmask passed: failed lanes issue no loads
                bl_row = tl.load(bloom_index_ptr + entry, mask=ok, other=0)
                matcher = bloom_table_ptr + bl_row * W_BL
            # ALL families, one after the other (unrolled): a family is searched only by
            # the children that passed every test before it, and a chunk where none did
            # never enters its row loop
            for f in tl.static_range(K):
                # the family's own rows, no padding row read; without counts all L rows
                # (padding repeats row 0: reading it changes nothing)
                n = tl.minimum(tl.load(n_blooms_ptr + req * K + f), L) if HAS_N else L
                need = ok  # passed every test so far, no row of this family contained yet
                hit = tl.zeros([BLOCK_C], dtype=tl.int1)
                l0 = 0
                # ANY-of-many: BLOCK_L rows at a time, stopping as soon as every surviving
                # child contains one (inner nodes' ORed Blooms are dense, so the first
                # chunk usually settles them)
                while (l0 < n) & (tl.max(need.to(tl.int32), axis=0) > 0):
                    ls = l0 + lanes_l
                    contained = need[:, None] & (ls < n)[None, :]  # [BLOCK_C, BLOCK_L]
                    # word by word: one [BLOCK_C, BLOCK_L] tile live, not the family's
                    # width; re-reading a matcher word is an L1 hit, and only lanes still
                    # searching read it
                    if FAM_W[f] <= UNROLL_WORDS:
                        # a constant range; tuple items are plain ints to Triton 3.6's
                        # static_range, so it counts to UNROLL_WORDS and drops the rest
                        for j in tl.static_range(UNROLL_WORDS):
                            if j < FAM_W[f]:
                                w = FAM_AT[f] + j
                                contained = _contains_word(contained, req_blooms, matcher, ls,
                                                           n, need, w, W_BL)  # fmt: skip
                    else:
                        for w in range(FAM_AT[f], FAM_AT[f] + FAM_W[f]):
                            contained = _contains_word(contained, req_blooms, matcher, ls, n,
                                                       need, w, W_BL)  # fmt: skip
                    got = tl.max(contained.to(tl.int32), axis=1) > 0
                    hit = hit | got
                    need = need & ~got
                    l0 += BLOCK_L
                ok = hit
        # read the logits of the allowed tokens only; write them and their child nodes
        tok = tl.load(tokens_ptr + entry, mask=ok, other=0)
        child = tl.load(child_nodes_ptr + entry, mask=ok, other=0)
        x = tl.load(logits_ptr + r * stride_logits + tok, mask=ok, other=0.0)
        tl.store(masked_ptr + out_row + tok, x.to(tl.float32), mask=ok)
        tl.store(child_out_ptr + out_row + tok, child, mask=ok)

    # score + log_softmax over the row, −inf where barred; a row with nothing allowed stays
    # all −inf. The barrier makes the scattered stores above visible to every thread of
    # the program (the row is in L1/L2: this re-read is cheap).
    tl.debug_barrier()
    x = tl.load(masked_ptr + out_row + v, mask=v < V, other=float("-inf"))
    allowed = x > float("-inf")
    if UNMASKED:
        # the model's log-softmax: max and sum over all V logits of the row (fp32),
        # whatever the mask let through (an allowed token's x is its logit, as fp32)
        row = logits_ptr + r * stride_logits
        full = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        m_full = tl.max(full, axis=0)
        total_full = tl.sum(tl.where(v < V, tl.exp(full - m_full), 0.0), axis=0)
        s = tl.load(score_ptr + r)
        cand = tl.where(allowed, s + ((full - m_full) - tl.log(total_full)), float("-inf"))
    else:
        m = tl.max(x, axis=0)
        shifted = x - tl.where(m > float("-inf"), m, 0.0)
        total = tl.sum(tl.where(allowed, tl.exp(shifted), 0.0), axis=0)
        s = tl.load(score_ptr + r)
        cand = tl.where(allowed, s + (shifted - tl.log(total)), float("-inf"))
    # Triton promises no lane-to-element map, so every read ends before any overwrite
    tl.debug_barrier()
    tl.store(masked_ptr + out_row + v, cand, mask=v < V)


def _configs() -> list[triton.Config]:
    # A Bloom tile (BLOCK_C children x BLOCK_L locations) of 8..16 elements per thread:
    # fewer wastes the lanes of deep nodes (1-2 children each), more costs registers
    # (and occupancy) for nothing — the first location chunk usually settles a child.
    def keep(c: int, lc: int, warps: int) -> bool:
        return 8 <= c * lc // (32 * warps) <= 16

    return [
        triton.Config({"BLOCK_C": c, "BLOCK_L": lc}, num_warps=w)
        for c in (16, 32, 64, 128)
        for lc in (8, 32)
        for w in (1, 2, 4)
        if keep(c, lc, w)
    ]


_gtm_mask_autotuned = triton.autotune(
    configs=_configs(), key=["R", "L", "FAM_W", "HAS_N", "GTM", "UNMASKED"]
)(_gtm_mask_kernel)

# used where nothing is autotuned (the interpreter, explicit `config=`)
DEFAULT_CONFIG = {"BLOCK_C": 32, "BLOCK_L": 16, "num_warps": 2}


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, ndim: int) -> None:
    assert t.dtype == dtype, f"{name}: expected {dtype}, got {t.dtype}"
    assert t.dim() == ndim, f"{name}: expected {ndim} dims, got {tuple(t.shape)}"
    assert t.is_contiguous(), f"{name} must be contiguous"


def gtm_mask_triton(
    logits: torch.Tensor,  # float32/bf16/fp16 [R, V]; rows may be strided, columns contiguous
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]: trie node of each beam row
    row_request: torch.Tensor,  # int64 [R]: batch index of each row's request
    # bitmask int64 [B, W_bm], blooms int64 [B, L, W_bl], n_blooms int32 [B, K] or None
    requests: RequestTensors | None,
    score: torch.Tensor,  # float32 [R]: each row's accumulated score
    *,
    gtm: bool,  # False: CD only
    scoring: Scoring = "masked",  # the log-softmax over the allowed tokens, or the row
    config: dict[str, int] | None = None,  # BLOCK_C, BLOCK_L, num_warps; None: autotune
) -> tuple[torch.Tensor, torch.Tensor]:  # (candidates float32 [R, V], child int32 [R, V])
    """`kernels.gtm_mask.masked_candidates` for CD_ONLY (`gtm=False`) and CD_GTM: one
    program per row, every output element written."""
    rows = node_ids.shape[0]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    assert logits.dtype in floats and logits.dim() == 2, (logits.dtype, logits.shape)
    assert logits.shape == (rows, VOCAB_SIZE) and logits.stride(1) == 1, logits.shape
    _check(node_ids, "node_ids", torch.int64, 1)
    _check(row_request, "row_request", torch.int64, 1)
    assert row_request.shape[0] == rows
    t = tables
    # 32-bit per-entry arrays (half the bytes of int64); offsets into them stay < 2^31
    for name in ("node_offsets", "child_nodes", "tokens", "bitmask_index", "bloom_index"):
        _check(getattr(t, name), name, torch.int32, 1)
    _check(t.bitmask_table, "bitmask_table", torch.int64, 2)
    _check(t.bloom_table, "bloom_table", torch.int64, 2)
    w_bm, w_bl = t.bitmask_table.shape[1], t.bloom_table.shape[1]
    families = t.families
    n_blooms = None
    if gtm:
        assert requests is not None, "GTM needs encoded requests"
        _check(requests.bitmask, "requests.bitmask", torch.int64, 2)
        _check(requests.blooms, "requests.blooms", torch.int64, 3)
        assert requests.bitmask.shape[1] == w_bm and requests.blooms.shape[2] == w_bl
        n_loc = requests.blooms.shape[1]
        assert n_loc >= 1, n_loc
        req_bitmask, req_blooms, n_blooms = requests.bitmask, requests.blooms, requests.n_blooms
        if n_blooms is not None:
            _check(n_blooms, "requests.n_blooms", torch.int32, 2)
            assert n_blooms.shape == (requests.bitmask.shape[0], len(families)), (
                f"n_blooms {tuple(n_blooms.shape)}: one count per request and family "
                f"({len(families)})"
            )
    else:
        n_loc, req_bitmask, req_blooms = 1, node_ids, node_ids  # never read
    assert scoring in SCORINGS, scoring
    _check(score, "score", torch.float32, 1)
    assert score.shape[0] == rows
    masked = torch.empty(rows, VOCAB_SIZE, dtype=torch.float32, device=logits.device)
    child = torch.empty(rows, VOCAB_SIZE, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return masked, child
    args = (
        logits, masked, child, node_ids, row_request,
        t.node_offsets, t.child_nodes, t.tokens, t.bitmask_index, t.bloom_index,
        t.bitmask_table, t.bloom_table, req_bitmask, req_blooms,
        node_ids if n_blooms is None else n_blooms,  # never read without HAS_N
        score,
        # the key R, rows rounded up to a power of two: part-sized row counts reuse the
        # next power's tuning instead of autotuning every bucket's shapes at start-up
        logits.stride(0), triton.next_power_of_2(rows), n_loc,
    )  # fmt: skip
    meta = {
        "V": VOCAB_SIZE,
        "W_BM": w_bm,
        "W_BL": w_bl,
        "K": len(families),
        "FAM_AT": tuple(at for at, _ in families),
        "FAM_W": tuple(w for _, w in families),
        "HAS_N": n_blooms is not None,
        "GTM": gtm,
        "UNMASKED": scoring == "unmasked",
        "BLOCK_V": triton.next_power_of_2(VOCAB_SIZE),
        "BLOCK_WBM": triton.next_power_of_2(w_bm),
    }
    if config is None and (not logits.is_cuda or not AUTOTUNE):
        config = DEFAULT_CONFIG  # the interpreter (nothing to tune) or GRACE_AUTOTUNE=0
    if config is None:
        _gtm_mask_autotuned[(rows,)](*args, **meta)
    else:
        _gtm_mask_kernel[(rows,)](*args, **meta, **config)
    return masked, child
