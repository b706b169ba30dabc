"""`bench/study.sh`, the effectiveness study end to end, split over device calls by
STOP_AFTER: the run ends after the named step, and a bad value is refused in one line
before anything is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def study(out: Path, work: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "study.sh"), str(out), "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHON": sys.executable, "WORK": str(work), "ADS": "3000",
             "USERS": "200", **env},
    )  # fmt: skip


def test_stop_after_synth_writes_the_world_and_nothing_after(tmp_path: Path) -> None:
    proc = study(tmp_path / "out", tmp_path / "work", STOP_AFTER="synth")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "work" / "world" / "world.json").is_file()
    assert not (tmp_path / "work" / "model").exists()
    assert "stopped after synth" in proc.stderr
    log = (tmp_path / "out" / "study.log").read_text()  # what it printed, kept in OUT
    assert "study: grace synth at" in log and "stopped after synth" in log
    # a rerun skips the finished step and stops at the same place
    again = study(tmp_path / "out", tmp_path / "work", STOP_AFTER="synth")
    assert again.returncode == 0 and "grace synth" not in again.stderr


def test_a_bad_stop_after_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = study(tmp_path / "out", tmp_path / "work", STOP_AFTER="evaluation")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "study.sh: STOP_AFTER must be synth, train, index or eval, not 'evaluation'"
    ]
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
