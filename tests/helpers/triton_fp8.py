"""Exact float32 -> e4m3 casts for Triton kernels run under TRITON_INTERPRET=1.

Triton 3.9's interpreter rounds a float32 -> float8e4nv cast wrongly: ties go away from
zero, and a rounding that carries out of the mantissa is OR'ed into the exponent instead
of added (126.24 becomes 64, not 128: triton-lang/triton#8322, fixes open upstream). On a
GPU the cast is the hardware's. So a test that checks an FP8-emitting kernel on CPU
replaces that one conversion with torch's (round to nearest even, saturating at ±448)
through the `exact_fp8_casts` fixture; every other conversion stays the interpreter's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def exact_fp8_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(values.shape)
        return real(values, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
