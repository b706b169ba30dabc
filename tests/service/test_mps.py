"""`service/mps.py` and the `mps` setting: the supervisor's private CUDA MPS daemon, run
against a stand-in `nvidia-cuda-mps-control` that logs how it was called (no GPU here)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service import mps, workers
from service.mps import ENV, MpsError, check_mps, mps_daemon, resolve_mps
from service.placement import Slot
from service.settings import load_settings
from tests.helpers.mps_control import fake_control
from tests.helpers.server_process import free_ports

ROOT = Path(__file__).resolve().parents[2]
ONE_GPU = [Slot(0, 0, None), Slot(1, 0, None)]  # two workers on GPU 0 (no GPU here)


def test_daemon_starts_before_and_quits_after_the_block(control: Path) -> None:
    """`-d` with private pipe/log dirs, the clients' environment exported meanwhile (so
    spawned workers connect to it), 'quit' on the way out, the environment restored."""
    with mps_daemon(ordinal=2) as env:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(pipe).is_dir() and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        exe = shutil.which("nvidia-cuda-mps-control")
        # the probe attached through this daemon (its pipes), to GPU 2, before the block
        assert control.read_text().splitlines() == [f"-d||{pipe}", f"probe|{exe} 2|{pipe}"]
    assert control.read_text().splitlines()[2:] == [f"|quit|{pipe}"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert not Path(pipe).exists()  # the private temp dir is gone


def test_daemon_quits_even_when_the_block_fails(control: Path) -> None:
    with pytest.raises(KeyError), mps_daemon():
        raise KeyError("a worker failed")
    calls = [x for x in control.read_text().splitlines() if not x.startswith("probe|")]
    assert [line.split("|")[1] for line in calls] == ["", "quit"]


def test_missing_or_failing_control_binary_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(MpsError, match="not on PATH"), mps_daemon():
        pass
    fake_control(tmp_path, tmp_path / "calls.log", fail=True)
    with pytest.raises(MpsError, match="already running"), mps_daemon():
        pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_mps_setting_needs_workers_and_cuda() -> None:
    assert load_settings({"workers": 2}).mps is None  # unset: decided at start (resolve_mps)
    assert load_settings({"workers": 2, "mps": True, "device": "cuda"}).mps
    for bad in ({"workers": 1, "mps": True}, {"workers": 2, "mps": True, "device": "cpu"}):
        with pytest.raises(ValidationError, match="mps"):
            load_settings(bad)


def test_supervise_runs_the_workers_inside_the_daemon(
    control: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers start with the daemon's environment and the daemon outlives them; with
    `auto` resolving to a CPU the supervisor refuses before starting anything."""
    seen: list[str | None] = []

    def fake_supervise(settings, placed, envs) -> int:
        seen.append(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
        return 0

    monkeypatch.setattr(workers, "_supervise", fake_supervise)
    s = load_settings({"workers": 2, "mps": True, "device": "cuda", "port": 50999})
    assert workers.supervise(s, ONE_GPU) == 0
    assert seen[0] is not None and control.read_text().count("quit") == 1
    auto = load_settings({"workers": 2, "mps": True, "port": 50999})
    monkeypatch.setattr(mps, "DRIVER_NODE", Path("/nonexistent/nvidiactl"))
    with pytest.raises(MpsError, match="no CUDA"):
        workers.supervise(auto)
    assert len(seen) == 1


def test_serve_flag_reports_a_missing_daemon_as_bad_input(tmp_path: Path) -> None:
    """`grace serve --workers 2 --mps` without the driver's control binary: one line on
    stderr, exit status 2, no traceback."""
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}"}
    # free ports: the ports are checked first, and a test beside it may hold the defaults
    port, metrics = free_ports(1, 2)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--workers", "2", "--mps", "--device",
         "cuda", "--data-dir", str(tmp_path), "--port", str(port), "--metrics-port",
         str(metrics), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "nvidia-cuda-mps-control is not on PATH" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_daemon_start_that_hangs_is_told_to_quit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-d` that does not return in time: MpsError, and 'quit' is sent in case it is up.
    TIMEOUT_S bounds both calls: 2 s (all the hang costs here) leaves the 'quit' script
    time to run on a busy machine; `-d` hangs an hour (exec'd: the timeout's kill ends it)."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text(
        f'#!/bin/sh\nif [ "$1" = "-d" ]; then exec sleep 3600; fi\necho "quit:$(cat)" >> {log}\n'
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(mps, "TIMEOUT_S", 2.0)
    with pytest.raises(MpsError, match="failed"), mps_daemon():
        pass
    assert log.read_text().strip() == "quit:quit"


def test_check_mps_refuses_a_cpu_before_anything_starts(
    control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decided without torch: 'auto' is CUDA where the driver's device node is."""
    check_mps(load_settings({"workers": 2, "mps": True, "device": "cuda"}))
    auto = load_settings({"workers": 2, "mps": True})
    monkeypatch.setattr(mps, "DRIVER_NODE", tmp_path / "nvidiactl")
    with pytest.raises(MpsError, match="no CUDA device"):
        check_mps(auto)
    (tmp_path / "nvidiactl").touch()
    check_mps(auto)
    assert not control.exists()  # checking starts no daemon


def _on(settings: dict, device: str = "cuda") -> bool:
    return resolve_mps(load_settings({"port": 50999, "device": device, **settings}))


def test_unset_mps_is_on_wherever_it_can_help(
    control: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset, MPS runs for several workers on CUDA with the control binary present; never
    for one worker or a CPU; not when a node-wide daemon is already configured; `mps`
    false wins. A missing binary turns it off with a warning, not an error."""
    assert _on({"workers": 2})
    assert not _on({"workers": 1})
    assert not _on({"workers": 2}, device="cpu")
    assert not _on({"workers": 2, "mps": False})
    monkeypatch.setattr(mps, "DRIVER_NODE", control.parent / "nvidiactl")
    assert not _on({"workers": 2}, device="auto")  # no NVIDIA driver: auto is the CPU
    (control.parent / "nvidiactl").touch()
    assert _on({"workers": 2}, device="auto")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/nvidia/mps")
    assert not _on({"workers": 2})
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    monkeypatch.setenv("PATH", str(control.parent))  # no control binary there
    with caplog.at_level("WARNING", logger="grace.mps"):
        assert not _on({"workers": 3})
    assert "3 workers share one GPU without MPS" in caplog.text
    assert not control.exists()  # deciding starts no daemon


@pytest.mark.parametrize("failure", ["daemon", "probe"])
def test_an_mps_start_that_fails_serves_without_it_unless_asked(
    control: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failure: str,
) -> None:
    """`-d` fails, or it succeeds but no CUDA client can use the GPU through it (server
    will not start, user or /dev/shm trouble): unset `mps` logs an error and serves
    without MPS, `mps` true is an error naming why; a daemon that started is told to quit."""
    if failure == "daemon":
        fake_control(control.parent / "bin", control, fail=True)
        said, calls = "already running", [""]
    else:
        failing = control.parent / "failing_probe.py"
        failing.write_text("raise SystemExit('cuInit failed with CUDA error 805')\n")
        monkeypatch.setattr(mps, "PROBE_SCRIPT", failing)
        said, calls = "could attach.*CUDA error 805", ["", "quit"]
    ran: list[str | None] = []
    monkeypatch.setattr(workers, "_supervise",
                        lambda s, p, e: ran.append(os.environ.get(ENV[0])) or 0)  # fmt: skip
    unset = load_settings({"workers": 2, "device": "cuda", "port": 50999})
    with caplog.at_level("ERROR", logger="grace.workers"):
        assert workers.supervise(unset, ONE_GPU) == 0
    assert ran == [None] and "MPS did not start" in caplog.text
    assert [line.split("|")[1] for line in control.read_text().splitlines()] == calls
    asked = load_settings({"workers": 2, "mps": True, "device": "cuda", "port": 50999})
    with pytest.raises(MpsError, match=said):
        workers.supervise(asked, ONE_GPU)
    assert ran == [None]


def _server_list_control(bin_dir: Path, pids: str) -> str:
    """A control binary answering `get_server_list` with `pids` (and logging nothing)."""
    exe = bin_dir / "control-with-servers"
    exe.write_text(f'#!/bin/sh\ncat >/dev/null\necho "{pids}"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_probe_needs_a_server_serving_the_attached_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The probe passes only when the attach succeeds *and* the daemon lists a server —
    a client that cannot reach the daemon runs without MPS, silently."""
    from service import _mps_probe

    attached: list[int] = []
    monkeypatch.setattr(_mps_probe, "attach", attached.append)
    assert _mps_probe.main([_server_list_control(tmp_path, "4242"), "1"]) == 0
    assert attached == [1]
    assert _mps_probe.main([_server_list_control(tmp_path, ""), "0"]) == 1
    assert "attached without MPS" in capsys.readouterr().err

    def fails(ordinal: int) -> None:
        raise RuntimeError("cuDevicePrimaryCtxRetain failed with CUDA error 805")

    monkeypatch.setattr(_mps_probe, "attach", fails)
    assert _mps_probe.main([_server_list_control(tmp_path, "4242"), "0"]) == 1
    assert "CUDA error 805" in capsys.readouterr().err


def test_probe_reports_a_missing_driver(tmp_path: Path) -> None:
    """Run as the supervisor runs it: no libcuda here, so the reason is the loader's."""
    done = subprocess.run(
        [sys.executable, "-I", str(mps.PROBE_SCRIPT), _server_list_control(tmp_path, "1"), "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if done.returncode == 0:
        pytest.skip("a CUDA driver is installed here")
    assert "libcuda" in done.stderr


def test_gpu_ordinal_follows_the_device_setting() -> None:
    assert mps.gpu_ordinal(load_settings({"device": "cuda:3"})) == 3
    assert mps.gpu_ordinal(load_settings({"device": "cuda"})) == 0
    assert mps.gpu_ordinal(load_settings({"device": "auto"})) == 0


def test_mps_client_is_cuda_with_a_daemons_pipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `grace_mps_client` reports: CUDA and a daemon's pipe directory exported."""
    monkeypatch.delenv(ENV[0], raising=False)
    assert not mps.mps_client("cuda")
    monkeypatch.setenv(ENV[0], "/tmp/grace-mps-x/pipe")
    assert mps.mps_client("cuda:1") and not mps.mps_client("cpu")
