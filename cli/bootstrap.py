"""The embedded default for `grace serve` with no arguments: make whatever the data
directory lacks — a tiny synthetic world, a trained tiny model (unless `model_dir` holds a
checkpoint or a model repository), a published index — logging each step, then serve it.
Each step is skipped when its output already exists, so the second start is immediate;
the world is seeded and the training deterministic, so two bootstraps on one machine
train the same weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from index_builder.build import build_index
from index_builder.publish import current_version
from index_builder.synth import generate_world, load_world_schema
from service.model.checkpoint import CONFIG_FILE, TOKENIZER_DIR, sid_space_of
from service.model.repository import is_checkpoint, resolve_checkpoint
from service.settings import ServerSettings

if TYPE_CHECKING:
    from training.train import TrainSettings

log = logging.getLogger("grace.bootstrap")


def ensure_default(
    settings: ServerSettings,
    *,
    progress: bool = True,
    train_settings: TrainSettings | None = None,  # default: the profile's full training
) -> None:
    world = Path(settings.data_dir) / "world"
    model = Path(settings.model_dir)
    index = Path(settings.index_root)
    if has_model(model) and current_version(index) is not None:
        return  # a model and an index are given (or made earlier): nothing to make
    if not (world / "world.json").is_file():
        log.info("generating the tiny demo world in %s", world)
        generate_world("tiny", 0, world, progress=progress)
    if not has_model(model):
        import torch

        from training.train import TrainSettings, train

        log.info("training the %s model on it, once: the longest step; its progress and "
                 "the time left on this machine follow", settings.profile)  # fmt: skip
        ts = train_settings or TrainSettings(profile=settings.profile)
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)  # the same weights at every bootstrap
        try:
            train(world, model, ts, progress=progress)
        finally:  # the server after it keeps torch's usual (faster) algorithms
            torch.use_deterministic_algorithms(deterministic)
    if current_version(index) is None:
        log.info("building and publishing the index in %s", index)
        build_index(world / "catalog.parquet", index, progress=progress,
                    schema=load_world_schema(world), **sid_source(model))  # fmt: skip


def has_model(model_dir: Path) -> bool:
    """Whether `model_dir` holds a checkpoint or a model repository with a CURRENT."""
    return is_checkpoint(model_dir) or current_version(model_dir) is not None


def sid_source(model_dir: Path) -> dict[str, Any]:
    """How to assign an index's SIDs for the model at `model_dir` (a checkpoint, or a model
    repository's CURRENT version): its SID tokenizer, or the name of its SID space
    (contracts/sid_space.py) — `build_index` keyword arguments."""
    from contracts import sid_space

    checkpoint = resolve_checkpoint(model_dir)
    key = sid_space_of(checkpoint)
    if key is None:
        raise ValueError(f"{checkpoint / CONFIG_FILE} is unreadable: not a model checkpoint")
    if sid_space.is_named(key):
        return {"sid_space": key.removeprefix(sid_space.PREFIX)}
    return {"tokenizer_path": checkpoint / TOKENIZER_DIR}
