"""`grace train`: teacher-forced next-SID training of the generative retriever on a
synthetic world or on a team's own catalog, interactions and users (docs/DATA.md),
resumable, with a validation loss after every epoch where the data has a validation split
(the checkpoint keeps the best epoch), ending with a held-out evaluation against popularity.

    data ─► SID tokenizer (trained here, or given) ─► SIDs for the catalog ─► in-memory
    index ─► (user history, next event's SID) pairs ─► AdamW on cross-entropy over the 4
    SID positions ─► checkpoint (weights + config + tokenizer + metrics)

Work in progress lives in `<out>.partial/` (tokenizer, `state.pt` every `checkpoint_every`
steps); a rerun with the same arguments resumes from it and sees the same batches (the
data order is a function of (seed, epoch)).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from contracts import sid_space as sid_spaces
from contracts.data_format import DEFAULT_EVENT_MAP, EventMap
from contracts.index_arrays import IndexArrays
from contracts.sid_space import LAST_TOKENS, LastToken
from contracts.targeting_schema import DEFAULT, TargetingSchema
from index_builder.build import assign_sids, build_arrays
from index_builder.catalog import read_catalog
from index_builder.synth import load_world
from index_builder.synth.reader import UserHistories, World
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from service.index.loaded import LoadedIndex
from service.model.checkpoint import save_checkpoint
from service.model.config import ModelConfig, profile
from service.model.retriever import GenerativeRetriever
from training.data import Batch, Examples
from training.evaluate import recall_at_k
from training.steps import (
    Diverged,
    Precision,
    ProgressLog,
    autocast,
    check_precision,
    cosine_lr,
    prefetch,
    validation_loss,
)
from training.user_data import read_user_data

log = logging.getLogger("grace.train")


@dataclass(frozen=True)
class TrainSettings:
    profile: str = "tiny"
    epochs: float = 4.0
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    seed: int = 0
    eval_users: int = 400
    eval_ks: tuple[int, ...] = (10, 50, 100)
    checkpoint_every: int = 200
    device: str = "cpu"
    # of the tokenizer trained here (None: "rank"); a given or kept tokenizer of another
    # mode is an error (docs/TOKENIZER.md)
    last_token: LastToken | None = None
    precision: Precision = "fp32"  # or "bf16" autocast (training/steps.py)

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("epochs, batch_size and lr must be positive")
        if self.last_token is not None and self.last_token not in LAST_TOKENS:
            raise ValueError(f"last_token must be one of {LAST_TOKENS}, got {self.last_token!r}")
        check_precision(self.precision)


@dataclass(frozen=True)
class TrainingData:
    """Where the examples come from: a world directory (`grace synth`), or the three
    files of docs/DATA.md."""

    world: Path | None = None
    catalog: Path | None = None
    interactions: Path | None = None
    users: Path | None = None
    events: EventMap = DEFAULT_EVENT_MAP  # how the interactions' event types are read
    # the targeting schema the catalog is read by (a world's: its own file)
    schema: TargetingSchema = DEFAULT

    def __post_init__(self) -> None:
        files = [f is not None for f in (self.catalog, self.interactions, self.users)]
        world_only = self.world is not None and not any(files)
        if not (world_only or (self.world is None and all(files))):
            raise ValueError("give a world directory, or a catalog, interactions and users")


def prepare(
    data: TrainingData,
    work: Path,
    tokenizer_path: Path | None,
    progress: bool,
    sid_space: str | None = None,
    last_token: LastToken | None = None,
) -> tuple[UserHistories, SIDTokenizer | None, IndexArrays]:
    """The users' histories, the SID tokenizer (kept in `work/tokenizer`; None for a named
    SID space: every catalog row carries its SID; trained with `last_token` when neither
    given nor kept: docs/TOKENIZER.md) and an in-memory index of the catalog."""
    world = load_world(data.world) if data.world is not None else None
    catalog_path = world.catalog_parquet if world is not None else data.catalog
    assert catalog_path is not None  # TrainingData checked it
    t = time.perf_counter()
    schema = world.schema if world is not None else data.schema
    catalog = read_catalog(catalog_path, progress=progress, schema=schema)
    log.info("catalog %s: %d ads read in %.1f s", catalog_path, len(catalog.ad_id),
             time.perf_counter() - t)  # fmt: skip
    histories: UserHistories
    if world is not None:
        histories = world
    else:
        assert data.interactions is not None and data.users is not None
        histories = read_user_data(data.interactions, data.users, catalog.ad_id, data.events)
        log.info("training data: %s", histories.summary)
    saved = work / "tokenizer"
    if sid_space is not None:
        if tokenizer_path is not None or last_token is not None:
            raise ValueError("a named SID space has no tokenizer: drop --tokenizer and "
                             "--last-token, or --sid-space")  # fmt: skip
        if not catalog.has_sid.all():
            missing = int((~catalog.has_sid).sum())
            raise ValueError(f"SID space {sid_space!r}: {missing} catalog rows carry no sid")
        sids, _ = assign_sids(catalog, None)
        return histories, None, build_arrays(catalog, sids)
    if tokenizer_path is not None or saved.exists():
        tokenizer = SIDTokenizer.load(tokenizer_path or saved)
    elif catalog.embedding is None:
        raise ValueError(
            f"catalog {catalog_path} carries no embeddings to train a SID tokenizer on: "
            "pass --tokenizer, or --sid-space NAME when every row carries its sid"
        )
    else:
        config = TokenizerConfig(last_token=last_token or "rank")
        t = time.perf_counter()
        tokenizer = SIDTokenizer.train(catalog.embedding, config, progress=progress)
        log.info("SID tokenizer (%s) trained in %.1f s", config.last_token,
                 time.perf_counter() - t)  # fmt: skip
    if last_token is not None and tokenizer.config.last_token != last_token:
        where = tokenizer_path or saved
        raise ValueError(f"last token {last_token!r} asked, but the tokenizer {where} makes "
                         f"{tokenizer.config.last_token!r} SIDs: drop one of the two")  # fmt: skip
    if not saved.exists():
        tokenizer.save(saved)
    sids, _ = assign_sids(catalog, tokenizer)
    return histories, tokenizer, build_arrays(catalog, sids)


def train(
    data: TrainingData | Path,
    out: Path,
    settings: TrainSettings,
    *,
    tokenizer_path: Path | None = None,
    progress: bool = True,
    sid_space: str | None = None,
) -> dict[str, Any]:
    """Train (or resume) and write the checkpoint to `out`; returns the metrics. `data`:
    the training data, or a world directory."""
    if not isinstance(data, TrainingData):
        data = TrainingData(world=Path(data))
    out = Path(out)
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    world, tokenizer, arrays = prepare(data, work, tokenizer_path, progress, sid_space,
                                       settings.last_token)  # fmt: skip
    space = tokenizer.fingerprint if tokenizer is not None else sid_spaces.named(str(sid_space))
    config: ModelConfig = profile(settings.profile)
    schema = world.schema if isinstance(world, World) else data.schema
    index = LoadedIndex.from_arrays(arrays, settings.device, schema=schema)
    examples = Examples(world, index.lookup, config)
    model = GenerativeRetriever(config).to(settings.device)
    on_cuda = torch.device(settings.device).type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr,
                            weight_decay=settings.weight_decay, fused=on_cuda)  # fmt: skip
    per_epoch = len(examples) // settings.batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(examples)} training pairs: fewer than one batch")
    total = int(settings.epochs * per_epoch)
    step, state_file = 0, work / "state.pt"
    validation: list[float] = []  # loss on the validation events after each epoch
    best: dict[str, Any] | None = None  # the weights of the best epoch so far
    earlier_s = 0.0  # seconds of steps before the saved state (a resumed run adds them)
    if state_file.exists():
        state = torch.load(state_file, map_location=settings.device, weights_only=False)
        # a field the state predates (such as `precision`) counts as its default
        saved = {**asdict(TrainSettings()), **state["settings"]}
        if saved != asdict(settings) or state["tokenizer"] != space:
            raise ValueError(f"{work} holds a run with other settings; remove it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        validation, best = state.get("validation", []), state.get("best")
        earlier_s = float(state.get("train_seconds", 0.0))  # absent in older states
        log.info("resuming at step %d of %d", step, total)

    def save_state() -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "settings": asdict(settings),
            "tokenizer": space,
            "validation": validation,
            "best": best,
            "train_seconds": earlier_s + time.perf_counter() - t0,
        }
        tmp = state_file.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(state_file)

    log.info("training on %s (%s): %d pairs, %d steps of %d (%.3g epochs)", settings.device,
             settings.precision, len(examples), total,
             settings.batch_size, settings.epochs)  # fmt: skip

    def make(pairs: np.ndarray) -> Batch:
        """A batch, built on the prefetch thread; page-locked for the GPU, so that its
        copy does not wait for the steps before it."""
        batch = examples.batch(pairs)
        if on_cuda:
            batch = replace(batch, features=batch.features.pin_memory(),
                            target_sid=batch.target_sid.pin_memory())  # fmt: skip
        return batch

    def learn(batch: Batch) -> torch.Tensor:
        """One AdamW step on a batch; its loss, still on the device."""
        features = batch.features.to(settings.device, non_blocking=True)
        target = batch.target_sid.to(settings.device, non_blocking=True)
        with autocast(settings.device, settings.precision):
            logits = model.forward_train(features, target)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, config.vocab_size).float(), target.reshape(-1)
            )
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total, settings.lr, settings.warmup_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    model.train()
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # losses, read back every 50 steps (a device sync)
    report = ProgressLog(log, step, total, enabled=not progress)
    bar = tqdm(total=total, initial=step, desc="train", disable=not progress)
    while step < total:
        epoch, offset = divmod(step, per_epoch)
        rng = np.random.default_rng([settings.seed, epoch])
        order = list(examples.epoch(settings.batch_size, rng))[offset:]
        with contextlib.closing(prefetch(order, make)) as batches:
            for batch in batches:
                pending.append(learn(batch))
                step += 1
                bar.update(1)
                epoch_end = step % per_epoch == 0 or step >= total
                read_back = epoch_end or report.due(step) or step % settings.checkpoint_every == 0
                if len(pending) == 50 or read_back:
                    losses.extend(torch.stack(pending).float().tolist())
                    pending.clear()
                    if not all(map(math.isfinite, losses[-50:])):  # a diverged run: no save
                        state_file.unlink(missing_ok=True)  # its weights may be the NaN ones
                        raise Diverged(
                            f"the loss turned non-finite by step {step} "
                            f"({losses[-1]}, lr {settings.lr:g}): the run diverged, "
                            f"nothing saved; lower --lr (tokenizer kept in {work})"
                        )
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}", epoch=epoch)
                if epoch_end and len(examples.validation_users):
                    setup = (settings.batch_size, settings.device, settings.precision)
                    validation.append(validation_loss(model, examples, *setup))
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}", epoch=epoch,
                                    val=f"{validation[-1]:.3f}")  # fmt: skip
                    if best is None or validation[-1] < best["loss"]:
                        live = model.state_dict().items()
                        weights = {k: v.detach().cpu().clone() for k, v in live}
                        best = {"loss": validation[-1], "epoch": len(validation), "model": weights}
                report(step, float(np.mean(losses[-50:])) if losses else None,
                       validation[-1] if validation else None)  # fmt: skip
                if step % settings.checkpoint_every == 0:
                    save_state()
                if step >= total:
                    break
    bar.close()
    train_s = earlier_s + time.perf_counter() - t0  # over every run that made these steps
    if best is not None:  # the checkpoint keeps the epoch with the lowest validation loss
        model.load_state_dict(best["model"])
    rng = np.random.default_rng(settings.seed + 1)
    held = np.flatnonzero(world.heldout_ad_ids >= 0)  # the users with a held-out event
    users = np.sort(rng.permutation(held)[: settings.eval_users])
    metrics = recall_at_k(model, examples, index, users, settings.eval_ks, config.beams)
    metrics |= {
        "final_loss": float(np.mean(losses[-50:])) if losses else None,
        "steps": step,
        "train_seconds": round(train_s, 1),
        "training_pairs": len(examples),
        "validation_loss": [round(v, 4) for v in validation],
        "best_epoch": best["epoch"] if best is not None else None,
    }
    log.info("held-out evaluation: %s", metrics)
    extra = {"metrics": metrics, "settings": asdict(settings)}
    version = save_checkpoint(
        model, tokenizer, out, extra=extra, sid_space=sid_space if tokenizer is None else None
    )
    shutil.rmtree(work, ignore_errors=True)
    metrics["model_version"] = version
    return metrics
