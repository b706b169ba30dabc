"""The CD+GTM mask of one decode step (paper §3.5, docs/ARCHITECTURE.md §7).

For every beam row: which next tokens keep the prefix in the catalog (CD) and may still
hold an ad eligible for the row's request (GTM: bitmask, then Bloom, ANY-of-many over the
request's locations). Output is the step's logits with every disallowed token set to −inf,
and the child trie node of every allowed token (−1 elsewhere) — fixed shapes `[R, V]`, so
the decode loop around it can be captured in a CUDA graph.

`masked_logits` dispatches: the Triton kernel (`kernels._triton_gtm_mask`) on CUDA
tensors for CD_ONLY and CD_GTM, the reference (`index_builder.lookup`) otherwise; k-way
always takes the reference. `bloom=False` drops the Bloom test (CD + bitmask only), the
decode-loop ablation. `masked_candidates` goes one step further, as the fixed-shape
decode loop needs it: each allowed token's candidate score — the row's accumulated score
plus the token's log-softmax over the allowed tokens (`candidates`) — in the same kernel.
"""

from __future__ import annotations

import torch

from index_builder.lookup import FilterMode, GtmTables, RequestTensors, lookup

try:  # the GPU path; CPU-only installs may lack triton
    from kernels._triton_gtm_mask import gtm_mask_triton
except ImportError:  # pragma: no cover - depends on the install
    gtm_mask_triton = None

NEG_INF = float("-inf")


def bitmask_only(requests: RequestTensors) -> RequestTensors:
    """The same requests with one all-zero Bloom row each: an all-zero query is contained
    in every matcher, so `lookup`'s Bloom step passes everywhere and only the bitmask
    decides."""
    b, _, w = requests.blooms.shape
    return RequestTensors(requests.bitmask, requests.blooms.new_zeros(b, 1, w))


def masked_logits_reference(
    logits: torch.Tensor,  # float32 [R, V]
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]: trie node of each beam row
    row_request: torch.Tensor,  # int64 [R]: batch index of each row's request
    requests: RequestTensors | None,  # None only for CD_ONLY
    mode: FilterMode = FilterMode.CD_GTM,
    *,
    bloom: bool = True,  # False: CD + bitmask only
) -> tuple[torch.Tensor, torch.Tensor]:  # (float32 [R, V] with −inf, int32 [R, V] with −1)
    if not bloom and mode != FilterMode.CD_ONLY and requests is not None:
        requests = bitmask_only(requests)
    allowed, child = lookup(tables, node_ids, row_request, requests, mode)
    return logits.masked_fill(~allowed, NEG_INF), child


def candidates(
    score: torch.Tensor,  # float32 [R]: accumulated log-probability of each row
    masked: torch.Tensor,  # float32 [R, V]: the step's logits, −inf where not allowed
    allowed: torch.Tensor,  # bool [R, V]
) -> torch.Tensor:  # float32 [R, V]: score of every (row, token) extension, −inf if barred
    """A row with nothing allowed (dead, or no eligible child) has a NaN log-softmax: the
    fill turns it into −inf like every other barred token."""
    logp = torch.log_softmax(masked, dim=-1)
    return (score[:, None] + logp).masked_fill(~allowed, NEG_INF)


def masked_logits(
    logits: torch.Tensor,  # float32 [R, V]
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]
    row_request: torch.Tensor,  # int64 [R]
    requests: RequestTensors | None,  # None only for CD_ONLY
    mode: FilterMode = FilterMode.CD_GTM,
    *,
    bloom: bool = True,  # False: CD + bitmask only (ablation)
) -> tuple[torch.Tensor, torch.Tensor]:  # (float32 [R, V] with −inf, int32 [R, V] with −1)
    """Dispatcher: the Triton kernel on CUDA, the reference elsewhere."""
    fast = mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM)
    if fast and logits.is_cuda and gtm_mask_triton is not None:
        if mode == FilterMode.CD_GTM and requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        gtm = mode == FilterMode.CD_GTM
        return gtm_mask_triton(
            logits, tables, node_ids, row_request, requests, gtm=gtm, bloom=bloom
        )
    return masked_logits_reference(
        logits, tables, node_ids, row_request, requests, mode, bloom=bloom
    )


def masked_candidates(
    logits: torch.Tensor,  # [R, V], float32 or (CUDA) bf16/fp16
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]
    row_request: torch.Tensor,  # int64 [R]
    requests: RequestTensors | None,  # None only for CD_ONLY
    score: torch.Tensor,  # float32 [R]: each row's accumulated log-probability
    mode: FilterMode = FilterMode.CD_GTM,
    *,
    bloom: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (candidates float32 [R, V], child int32 [R, V])
    """`candidates(score, *masked_logits(...))` in one kernel on CUDA (mask, log-softmax
    and the score added per row: no cast or elementwise passes over `[R, V]` between);
    the two references one after the other elsewhere."""
    fast = mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM)
    if fast and logits.is_cuda and gtm_mask_triton is not None:
        if mode == FilterMode.CD_GTM and requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        return gtm_mask_triton(
            logits, tables, node_ids, row_request, requests,
            gtm=mode == FilterMode.CD_GTM, bloom=bloom, score=score,
        )  # fmt: skip
    masked, child = masked_logits_reference(
        logits.float(), tables, node_ids, row_request, requests, mode, bloom=bloom
    )
    return candidates(score, masked, child >= 0), child
