"""One decode step's bookkeeping after top-k (pipeline stage 3): from each request's kept
candidates to the next step's rows — scores, parent rows, tokens, liveness and trie nodes.
`parents_and_tokens` is the one home of how a kept candidate's position maps to its
parent row and token. The Triton kernel (`_triton_beam_advance`, one launch instead of
~10) on CUDA tensors, the torch reference elsewhere.
"""

from __future__ import annotations

import torch

try:
    from kernels._triton_beam_advance import triton_beam_advance
except ImportError:  # no triton on this machine: the reference serves every call
    triton_beam_advance = None

Advanced = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def parents_and_tokens(
    flat: torch.Tensor,  # int64 [B, keep]: winners' positions in their request's M·V row
    rows_per_request: int,  # M_t: rows per request at this step
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent rows int64 [B·keep] (among the B·M rows) and tokens of top-k winners."""
    base = torch.arange(flat.shape[0], device=flat.device)[:, None] * rows_per_request
    return (flat // vocab + base).view(-1), (flat % vocab).view(-1)


def beam_advance(
    top: torch.Tensor,  # float32 [B, keep]: each request's top-k scores
    flat: torch.Tensor,  # int64 [B, keep]: their positions in the request's M·V candidates
    child: torch.Tensor,  # int32 [B·M, V]: child node per (row, token)
    rows_per_request: int,  # M_t
    vocab: int,
    dead_node: int,  # a leaf: where dead rows park (nothing is allowed below it)
) -> Advanced:
    """The kept rows' scores float32 [B·keep] (−inf: dead), parent rows int64, tokens
    int64, liveness bool and trie nodes int64."""
    if triton_beam_advance is not None and top.is_cuda and child.stride(-1) == 1:
        return triton_beam_advance(top, flat, child, rows_per_request, vocab, dead_node)
    return beam_advance_reference(top, flat, child, rows_per_request, vocab, dead_node)


def beam_advance_reference(
    top: torch.Tensor,
    flat: torch.Tensor,
    child: torch.Tensor,
    rows_per_request: int,
    vocab: int,
    dead_node: int,
) -> Advanced:
    """The same in torch: about ten small launches."""
    parent, token = parents_and_tokens(flat, rows_per_request, vocab)
    score = top.reshape(-1)
    live = torch.isfinite(score)
    node = child[parent, token].long().masked_fill(~live, dead_node)
    return score, parent, token, live, node
