"""Shared bits of the benchmark scripts: the result header and the JSON writer.

Every result file holds the command, git commit, device, date and the figures, so any
number in docs/PERFORMANCE.md can be reproduced.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            # results of earlier runs do not make the code dirty
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total / 2**30
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"GPU {torch.cuda.get_device_name()} (torch {torch.__version__})"
    except ImportError:
        pass
    return f"{cpu}; {os.cpu_count()} CPUs; {mem:.0f} GiB RAM; {gpu}"


def timed(fn: Callable[[], object], repeat: int, warmup: int = 2) -> list[float]:
    """Milliseconds of `repeat` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def percentiles(xs: list[float], digits: int = 3) -> dict[str, float]:
    """Median and P99 of millisecond samples, as every bench reports them."""
    return {
        "p50_ms": round(statistics.median(xs), digits),
        "p99_ms": round(float(np.percentile(xs, 99)), digits),
    }


def header() -> dict[str, Any]:
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": git_commit(),
        "device": device(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def write_result(name: str, figures: dict[str, Any], path: Path | None = None, **meta: Any) -> Path:
    """bench/results/NAME.json (or `path`): the header (fields in `meta` replace or join
    it) and the figures."""
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header(), **meta, "figures": figures}, indent=1) + "\n")
    return path
