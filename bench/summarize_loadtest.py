"""Summarise one `bench/gpu_loadtest.sh` output directory as result JSON and a table.

The load script leaves, per offered rate R: locust's `rate_R_stats.csv` and `rate_R.log`
(its `grace loadtest:` summary line), each worker's `/metrics` after the rate
(`metrics_R_wI.prom`, and `metrics_start_wI.prom` after the warm-up), `nvidia-smi dmon`
samples (`dmon_R.txt`, GPU only) and the server's log. This script turns them into the
figures docs/OPERATIONS.md quotes, so a run's numbers come from its files, not by hand:
OK req/s, failed share, P50/P99, pass/fail (locust's verdict as logged; the given
thresholds where the log has none), and per worker the batches, mean batch size and mean
stage times over that rate alone (metric deltas from the previous scrape; a restarted
worker's counters count from zero), plus the median GPU busy share and how long the
decode plans took to capture. The JSON's header (commit, device, date) is the machine's
that runs this script: the load script runs it where the test ran.

    python bench/summarize_loadtest.py /tmp/paper --rates "700 800" --duration 20s \\
        --json bench/results/gpu_loadtest_run.json
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result

SCRIPT = Path(__file__).resolve()
STAGES = ("input", "features", "compute", "post")
_SUMMARY = re.compile(r"grace loadtest: .*P50 (?P<p50>[\d.]+) ms, P99 (?P<p99>[\d.]+) ms")
_CAPTURE = re.compile(r"(?P<plans>\d+) decode plans captured as CUDA graphs in (?P<s>[\d.]+) s")
_SERVES = re.compile(r"model (?P<model>\S+) serves in (?P<dtype>\w+): (?P<why>.*)$")  # dtype auto


def seconds(duration: str) -> float:
    """A locust-style duration ("20s", "1m", "1m30s", or bare seconds) in seconds."""
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?",
                         duration.strip())  # fmt: skip
    if not duration.strip() or parts is None:
        raise ValueError(f"not a duration: {duration!r} (e.g. 20s, 1m, 1m30s)")
    h, m, s = (float(x) if x else 0.0 for x in parts.groups())
    return 3600 * h + 60 * m + s


def scrape(path: Path) -> dict[tuple[str, str], float] | None:
    """(sample name, stage label or "") -> value for the series this summary reads; None
    for a scrape that is missing or empty (the load script leaves an empty file when a
    worker did not answer)."""
    if not path.exists() or not path.read_text().strip():
        return None
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            if s.name.startswith(("grace_batch_size_", "grace_stage_duration_seconds_")):
                out[(s.name, s.labels.get("stage", ""))] = s.value
    return out


def worker_delta(before: Path | None, after: Path) -> dict:
    """Batches, mean batch size and mean stage wall time per batch between two scrapes.
    A counter that went down means the worker restarted: as Prometheus' rate() does, its
    value after the restart is the increase. A missing "after" scrape gives no figures."""
    b = scrape(after)
    if b is None:
        return {"batches": None, "mean_batch": None, "stage_mean_ms": None, "scrape": "missing"}
    a = (scrape(before) if before is not None else None) or {}
    restarted = b.get(("grace_batch_size_count", ""), 0.0) < a.get(
        ("grace_batch_size_count", ""), 0.0
    )
    if restarted:
        a = {}

    def d(name: str, stage: str = "") -> float:
        return b.get((name, stage), 0.0) - a.get((name, stage), 0.0)

    batches = d("grace_batch_size_count")
    stages = {}
    for st in STAGES:
        n = d("grace_stage_duration_seconds_count", st)
        stages[st] = round(1e3 * d("grace_stage_duration_seconds_sum", st) / n, 2) if n else None
    out = {
        "batches": int(batches),
        "mean_batch": round(d("grace_batch_size_sum") / batches, 2) if batches else None,
        "stage_mean_ms": stages,
    }
    if restarted or (before is not None and scrape(before) is None):
        out["scrape"] = "restarted" if restarted else "no baseline: counts since start"
    return out


def gpu_busy(path: Path) -> dict | None:
    """`nvidia-smi dmon -s u` samples: the `sm` column per second (the share of the second
    in which a kernel was running, not how fully it used the GPU)."""
    if not path.exists():
        return None
    sm = [int(p[1]) for p in (line.split() for line in path.read_text().splitlines())
          if len(p) > 1 and not p[0].startswith("#") and p[1].isdigit()]  # fmt: skip
    busy = [x for x in sm if x > 0]
    return {"sm_pct_per_s": sm, "median_pct_under_load": statistics.median(busy) if busy else 0}


def _workers(out: Path, rate: str) -> list[int]:
    """Worker numbers with a scrape after this rate (a missing one leaves a gap, not an end)."""
    found = (re.fullmatch(rf"metrics_{re.escape(rate)}_w(\d+)\.prom", p.name)
             for p in out.glob(f"metrics_{rate}_w*.prom"))  # fmt: skip
    return sorted(int(m[1]) for m in found if m)


def _verdict(log: list[str]) -> bool | None:
    """locust's own verdict (loadtest/locustfile.py logs it: every threshold, the open-loop
    dispatch lag and "no request answered" included); None when the log has none."""
    for line in reversed(log):
        if "threshold missed:" in line:
            return False
        if "thresholds met" in line:
            return True
    return None


def rate_row(out: Path, rate: str, prev: str | None, duration_s: float, p99_ms: float,
             fail_ratio: float) -> dict:  # fmt: skip
    with (out / f"rate_{rate}_stats.csv").open() as fh:
        agg = next((r for r in csv.DictReader(fh) if r["Name"] == "Aggregated"), None)
    sent = int(agg["Request Count"]) if agg else 0
    failed = int(agg["Failure Count"]) if agg else 0
    log_path = out / f"rate_{rate}.log"
    log = log_path.read_text().splitlines() if log_path.exists() else []
    m = next((m for m in map(_SUMMARY.search, reversed(log)) if m), None)

    def pct(key: str) -> float | None:  # the CSV's "N/A" when nothing was answered
        try:
            return float(m[key]) if m else float(agg[f"{key[1:]}%"]) if agg else None
        except (TypeError, ValueError):
            return None

    p50, p99 = pct("p50"), pct("p99")
    failed_ratio = failed / sent if sent else 0.0
    verdict = _verdict(log)
    if verdict is None:  # no thresholds in the log: judge by the given ones
        verdict = sent > 0 and p99 is not None and p99 <= p99_ms and failed_ratio <= fail_ratio
    workers = {
        f"w{i}": worker_delta(
            None if prev is None else out / f"metrics_{prev}_w{i}.prom",
            out / f"metrics_{rate}_w{i}.prom",
        )
        for i in _workers(out, rate)
    }
    return {
        "offered_rps": float(rate),
        "sent": sent,
        "ok": sent - failed,
        "ok_rps": round((sent - failed) / duration_s, 1),
        "failed": failed,
        "failed_pct": round(100 * failed_ratio, 2),
        "all_p50_ms": p50,
        "all_p99_ms": p99,
        "passed": verdict,
        "server_workers": workers,
        "gpu": gpu_busy(out / f"dmon_{rate}.txt"),
    }


def summarize(out: Path, rates: list[str], duration_s: float, p99_ms: float = 100.0,
              fail_ratio: float = 0.001) -> dict:  # fmt: skip
    """Rates in the order they ran: each one's worker figures are the change since the
    scrape after the previous rate (after the warm-up for the first)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    rows, prev = [], "start"
    for rate in rates:
        if (out / f"rate_{rate}_stats.csv").exists():  # a rate whose locust run left nothing
            rows.append(rate_row(out, rate, prev, duration_s, p99_ms, fail_ratio))
        prev = rate  # its scrape, if any, is still the next rate's baseline
    passing = [r["ok_rps"] for r in rows if r["passed"]]
    log = out / "server.log"
    lines = log.read_text().splitlines() if log.exists() else []
    captures = [
        {"plans": int(m["plans"]), "seconds": float(m["s"])}
        for m in map(_CAPTURE.search, lines)
        if m
    ]
    served = [m.groupdict() for m in map(_SERVES.search, lines) if m]
    env = out / "settings.env"  # what the load script ran with (GRACE_*, WORKERS, USERS)
    settings = dict(
        line.split("=", 1) for line in (env.read_text().splitlines() if env.exists() else [])
        if "=" in line
    )  # fmt: skip
    return {
        "settings": settings,
        "thresholds": {"p99_ms": p99_ms, "fail_ratio": fail_ratio},
        "duration_s": duration_s,
        "rates": rows,
        "max_ok_rps_passing": max(passing) if passing else None,
        "decode_plan_captures": captures,
        "served_in": served,  # each model load's dtype and why (docs/FP8.md, "FP8 by default")
    }


