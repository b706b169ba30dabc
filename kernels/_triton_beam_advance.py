"""Triton beam advance: one step's bookkeeping after top-k in one launch, the GPU path
behind `kernels.beam_advance.beam_advance`. One program handles BLOCK of the B·keep kept
slots: parent row and token from the slot's position, liveness (a finite score), the
trie's child node of (parent, token), dead slots parked on `dead_node`. Eager torch
spends about ten small launches on this; their gaps, not their bytes, are the cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # kept slots per program: 16 programs for the paper's 16 × 1024


@triton.jit
def _beam_advance_kernel(
    top_ptr,  # float32 [n]: kept slots' scores, request-major (n = B · keep)
    flat_ptr,  # int64 [n]: position in the request's M·V candidates
    child_ptr,  # int32 [B·M, V] child node per (row, token)
    score_ptr,  # float32 [n] out
    parent_ptr,  # int64 [n] out: row among the B·M rows
    token_ptr,  # int64 [n] out
    live_ptr,  # bool [n] out
    node_ptr,  # int64 [n] out
    n,
    keep,
    rows_per_request,  # M
    vocab,  # V
    stride_child,
    dead_node,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    flat = tl.load(flat_ptr + i, mask=ok, other=0)
    score = tl.load(top_ptr + i, mask=ok, other=float("-inf"))
    token = flat % vocab
    parent = flat // vocab + (i // keep).to(tl.int64) * rows_per_request
    live = (score == score) & (score != float("inf")) & (score != float("-inf"))
    tl.store(score_ptr + i, score, mask=ok)
    tl.store(parent_ptr + i, parent, mask=ok)
    tl.store(token_ptr + i, token, mask=ok)
    tl.store(live_ptr + i, live, mask=ok)
    node = tl.load(child_ptr + parent * stride_child + token, mask=ok & live, other=0)
    tl.store(node_ptr + i, tl.where(live, node.to(tl.int64), dead_node), mask=ok)


def triton_beam_advance(
    top: torch.Tensor,  # float32 [B, keep]
    flat: torch.Tensor,  # int64 [B, keep]
    child: torch.Tensor,  # int32 [B·M, V], last dim contiguous
    rows_per_request: int,
    vocab: int,
    dead_node: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.beam_advance.beam_advance_reference` in one launch."""
    bsz, keep = top.shape
    n = bsz * keep
    assert flat.shape == top.shape and top.dtype == torch.float32 and flat.dtype == torch.int64
    assert child.dtype == torch.int32 and child.stride(1) == 1, child
    top, flat = top.contiguous(), flat.contiguous()
    score = torch.empty(n, dtype=torch.float32, device=top.device)
    parent = torch.empty(n, dtype=torch.int64, device=top.device)
    token = torch.empty_like(parent)
    live = torch.empty(n, dtype=torch.bool, device=top.device)
    node = torch.empty_like(parent)
    if n == 0:
        return score, parent, token, live, node
    _beam_advance_kernel[(triton.cdiv(n, BLOCK),)](
        top, flat, child, score, parent, token, live, node,
        n, keep, rows_per_request, vocab, child.stride(0), dead_node, BLOCK=BLOCK,
    )  # fmt: skip
    return score, parent, token, live, node
