"""Every served Triton kernel compiles for Hopper (sm_90) — with the installed Triton and
with the oldest one the gpu extra allows — on a machine without a GPU.

The other kernel tests run under the interpreter, which never meets the compiler: the GTM
mask of the targeting schema passed all of them and then failed its first GPU start,
because Triton 3.6's front end would not take a tuple item as a `tl.static_range` bound.
`tests/helpers/hopper_compile.py` records the launches of the served launchers on CPU
tensors and compiles each one through the real front end, passes and ptxas.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# where `make install` puts the floor of the gpu extra, beside the venv's own packages
TRITON_MIN = Path(sys.prefix) / "triton-min"
SERVED = {"_gtm_mask_kernel", "_beam_advance_kernel", "_layer_norm_kernel",
          "_quantize_kernel", "_self_attn_kernel"}  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None,
        reason="triton is not installed (the gpu extra)",
    ),
]


def _compile_all(tmp_path: Path, extra_path: Path | None = None) -> tuple[dict, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, no cached kernel
    env["PYTHONPATH"] = os.pathsep.join([*([str(extra_path)] if extra_path else []), str(ROOT)])
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.hopper_compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert lines, f"no report (exit {run.returncode}): {run.stderr[-2000:]}"
    summary, launches = lines[-1], lines[:-1]
    failed = [f"{x['kernel']} {x['constants']}: {x['error']}" for x in launches if x["error"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stderr[-2000:]
    assert {x["kernel"] for x in launches} == SERVED
    return summary, launches


def _gtm_layouts(launches: list[dict]) -> set[tuple]:
    return {
        (tuple(x["constants"]["FAM_W"]), x["constants"]["HAS_N"], x["constants"]["GTM"])
        for x in launches
        if x["kernel"] == "_gtm_mask_kernel"
    }


def test_served_kernels_compile_for_hopper(tmp_path: Path) -> None:
    summary, launches = _compile_all(tmp_path)
    assert summary["failed"] == 0 and summary["launches"] == len(launches)
    # the GTM mask at no family, the default's one, several unrolled and a looped width,
    # without n_blooms, and CD only
    layouts = _gtm_layouts(launches)
    assert {((), True, True), ((4,), True, True), ((2, 8, 1), True, True)} <= layouts
    assert {((16, 2), True, True), ((4,), False, True), ((4,), False, False)} <= layouts


@pytest.mark.skipif(not TRITON_MIN.is_dir(), reason=f"no {TRITON_MIN} (make install)")
def test_served_kernels_compile_with_the_oldest_triton_allowed(tmp_path: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = next(
        re.search(r">=\s*([\d.]+)", x).group(1)
        for x in pyproject["project"]["optional-dependencies"]["gpu"]
        if x.startswith("triton")
    )
    summary, launches = _compile_all(tmp_path, TRITON_MIN)
    # the floor itself, not the installed Triton through a missing path
    assert summary["triton"].split(".")[:2] == floor.split(".")[:2], (summary, floor)
    assert len(_gtm_layouts(launches)) >= 6