def run_order(out: Path, rates: list[str]) -> list[str]:
    """The rates whose CSVs exist, checked to be in the order they ran (file times): the
    metric deltas are taken between consecutive rates."""
    times = [(out / f"rate_{r}_stats.csv").stat().st_mtime for r in rates]
    if times != sorted(times):
        raise ValueError(f"rates {rates} are not in the order they ran (by their CSVs' times)")
    return rates


def table(figures: dict) -> str:
    lines = [
        "| offered | OK req/s | failed | P50 / P99 | passed | GPU | batch | post ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rates"]:
        ws = list(r["server_workers"].values())
        gpu = f"{r['gpu']['median_pct_under_load']:.0f} %" if r["gpu"] else "—"
        batch = " + ".join(f"{w['mean_batch']}" for w in ws) or "—"
        post = (
            " / ".join(f"{w['stage_mean_ms']['post']}" if w["stage_mean_ms"] else "—" for w in ws)
            or "—"
        )
        ms = "—" if r["all_p99_ms"] is None else f"{r['all_p50_ms']:.0f} / {r['all_p99_ms']:.0f} ms"
        lines.append(
            f"| {r['offered_rps']:,.0f} | {r['ok_rps']:,.1f} | {r['failed_pct']} % | "
            f"{ms} | {'yes' if r['passed'] else 'no'} "
            f"| {gpu} | {batch} | {post} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the load script's output directory")
    ap.add_argument("--rates", required=True, help='the offered rates, in run order: "700 800"')
    ap.add_argument("--duration", required=True, help="time per rate, as the load script's "
                    "DURATION: 20s, 1m, 1m30s")  # fmt: skip
    ap.add_argument("--p99-ms", type=float, default=100.0, help="P99 threshold (ms)")
    ap.add_argument("--fail-ratio", type=float, default=0.001, help="failure threshold")
    ap.add_argument("--json", type=Path, help="write the result here (default: OUT/summary.json)")
    ap.add_argument("--skip-missing", action="store_true",
                    help="leave out rates that left no CSV (the load script's use)")  # fmt: skip
    a = ap.parse_args()
    if not a.out.is_dir():
        ap.error(f"{a.out} is not a directory")
    rates = a.rates.split()
    missing = [r for r in rates if not (a.out / f"rate_{r}_stats.csv").exists()]
    if missing and not a.skip_missing:
        ap.error(f"no rate_R_stats.csv in {a.out} for rates {missing} (--skip-missing)")
    try:
        duration = seconds(a.duration)
        run_order(a.out, [r for r in rates if r not in missing])
    except ValueError as exc:
        ap.error(str(exc))
    if duration <= 0:
        ap.error(f"--duration must be positive, got {a.duration!r}")
    if missing:
        print(f"skipping rates without results: {missing}", file=sys.stderr)
    figures = summarize(a.out, rates, duration, a.p99_ms, a.fail_ratio)
    path = write_result("gpu_loadtest", figures, a.json or a.out / "summary.json")
    print(table(figures))
    print(f"max OK req/s passing: {figures['max_ok_rps_passing']}; wrote {path}")


if __name__ == "__main__":
    main()
