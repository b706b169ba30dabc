"""Summarise one `bench/gpu_loadtest.sh` output directory as result JSON and a table.

The load script leaves, per offered rate R: locust's `rate_R_stats.csv` and `rate_R.log`
(its `grace loadtest:` summary line), each worker's `/metrics` after the rate
(`metrics_R_wI.prom`, and `metrics_start_wI.prom` after the warm-up), `nvidia-smi dmon`
samples (`dmon_R.txt`, GPU only) and the server's log. This script turns them into the
figures docs/OPERATIONS.md quotes, so a run's numbers come from its files, not by hand:
OK req/s, refused share, P50/P99, pass/fail against the thresholds, and per worker the
batches, mean batch size and mean stage times over that rate alone (metric deltas from
the previous scrape), plus the median GPU busy share and how long the decode plans took
to capture.

    python bench/summarize_loadtest.py /tmp/paper --rates "700 800" --duration 20s \\
        --json bench/results/gpu_loadtest_run.json
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import header

SCRIPT = Path(__file__).resolve()
STAGES = ("input", "features", "compute", "post")
_SUMMARY = re.compile(r"grace loadtest: .*P50 (?P<p50>[\d.]+) ms, P99 (?P<p99>[\d.]+) ms")
_CAPTURE = re.compile(r"(?P<plans>\d+) decode plans captured as CUDA graphs in (?P<s>[\d.]+) s")


def seconds(duration: str) -> float:
    """A locust-style duration ("20s", "1m", "1m30s", or bare seconds) in seconds."""
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?",
                         duration.strip())  # fmt: skip
    if not duration.strip() or parts is None:
        raise ValueError(f"not a duration: {duration!r} (e.g. 20s, 1m, 1m30s)")
    h, m, s = (float(x) if x else 0.0 for x in parts.groups())
    return 3600 * h + 60 * m + s


def scrape(path: Path) -> dict[tuple[str, str], float]:
    """(sample name, stage label or "") -> value, for the series this summary reads."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            if s.name.startswith(("grace_batch_size_", "grace_stage_duration_seconds_")):
                out[(s.name, s.labels.get("stage", ""))] = s.value
    return out


def worker_delta(before: Path, after: Path) -> dict:
    """Batches, mean batch size and mean stage wall time per batch between two scrapes."""
    a, b = (scrape(before) if before.exists() else {}), scrape(after)

    def d(name: str, stage: str = "") -> float:
        return b.get((name, stage), 0.0) - a.get((name, stage), 0.0)

    batches = d("grace_batch_size_count")
    stages = {}
    for st in STAGES:
        n = d("grace_stage_duration_seconds_count", st)
        stages[st] = round(1e3 * d("grace_stage_duration_seconds_sum", st) / n, 2) if n else None
    return {
        "batches": int(batches),
        "mean_batch": round(d("grace_batch_size_sum") / batches, 2) if batches else None,
        "stage_mean_ms": stages,
    }


def gpu_busy(path: Path) -> dict | None:
    """`nvidia-smi dmon -s u` samples: the `sm` column per second (the share of the second
    in which a kernel was running, not how fully it used the GPU)."""
    if not path.exists():
        return None
    sm = [int(p[1]) for p in (line.split() for line in path.read_text().splitlines())
          if len(p) > 1 and not p[0].startswith("#") and p[1].isdigit()]  # fmt: skip
    busy = [x for x in sm if x > 0]
    return {"sm_pct_per_s": sm, "median_pct_under_load": statistics.median(busy) if busy else 0}


def rate_row(out: Path, rate: str, prev: str, duration_s: float, p99_ms: float,
             fail_ratio: float) -> dict:  # fmt: skip
    with (out / f"rate_{rate}_stats.csv").open() as fh:
        agg = next(r for r in csv.DictReader(fh) if r["Name"] == "Aggregated")
    sent, failed = int(agg["Request Count"]), int(agg["Failure Count"])
    m = None
    log = out / f"rate_{rate}.log"
    if log.exists():
        m = next((m for m in map(_SUMMARY.search, reversed(log.read_text().splitlines())) if m),
                 None)  # fmt: skip
    # the summary line's percentiles are locust's over all calls; the CSV's are the same
    p50 = float(m["p50"]) if m else float(agg["50%"])
    p99 = float(m["p99"]) if m else float(agg["99%"])
    workers = []
    i = 0
    while (out / f"metrics_{rate}_w{i}.prom").exists():
        workers.append(
            worker_delta(out / f"metrics_{prev}_w{i}.prom", out / f"metrics_{rate}_w{i}.prom")
        )
        i += 1
    refused = failed / sent if sent else 0.0
    return {
        "offered_rps": float(rate),
        "sent": sent,
        "ok": sent - failed,
        "ok_rps": round((sent - failed) / duration_s, 1),
        "failed": failed,
        "failed_pct": round(100 * refused, 2),
        "all_p50_ms": p50,
        "all_p99_ms": p99,
        "passed": p99 <= p99_ms and refused <= fail_ratio,
        "server_workers": workers,
        "gpu": gpu_busy(out / f"dmon_{rate}.txt"),
    }


def summarize(out: Path, rates: list[str], duration_s: float, p99_ms: float = 100.0,
              fail_ratio: float = 0.001) -> dict:  # fmt: skip
    rows, prev = [], "start"
    for rate in rates:
        rows.append(rate_row(out, rate, prev, duration_s, p99_ms, fail_ratio))
        prev = rate
    passing = [r["ok_rps"] for r in rows if r["passed"]]
    log = out / "server.log"
    captures = [
        {"plans": int(m["plans"]), "seconds": float(m["s"])}
        for m in map(_CAPTURE.search, log.read_text().splitlines() if log.exists() else [])
        if m
    ]
    return {
        "thresholds": {"p99_ms": p99_ms, "fail_ratio": fail_ratio},
        "duration_s": duration_s,
        "rates": rows,
        "max_ok_rps_passing": max(passing) if passing else None,
        "decode_plan_captures": captures,
    }


def table(figures: dict) -> str:
    lines = [
        "| offered | OK req/s | failed | P50 / P99 | passed | GPU | batch | post ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rates"]:
        ws = r["server_workers"]
        gpu = f"{r['gpu']['median_pct_under_load']:.0f} %" if r["gpu"] else "—"
        batch = " + ".join(f"{w['mean_batch']}" for w in ws) or "—"
        post = " / ".join(f"{w['stage_mean_ms']['post']}" for w in ws) or "—"
        lines.append(
            f"| {r['offered_rps']:,.0f} | {r['ok_rps']:,.1f} | {r['failed_pct']} % | "
            f"{r['all_p50_ms']:.0f} / {r['all_p99_ms']:.0f} ms | {'yes' if r['passed'] else 'no'} "
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
    a = ap.parse_args()
    if not a.out.is_dir():
        ap.error(f"{a.out} is not a directory")
    try:
        duration = seconds(a.duration)
    except ValueError as exc:
        ap.error(str(exc))
    rates = a.rates.split()
    missing = [r for r in rates if not (a.out / f"rate_{r}_stats.csv").exists()]
    if missing:
        ap.error(f"no rate_R_stats.csv in {a.out} for rates {missing}")
    figures = summarize(a.out, rates, duration, a.p99_ms, a.fail_ratio)
    path = a.json or a.out / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header(), "figures": figures}, indent=1) + "\n")
    print(table(figures))
    print(f"max OK req/s passing: {figures['max_ok_rps_passing']}; wrote {path}")


if __name__ == "__main__":
    main()
