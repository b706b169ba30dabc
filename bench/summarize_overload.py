"""Summarise a bench/gpu_overload.sh run: one row per offered rate — goodput, outcomes,
latencies, refusal latency, and per worker the requests it batched and refused — against
the run's own baseline (the goodput at --baseline req/s offered, about the served
capacity). Writes a result JSON (command, commit, device, date, figures) and prints a
markdown table.

    python3 bench/summarize_overload.py OUT --json bench/results/overload_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device, write_result
from bench.svg_plot import Series, write_line_chart
from tests.helpers.server_process import metric_value

COUNTERS = {
    "requests": "grace_batch_size_sum",
    "batches": "grace_batch_size_count",
    "refused": "grace_admission_refused_total",
    "queue_expired": "grace_queue_expired_total",
    "stage_dropped": "grace_stage_dropped_total",
}


def worker_deltas(out: Path, before: str, after: str) -> list[dict[str, float]]:
    """Per worker: how much each counter grew between two scrapes."""
    rows = []
    for path in sorted(out.glob(f"metrics_{after}_w*.prom")):
        prior = path.with_name(path.name.replace(f"_{after}_", f"_{before}_"))
        a, b = path.read_text(), prior.read_text() if prior.exists() else ""
        grown = {k: (metric_value(a, m) or 0.0) - (metric_value(b, m) or 0.0)
                 for k, m in COUNTERS.items()}  # fmt: skip
        rows.append(grown)
    return rows


def summarise(out: Path, baseline: float) -> dict[str, Any]:
    runs = sorted(
        (json.loads(p.read_text()) for p in out.glob("rate_*.json")), key=lambda r: r["rate"]
    )
    if not runs:
        raise SystemExit(f"{out}: no rate_*.json")
    base = min(runs, key=lambda r: abs(r["rate"] - baseline))
    base_goodput = base["steady_goodput_rps"]
    rows, before = [], "start"
    for r in runs:
        name = f"{r['rate']:g}"
        rows.append(
            {
                "offered_rps": r["offered_rps"],
                "deadline_ms": r["deadline_s"] * 1e3,
                "goodput_rps": r["steady_goodput_rps"],
                "goodput_vs_baseline": round(r["steady_goodput_rps"] / base_goodput, 3),
                "outcomes": {k: v["count"] for k, v in r["outcomes"].items()},
                "ok_p50_ms": r["ok_p50_ms"],
                "ok_p99_ms": r["ok_p99_ms"],
                "refusal_p50_ms": r["refusal_p50_ms"],
                "refusal_p99_ms": r["refusal_p99_ms"],
                "generator_lag_p99_ms": r["lag_p99_ms"],
                "generator_behind": r["generator_behind"],
                "workers": worker_deltas(out, before, name),
            }
        )
        before = name
    return {
        "baseline_offered_rps": base["offered_rps"],
        "baseline_goodput_rps": base["steady_goodput_rps"],
        "processes": runs[0]["processes"],
        "channels_per_process": runs[0]["channels"],
        "seconds_per_rate": runs[0]["seconds"],
        "rates": rows,
    }


def table(figures: dict[str, Any]) -> str:
    lines = [
        "| offered req/s | goodput req/s | vs baseline | OK | RESOURCE_EXHAUSTED | "
        "DEADLINE_EXCEEDED | OK P50 / P99 ms | refusal P99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rates"]:
        o = r["outcomes"]
        lines.append(
            f"| {r['offered_rps']:,.0f} | {r['goodput_rps']:,.1f} | {r['goodput_vs_baseline']:.2f} "
            f"| {o.get('OK', 0):,} | {o.get('RESOURCE_EXHAUSTED', 0):,} "
            f"| {o.get('DEADLINE_EXCEEDED', 0):,} | {r['ok_p50_ms']} / {r['ok_p99_ms']} "
            f"| {r['refusal_p99_ms']} |"
        )
    return "\n".join(lines)


def plot(path: Path, figures: dict[str, Any], device: str) -> Path:
    """Goodput against offered load, with the ideal min(offered, baseline goodput)."""
    rows = figures["rates"]
    top = max(r["offered_rps"] for r in rows)
    base = figures["baseline_goodput_rps"]
    deadline = rows[0]["deadline_ms"]
    refused = [
        (r["offered_rps"], r["outcomes"].get("RESOURCE_EXHAUSTED", 0) / figures["seconds_per_rate"])
        for r in rows
    ]
    series = [
        Series(
            "ideal: min(offered, baseline)",
            [(0.0, 0.0), (base, base), (top, base)],
            color="#888888",
            dashed=True,
            markers=False,
        ),
        Series(
            f"goodput, deadline {deadline:g} ms",
            [(r["offered_rps"], r["goodput_rps"]) for r in rows],
        ),
        Series("refused per second", refused),
    ]
    return write_line_chart(
        path,
        series,
        x_range=(0.0, top),
        title=f"Goodput under overload ({device})",
        x_label="offered load (req/s)",
        y_label="req/s",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the run's output directory (bench/gpu_overload.sh OUT)")
    p.add_argument("--json", type=Path, help="write the result here (default OUT/summary.json)")
    p.add_argument("--baseline", type=float, default=1000.0,
                   help="offered rate whose goodput is the baseline (%(default)s)")  # fmt: skip
    p.add_argument("--note", help="a note stored with the result (where and how it ran)")
    p.add_argument("--command", help="the command that ran (default: this one)")
    p.add_argument("--commit", help="the code's git commit (default: this checkout's)")
    p.add_argument("--device", help="the machine it ran on (default: this one)")
    p.add_argument("--svg", type=Path, help="also plot goodput here (docs/figures/*.svg)")
    a = p.parse_args(argv)
    figures = summarise(a.out, a.baseline)
    given = {"command": a.command, "git_commit": a.commit, "device": a.device, "note": a.note}
    given = {k: v for k, v in given.items() if v}
    path = write_result("overload_gpu", figures, a.json or a.out / "summary.json", **given)
    print(table(figures))
    print(f"wrote {path}")
    if a.svg:
        gpu = given.get("device", device()).rsplit("GPU ", 1)[-1].split(" (")[0]
        print(f"wrote {plot(a.svg, figures, gpu)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
