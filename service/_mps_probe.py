"""The MPS attach probe: run by `service/mps.py` as a throwaway process (a script, no torch)
right after `nvidia-cuda-mps-control -d`, with the daemon's CUDA_MPS_PIPE_DIRECTORY.

`-d` returns once the daemon forks: an MPS server that cannot start shows only when a
client attaches, and a client that cannot reach the daemon runs without MPS, silently, so
the probe attaches and, while it holds its context, asks the daemon for its server.

    python -I service/_mps_probe.py CONTROL_BINARY GPU_ORDINAL    -> exit 0, or 1 + why
"""

from __future__ import annotations

import ctypes
import subprocess
import sys


def attach(ordinal: int) -> None:
    """Retain GPU `ordinal`'s primary context through the driver API (what the CUDA
    runtime does first); RuntimeError naming the call that failed."""
    cu = ctypes.CDLL("libcuda.so.1")
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


def main(argv: list[str]) -> int:
    control, ordinal = argv[0], int(argv[1])
    try:
        attach(ordinal)
    except (OSError, RuntimeError) as exc:
        print(exc, file=sys.stderr)
        return 1
    # the MPS server PIDs the daemon lists, asked while this process holds its context
    done = subprocess.run([control], input="get_server_list\n", capture_output=True,
                          text=True, errors="replace", timeout=30)  # fmt: skip
    if not done.stdout.split():
        print("a CUDA client attached without MPS: the daemon runs no server for it",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
