"""bench/bench_fp8_quality.py on a tiny world and an untrained tiny model (CPU, the
1 x 128 FFN under the interpreter): served FP8 first, the model's dtype, then each FFN
variant, every one decoding the same users through the study's loop with its own engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_fp8_quality import main
from cli import main as grace
from service.decode.engine import DecodeEngine

BEAMS = ["1", "16", "32", "32"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8q")
    paths = {name: str(root / name) for name in ("world", "tok", "index", "model")}
    for argv in (
        ["synth", "--profile", "tiny", "--seed", "1", "--out", paths["world"], "--no-progress"],
        ["train-tokenizer", "--catalog", f"{paths['world']}/catalog.parquet",
         "--out", paths["tok"], "--no-progress"],
        ["build-index", "--catalog", f"{paths['world']}/catalog.parquet",
         "--tokenizer", paths["tok"], "--out", paths["index"], "--no-progress"],
        ["init-model", "--profile", "tiny", "--tokenizer", paths["tok"], "--out", paths["model"]],
    ):  # fmt: skip
        assert grace(argv) == 0, argv
    return paths | {"root": str(root)}


def test_rows_compare_each_variant_with_served_fp8_and_the_models_dtype(inputs, capsys):
    out = Path(inputs["root"]) / "q.json"
    argv = ["--world", inputs["world"], "--index", inputs["index"], "--model", inputs["model"],
            "--users", "24", "--beams", *BEAMS, "--k", "10", "32", "--dtype", "float32",
            "--resamples", "50", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["figures"]["variants"]}
    assert list(rows) == ["cd_gtm_fp8", "cd_gtm", "cd_gtm_fp8_rowwise", "cd_gtm_fp8_exp_tanh"]
    assert all(r["users"] == 24 and r["ineligible_returned"] == 0 for r in rows.values())
    for name in ("cd_gtm", "cd_gtm_fp8_rowwise", "cd_gtm_fp8_exp_tanh"):
        assert rows[name]["vs_first"]["variant"] == "cd_gtm_fp8"
    for name in ("cd_gtm_fp8", "cd_gtm_fp8_rowwise", "cd_gtm_fp8_exp_tanh"):
        full = rows[name]["vs_full_precision"]
        assert full["variant"] == "cd_gtm"
        assert all(0 < v["mean"] <= 1 for v in full["sid_overlap"].values())
    for m in ("recall@10", "recall@32", "ndcg@10", "ndcg@32"):  # paired, with intervals
        d = rows["cd_gtm_fp8_exp_tanh"]["vs_first"][m]
        assert d["lo"] <= d["mean"] <= d["hi"] and isinstance(d["resolved"], bool)
    printed = capsys.readouterr().out
    assert "cd_gtm_fp8_rowwise" in printed and "SIDs kept" in printed


def test_each_variant_decodes_with_its_own_engine(inputs, monkeypatch) -> None:
    """The rows are the variants' engines, not the served one four times."""
    import bench.baselines.decode_variants as variants

    built: list[tuple[str, bool]] = []
    real = variants.VariantEngine

    class Recording(real):
        def __init__(self, decoder, options=None, **kwargs) -> None:
            built.append((options.fp8_ffn, kwargs["fp8"]))
            super().__init__(decoder, options, **kwargs)

    monkeypatch.setattr(variants, "VariantEngine", Recording)
    served: list[bool] = []
    monkeypatch.setattr(DecodeEngine, "__init__", _recording(DecodeEngine.__init__, served))
    argv = ["--world", inputs["world"], "--index", inputs["index"], "--model", inputs["model"],
            "--users", "4", "--beams", *BEAMS, "--k", "10", "--dtype", "float32",
            "--variants", "exp_tanh", "--resamples", "10", "--no-progress",
            "--out", str(Path(inputs["root"]) / "q2.json")]  # fmt: skip
    assert main(argv) == 0
    assert built == [("exp_tanh", True)]
    assert served == [True, False, True]  # served FP8, the model's dtype, the variant's base


def _recording(init, calls: list[bool]):
    def wrapped(self, *args, **kwargs) -> None:
        calls.append(kwargs.get("fp8", False))
        init(self, *args, **kwargs)

    return wrapped


def test_an_unknown_variant_is_one_line_naming_the_choices(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--world", "w", "--index", "i", "--model", "m", "--variants", "exp_tanh,fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown --variants fast" in err and "triton_down" in err
