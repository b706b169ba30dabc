"""The beam-advance kernel (one step's bookkeeping after top-k) equals the torch
reference, bit for bit: parents, tokens, scores, liveness and trie nodes.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small,
awkward shapes, with its outputs poisoned before the launch (NaN, a sentinel, both
booleans) so that an element it forgot to write fails the comparison; the `gpu` test
runs the dispatcher at the paper's shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels._triton_beam_advance import BLOCK, triton_beam_advance
from kernels.beam_advance import beam_advance, beam_advance_reference
from kernels.gtm_mask import NEG_INF

DEAD_NODE = 999_983


def inputs(bsz: int, keep: int, width: int, vocab: int, *, seed: int = 0, device: str = "cpu"):
    """A top-k result: scores with dead (−inf) slots, positions in each request's M·V
    candidates and a child table [B·M, V]."""
    g = torch.Generator().manual_seed(seed)
    top = torch.randn(bsz, keep, generator=g) * 4 - 10
    top[torch.rand(bsz, keep, generator=g) < 0.3] = NEG_INF
    flat = torch.randint(0, width * vocab, (bsz, keep), generator=g)
    child = torch.randint(0, 50_000, (bsz * width, vocab), generator=g, dtype=torch.int32)
    return (x.to(device) for x in (top, flat, child))


@contextmanager
def poisoned(flag: bool) -> Iterator[None]:
    """torch.empty / empty_like return tensors already full of garbage: NaN, a sentinel
    integer, or `flag` for booleans."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bool:
            return x.fill_(flag)
        return x.fill_(float("nan") if x.is_floating_point() else -7777)

    torch.empty = lambda *a, **k: fill(empty(*a, **k))  # type: ignore[assignment]
    torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like  # type: ignore[assignment]


def assert_same(got, want) -> None:
    for name, g, w in zip(("score", "parent", "token", "live", "node"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype)
        assert torch.equal(g, w), name


@pytest.mark.parametrize(
    ("bsz", "keep", "width", "vocab"),
    [(1, 1, 1, 3), (3, 5, 4, 7), (2, BLOCK + 6, 9, 300), (4, 16, 16, 64)],
)
@pytest.mark.parametrize("flag", [True, False])
def test_kernel_equals_reference(bsz: int, keep: int, width: int, vocab: int, flag: bool) -> None:
    """A single slot, odd sizes, more slots than one program holds (a partial last block)."""
    top, flat, child = inputs(bsz, keep, width, vocab, seed=bsz + keep)
    args = (top, flat, child, width, vocab)
    with poisoned(flag):
        got = triton_beam_advance(*args, DEAD_NODE)
    want = beam_advance_reference(*args, DEAD_NODE)
    assert_same(got, want)


def test_reference_semantics() -> None:
    """Position p of request b's candidates is row b·M + p // V, token p % V; a −inf slot
    is dead and parked on the dead node; a live one reads its child."""
    top = torch.tensor([[-1.0, NEG_INF], [-2.0, -3.0]])
    flat = torch.tensor([[7, 2], [0, 11]])  # M = 3, V = 4
    child = torch.arange(24, dtype=torch.int32).view(6, 4)
    score, parent, token, live, node = beam_advance_reference(top, flat, child, 3, 4, 99)
    assert parent.tolist() == [1, 0, 3, 5] and token.tolist() == [3, 2, 0, 3]
    assert live.tolist() == [True, False, True, True]
    assert score.tolist() == [-1.0, NEG_INF, -2.0, -3.0]
    assert node.tolist() == [7, 99, 12, 23]


def test_dispatcher_runs_the_reference_off_cuda() -> None:
    top, flat, child = inputs(2, 5, 3, 11)
    assert_same(beam_advance(top, flat, child, 3, 11, DEAD_NODE),
                beam_advance_reference(top, flat, child, 3, 11, DEAD_NODE))  # fmt: skip


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bsz=st.integers(1, 4),
    keep=st.integers(1, 40),
    width=st.integers(1, 6),
    vocab=st.integers(1, 33),
    seed=st.integers(0, 2**16),
)
def test_dead_slots_never_come_back(bsz: int, keep: int, width: int, vocab: int, seed: int) -> None:
    """Whatever the shapes: a slot top-k could not fill is never live, and is parked
    where nothing is allowed; live slots keep their scores."""
    top, flat, child = inputs(bsz, keep, width, vocab, seed=seed)
    score, parent, token, live, node = triton_beam_advance(
        top, flat, child, width, vocab, DEAD_NODE
    )
    killed = ~torch.isfinite(top.reshape(-1))
    assert not live[killed].any() and live[~killed].all()
    assert (node[killed] == DEAD_NODE).all() and (score[killed] == NEG_INF).all()
    assert torch.equal(score[~killed], top.reshape(-1)[~killed])
    assert ((parent // width) == torch.arange(bsz).repeat_interleave(keep)).all()
    assert (token < vocab).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_paper_shape() -> None:
    """B 16, 1 024 kept of 1 024 rows × 512 tokens per request: the dispatcher's kernel
    equals the reference."""
    top, flat, child = inputs(16, 1024, 1024, 512, device="cuda")
    args = (top, flat, child, 1024, 512, DEAD_NODE)
    got = beam_advance(*args)
    assert_same(got, beam_advance_reference(*args))
