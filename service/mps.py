"""CUDA MPS for several workers on one GPU (setting `mps`; docs/SERVICE.md "MPS"): without
it the GPU time-slices between the workers' contexts; through MPS their kernels run side
by side. The supervisor (`service/workers.py`) brackets the workers with a private daemon:

    nvidia-cuda-mps-control -d      (pipe and log directories in a private temp dir)
    a throwaway CUDA client attaches through it (service/_mps_probe.py): it works
    workers inherit CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY and connect to it
    echo quit | nvidia-cuda-mps-control

It decides without importing torch or initialising CUDA, changes none of the GPU's own
settings, and uses a node-wide daemon whose CUDA_MPS_PIPE_DIRECTORY reaches it as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from service.settings import ServerSettings

log = logging.getLogger("grace.mps")
CONTROL = "nvidia-cuda-mps-control"
ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
TIMEOUT_S = 30.0
PROBE_SCRIPT = Path(__file__).with_name("_mps_probe.py")  # attaches before any worker
ATTACH_TIMEOUT_S = 60.0


class MpsError(OSError):
    """The MPS control daemon could not be started (the CLI reports it as bad input)."""


DRIVER_NODE = Path("/dev/nvidiactl")  # present wherever the NVIDIA driver is usable


def check_mps(settings: ServerSettings) -> None:
    """Everything `mps` needs, checked before anything slow: the control binary on PATH
    and a CUDA device (MpsError otherwise)."""
    control_binary()
    if not _on_cuda(settings):
        raise MpsError(f"mps is on but no CUDA device is in use (device {settings.device}"
                       f"{'' if settings.device == 'cpu' else f', no {DRIVER_NODE}'})")  # fmt: skip


def _on_cuda(settings: ServerSettings) -> bool:
    """Whether the workers will run on CUDA, without importing torch: 'auto' does where
    the driver is (where torch cannot use that GPU, set `mps` false)."""
    if settings.device == "auto":
        return DRIVER_NODE.exists()
    return settings.device.startswith("cuda")


def mps_client(device: str) -> bool:
    """Whether a process on `device` reaches the GPU through an MPS daemon."""
    # the supervisor's private daemon (exported once a client attached) or a node-wide one
    return device.startswith("cuda") and bool(os.environ.get(ENV[0]))


def resolve_mps(settings: ServerSettings) -> bool:
    """Whether the supervisor runs its private daemon: `mps` when set; unset, with several
    workers on CUDA, the control binary on PATH and no daemon configured already."""
    if settings.mps is not None:
        return settings.mps
    if settings.workers < 2 or not _on_cuda(settings):
        return False
    if pipes := os.environ.get(ENV[0]):
        log.info("MPS: using the daemon configured in %s=%s", ENV[0], pipes)
        return False
    if shutil.which(CONTROL) is None:
        log.warning(
            "%d workers share one GPU without MPS (%s is not on PATH): their kernels "
            "time-slice; give the container the driver's 'compute' capability, or set mps "
            "false to silence this",
            settings.workers, CONTROL,
        )  # fmt: skip
        return False
    return True


def control_binary() -> str:
    """The control daemon's path; MpsError when it is not on PATH (check before slow work)."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise MpsError(
            f"mps is on but {CONTROL} is not on PATH (it comes with the NVIDIA driver; in a "
            "container the NVIDIA runtime mounts it with the 'compute' capability)"
        )
    return exe


@contextlib.contextmanager
def mps_daemon(
    ordinal: int = 0,
    *,
    visible: str | None = None,  # the daemon's (and its clients') CUDA_VISIBLE_DEVICES
    export: bool = True,
) -> Iterator[dict[str, str]]:
    """A private MPS control daemon for the block; yields the environment its clients need
    (with `export` also set in `os.environ` meanwhile, for spawned workers to inherit).
    MpsError when it cannot start or no CUDA client can use GPU `ordinal` through it."""
    exe = control_binary()
    with tempfile.TemporaryDirectory(prefix="grace-mps-") as root:
        dirs = {k: Path(root, name) for k, name in zip(ENV, ("pipe", "log"), strict=True)}
        for d in dirs.values():
            d.mkdir()
        env = {k: str(v) for k, v in dirs.items()}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        full = {**os.environ, **env}
        out = dirs["CUDA_MPS_LOG_DIRECTORY"] / "grace-start.txt"
        try:
            with out.open("w") as sink:  # a file, not a pipe the daemon could keep open
                subprocess.run([exe, "-d"], env=full, check=True, timeout=TIMEOUT_S,
                               stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)  # fmt: skip
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            if isinstance(exc, subprocess.TimeoutExpired):
                _quit(exe, full)  # it may be up after all: do not leave it behind
            said = out.read_text().strip() if out.exists() else ""
            raise MpsError(f"{CONTROL} -d failed: {said or exc}") from exc
        try:
            _attach(exe, ordinal, full)
        except BaseException:  # MpsError, or an interrupt while it waits: no daemon left
            _quit(exe, full)
            raise
        log.info("MPS control daemon started (pipes in %s%s)", env[ENV[0]],
                 f", GPU {visible}" if visible is not None else "")  # fmt: skip
        saved = {k: os.environ.get(k) for k in env} if export else {}
        if export:
            os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _quit(exe, full)


def _attach(exe: str, ordinal: int, env: dict[str, str]) -> None:
    """A CUDA client uses GPU `ordinal` through the new daemon, or MpsError with why."""
    log.info("MPS: checking that a CUDA client attaches through the daemon")
    command = [sys.executable, "-I", str(PROBE_SCRIPT), exe, str(ordinal)]
    try:
        done = subprocess.run(command, env=env, timeout=ATTACH_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace")  # fmt: skip
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise MpsError(f"no CUDA client could attach through the MPS daemon: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise MpsError(f"no CUDA client could attach through the MPS daemon: {said}")


def gpu_ordinal(settings: ServerSettings) -> int:
    """The GPU the workers use: N of 'cuda:N', else 0 (of the visible devices)."""
    _, _, n = settings.device.partition(":")
    return int(n) if n.isdigit() else 0


def _quit(exe: str, env: dict[str, str]) -> None:
    """Stop the daemon (it ends its MPS server once the last client has gone)."""
    try:
        subprocess.run([exe], input="quit\n", env=env, check=True, timeout=TIMEOUT_S,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log.error("could not stop the MPS control daemon: %s", exc)
    else:
        log.info("MPS control daemon stopped")
