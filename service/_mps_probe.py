"""The MPS attach probe: run by `service/mps.py` as a throwaway process (a script, no torch)
right after `nvidia-cuda-mps-control -d`, with the daemon's CUDA_MPS_PIPE_DIRECTORY.

`-d` returns as soon as the control daemon forks. Whether a client gets the GPU through
it shows only when one attaches: an MPS server that cannot start (user, /dev/shm,
another server on the GPU) fails the attach, and a client that cannot reach the daemon
at all runs *without* MPS, silently — so the probe also asks the daemon, while it holds
its context, for the server that serves it.

    python -I service/_mps_probe.py CONTROL_BINARY GPU_ORDINAL    -> exit 0, or 1 + why
"""

from __future__ import annotations

import ctypes
import subprocess
import sys


def attach(ordinal: int, library: str = "libcuda.so.1") -> None:
    """Retain GPU `ordinal`'s primary context through the driver API (what the CUDA
    runtime does first); RuntimeError naming the call that failed."""
    cu = ctypes.CDLL(library)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    steps = (
        ("cuInit", lambda: cu.cuInit(0)),
        ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), ordinal)),
        ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
    )
    for name, call in steps:
        rc = call()
        if rc:
            raise RuntimeError(f"{name} failed with CUDA error {rc}")


def servers(control: str) -> list[str]:
    """The MPS server PIDs the control daemon lists (`get_server_list`)."""
    done = subprocess.run([control], input="get_server_list\n", capture_output=True,
                          text=True, errors="replace", timeout=30)  # fmt: skip
    return done.stdout.split()


def main(argv: list[str]) -> int:
    control, ordinal = argv[0], int(argv[1])
    try:
        attach(ordinal)
    except (OSError, RuntimeError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if not servers(control):  # asked while this process holds its context
        print("a CUDA client attached without MPS: the daemon runs no server for it",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
