"""One decode step's bookkeeping after top-k (pipeline stage 3; docs/ARCHITECTURE.md §2): from each
request's kept candidates to the next step's rows — scores, parent rows, tokens,
liveness and trie nodes.

`parents_and_tokens` is the one home of how a kept candidate's position maps to its
parent row and token (the reference engine `service/decode/engine.py` uses it too).
Dispatcher: the Triton kernel (`_triton_beam_advance`, one launch instead of ~10) on CUDA
tensors, the torch reference elsewhere (the CPU path).
"""

from __future__ import annotations

import torch

from kernels.gtm_mask import NEG_INF

try:
    from kernels._triton_beam_advance import triton_beam_advance
except ImportError:  # no triton on this machine: the reference serves every call
    triton_beam_advance = None

Advanced = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def parents_and_tokens(
    flat: torch.Tensor,  # int64 [B, keep]: winners' positions in their request's M·V row
    rows_per_request: int,  # M (the static engine's W_t: rows per request at this step)
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent rows int64 [B·keep] (among the B·M rows) and tokens of top-k winners."""
    base = torch.arange(flat.shape[0], device=flat.device)[:, None] * rows_per_request
    return (flat // vocab + base).view(-1), (flat % vocab).view(-1)


def beam_advance(
    top: torch.Tensor,  # float32 [B, keep]: each request's top-k scores
    flat: torch.Tensor,  # int64 [B, keep]: their positions in the request's W·V candidates
    child: torch.Tensor | None,  # int32 [B·W, V]: child node per (row, token); None: no mask
    dead_slots: torch.Tensor | None,  # bool [B·keep]: slots past M_{t+1} (fixed_beams)
    rows_per_request: int,  # W_t
    vocab: int,
    dead_node: int,  # a leaf: where dead rows park (nothing is allowed below it)
) -> Advanced:
    """The kept rows' scores float32 [B·keep] (−inf: dead), parent rows int64, tokens
    int64, liveness bool and trie nodes int64 (None without `child`)."""
    fast = triton_beam_advance is not None and top.is_cuda
    if fast and (child is None or child.stride(-1) == 1):
        return triton_beam_advance(top, flat, child, dead_slots, rows_per_request, vocab, dead_node)
    return beam_advance_reference(top, flat, child, dead_slots, rows_per_request, vocab, dead_node)


def beam_advance_reference(
    top: torch.Tensor,
    flat: torch.Tensor,
    child: torch.Tensor | None,
    dead_slots: torch.Tensor | None,
    rows_per_request: int,
    vocab: int,
    dead_node: int,
) -> Advanced:
    """Elementwise work and gathers only, so torch.compile can fuse it too (the decode
    bench's "compiled" comparison)."""
    parent, token = parents_and_tokens(flat, rows_per_request, vocab)
    score = top.reshape(-1)
    if dead_slots is not None:
        score = score.masked_fill(dead_slots, NEG_INF)
    live = torch.isfinite(score)
    node = None
    if child is not None:
        node = child[parent, token].long().masked_fill(~live, dead_node)
    return score, parent, token, live, node
