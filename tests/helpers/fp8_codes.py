"""How close two per-row e4m3 quantisations of the same numbers must be, for the tests of
the FP8-emitting kernels (tests/kernels/): the kernel's fp32 sums run in another order
than torch's, so a value lying on an e4m3 rounding boundary may round the other way.

"One e4m3 step" is counted in codes, not as a relative error: e4m3fn's bit patterns
are sign and magnitude, and the magnitude bits order the values, so neighbouring codes
differ by one in their low seven bits — across binades and through the subnormals,
where one step (2⁻⁹ · scale) is far more than 2⁻³ of the value (the H200 run of the
paper-shape LayerNorm test rounded 2⁻⁹ up to 2⁻⁸ where torch rounded down).
"""

from __future__ import annotations

import torch


def e4m3_ordinals(q: torch.Tensor) -> torch.Tensor:
    """Each e4m3fn code's position on the number line (+0 and -0 both 0), as int32."""
    bits = q.view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 != 0, -magnitude, magnitude)


def assert_codes_close(
    q: torch.Tensor,
    scale: torch.Tensor,
    want_q: torch.Tensor,
    want_scale: torch.Tensor,
    same: float = 0.97,
) -> None:
    """Scales equal to fp32 rounding; every code at most one e4m3 step from the
    reference's; more than `same` of them byte for byte the reference's."""
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0)
    steps = (e4m3_ordinals(q) - e4m3_ordinals(want_q)).abs()
    assert int(steps.max()) <= 1, f"{int((steps > 1).sum())} codes more than one step off"
    assert (steps == 0).float().mean() > same
