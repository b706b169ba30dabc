"""FP8 by default where proven (docs/FP8.md, "FP8 by default"): `grace publish-model` with
--index and --world makes an FP8 quality record (FP8 against bfloat16 on held-out users,
judged by `precision.fp8_verdict`) and keeps it in the version's gate.json; a server with
`dtype = auto` serves that version in FP8 on a GPU with FP8 when the record passes, else in
bfloat16 (float32 on a CPU), and says which and why in one log line. `bfloat16`, `float32`
and `fp8` still force."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from cli import main
from contracts.versions import current_version
from service.model.checkpoint import load_checkpoint
from service.model.precision import (
    FP8_MIN_SIDS_KEPT,
    FP8_MIN_USERS,
    FP8_TOLERANCE,
    choose,
    for_serving,
    fp8_verdict,
    serves_in,
)
from service.model.repository import fp8_record
from service.pipeline.stages import Stages
from service.rollout.sources import model_follower
from tests.helpers.serving import make_serving_data

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("fp8auto"))


def figures(*recall: tuple[float, float, float], kept: float = 0.99) -> dict:
    """A study's `vs_full_precision` with these recall@100, @1000 (mean, lo, hi)."""
    return {
        **{
            f"recall@{k}": {"mean": m, "lo": lo, "hi": hi}
            for k, (m, lo, hi) in zip((100, 1000), recall, strict=False)
        },
        "ndcg@100": {"mean": -0.5, "lo": -0.6, "hi": -0.4},  # not judged
        "sid_overlap": {"@100": {"mean": kept, "lo": kept, "hi": kept}},
    }


def test_the_pass_rule_needs_the_interval_to_exclude_a_loss_beyond_the_tolerance() -> None:
    """Passes only when, at every K, the lower end of FP8 - bf16's interval is at least
    -tolerance and top-K SIDs kept is at least the floor; the reason names what failed."""
    shown = fp8_verdict(figures((-0.001, -0.005, 0.003), (-0.003, -0.007, 0.0)), 1000)
    assert shown["passed"] and "recall@100 -0.0010 [-0.0050, +0.0030]" in shown["why"]
    assert "top-100 SIDs kept 0.990" in shown["why"]
    assert shown["rule"] == {"tolerance": FP8_TOLERANCE, "min_sids_kept": FP8_MIN_SIDS_KEPT,
                             "min_users": FP8_MIN_USERS}  # fmt: skip
    assert shown["users"] == 1000
    edge = fp8_verdict(figures((0.0, -FP8_TOLERANCE, 0.01), (0.0, 0.0, 0.0)), 1000)
    assert edge["passed"]  # exactly the tolerance: not shown to lose more
    wide = fp8_verdict(figures((0.0, -0.02, 0.02), (0.0, -0.001, 0.001)), 1000)
    assert not wide["passed"]  # a sample too small to prove it is no pass
    assert wide["why"] == "recall@100 +0.0000 [-0.0200, +0.0200] may lose more than 0.01"
    assert fp8_verdict(figures((0.0, -0.02, 0.02)), 1000, tolerance=0.05)["passed"]
    sids = fp8_verdict(figures((0.0, 0.0, 0.0), kept=0.9), 1000)
    assert not sids["passed"] and sids["why"] == "top-100 SIDs kept 0.900 < 0.95"
    # too few users fail whatever they read: one user, resampled, reads [0, 0]
    few = fp8_verdict(figures((0.0, 0.0, 0.0)), FP8_MIN_USERS - 1)
    assert not few["passed"] and few["why"] == f"{FP8_MIN_USERS - 1} users < 200: too few to judge"
    assert fp8_verdict(figures((0.0, 0.0, 0.0)), FP8_MIN_USERS)["passed"]
    with pytest.raises(ValueError, match="needs recall@K"):
        fp8_verdict({"sid_overlap": {}}, 1000)


