"""Nsight Compute's CSV (`ncu --csv --page details`, one row per metric and launch) → one
line per kernel and launch shape: launches, and the median of each speed-of-light,
occupancy and scheduler figure over them. `bench/gpu_fp8.sh` step "ncu" profiles the
FP8 decode loop's kernels that are not GEMMs with it (docs/FP8.md): whether each is
held by DRAM bandwidth or by issue, which decides what to change in it.

    python3 bench/summarize_ncu.py NCU.csv [--command "the ncu command"] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header

# ncu's metric name -> the key this writes (its median over a kernel's launches)
METRICS = {
    "Duration": "duration_us",
    "DRAM Throughput": "dram_pct",
    "L2 Cache Throughput": "l2_pct",
    "Memory Throughput": "memory_pct",
    "Compute (SM) Throughput": "sm_pct",
    "Achieved Occupancy": "achieved_occupancy_pct",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Registers Per Thread": "registers_per_thread",
    "Issue Slots Busy": "issue_slots_busy_pct",
    "No Eligible": "no_eligible_pct",
}
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}  # fmt: skip


class NcuCsvError(ValueError):
    """The file holds no ncu details CSV (or not the columns this reads)."""


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def short_name(kernel: str, width: int = 90) -> str:
    """A kernel's name without its argument list (C++ kernels carry their signature)."""
    return kernel.removeprefix("void ").split("(", 1)[0][:width].strip()


def rows(text: str) -> list[dict[str, str]]:
    """The CSV rows, from ncu's header line on (the profiled program's output and ncu's
    ==PROF== lines come before it)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise NcuCsvError('no ncu CSV header ("ID", ...): was ncu run with --csv --page details?')
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    need = {"ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name", "Metric Unit",
            "Metric Value"}  # fmt: skip
    if not need <= set(reader.fieldnames or ()):
        raise NcuCsvError(f"ncu CSV lacks columns {sorted(need - set(reader.fieldnames or ()))}")
    return list(reader)


def summarize(text: str) -> list[dict]:
    """One entry per (kernel, grid, block), in order of first launch: launches and the
    median of each METRICS figure (durations in µs)."""
    launches: dict[tuple[str, str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    for row in rows(text):
        key = (short_name(row["Kernel Name"]), row["Grid Size"], row["Block Size"])
        name = METRICS.get(row["Metric Name"])
        value = _number(row["Metric Value"])
        if name is None or value is None:
            continue
        if name == "duration_us":
            value *= TO_US.get(row["Metric Unit"].strip(), float("nan"))
        launches[key].setdefault(row["ID"], {})[name] = value
    out = []
    for (kernel, grid, block), by_id in launches.items():
        entry: dict = {"kernel": kernel, "grid": grid, "block": block, "launches": len(by_id)}
        for name in METRICS.values():
            values = [m[name] for m in by_id.values() if name in m]
            if values:
                entry[f"{name}_median"] = round(statistics.median(values), 2)
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("csv", type=Path, help="ncu --csv --page details output")
    ap.add_argument("--command", default="", help="the ncu command that wrote it (recorded)")
    ap.add_argument("--out", type=Path, help="write the JSON here (else print it)")
    a = ap.parse_args(argv)
    try:
        kernels = summarize(a.csv.read_text(errors="replace"))
    except (OSError, NcuCsvError) as exc:
        print(f"summarize_ncu: {a.csv}: {exc}", file=sys.stderr)
        return 2
    result = header()
    result["summarized_by"] = result["command"]
    result["command"] = a.command or f"ncu --csv --page details ... > {a.csv.name}"
    result["figures"] = {"kernels": kernels}
    text = json.dumps(result, indent=1) + "\n"
    if a.out:
        a.out.write_text(text)
        print(a.out)
    else:
        print(text, end="")
    for k in kernels:
        print(
            f"{k['kernel'][:40]:40} grid {k['grid']:>14} x{k['launches']:<4} "
            f"{k.get('duration_us_median', float('nan')):9.2f} us  DRAM "
            f"{k.get('dram_pct_median', float('nan')):5.1f} %  SM "
            f"{k.get('sm_pct_median', float('nan')):5.1f} %  issue "
            f"{k.get('issue_slots_busy_pct_median', float('nan')):5.1f} %",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
