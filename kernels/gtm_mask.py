"""The CD+GTM mask of one decode step (paper §3.5, docs/ARCHITECTURE.md §2).

For every beam row: which next tokens keep the prefix in the catalog (CD) and may still
hold an ad eligible for the row's request (GTM: the bitmask, then the K >= 0 Bloom
families of the targeting schema's `set` attributes one after the other — ANY of the
request's rows of a family, ALL families — the first test that fails settling the entry;
`GtmTables.bloom_families` lays them out). `masked_candidates`, what the decode loop calls,
returns each allowed token's candidate score — the row's accumulated score plus the
token's log-softmax, −inf where barred — and its child trie node (−1 elsewhere), fixed
shapes `[R, V]` so the loop can be captured in a CUDA graph: one Triton kernel
(`kernels._triton_gtm_mask`) on CUDA tensors for CD_ONLY and CD_GTM; elsewhere, and for
k-way, the references (`lookup`, paper §3.5 `Lookup` in torch; `masked_logits_reference`;
`candidates`). `scoring` (`contracts.request.Scoring`) picks the log-softmax: over the
allowed tokens ("masked", the default) or the model's own over the whole row ("unmasked").
"""

from __future__ import annotations

import torch

from contracts.index_format import VOCAB_SIZE
from contracts.request import SCORINGS, FilterMode, Scoring
from contracts.tensors import GtmTables, RequestTensors

try:  # the GPU path; CPU-only installs may lack triton
    from kernels._triton_gtm_mask import gtm_mask_triton
except ImportError:  # pragma: no cover - depends on the install
    gtm_mask_triton = None

NEG_INF = float("-inf")


def masked_logits_reference(
    logits: torch.Tensor,  # float32 [R, V]
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]: trie node of each beam row
    row_request: torch.Tensor,  # int64 [R]: batch index of each row's request
    requests: RequestTensors | None,  # None only for CD_ONLY
    mode: FilterMode = FilterMode.CD_GTM,
) -> tuple[torch.Tensor, torch.Tensor]:  # (float32 [R, V] with −inf, int32 [R, V] with −1)
    """The step's logits with every barred token −inf, and the allowed tokens' child nodes."""
    allowed, child = lookup(tables, node_ids, row_request, requests, mode)
    return logits.masked_fill(~allowed, NEG_INF), child


def candidates(
    score: torch.Tensor,  # float32 [R]: accumulated log-probability of each row
    masked: torch.Tensor,  # float32 [R, V]: the step's logits, −inf where not allowed
    allowed: torch.Tensor,  # bool [R, V]
    *,
    scoring: Scoring = "masked",
    logits: torch.Tensor | None = None,  # [R, V] before the mask: needed for "unmasked"
) -> torch.Tensor:  # float32 [R, V]: score of every (row, token) extension, −inf if barred
    """The row's score plus each allowed token's log-probability: the log-softmax of
    `masked` ("masked") or of the whole `logits` row, read as float32 ("unmasked"). A row
    with nothing allowed (dead, or no eligible child) has a NaN masked log-softmax: the
    fill turns it into −inf like every other barred token."""
    if scoring == "masked":
        logp = torch.log_softmax(masked, dim=-1)
    elif scoring == "unmasked":
        if logits is None:
            raise ValueError("unmasked scoring needs the step's logits before the mask")
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    return (score[:, None] + logp).masked_fill(~allowed, NEG_INF)


def masked_candidates(
    logits: torch.Tensor,  # [R, V], float32 or (CUDA) bf16/fp16
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]
    row_request: torch.Tensor,  # int64 [R]
    requests: RequestTensors | None,  # None only for CD_ONLY
    score: torch.Tensor,  # float32 [R]: each row's accumulated log-probability
    mode: FilterMode = FilterMode.CD_GTM,
    *,
    scoring: Scoring = "masked",  # the log-softmax: over the allowed tokens, or the row
) -> tuple[torch.Tensor, torch.Tensor]:  # (candidates float32 [R, V], child int32 [R, V])
    """(`candidates(score, masked, child >= 0, scoring=scoring, logits=logits)`, child)
    for `masked, child = masked_logits_reference(...)`: one kernel on CUDA (mask,
    log-softmax and the score added per row: no cast or elementwise passes over `[R, V]`
    between), the references one after the other elsewhere."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    fast = mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM)
    if fast and logits.is_cuda and gtm_mask_triton is not None:
        if mode == FilterMode.CD_GTM and requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        return gtm_mask_triton(logits, tables, node_ids, row_request, requests, score,
                               gtm=mode == FilterMode.CD_GTM, scoring=scoring)  # fmt: skip
    full = logits.float()
    masked, child = masked_logits_reference(full, tables, node_ids, row_request, requests, mode)
    return candidates(score, masked, child >= 0, scoring=scoring, logits=full), child


def _contains(matchers: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(matcher & query) == query over the last dim."""
    return ((matchers & query) == query).all(dim=-1)


