"""A small hand-written SVG line chart: axes, 1-2-5 ticks, grid, axis labels, a legend.

The bench figures (docs/figures/*.svg) are plain SVG 1.1 written here so that no
plotting library is needed. Each series is one `<polyline class="series">` (plus a
`<circle>` per point when markers are on); axes, ticks and grid are `<line>`s, so a
chart with N series holds exactly N polylines.

    from bench.svg_plot import Series, write_line_chart
    write_line_chart(path, [Series("ideal", [(0, 0), (1, 1)], dashed=True)],
                     title="...", x_label="...", y_label="...")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

# Okabe-Ito: distinguishable for colour-blind readers
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


@dataclass(frozen=True)
class Series:
    """One line: `points` are (x, y) in data units, drawn in order; y None is skipped."""

    name: str
    points: Sequence[tuple[float, float | None]]
    color: str | None = None  # default: the next palette colour
    dashed: bool = False
    markers: bool = True


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"tick range must be finite, got {lo}..{hi}")
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    k = 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def _nice_range(lo: float, hi: float, target: int) -> tuple[float, float]:
    """[lo, hi] widened to the enclosing tick values."""
    if hi <= lo:
        hi = lo + 1.0
    t = nice_ticks(lo, hi, target)
    step = t[1] - t[0] if len(t) > 1 else 1.0
    return math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step


def _label(v: float) -> str:
    return f"{v:.6g}"


def line_chart(
    series: Sequence[Series],
    *,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    x_range: tuple[float, float] | None = None,
    y_range: tuple[float, float] | None = None,
    width: int = 720,
    height: int = 440,
    ticks: int = 6,
) -> str:
    """The chart as an SVG document (a string). Ranges default to the data, widened to
    round ticks; the y range includes 0. The legend sits right of the plot area."""
    if not series:
        raise ValueError("a chart needs at least one series")
    xs = [x for s in series for x, y in s.points if y is not None]
    ys = [y for s in series for _, y in s.points if y is not None]
    if not xs:
        raise ValueError("no data points to plot")
    x0, x1 = x_range or _nice_range(min(xs), max(xs), ticks)
    y0, y1 = y_range or _nice_range(min(0.0, *ys), max(ys), ticks)
    legend_w = 36 + math.ceil(6.8 * max(len(s.name) for s in series))  # ~12 px sans
    left, right, top, bottom = 64, legend_w + 16, 40 if title else 16, 52
    pw, ph = width - left - right, height - top - bottom
    if pw <= 0 or ph <= 0:
        raise ValueError(f"{width}x{height} is too small for the margins and legend")

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, '
        f'sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    if title:
        out.append(f'<text x="{left + pw / 2:.1f}" y="22" text-anchor="middle" '
                   f'font-size="15" font-weight="bold">{escape(title)}</text>')  # fmt: skip
    out.append('<g class="grid" stroke="#e0e0e0" stroke-width="1">')
    x_ticks = [t for t in nice_ticks(x0, x1, ticks) if x0 - 1e-9 <= t <= x1 + 1e-9]
    y_ticks = [t for t in nice_ticks(y0, y1, ticks) if y0 - 1e-9 <= t <= y1 + 1e-9]
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" y2="{top + ph}"/>')
    for t in y_ticks:
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + pw}" y2="{py(t):.1f}"/>')
    out.append("</g>")
    out.append('<g class="axes" stroke="#000000" stroke-width="1">')
    out.append(f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}"/>')
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{top + ph}" x2="{px(t):.1f}" y2="{top + ph + 5}"/>')
    for t in y_ticks:
        out.append(f'<line x1="{left - 5}" y1="{py(t):.1f}" x2="{left}" y2="{py(t):.1f}"/>')
    out.append("</g>")
    out.append('<g class="tick-labels" fill="#000000">')
    for t in x_ticks:
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 19}" '
                   f'text-anchor="middle">{_label(t)}</text>')  # fmt: skip
    for t in y_ticks:
        out.append(f'<text x="{left - 8}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{_label(t)}</text>')  # fmt: skip
    out.append("</g>")
    if x_label:
        out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 12}" '
                   f'text-anchor="middle">{escape(x_label)}</text>')  # fmt: skip
    if y_label:
        cy = top + ph / 2
        out.append(f'<text x="16" y="{cy:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 16 {cy:.1f})">{escape(y_label)}</text>')  # fmt: skip
    colors = iter(PALETTE * (len(series) // len(PALETTE) + 1))
    dashes = ' stroke-dasharray="6 4"'
    styled = [(s, s.color or next(colors), dashes if s.dashed else "") for s in series]
    out.append(f'<clipPath id="plot-area"><rect x="{left}" y="{top}" width="{pw}" '
               f'height="{ph}"/></clipPath>')  # fmt: skip
    for s, color, dash in styled:
        pts = [(px(x), py(y)) for x, y in s.points if y is not None]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
        out.append(f'<g clip-path="url(#plot-area)"><polyline class="series" '
                   f'data-name={quoteattr(s.name)} points="{coords}" fill="none" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')  # fmt: skip
        if s.markers:
            out.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>' for a, b in pts)
        out.append("</g>")
    lx, ly = left + pw + 16, top + 8
    out.append('<g class="legend">')
    for i, (s, color, dash) in enumerate(styled):
        y = ly + 20 * i
        out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 28}" y2="{y}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')  # fmt: skip
        if s.markers:
            out.append(f'<circle cx="{lx + 14}" cy="{y}" r="3" fill="{color}"/>')
        out.append(f'<text x="{lx + 36}" y="{y + 4}">{escape(s.name)}</text>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_line_chart(path: Path, series: Sequence[Series], **kw: Any) -> Path:
    """`line_chart(series, **kw)` written to `path` (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line_chart(series, **kw))
    return path
