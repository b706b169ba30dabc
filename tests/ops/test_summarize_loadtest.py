"""`bench/summarize_loadtest.py`: the load script's files -> the figures OPERATIONS.md
quotes. Synthetic run directories: two rates, two workers, counters that grow."""

from __future__ import annotations

import json
import os
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
        os.utime(out / f"rate_{rate}_stats.csv", (int(rate), int(rate)))  # ran in this order
    # worker 0: 100 batches of 5 before the rates, +200 batches of 4 at 700, +100 of 10 at 800
    for w in (0, 1):
        (out / f"metrics_start_w{w}.prom").write_text(metrics(100, 500, 1.0))
        (out / f"metrics_700_w{w}.prom").write_text(metrics(300, 1300, 3.0))
        (out / f"metrics_800_w{w}.prom").write_text(metrics(400, 2300, 5.5))
    (out / "dmon_700.txt").write_text(
        "# gpu sm mem\n# Idx % %\n 0 0 0\n 0 96 3\n 0 97 3\n 0 99 4\n"
    )
    capture = "index v1: 6 decode plans captured as CUDA graphs in 67.8 s"
    serves = "model m-1 serves in fp8: its FP8 quality record passes: recall@100 +0.0000"
    (out / "server.log").write_text(
        f"INFO grace.rollout[worker 0]: {serves}\nINFO grace.pipeline[worker 0]: {capture}\n"
    )
    return out


def test_rates_workers_and_thresholds(run_dir: Path) -> None:
    assert summarize(run_dir, ["700"], 20.0)["settings"] == {}  # an older run: no record
    (run_dir / "settings.env").write_text("GRACE_BALANCE=request\nWORKERS=2\n")
    f = summarize(run_dir, ["700", "800"], 20.0)
    assert f["settings"] == {"GRACE_BALANCE": "request", "WORKERS": "2"}
    r700, r800 = f["rates"]
    assert (r700["ok"], r700["ok_rps"], r700["passed"]) == (14000, 700.0, True)
    assert (r800["ok"], r800["failed_pct"], r800["passed"]) == (15992, 0.05, False)
    assert f["max_ok_rps_passing"] == 700.0
    w = r700["server_workers"]
    assert set(w) == {"w0", "w1"} and w["w0"]["batches"] == 200  # deltas, not totals
    assert w["w0"]["mean_batch"] == 4.0
    assert w["w0"]["stage_mean_ms"] == {"input": 4.0, "features": 1.0, "compute": 2.0, "post": 10.0}
    assert r800["server_workers"]["w1"]["mean_batch"] == 10.0
    assert r800["server_workers"]["w1"]["stage_mean_ms"]["post"] == 25.0
    assert r700["gpu"]["median_pct_under_load"] == 97 and r800["gpu"] is None
    assert f["decode_plan_captures"] == [{"plans": 6, "seconds": 67.8}]
    why = "its FP8 quality record passes: recall@100 +0.0000"
    assert f["served_in"] == [{"model": "m-1", "dtype": "fp8", "why": why}]
    text = table(f)
    assert "| 700 | 700.0 | 0.0 % | 30 / 59 ms | yes | 97 % | 4.0 + 4.0 | 10.0 / 10.0 |" in text
    assert "| 800 | 799.6 | 0.05 % | 98 / 160 ms | no | — |" in text


def test_a_failure_ratio_over_the_threshold_fails_the_rate(run_dir: Path) -> None:
    f = summarize(run_dir, ["700", "800"], 20.0, p99_ms=200.0, fail_ratio=0.0001)
    assert [r["passed"] for r in f["rates"]] == [True, False]  # 8 / 16000 > 0.01 %
    f = summarize(run_dir, ["700", "800"], 20.0, p99_ms=200.0, fail_ratio=0.001)
    assert [r["passed"] for r in f["rates"]] == [True, True]
    assert f["max_ok_rps_passing"] == 799.6


def test_locust_verdict_wins_over_the_recomputed_one(run_dir: Path) -> None:
    """The log's verdict covers checks the CSV cannot show (open-loop dispatch lag)."""
    log = run_dir / "rate_700.log"
    log.write_text(log.read_text() + "[x] ERROR: threshold missed: dispatch lag 2.0 s\n")
    assert summarize(run_dir, ["700", "800"], 20.0)["rates"][0]["passed"] is False
    log.write_text(log.read_text() + "[x] INFO: thresholds met\n")
    assert summarize(run_dir, ["700", "800"], 20.0)["rates"][0]["passed"] is True


def test_restarts_and_missing_scrapes_never_give_negative_counts(run_dir: Path) -> None:
    """A worker restarted during 800 (counters back near zero): its after-value is the
    increase. Worker 0's scrape after 700 empty: no figures for it there, and at 800 its
    counts run from its start (flagged); worker 1 is still reported."""
    (run_dir / "metrics_800_w1.prom").write_text(metrics(50, 300, 1.0))
    (run_dir / "metrics_700_w0.prom").write_text("")
    r700, r800 = summarize(run_dir, ["700", "800"], 20.0)["rates"]
    assert r700["server_workers"]["w0"] == {
        "batches": None,
        "mean_batch": None,
        "stage_mean_ms": None,
        "scrape": "missing",
    }
    assert r700["server_workers"]["w1"]["batches"] == 200
    w1 = r800["server_workers"]["w1"]
    assert (w1["batches"], w1["mean_batch"], w1["scrape"]) == (50, 6.0, "restarted")
    w0 = r800["server_workers"]["w0"]
    assert w0["batches"] == 400 and w0["scrape"].startswith("no baseline")
    (run_dir / "metrics_700_w0.prom").unlink()  # a gap: w1 is still found
    assert set(summarize(run_dir, ["700"], 20.0)["rates"][0]["server_workers"]) == {"w1"}


def test_a_rate_that_answered_nothing_fails_without_crashing(run_dir: Path) -> None:
    (run_dir / "rate_800_stats.csv").write_text(CSV_HEAD + ",Aggregated,0,0,N/A,N/A\n")
    (run_dir / "rate_800.log").write_text("")
    r800 = summarize(run_dir, ["700", "800"], 20.0)["rates"][1]
    assert (r800["sent"], r800["all_p99_ms"], r800["passed"]) == (0, None, False)
    assert "| 800 | 0.0 | 0.0 % | — | no |" in table({"rates": [r800]})


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
    skip = subprocess.run([*cmd, "--rates", "700 900", "--skip-missing"], capture_output=True)
    assert skip.returncode == 0 and len(json.loads(out.read_text())["figures"]["rates"]) == 1
    order = subprocess.run([*cmd, "--rates", "800 700"], capture_output=True, text=True)
    assert order.returncode == 2 and "not in the order they ran" in order.stderr
    zero = subprocess.run([*cmd[:4], "--duration", "0s", "--rates", "700"], capture_output=True)
    assert zero.returncode == 2