def _passes(
    bm: torch.Tensor,  # int64 [T, W_bm]: bitmask matchers of T candidates
    bl: torch.Tensor,  # int64 [T, W_bl]: their Bloom matchers, every family
    req: torch.Tensor,  # int64 [T]: the request of each candidate
    r: RequestTensors,
    families: tuple[tuple[int, int], ...],  # (first word, words) of each family
) -> torch.Tensor:  # bool [T]
    """The bitmask contains the request's; then per family, where all before passed, ANY
    of the request's rows (l < n_blooms, or all L) is contained in the family's words."""
    ok = _contains(bm, r.bitmask[req])
    rows = torch.arange(r.blooms.shape[1], device=bm.device)
    for f, (at, w) in enumerate(families):
        idx = ok.nonzero().squeeze(1)  # only where everything before passed
        if not len(idx):
            break
        hit = _contains(bl[idx, None, at : at + w], r.blooms[req[idx], :, at : at + w])  # [t, L]
        if r.n_blooms is not None:
            hit &= rows[None, :] < r.n_blooms[req[idx], f, None]
        ok[idx] = hit.any(dim=1)
    return ok


def lookup(
    tables: GtmTables,
    node_ids: torch.Tensor,  # int64 [R]: the trie node of each beam row
    row_request: torch.Tensor,  # int64 [R]: the request (batch index) of each beam row
    requests: RequestTensors | None,
    mode: FilterMode = FilterMode.CD_GTM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed next tokens and their child nodes for every beam row, on any device:
    (allowed bool [R, VOCAB_SIZE], child int32 [R, VOCAB_SIZE], -1 where not allowed)."""
    dev = node_ids.device
    rows = node_ids.shape[0]
    start = tables.node_offsets[node_ids].long()
    count = tables.node_offsets[node_ids + 1].long() - start
    row_of = torch.repeat_interleave(torch.arange(rows, device=dev), count)
    first = torch.cumsum(count, 0) - count
    entry = start[row_of] + torch.arange(row_of.shape[0], device=dev) - first[row_of]
    ok = torch.ones(entry.shape[0], dtype=torch.bool, device=dev)
    if mode != FilterMode.CD_ONLY:
        if requests is None:
            raise ValueError(f"{mode.name} needs encoded requests")
        req = row_request[row_of]
        if mode == FilterMode.CD_GTM:
            ok = _passes(
                tables.bitmask_table[tables.bitmask_index[entry]],
                tables.bloom_table[tables.bloom_index[entry]],
                req,
                requests,
                tables.families,
            )
        else:
            ok = _any_partition(tables, entry, req, requests)
    allowed = torch.zeros(rows, VOCAB_SIZE, dtype=torch.bool, device=dev)
    child = torch.full((rows, VOCAB_SIZE), -1, dtype=torch.int32, device=dev)
    keep_row, keep_tok = row_of[ok], tables.tokens[entry[ok]].long()
    allowed[keep_row, keep_tok] = True
    child[keep_row, keep_tok] = tables.child_nodes[entry[ok]]
    return allowed, child


def _any_partition(
    tables: GtmTables, entry: torch.Tensor, req: torch.Tensor, r: RequestTensors
) -> torch.Tensor:
    if tables.kway_offsets is None or tables.kway_bitmask is None or tables.kway_bloom is None:
        raise ValueError("this index has no k-way partitions (build it with --kway)")
    start = tables.kway_offsets[entry]
    count = tables.kway_offsets[entry + 1] - start
    owner = torch.repeat_interleave(torch.arange(entry.shape[0], device=entry.device), count)
    first = torch.cumsum(count, 0) - count
    part = start[owner] + torch.arange(owner.shape[0], device=entry.device) - first[owner]
    passed = _passes(
        tables.kway_bitmask[part], tables.kway_bloom[part], req[owner], r, tables.families
    )
    ok = torch.zeros(entry.shape[0], dtype=torch.bool, device=entry.device)
    ok[owner[passed]] = True
    return ok
