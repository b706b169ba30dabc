"""The benchmark scripts run end to end on small inputs: start-up, the Table 4 and 5
analogues (cross- and self-attention, CPU smoke mode), the Table 6 ladder of the decode
loop (its rows and its smoke run); the model-swap summary."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import bench_cross_attention, bench_self_attention, bench_startup
from bench.bench_model_swap import summarise as summarise_swap
from index_builder.catalog import read_catalog
from tests.helpers.indexes import small_index
from tests.helpers.serving import make_serving_data

ROOT = Path(__file__).resolve().parents[2]


def test_startup_bench_times_both_loads(tmp_path: Path) -> None:
    root = make_serving_data(tmp_path / "data")
    out = tmp_path / "startup.json"
    args = ["--index-root", str(root / "index"), "--model", str(root / "model"),
            "--repeat", "2", "--out", str(out)]  # fmt: skip
    assert bench_startup.main(args) == 0
    result = json.loads(out.read_text())
    f = result["figures"]
    world_ads = len(read_catalog(root / "world" / "catalog.parquet", progress=False).ad_id)
    assert f["ads"] == world_ads and f["device"] == "cpu"
    assert len(f["model_load_s"]) == len(f["index_load_and_validate_s"]) == 2
    assert f["model_load_median_s"] > 0 and f["index_load_and_validate_median_s"] > 0
    assert {"command", "git_commit", "device", "date"} <= result.keys()


def test_cross_attention_bench_checks_every_form_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Table 4 bench's smoke mode: every form checked against the fp32 reference, none
    wrong; the backends a CPU lacks (cuDNN, memory-efficient) reported, not fatal."""
    out = tmp_path / "cross.json"
    args = "--device cpu --small --dtype float32 --iters 2 --warmup 1 --out".split()
    monkeypatch.setattr(sys, "argv", ["bench_cross_attention.py", *args, str(out)])
    bench_cross_attention.main()
    f = json.loads(out.read_text())["figures"]
    status = {(r["layout"], r["backend"]): r["status"] for r in f["variants"]}
    assert len(status) == 5 and "mismatch" not in status.values()
    assert status[("per_beam", "sdpa_flash")] == status[("beam_as_query", "sdpa_flash")] == "ok"
    assert status[("beam_as_query", "sdpa_cudnn")].startswith("unavailable")
    assert f["winner"] == "sdpa_flash" and f["winner_meets_target"] is None


