"""Test-session set-up shared by every test directory.

Triton kernels (kernels/) are tested on CPU under Triton's interpreter; the switch is read
when a kernel is decorated, so it is set here, before any test module imports `kernels`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GPU test runs check kernels at many awkward shapes: use each kernel's fixed default
# config there instead of autotuning every shape (tests that sweep configs pass them).
os.environ.setdefault("GRACE_AUTOTUNE", "0")

# shared fixtures: `exact_fp8_casts` (FP8-emitting Triton kernels under the interpreter),
# `control` (a stand-in MPS control binary)
pytest_plugins = ["tests.helpers.triton_fp8", "tests.helpers.mps_control"]
