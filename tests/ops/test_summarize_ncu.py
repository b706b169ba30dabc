"""`bench/summarize_ncu.py`: Nsight Compute's details CSV (one row per metric and launch,
after the profiled program's own output) -> one line per kernel and launch shape with
medians. The CSV here is written as ncu writes it: quoted fields, thousands separators,
durations in nanoseconds or microseconds."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.summarize_ncu import NcuCsvError, short_name, summarize

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
           "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
           "Metric Unit", "Metric Value"]  # fmt: skip


def ncu_csv(launches: list[tuple[str, str, dict[str, tuple[str, str]]]]) -> str:
    """`launches`: (kernel, grid, {metric: (unit, value)}) in launch order."""
    out = io.StringIO()
    out.write("row  P50 ms   (the program's own output)\n==PROF== Disconnected from process 7\n")
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(COLUMNS)
    for i, (kernel, grid, metrics) in enumerate(launches):
        for name, (unit, value) in metrics.items():
            w.writerow([i, 7, "python3", "127.0.0.1", kernel, 1, 7, "(256, 1, 1)", grid, 0,
                        "9.0", "GPU Speed Of Light Throughput", name, unit, value])  # fmt: skip
    return out.getvalue()


def sol(ns: str, dram: str, sm: str, unit: str = "nsecond") -> dict[str, tuple[str, str]]:
    return {"Duration": (unit, ns), "DRAM Throughput": ("%", dram),
            "Compute (SM) Throughput": ("%", sm),
            "SM Frequency": ("hz", "1,755,000,000")}  # fmt: skip


def test_medians_per_kernel_and_shape_in_launch_order() -> None:
    text = ncu_csv([
        ("_gelu_fp8_kernel", "(16384, 1, 1)", sol("190,000", "40.0", "70.0")),
        ("_layer_norm_kernel", "(2048, 1, 1)", sol("6.5", "27.2", "37.5", unit="usecond")),
        ("_gelu_fp8_kernel", "(16384, 1, 1)", sol("200,000", "42.0", "72.0")),
        ("_gelu_fp8_kernel", "(16384, 1, 1)", sol("230,000", "44.0", "71.0")),
        ("_gelu_fp8_kernel", "(16, 1, 1)", sol("3,000", "1.0", "2.0")),
    ])  # fmt: skip
    got = summarize(text)
    assert [(k["kernel"], k["grid"], k["launches"]) for k in got] == [
        ("_gelu_fp8_kernel", "(16384, 1, 1)", 3),
        ("_layer_norm_kernel", "(2048, 1, 1)", 1),
        ("_gelu_fp8_kernel", "(16, 1, 1)", 1),
    ]
    gelu = got[0]
    assert gelu["duration_us_median"] == 200.0  # ns -> us, the median of 190, 200, 230
    assert gelu["dram_pct_median"] == 42.0 and gelu["sm_pct_median"] == 71.0
    assert got[1]["duration_us_median"] == 6.5  # already in us
    assert "issue_slots_busy_pct_median" not in gelu  # a section not collected is absent


def test_short_names_drop_the_signature() -> None:
    assert short_name("_gelu_fp8_kernel") == "_gelu_fp8_kernel"
    name = "void at::native::mbtopk::gatherTopK<float, unsigned int, 2>(at::cuda::detail::T)"
    assert short_name(name) == "at::native::mbtopk::gatherTopK<float, unsigned int, 2>"


def test_not_an_ncu_csv_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(NcuCsvError, match="no ncu CSV header"):
        summarize("==PROF== no kernels were profiled\n")
    bad = tmp_path / "ncu.csv"
    bad.write_text("==ERR== something went wrong\n")
    done = subprocess.run([sys.executable, "bench/summarize_ncu.py", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no ncu CSV header" in done.stderr


def test_the_cli_writes_the_json_with_the_ncu_command(tmp_path: Path) -> None:
    src, out = tmp_path / "ncu.csv", tmp_path / "ncu.json"
    src.write_text(ncu_csv([("_quantize_kernel", "(64, 1, 1)", sol("9,000", "60.0", "20.0"))]))
    done = subprocess.run([sys.executable, "bench/summarize_ncu.py", str(src), "--out", str(out),
                           "--command", "ncu -k regex:x python3 y.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["command"] == "ncu -k regex:x python3 y.py"
    assert "summarize_ncu.py" in result["summarized_by"]
    assert result["figures"]["kernels"][0]["duration_us_median"] == 9.0
    assert "_quantize_kernel" in done.stderr  # the table for the reader