def test_self_attention_bench_checks_every_form_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Table 5 bench's smoke mode: each form's output and cache write checked at every
    step (a mismatch raises), the no-store form at the last position only."""
    out = tmp_path / "self.json"
    args = ["--device", "cpu", "--small", "--dtype", "fp32", "--repeat", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench_self_attention.py", *args])
    bench_self_attention.main()
    rows = json.loads(out.read_text())["figures"]["rows"]
    forms = ["sdpa_flash", "reference", "coalesced", "fused", "paged"]
    assert [r["variant"] for r in rows] == forms * 3 + [*forms, "paged_no_store"]
    assert all(r["check"] == "ok" and r["p50_ms"] > 0 for r in rows)


def test_decoder_loop_ladder_adds_one_change_a_row_and_ends_at_the_served_engine() -> None:
    """Table 6: each textbook row changes one switch of the row above, from the naive
    loop to everything the textbook loop can do; the served rows run the served engine
    (the FP8 one on a decoder made FP8 as a load makes it), and the smoke run's served
    result equals the textbook loop's with the same mask (fp32) and its eager twin's."""
    from bench.baselines.ladder import Rung, TextbookSearch
    from bench.bench_decoder_loop import LADDER, NAIVE, ROWS, runner
    from service.decode.engine import DecodeEngine
    from service.decode.fp8_step import FP8DecoderStep
    from service.index.loaded import LoadedIndex
    from service.model.config import PROFILES
    from service.model.precision import quantize_decoder
    from service.model.retriever import GenerativeRetriever

    rung = NAIVE
    for _, _, change in LADDER[1:]:
        before, rung = rung, dataclasses.replace(rung, **change)
        assert len(change) == 1 and rung != before
    assert rung == Rung() and ROWS[-1] == "served_fp8"
    model = GenerativeRetriever(PROFILES["tiny"]).eval()
    fp8 = quantize_decoder(copy.deepcopy(model.decoder))
    index = LoadedIndex.from_arrays(small_index(), "cpu")
    for key in ("served", "served_fp8"):
        _, graphs, engine = runner(model.decoder, fp8, index, key, 2)
        assert type(engine) is DecodeEngine and graphs() == 0  # CPU: nothing captured
        assert isinstance(engine.step, FP8DecoderStep) == (key == "served_fp8")
    _, _, search = runner(model.decoder, fp8, index, "bloom", 2)
    assert isinstance(search, TextbookSearch) and search.rung == Rung()


def test_decoder_loop_smoke_run_writes_every_row_and_agrees_with_itself(tmp_path: Path) -> None:
    """`--small` on a CPU: every row runs, the served graph and eager rows return one
    result, and the textbook loop with the full mask returns the served SIDs (fp32)."""
    out = tmp_path / "loop.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_decoder_loop.py"), "--device", "cpu",
         "--profile", "tiny", "--small", "--no-full", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    f = json.loads(out.read_text())["figures"]
    from bench.bench_decoder_loop import ROWS

    assert [r["row"] for r in f["rows"]] == ROWS and not any("error" in r for r in f["rows"])
    assert f["graph_equals_eager"] is True and f["bloom_vs_served_sid_overlap"] == 1.0
    assert 0.5 < f["served_fp8_vs_served_sid_overlap"] <= 1.0
    by = {r["row"]: r for r in f["rows"]}
    assert by["naive"]["live_sids_per_request"] == 0  # no mask: no leaves
    assert by["served"]["live_sids_per_request"] > 0


def test_the_rich_schema_index_and_its_requests_find_eligible_ads() -> None:
    """`--schema rich`: the synthetic index carries the rich schema's rules (audiences with
    exclusions), and every request it is timed with has eligible ads, the rich schema's
    most values per set attribute, and passes the served request checks' limits."""
    from bench.indexes import RICH, requests_for, synthetic_index
    from service.index.loaded import LoadedIndex

    arrays = synthetic_index(3000, seed=2, schema=RICH)
    index = LoadedIndex.from_arrays(arrays, "cpu", schema=RICH)
    assert arrays.ads.sets["audiences"].exclude is not None
    targeting = requests_for(arrays, 8, 16, seed=3, schema=RICH)
    leaves = np.arange(len(arrays.ads.leaf_sids), dtype=np.int64)
    posts = index.post.run([index.post_request(leaves, np.zeros(len(leaves), np.float32), t,
                                               10**6) for t in targeting])  # fmt: skip
    assert all(p.ads_eligible > 0 for p in posts)
    assert sum(p.ads_removed["exclusion"] for p in posts) > 0
    for t in targeting:
        values = dict(t.attributes)
        assert (len(values["audiences"]), len(values["interests"])) == (256, 32)
        assert len(values["platform"]) == len(values["device"]) == 1


def test_model_swap_summary_times_the_swap_and_lays_out_each_second() -> None:
    """bench/bench_model_swap.py's figures from known records: the first new answer, the
    windows, and a per-second timeline whose refusals sit in the seconds they happened."""
    t0, published = 1000.0, 1010.0
    records = [(t0 + i * 0.1, 0.02, "OK", "old") for i in range(100)]  # 10 s before
    records += [
        (published + 0.5, 0.02, "RESOURCE_EXHAUSTED", ""),
        (published + 1.2, 0.03, "OK", "old"),
        (published + 2.1, 0.04, "OK", "new"),
        (published + 3.5, 0.02, "OK", "new"),
    ]
    out = summarise_swap(records, published, "old", "new", warmup=1.0, start=t0)
    assert out["publish_to_first_new_answer_s"] == pytest.approx(2.14)
    assert out["failed_calls"] == 1 and out["answered_by"] == {"new": 2, "old": 101}
    assert out["windows"]["during_swap"]["failed"] == 1
    by_t = {row["t"]: row for row in out["timeline"]}
    assert by_t[0]["failed"] == {"RESOURCE_EXHAUSTED": 1} and by_t[0]["calls"] == 1
    assert by_t[-1]["calls"] == 10 and by_t[-1]["failed"] == {}
    assert by_t[2]["unix"] == published + 2 and min(by_t) == -5
