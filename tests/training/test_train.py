"""`grace train` on the tiny world: it learns, checkpoints, and resumes where it stopped."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from index_builder.synth import generate_world
from service.model.checkpoint import load_checkpoint
from training import train as train_module
from training.data import Examples
from training.train import TrainSettings, train

SETTINGS = TrainSettings(
    epochs=0.5, batch_size=32, warmup_steps=5, eval_users=32, eval_ks=(10, 50),
    checkpoint_every=10,
)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train") / "world"
    generate_world("tiny", 11, out, progress=False)
    return out


def test_training_learns_and_writes_a_loadable_checkpoint(
    world: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="grace.train"):
        metrics = train(world, tmp_path / "ckpt", SETTINGS, progress=False)
    messages = [r.getMessage() for r in caplog.records if r.name == "grace.train"]
    progress = [m for m in messages if m.startswith("train: step")]
    assert len(progress) == 10  # no bar: a line each tenth, the last at the end
    assert progress[-1].startswith(f"train: step {metrics['steps']}/{metrics['steps']} (100 %)")
    assert any(m.startswith("SID tokenizer (rank) trained in") for m in messages)
    assert any(f"{metrics['training_pairs']} pairs, {metrics['steps']} steps" in m
               for m in messages)  # fmt: skip
    assert metrics["final_loss"] < 0.75 * math.log(512)  # far below a uniform guess
    assert 0.0 <= metrics["recall@10"] <= metrics["recall@50"] <= 1.0
    assert metrics["mean_ads_returned"] > 0
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.model_version == metrics["model_version"]
    assert loaded.meta["extra"]["metrics"]["steps"] == metrics["steps"]
    assert not (tmp_path / "ckpt.partial").exists()


class Interrupt(Exception):
    pass


def test_interrupted_training_resumes_to_the_same_weights(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = TrainSettings(epochs=0.3, batch_size=32, warmup_steps=5, eval_users=8,
                             eval_ks=(10,), checkpoint_every=10)  # fmt: skip
    straight = train(world, tmp_path / "a", settings, progress=False)

    real_batch = Examples.batch
    calls = {"n": 0}

    def flaky(self: Examples, pairs: np.ndarray):
        calls["n"] += 1
        if calls["n"] == 15:  # after the step-10 state was saved
            raise Interrupt
        return real_batch(self, pairs)

    monkeypatch.setattr(train_module.Examples, "batch", flaky)
    with pytest.raises(Interrupt):
        train(world, tmp_path / "b", settings, progress=False)
    state_file = tmp_path / "b.partial" / "state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["step"] == 10 and state["train_seconds"] > 0
    state["train_seconds"] = 1000.0  # as if the first run had taken long: the total keeps it
    torch.save(state, state_file)
    monkeypatch.setattr(train_module.Examples, "batch", real_batch)
    resumed = train(world, tmp_path / "b", settings, progress=False)
    assert resumed["steps"] == straight["steps"]
    assert resumed["train_seconds"] > 1000.0  # the earlier run's seconds are counted
    a = load_checkpoint(tmp_path / "a").model.state_dict()
    b = load_checkpoint(tmp_path / "b").model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


def test_a_last_token_other_than_the_given_tokenizers_is_refused(world: Path, tmp_path: Path):
    from index_builder.catalog import read_catalog
    from index_builder.tokenizer import SIDTokenizer, TokenizerConfig

    emb = read_catalog(world / "catalog.parquet", progress=False).embedding
    SIDTokenizer.train(emb, TokenizerConfig(codebook_size=16, iterations=2), progress=False).save(
        tmp_path / "rank-tok"
    )
    code = TrainSettings(epochs=0.01, last_token="code")
    with pytest.raises(ValueError, match=r"last token 'code' asked, but the tokenizer .*'rank'"):
        train(world, tmp_path / "ckpt", code, tokenizer_path=tmp_path / "rank-tok", progress=False)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="last_token must be one of"):
        TrainSettings(last_token="nope")  # type: ignore[arg-type]


def test_bf16_autocast_training_learns(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--precision bf16`: the forward passes run under bf16 autocast, and it learns."""
    entered: list[torch.dtype] = []
    real = torch.autocast

    def spy(*args, **kwargs):
        entered.append(kwargs["dtype"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", spy)
    metrics = train(world, tmp_path / "ckpt", replace(SETTINGS, precision="bf16"), progress=False)
    assert metrics["final_loss"] < 0.75 * math.log(512)
    assert len(entered) >= metrics["steps"] and set(entered) == {torch.bfloat16}


def test_training_that_diverges_stops_and_saves_nothing(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A learning rate far too large: the loss turns NaN. `grace train` stops on one
    line naming the step and the loss instead of saving a NaN checkpoint."""
    from cli import main

    out = tmp_path / "ckpt"
    args = ["train", "--world", str(world), "--out", str(out), "--lr", "1e8", "--epochs", "0.5",
            "--batch-size", "32", "--eval-users", "8", "--no-progress"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("grace train:")]
    assert len(said) == 1 and said[0].startswith("grace train: the loss turned non-finite"), err
    assert "nothing saved" in said[0] and "Traceback" not in err
    assert not out.exists()


def test_a_world_of_richer_targeting_trains_and_evaluates_by_its_own_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A world with audiences and extra enums carries its schema file: training reads the
    catalog by it (its held-out evaluation filters by every rule, no field ignored), and
    `--targeting-schema` beside `--world` is refused in one line."""
    from cli import main
    from index_builder.synth import PROFILES, load_world_schema
    from training.train import TrainingData, prepare

    world = tmp_path / "rich"
    rich = replace(PROFILES["tiny"], name="tiny-rich", n_audiences=400, extra_enums=1)
    generate_world(rich, 3, world, progress=False)
    schema = load_world_schema(world)
    _, _, arrays = prepare(TrainingData(world=world), tmp_path / "work", None, progress=False)
    assert set(arrays.ads.sets) == {a.name for a in schema.families} >= {"audiences"}
    assert arrays.ads.ad_bitmask.shape[1] == schema.bitmask_words
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]  # no field unread
    args = ["train", "--world", str(world), "--targeting-schema", "x.yaml", "--out",
            str(tmp_path / "m")]  # fmt: skip
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--targeting-schema is for --catalog" in lines[0]
