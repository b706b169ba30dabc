"""How a version of each root the server follows (`follower.py`) loads for this process's
device: a model with every checksum verified, in the precision it serves in (`dtype`; for
"auto", per version, by its FP8 quality record: `precision.choose`, logged once), as a
`ModelRuntime` of the pipeline's stages; an index with every array validated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from contracts.index_manifest import MANIFEST, manifest_sid_space
from service.index.loaded import LoadedIndex, load_index
from service.model.checkpoint import load_checkpoint, sid_space_of
from service.model.precision import Precision, choose, for_serving, serves_in
from service.model.repository import COMPLETE, fp8_record, is_checkpoint
from service.pace import Pace
from service.pipeline.runtime import ModelRuntime
from service.pipeline.stages import Stages
from service.rollout.follower import Follower

log = logging.getLogger("grace.rollout")


def model_follower(
    model_dir: Path,
    stages: Stages,
    precision: Precision,  # the setting `dtype`
    *,
    served: Callable[[], str | None],
    on_failure: Callable[[str, Exception], None],
    backoff_seconds: float,
    pace: Pace | None = None,
) -> Follower[ModelRuntime]:
    """`pace` (`service/pace.py`) is called between the load's steps."""

    def load(path: Path, version: str) -> ModelRuntime:
        t0 = time.perf_counter()
        if pace is not None:
            pace.begin()
        slept = pace.slept if pace is not None else 0.0
        loaded = load_checkpoint(path, stages.device, pace=pace)
        t1 = time.perf_counter()
        chosen, why = choose(precision, stages.device, fp8_record(path))
        for_serving(loaded.model, chosen, stages.device)
        log.info("model %s serves in %s: %s", loaded.model_version, serves_in(loaded.model), why)
        runtime = stages.runtime(loaded.model, version=version, model_version=loaded.model_version,
                                 sid_space=loaded.sid_space, meta=loaded.meta)  # fmt: skip
        phases = {**loaded.seconds, "precision": time.perf_counter() - t1}
        if pace is not None and pace.slept > slept:  # the rests, inside the phases above
            phases["paced"] = pace.slept - slept
        log.info("model %s (%s) loaded and verified on %s in %.1f s (%s)", loaded.model_version,
                 path, stages.device, time.perf_counter() - t0,
                 ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))  # fmt: skip
        return runtime

    model_dir = Path(model_dir)
    return Follower(
        model_dir, "model", complete=COMPLETE, load=load, space=sid_space_of, served=served,
        on_failure=on_failure, single=is_checkpoint(model_dir), backoff_seconds=backoff_seconds,
    )  # fmt: skip


def index_follower(
    index_root: Path,
    device: str,
    *,
    served: Callable[[], str | None],
    on_failure: Callable[[str, Exception], None],
    backoff_seconds: float,
) -> Follower[LoadedIndex]:
    def load(path: Path, version: str) -> LoadedIndex:
        t0 = time.perf_counter()
        index = load_index(path, device=device, expect_version=version)
        log.info("index %s loaded and validated in %.1f s", version, time.perf_counter() - t0)
        return index

    return Follower(
        Path(index_root), "index", complete=MANIFEST, load=load, space=manifest_sid_space,
        served=served, on_failure=on_failure, backoff_seconds=backoff_seconds,
    )  # fmt: skip
