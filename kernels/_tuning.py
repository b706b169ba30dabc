"""What the Triton launchers share about where they run: whether they autotune (the
default) or run each kernel's fixed default config (`GRACE_AUTOTUNE=0`: the tests, so a GPU
run does not benchmark every config at every awkward shape; `grace train` and `grace eval`,
`cli/common.py::offline_kernels`), whether Triton's interpreter runs them (both read once,
at import), and the size of a persistent kernel's grid.
"""

import functools
import os

import torch

AUTOTUNE = os.environ.get("GRACE_AUTOTUNE", "1") != "0"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # CPU tensors, tests
CPU_PROGRAMS = 3  # the interpreter's "SM count": few programs, each walks several tiles


@functools.cache
def programs_per_wave(device: torch.device) -> int:
    """A persistent grid's size: the SMs of a CUDA device; a few "SMs" for the interpreter."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count
