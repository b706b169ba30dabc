"""Exact float32 -> e4m3 and float32 -> bf16 casts for Triton kernels run under
TRITON_INTERPRET=1.

Triton 3.9's interpreter rounds a float32 -> float8e4nv cast wrongly: ties go away from
zero, and a rounding that carries out of the mantissa is OR'ed into the exponent instead
of added (126.24 becomes 64, not 128: triton-lang/triton#8322, fixes open upstream). On a
GPU the cast is the hardware's. So a test that checks an FP8-emitting kernel on CPU
replaces that one conversion with torch's (round to nearest even, saturating at ±448)
through the `exact_fp8_casts` fixture; every other conversion stays the interpreter's.
The fixture fixes float32 -> bf16 too: the interpreter's `.to(tl.bfloat16)` passes no
rounding mode, so it truncates (2.2187 becomes 2.2031), where the GPU rounds to nearest
even; a test that checks a kernel's bf16 output byte for byte needs the GPU's rounding.
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
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return bits.reshape(values.shape)
        return real(values, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