def test_auto_serves_fp8_only_on_a_gpu_with_fp8_and_a_passing_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passing, failing = (
        fp8_verdict(figures((0.0, -0.001, 0.001)), 1000),
        fp8_verdict(figures((0.0, -0.5, 0.1)), 1000),
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert choose("auto", "cuda", passing) == (
        "fp8",
        f"its FP8 quality record passes: {passing['why']}",
    )
    assert choose("auto", "cuda", failing)[0] == "auto"
    assert "record fails: recall@100" in choose("auto", "cuda", failing)[1]
    assert choose("auto", "cuda", None) == ("auto", choose("auto", "cuda", None)[1])
    assert "no FP8 quality record" in choose("auto", "cuda", None)[1]
    assert choose("bfloat16", "cuda", passing) == ("bfloat16", "set by dtype")  # forced
    assert choose("fp8", "cuda", failing) == ("fp8", "set by dtype")
    assert choose("auto", "cpu", passing) == ("auto", "a CPU serves float32")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert choose("auto", "cuda", passing) == ("auto", "NVIDIA A100 has no FP8")


def test_publish_model_records_fp8_quality_and_a_server_says_what_it_serves(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The record's figures, the rule's verdict on them, its line on stdout; no record
    without --world or with --fp8-users 0; the server's choice and its one log line."""
    repo = tmp_path / "models"
    gated = ["--index", str(data / "index"), "--world", str(data / "world")]
    publish = ["publish-model", str(data / "model"), "--root", str(repo), *gated]
    assert main([*publish, "--fp8-users", "100000", "--fp8-tolerance", "1"]) == 0
    out = capsys.readouterr().out
    record = fp8_record(repo / current_version(repo))
    assert record is not None and record["passed"], out
    assert record["users"] == 400  # all the world's users: at most the world's
    assert f"FP8 quality record (400 users) passes: {record['why']}" in out
    assert set(record["recall_vs_bf16"]) == {"recall@100", "recall@1000"}
    assert record["sids_kept"]["@100"]["mean"] >= FP8_MIN_SIDS_KEPT
    assert record["against"] == "bfloat16" and record["index_version"] == current_version(
        data / "index"
    )
    assert 0 < record["final_pass"]["fp8"] <= 1 and record["recall@100"]["bf16"] > 0
    # the default tolerance on 250 users: the verdict is the rule's on the figures kept
    assert main([*publish, "--fp8-users", "250"]) == 0
    small = fp8_record(repo / current_version(repo))
    assert small is not None and small["users"] == 250
    lows = [d["lo"] for d in small["recall_vs_bf16"].values()]
    assert small["passed"] == (
        min(lows) >= -FP8_TOLERANCE and small["sids_kept"]["@100"]["mean"] >= 0.95
    )
    rejudged = fp8_verdict({**small["recall_vs_bf16"], "sid_overlap": small["sids_kept"]}, 250)
    assert small == {**small, **rejudged}
    assert main([*publish, "--fp8-users", "20", "--fp8-tolerance", "1"]) == 0
    few = fp8_record(repo / current_version(repo))
    assert (
        few is not None and not few["passed"] and few["why"] == "20 users < 200: too few to judge"
    )
    capsys.readouterr()
    assert main([*publish, "--fp8-users", "0"]) == 0
    assert "no FP8 quality record" in capsys.readouterr().out
    assert fp8_record(repo / current_version(repo)) is None
    assert json.loads((repo / current_version(repo) / "gate.json").read_text())["fp8"] is None
    assert fp8_record(data / "model") is None  # a checkpoint never published: no record

    for precision, serves in (("auto", "float32"), ("bfloat16", "bfloat16"), ("fp8", "fp8")):
        model = load_checkpoint(data / "model", "cpu").model
        assert serves_in(for_serving(model, precision, "cpu")) == serves

    # a server reads the record of the version it loads, and says what it serves and why
    assert main([*publish, "--fp8-users", "100000", "--fp8-tolerance", "1"]) == 0
    follower = model_follower(repo, Stages("cpu"), "auto", served=lambda: None,
                              on_failure=lambda *a: None, backoff_seconds=1.0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="grace.rollout"):
        runtime = follower.load(current_version(repo))
    assert runtime is not None and runtime.dtype == "float32"
    said = [r.getMessage() for r in caplog.records if "serves in" in r.getMessage()]
    assert said == [f"model {runtime.model_version} serves in float32: a CPU serves float32"]
    # the same version on a GPU with FP8 (faked: the choice, not the kernels) is FP8's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    chosen, why = choose("auto", "cuda", fp8_record(repo / current_version(repo)))
    assert chosen == "fp8" and why.startswith("its FP8 quality record passes: recall@100")


@pytest.mark.gpu
@NO_CUDA
@pytest.mark.parametrize(("passed", "setting", "serves"), [
    (True, "auto", "fp8"), (False, "auto", "bfloat16"), (None, "auto", "bfloat16"),
    (True, "bfloat16", "bfloat16"), (False, "fp8", "fp8"),
])  # fmt: skip
def test_a_gpu_server_picks_fp8_per_the_record(
    data: Path, tmp_path: Path, passed: bool | None, setting: str, serves: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """On a GPU with FP8 (compute capability 8.9 or newer), a version loads in FP8 under
    `auto` only with a passing record, and its decode engine runs the FP8 step."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8")
    repo = tmp_path / "models"
    extra = ["--fp8-tolerance", "1"] if passed else ["--fp8-users", "0" if passed is None else "1"]
    assert main(["publish-model", str(data / "model"), "--root", str(repo), "--index",
                 str(data / "index"), "--world", str(data / "world"), "--device", "cuda",
                 *extra]) == 0  # fmt: skip
    record = fp8_record(repo / current_version(repo))
    assert (record is None) == (passed is None)
    if passed is False:  # one user proves nothing: the rule fails it
        assert record is not None and not record["passed"]
    follower = model_follower(repo, Stages("cuda"), setting, served=lambda: None,  # type: ignore[arg-type]
                              on_failure=lambda *a: None, backoff_seconds=1.0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="grace.rollout"):
        runtime = follower.load(current_version(repo))
    assert runtime is not None and runtime.dtype == serves
    assert type(runtime.engine.step).__name__ == (
        "FP8DecoderStep" if serves == "fp8" else "DecoderStep"
    )
    assert any(f"serves in {serves}: " in r.getMessage() for r in caplog.records)
