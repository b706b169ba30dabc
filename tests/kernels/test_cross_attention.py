"""Beam-as-query cross-attention equals the per-beam layout (paper Appendix B)."""

from __future__ import annotations

import pytest
import torch

from kernels.cross_attention import cross_attention, cross_attention_per_beam
from kernels.self_attention import prefix_self_attention


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("t_ctx", [5, 33])
def test_beam_as_query_equals_per_beam(b: int, m: int, t_ctx: int) -> None:
    g = torch.Generator().manual_seed(b * 100 + m + t_ctx)
    h, d = 4, 16
    q = torch.randn(b * m, h, d, generator=g)
    k = torch.randn(b, h, t_ctx, d, generator=g)
    v = torch.randn(b, h, t_ctx, d, generator=g)
    torch.testing.assert_close(cross_attention(q, k, v), cross_attention_per_beam(q, k, v))


def test_beam_rows_attend_only_their_own_request() -> None:
    h, d = 2, 8
    q = torch.randn(4, h, d)
    k, v = torch.randn(2, h, 3, d), torch.randn(2, h, 3, d)
    out = cross_attention(q, k, v)
    v2 = v.clone()
    v2[1] += 5.0  # change request 1's context only
    out2 = cross_attention(q, k, v2)
    torch.testing.assert_close(out[:2], out2[:2])  # request 0's rows unchanged
    assert not torch.allclose(out[2:], out2[2:])


@pytest.mark.parametrize("t", [0, 1, 3])
def test_prefix_self_attention_matches_sdpa(t: int) -> None:
    r, h, d = 7, 3, 16
    q = torch.randn(r, h, d)
    k, v = torch.randn(r, t + 1, h, d), torch.randn(r, t + 1, h, d)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2)
    ).squeeze(2)
    torch.testing.assert_close(prefix_self_attention(q, k, v), want)
