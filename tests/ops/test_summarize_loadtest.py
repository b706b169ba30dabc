"""`bench/summarize_loadtest.py`: the load script's files -> the figures OPERATIONS.md
quotes. Synthetic run directories: two rates, two workers, counters that grow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.summarize_loadtest import SCRIPT, seconds, summarize, table

CSV_HEAD = "Type,Name,Request Count,Failure Count,50%,99%\n"


def metrics(batches: int, requests: int, post_s: float) -> str:
    """What a worker's /metrics holds after `batches` batches (only the series read)."""
    lines = [
        "# TYPE grace_batch_size histogram",
        f"grace_batch_size_count {batches}",
        f"grace_batch_size_sum {requests}",
        "# TYPE grace_stage_duration_seconds histogram",
    ]
    for stage, per_batch in (("input", 0.004), ("features", 0.001), ("compute", 0.002)):
        lines += [
            f'grace_stage_duration_seconds_count{{stage="{stage}"}} {batches}',
            f'grace_stage_duration_seconds_sum{{stage="{stage}"}} {per_batch * batches}',
        ]
    lines += [
        f'grace_stage_duration_seconds_count{{stage="post"}} {batches}',
        f'grace_stage_duration_seconds_sum{{stage="post"}} {post_s}',
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "lt"
    out.mkdir()
    # rate 700 passes (P99 59 ms, no failures); rate 800 misses on P99
    for rate, sent, failed, p50, p99 in (("700", 14000, 0, 30, 59), ("800", 16000, 8, 98, 160)):
        (out / f"rate_{rate}_stats.csv").write_text(
            CSV_HEAD + f"grpc,Retrieve,{sent},{failed},{p50},{p99}\n"
            f",Aggregated,{sent},{failed},{p50},{p99}\n"
        )
        (out / f"rate_{rate}.log").write_text(
            f"[x] vm/INFO/grace.loadtest: grace loadtest: {sent} requests, {failed} failures "
            f"(0.0 %), {sent / 20} req/s, P50 {p50} ms, P99 {p99} ms, open-loop dispatch lag\n"
        )
    # worker 0: 100 batches of 5 before the rates, +200 batches of 4 at 700, +100 of 10 at 800
    for w in (0, 1):
        (out / f"metrics_start_w{w}.prom").write_text(metrics(100, 500, 1.0))
        (out / f"metrics_700_w{w}.prom").write_text(metrics(300, 1300, 3.0))
        (out / f"metrics_800_w{w}.prom").write_text(metrics(400, 2300, 5.5))
    (out / "dmon_700.txt").write_text(
        "# gpu sm mem\n# Idx % %\n 0 0 0\n 0 96 3\n 0 97 3\n 0 99 4\n"
    )
    capture = "index v1: 6 decode plans captured as CUDA graphs in 67.8 s"
    (out / "server.log").write_text(f"INFO grace.pipeline[worker 0]: {capture}\n")
    return out


def test_rates_workers_and_thresholds(run_dir: Path) -> None:
    f = summarize(run_dir, ["700", "800"], 20.0)
    r700, r800 = f["rates"]
    assert (r700["ok"], r700["ok_rps"], r700["passed"]) == (14000, 700.0, True)
    assert (r800["ok"], r800["failed_pct"], r800["passed"]) == (15992, 0.05, False)
    assert f["max_ok_rps_passing"] == 700.0
    w = r700["server_workers"]
    assert len(w) == 2 and w[0]["batches"] == 200 and w[0]["mean_batch"] == 4.0  # deltas
    assert w[0]["stage_mean_ms"] == {"input": 4.0, "features": 1.0, "compute": 2.0, "post": 10.0}
    assert r800["server_workers"][1]["mean_batch"] == 10.0
    assert r800["server_workers"][1]["stage_mean_ms"]["post"] == 25.0
    assert r700["gpu"]["median_pct_under_load"] == 97 and r800["gpu"] is None
    assert f["decode_plan_captures"] == [{"plans": 6, "seconds": 67.8}]
    text = table(f)
    assert "| 700 | 700.0 | 0.0 % | 30 / 59 ms | yes | 97 % | 4.0 + 4.0 | 10.0 / 10.0 |" in text
    assert "| 800 | 799.6 | 0.05 % | 98 / 160 ms | no | — |" in text


def test_a_failure_ratio_over_the_threshold_fails_the_rate(run_dir: Path) -> None:
    f = summarize(run_dir, ["700", "800"], 20.0, p99_ms=200.0, fail_ratio=0.0001)
    assert [r["passed"] for r in f["rates"]] == [True, False]  # 8 / 16000 > 0.01 %
    f = summarize(run_dir, ["700", "800"], 20.0, p99_ms=200.0, fail_ratio=0.001)
    assert [r["passed"] for r in f["rates"]] == [True, True]
    assert f["max_ok_rps_passing"] == 799.6


def test_durations() -> None:
    assert [seconds(d) for d in ("20s", "1m", "1m30s", "90", "2.5s")] == [20, 60, 90, 90, 2.5]
    for bad in ("", "abc", "20x"):
        with pytest.raises(ValueError, match="duration"):
            seconds(bad)


def test_command_line_writes_json_and_refuses_missing_rates(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(SCRIPT), str(run_dir), "--duration", "20s", "--json", str(out)]
    done = subprocess.run([*cmd, "--rates", "700 800"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert {"command", "git_commit", "device", "date"} <= set(data)
    assert data["figures"]["max_ok_rps_passing"] == 700.0
    assert "max OK req/s passing: 700.0" in done.stdout
    bad = subprocess.run([*cmd, "--rates", "700 900"], capture_output=True, text=True)
    assert bad.returncode == 2 and "rates ['900']" in bad.stderr
