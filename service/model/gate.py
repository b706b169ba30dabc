"""The model gate: finite weights and answers on its index, what a model version must show
before it may serve (docs/MODEL.md "The model gate"). Called by `grace publish-model`
(`repository.publish_model`; with --index, `canary` requests must bring ads) and by each
model's warm-up (`ModelRuntime.prepare`: `check_finite`, then `check_answers`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import codec
from contracts.tensors import RequestTensors
from service.index.loaded import LoadedIndex
from service.model.checkpoint import CheckpointError
from service.model.features import VIEW, UserFeatures, prepare_features

CHUNK = 1 << 24  # elements checked at a time: the scratch stays small, on a GPU too
HISTORY = 8  # events per canary request made of an index's ads


class ModelRefused(CheckpointError):
    """A model that loads and verifies but must not serve: it would answer nothing."""


@dataclass(frozen=True)
class Canary:
    """What one canary measured (a published version keeps it in `gate.json`)."""

    index_version: str
    requests: int
    sids_per_request: float  # complete SIDs the beam search kept
    ads_per_request: float  # after the exact filter, at most max_ads each
    empty_share: float  # of the requests, those answered with no ads


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ModelRefused naming the tensors that hold NaN or inf (what a diverged run saves)."""

    def finite(t: torch.Tensor) -> bool:
        return all(torch.isfinite(c.float()).all() for c in t.detach().flatten().split(CHUNK))

    bad = [name for name, t in tensors.items() if t.is_floating_point() and not finite(t)]
    if bad:
        raise ModelRefused(
            f"{what}: weights not finite: {len(bad)} of {len(tensors)} tensors hold NaN or inf "
            f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): a diverged training run"
        )


@torch.no_grad()
def canary(runtime: Any, index: LoadedIndex, users: Sequence[UserFeatures], beams: tuple[int, ...],
           mode: FilterMode = FilterMode.CD_GTM, max_ads: int = 100) -> Canary:  # fmt: skip
    """Retrieve for `users` through `runtime`, a ModelRuntime (`Any`: its module imports
    this one), in this thread, in batches of its largest bucket; what they got."""
    size, device = runtime.engine.batch_buckets[-1], runtime.engine.device
    sids = ads = empty = 0
    for i in range(0, len(users), size):
        chunk = users[i : i + size]
        features = prepare_features(chunk, index.lookup, runtime.config).to(device)
        targeting = [u.targeting for u in chunk]
        requests = None
        if mode != FilterMode.CD_ONLY:
            enc = codec(index.schema).encode_requests([t.values() for t in targeting])
            requests = RequestTensors.from_encoded(enc, str(device))
        ctx = runtime.encoder(runtime.embedder(features))
        result = runtime.engine.run(runtime.plans(index), ctx, requests, beams, mode)
        leaves, scores = result.leaves.cpu().numpy(), result.scores.cpu().numpy()
        posts = index.post.run([
            index.post_request(lv[lv >= 0], sc[lv >= 0], t, max_ads)
            for lv, sc, t in zip(leaves, scores, targeting, strict=True)
        ])  # fmt: skip
        sids += int((leaves >= 0).sum())
        ads += sum(len(p.ad_ids) for p in posts)
        empty += sum(len(p.ad_ids) == 0 for p in posts)
    n = max(len(users), 1)
    return Canary(index.version, len(users), *(round(x / n, 4) for x in (sids, ads, empty)))


def check_answers(runtime: Any, index: LoadedIndex, beams: tuple[int, ...]) -> Canary:
    """The warm-up's canary: a batch of requests made of the index itself (histories of its
    ads spread over the catalog, no targeting: CD_ONLY) must yield SIDs."""
    n, ads = runtime.engine.batch_buckets[-1], index.lookup.ad_ids
    picks = np.linspace(0, max(len(ads) - 1, 0), n * HISTORY).astype(np.int64)
    history = (ads[picks] if len(ads) else picks).reshape(n, HISTORY)  # no ads: no history
    ts, types = np.arange(HISTORY, dtype=np.int64) * 60_000, np.full(HISTORY, VIEW)
    users = [UserFeatures(i, Targeting(), h, types, ts) for i, h in enumerate(history)]
    figures = canary(runtime, index, users, beams, FilterMode.CD_ONLY)
    if figures.sids_per_request == 0:
        raise ModelRefused(
            f"model {runtime.model_version}: a canary of {n} requests on index "
            f"{index.version} yielded no SIDs: every beam scored NaN or -inf"
        )
    return figures
