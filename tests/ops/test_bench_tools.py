"""The start-up, top-k capacity and cross-attention benchmark scripts run end to end on
small inputs, the capacity they report is the largest any set of beams can need, and the
decode-loop bench's tail breakdown names the samples and batches that made the tail."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import bench_startup, bench_topk_capacity
from bench.baselines.decode_variants import DecodeOptions, VariantEngine
from bench.bench_decoder_loop import FINAL_ROW, ROWS, paired, tail_spread, times_interleaved
from bench.bench_model_swap import summarise as summarise_swap
from contracts.index_format import VOCAB_SIZE
from index_builder.catalog import read_catalog
from index_builder.publish import current_path, publish
from tests.helpers.indexes import small_index, writer
from tests.helpers.serving import make_serving_data


@pytest.fixture(scope="module")
def index_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index")
    publish(root, writer(small_index(200)))
    return root


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


def test_capacity_is_the_most_any_beams_can_need(index_root: Path, tmp_path: Path) -> None:
    """For each step: no choice of M_t nodes of that level has more children than the
    reported capacity, and the M_t nodes with the most children reach it exactly."""
    version = current_path(index_root)
    assert version is not None
    beams = (1, 3, 8, 20)
    found = bench_topk_capacity.capacities(version, beams)
    arrays = small_index(200).trie
    level = np.asarray(arrays.level_offsets)
    children = np.diff(np.asarray(arrays.node_offsets))
    rng = np.random.default_rng(0)
    for step, m in zip(found["steps"], beams, strict=True):
        per_node = children[level[step["step"] - 1] : level[step["step"]]]
        assert step["dense"] == m * VOCAB_SIZE and step["capacity"] <= step["dense"]
        for _ in range(200):  # any M_t distinct nodes of the level
            pick = rng.choice(len(per_node), size=min(m, len(per_node)), replace=False)
            assert per_node[pick].sum() <= step["capacity"]
        assert np.sort(per_node)[::-1][:m].sum() == step["capacity"]
    out = tmp_path / "cap.json"
    args = ["--index-root", str(index_root), "--beams", *map(str, beams), "--out", str(out)]
    assert bench_topk_capacity.main(args) == 0
    assert json.loads(out.read_text())["figures"]["indexes"][0]["steps"] == found["steps"]


def test_cross_attention_bench_sweeps_warp_specialised_configs(tmp_path: Path) -> None:
    """On the CPU (Triton's interpreter) the bench checks every variant against the
    reference and runs its warp-specialised sweep's one small config through the same path
    the GPU sweep takes; a refused or wrong config would show in its status."""
    out = tmp_path / "cross.json"
    root = Path(__file__).resolve().parents[2]
    args = "--device cpu --small --beams 32 --iters 2 --warmup 1 --out".split()
    cmd = [sys.executable, str(root / "bench" / "bench_cross_attention.py"), *args, str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    f = json.loads(out.read_text())["figures"]
    assert all(r["status"] != "mismatch" for r in f["variants"])
    ws = f["warp_specialized"]
    assert ws["status"] == "ok" and [r["status"] for r in ws["configs"]] == ["ok"]
    assert ws["best"]["config"]["WS"] is True and ws["best"]["median_ms"] > 0


def test_tail_spread_names_the_slow_samples_and_their_batches() -> None:
    """Sample i ran batch i % 3; batch 1 is slow every time, one sample of batch 0 once."""
    xs = [10.0, 12.5, 10.1, 10.0, 12.4, 10.2, 13.0, 12.6, 10.1]
    t = tail_spread(xs, 3)
    assert t["per_batch_p50_ms"] == [10.0, 12.5, 10.1]
    assert t["per_batch_max_ms"] == [13.0, 12.6, 10.2]
    # median 10.2: over 11.2 ms are samples 1, 4, 6, 7
    assert t["samples_over_p50_plus_1_ms"] == [1, 4, 6, 7]
    assert t["their_batches"] == [1, 1, 0, 1] and t["their_ms"] == [12.5, 12.4, 13.0, 12.6]


def test_tail_spread_of_a_run_shorter_than_its_batches() -> None:
    """Two samples of eight batches (the Nsight Compute run): the two batches that ran."""
    t = tail_spread([10.0, 12.0], 8)
    assert t["per_batch_p50_ms"] == [10.0, 12.0] and t["per_batch_max_ms"] == [10.0, 12.0]
    assert t["samples_over_p50_plus_1_ms"] == []


def test_interleaved_rounds_rotate_the_order_and_pair_the_samples() -> None:
    """Each call runs once per round on that round's batch (2 warm-up rounds first), who
    goes first rotates, and the paired difference is taken round by round."""
    order: list[tuple[str, int]] = []
    calls = [lambda i, n=n: order.append((n, i)) for n in "abc"]
    times = times_interleaved(calls, 4, cuda=False)
    assert [len(t) for t in times] == [4, 4, 4]
    firsts = [order[3 * r][0] for r in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(order) == sorted((n, i) for n in "abc" for i in range(6))
    d = paired([10.0, 10.0, 12.0, 10.0], [9.0, 9.5, 13.0, 9.0])
    assert d["median_diff_ms"] == -0.75 and d["faster_share"] == 0.75
    assert d["p10_diff_ms"] < d["median_diff_ms"] < d["p90_diff_ms"]


def test_decoder_loop_final_row_is_the_served_configuration() -> None:
    """Table 6's final row runs the server's defaults (the one-launch bookkeeping), the
    naive row the torch reference; the row before the final one differs from it only in
    the bookkeeping, so the two must return the same result."""
    rows = {key: options for key, _, options, _ in ROWS}
    assert rows[FINAL_ROW] == DecodeOptions()
    assert rows["naive"].advance == "eager"
    assert rows["graph_tail"] == dataclasses.replace(DecodeOptions(), advance="eager")
    assert rows["graph_compiled"] == dataclasses.replace(DecodeOptions(), advance="compiled")
    assert rows["graph_fp8"] == dataclasses.replace(DecodeOptions(), fp8=True)  # the served one
    for ffn in ("rowwise", "exp_tanh", "triton_down", "promoted", "pointer_up"):  # one switch
        assert rows[f"graph_fp8_{ffn}"] == dataclasses.replace(rows["graph_fp8"], fp8_ffn=ffn)


def test_decoder_loop_fp8_row_runs_the_served_engine_in_fp8() -> None:
    """The FP8 row is the served `DecodeEngine` with fp8=True, not a bench variant."""
    from bench.bench_decoder_loop import Bound
    from service.decode.engine import DecodeEngine
    from service.index.loaded import LoadedIndex
    from service.model.config import PROFILES
    from service.model.retriever import GenerativeRetriever

    rows = {key: options for key, _, options, _ in ROWS}
    model = GenerativeRetriever(PROFILES["tiny"]).eval()
    index = LoadedIndex.from_arrays(small_index(), "cpu")
    bound = Bound(model, index, rows["graph_fp8"], 2)
    assert type(bound.engine) is DecodeEngine and bound.engine.step.fp8 is not None
    assert Bound(model, index, rows[FINAL_ROW], 2).engine.step.fp8 is None
    rowwise = Bound(model, index, rows["graph_fp8_rowwise"], 2).engine  # not the served FFN
    assert type(rowwise) is VariantEngine and rowwise.step.fp8 is not None


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
