"""The FP8 quality record of a model version (docs/FP8.md, "FP8 by default"), made by
`grace publish-model` with --index and --world and kept in the version's gate.json: the
model's decode step made FP8 as the server makes it (`service/model/precision.py`) against
the model in bfloat16, CD + GTM on held-out users of the world, through the effectiveness
study (`training/study.py`: recall@K paired differences and top-K SIDs kept, with
bootstrap intervals), judged by `precision.fp8_verdict`. With `dtype = auto` a server on a
GPU with FP8 serves the version in FP8 when the record passes (`service/rollout/sources.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from contracts.index_arrays import IndexArrays
from contracts.request import FilterMode
from contracts.targeting_schema import TargetingSchema
from index_builder.synth import World
from service.model.features import SidLookup
from service.model.precision import FP8_MIN_SIDS_KEPT, FP8_TOLERANCE, fp8_verdict
from service.model.retriever import GenerativeRetriever
from training.data import Examples
from training.study import Variant, run_study, sample_users

RECORD_KS = (100, 1000)  # the recall@K the rule judges (docs/EVALUATION.md's Ks)


def fp8_record(
    model: GenerativeRetriever,
    world: World,
    arrays: IndexArrays,
    schema: TargetingSchema,
    *,
    users: int = 1000,
    beams: tuple[int, ...] | None = None,
    device: str = "cpu",
    seed: int = 0,
    resamples: int = 1000,
    tolerance: float = FP8_TOLERANCE,
    min_sids_kept: float = FP8_MIN_SIDS_KEPT,
    progress: bool = False,
) -> dict[str, Any]:
    """The record of `model` (cast to bfloat16 here, in place) on `users` held-out users of
    `world` (at most all of them), decoded against the index `arrays` with `beams` (the
    model's own by default)."""
    model.to(device=device, dtype=torch.bfloat16)
    beams = tuple(beams or model.config.beams)
    picked = sample_users(world.n_users, min(users, world.n_users), seed)
    examples = Examples(world, SidLookup.from_ads(arrays.ads), model.config)
    variants = [Variant("cd_gtm", arrays, FilterMode.CD_GTM),
                Variant("cd_gtm_fp8", arrays, FilterMode.CD_GTM, fp8=True)]  # fmt: skip
    rows = run_study(model, examples, variants, picked, beams, RECORD_KS, device=device,
                     resamples=resamples, seed=seed, progress=progress, schema=schema)  # fmt: skip
    verdict = fp8_verdict(rows[1]["vs_full_precision"], len(picked), tolerance=tolerance,
                          min_sids_kept=min_sids_kept)  # fmt: skip
    return {
        **verdict,
        "against": "bfloat16",
        "filter": "cd_gtm",
        "beams": list(beams),
        "seed": seed,
        **{
            f"recall@{k}": {"bf16": rows[0][f"recall@{k}"], "fp8": rows[1][f"recall@{k}"]}
            for k in RECORD_KS
        },
        "final_pass": {"bf16": rows[0]["final_pass"], "fp8": rows[1]["final_pass"]},
    }
