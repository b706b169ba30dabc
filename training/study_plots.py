"""Pictures of a `grace eval` report (`training/study.py`), written as PNGs by
`grace eval --plots DIR` (docs/EVALUATION.md, "The report"): `pass_rates.png`,
`recall.png` and, when the report has it, `fixed_generation.png`. matplotlib is the
`eval` extra (`pip install grace-serving[eval]`); without it `MissingPlotting` says how to
get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training import study_stats

CHECKS = tuple(f"{c}_pass" for c in study_stats.CHECKS)  # the report's keys
# Okabe-Ito, as bench/svg_plot.py: distinguishable for colour-blind readers
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


class MissingPlotting(RuntimeError):
    """matplotlib is not installed."""


def require_plotting() -> Any:
    """matplotlib's pyplot, drawing into files; MissingPlotting without matplotlib (called
    first by `grace eval --plots`, so that it fails before the decoding)."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingPlotting(
            "plots need matplotlib: pip install 'grace-serving[eval]' (or matplotlib)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Every picture of `report` into directory `out`; returns their paths."""
    plt = require_plotting()
    out.mkdir(parents=True, exist_ok=True)
    rows = report["variants"]
    paths = [_pass_rates(plt, rows, out / "pass_rates.png", report),
             _recall(plt, rows, out / "recall.png", report)]  # fmt: skip
    if any(r.get("fixed_generation") for r in rows):
        paths.append(_fixed(plt, rows, out / "fixed_generation.png", report))
    return paths


def _save(plt: Any, fig: Any, path: Path, report: dict, rect: tuple | None = None) -> Path:
    """Title the figure with the report's run, lay it out, write it as a PNG, close it."""
    title = f"{report['users']:,} users, beams {report['beams']}, model {report['model_version']}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax: Any, groups: Sequence[str], rows: Sequence[dict[str, Any]], value) -> None:
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(groups))]
        ys = [value(r, g) for g in groups]
        bars = ax.bar(xs, [0 if y is None else y for y in ys], width, label=r["variant"],
                      color=PALETTE[i % len(PALETTE)])  # fmt: skip
        for bar, y in zip(bars, ys, strict=True):
            if y is not None:
                at = (bar.get_x() + bar.get_width() / 2, y)
                ax.annotate(f"{y:.2f}", at, ha="center", va="bottom", fontsize=7,
                            rotation=90 if len(rows) > 3 else 0, xytext=(0, 1),
                            textcoords="offset points")  # fmt: skip
    ax.set_ylim(0, 1.15)
    ax.grid(axis="y", alpha=0.3)


def _pass_rates(plt: Any, rows: list[dict[str, Any]], path: Path, report: dict) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(3, 2))
    labels = list(dict.fromkeys(b for r in rows for b in r["paper_buckets"]))
    groups = [*labels, "all"]

    def final(r: dict[str, Any], g: str) -> float | None:
        if g == "all":
            return r["final_pass"]
        b = r["paper_buckets"].get(g)
        return None if b is None else b["final_pass"]

    _bars(left, groups, rows, final)
    shares = {g: rows[0]["paper_buckets"].get(g, {}).get("users_share") for g in labels}
    left.set_xticks(range(len(groups)),
                    [f"{g} ads\n{shares[g]:.0%} of users" if shares.get(g) is not None else g
                     for g in labels] + ["all users"])  # fmt: skip
    left.set_ylabel("final pass rate (exactly eligible / generated)")
    left.set_title("final pass rate per bucket of ads generated (paper Table 3)")
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=len(rows),
               fontsize=8)  # fmt: skip
    checks = [c.removesuffix("_pass") for c in CHECKS]
    _bars(right, checks, rows, lambda r, c: r[f"{c}_pass"])
    right.set_xticks(range(len(checks)), checks)
    right.set_title("pass rate of each check, all users")
    return _save(plt, fig, path, report, rect=(0, 0.06, 1, 1))


def _recall(plt: Any, rows: list[dict[str, Any]], path: Path, report: dict) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, r in enumerate(rows):
        color = PALETTE[i % len(PALETTE)]
        curve = sorted((int(k), v) for k, v in r["recall_curve"].items())
        left.plot([k for k, _ in curve], [v for _, v in curve], marker=".", color=color,
                  label=r["variant"])  # fmt: skip
        for ax, name in ((left, "recall"), (right, "ndcg")):
            at = sorted((int(m.split("@")[1]), v) for m, v in r["metrics"].items()
                        if m.startswith(f"{name}@"))  # fmt: skip
            ks = [k * (1 + 0.03 * (i - (len(rows) - 1) / 2)) for k, _ in at]  # a little apart
            mean = [v["mean"] for _, v in at]
            err = [[v["mean"] - v["lo"] for _, v in at], [v["hi"] - v["mean"] for _, v in at]]
            ax.errorbar(ks, mean, yerr=err, fmt="o" if ax is left else "o-", color=color,
                        capsize=3, markersize=4,
                        label=None if ax is left else r["variant"])  # fmt: skip
    for ax, name in ((left, "recall@K"), (right, "NDCG@K")):
        ax.set_xscale("log")
        ax.set_xlabel("K (ads returned)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    left.set_title("recall@K of the held-out next interaction (95% bootstrap CI)")
    right.set_title("NDCG@K (95% bootstrap CI)")
    return _save(plt, fig, path, report)


def _fixed(plt: Any, rows: list[dict[str, Any]], path: Path, report: dict) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.6))
    sizes = sorted({int(n) for r in rows for n in r["fixed_generation"]})
    groups = [str(n) for n in sizes]

    def rate(r: dict[str, Any], g: str) -> float | None:
        f = r["fixed_generation"].get(g)
        return None if f is None or not f["users"] else f["final_pass"]

    _bars(ax, groups, rows, rate)
    ax.set_xticks(range(len(groups)),
                  [f"first {n:,} ads\n{rows[0]['fixed_generation'][str(n)]['users']:,} users"
                   for n in sizes])  # fmt: skip
    ax.set_ylabel("final pass rate among the first N generated")
    ax.set_title("at a fixed number of generated ads")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(plt, fig, path, report)
