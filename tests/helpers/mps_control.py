"""A stand-in `nvidia-cuda-mps-control` for the MPS tests (no GPU here): `fake_control`
writes one that logs how it was called, the `control` fixture puts it first on PATH
(with a probe that logs what it was given) and returns the log."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from service import mps
from service.mps import ENV


def fake_control(bin_dir: Path, log: Path, fail: bool = False) -> None:
    """A `nvidia-cuda-mps-control` that appends 'ARGS|STDIN|PIPE_DIR' to `log`, and
    '|CUDA_VISIBLE_DEVICES' when that is set (a daemon of one GPU of several)."""
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-d" ]; then in=; else in=$(cat); fi\n'
        f'echo "$*|$in|$CUDA_MPS_PIPE_DIRECTORY${{CUDA_VISIBLE_DEVICES:+|$CUDA_VISIBLE_DEVICES}}"'
        f" >> {log}\n"
        + ('echo "An instance of this daemon is already running" >&2; exit 1\n' if fail else "")
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    fake_control(bin_dir, log)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k in (*ENV, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    probe = bin_dir / "probe.py"  # attaches: logs what it was given
    probe.write_text(
        "import os, sys\n"
        f"open({str(log)!r}, 'a').write('probe|' + ' '.join(sys.argv[1:]) + '|'"
        " + os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '\\n')\n"
    )
    monkeypatch.setattr(mps, "PROBE_SCRIPT", probe)
    return log
