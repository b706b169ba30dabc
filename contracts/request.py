"""The RPC's enums (proto/grace/v1/retrieval.proto, ARCHITECTURE.md §5), `Scoring` (a
server setting, not an RPC field), and `check_schedule`, the one rule for a beam schedule
M_1..M_L: the settings' default, every request's `options.beam_widths`, the decode engine.
"""

from __future__ import annotations

import enum
from typing import Literal, get_args


class FilterMode(enum.IntEnum):
    """Matches the RPC enum `grace.v1.FilterMode` (UNSPECIFIED means CD_GTM)."""

    CD_ONLY = 1
    CD_GTM = 2
    CD_GTM_KWAY = 3  # CD_GTM with the index's k-way partitioned matchers


# How a decode step scores an allowed token (kernels/gtm_mask.py `candidates`; the server's
# `scoring` setting, docs/SERVICE.md): "masked" (the default), the log-softmax over the
# tokens the step's mask allows; "unmasked", the model's own over the whole vocabulary row,
# barred tokens still −inf, so CD_ONLY and CD_GTM give one SID the same score.
Scoring = Literal["masked", "unmasked"]
SCORINGS: tuple[Scoring, ...] = get_args(Scoring)


class EventType(enum.IntEnum):
    """Matches the RPC enum `grace.v1.EventType` (0, unspecified, is refused)."""

    VIEW = 1
    CLICK = 2
    CONVERSION = 3


def check_schedule(beams: tuple[int, ...], sid_length: int, vocab: int) -> None:
    """Raise ValueError unless `beams` is `sid_length` positive widths starting at 1, each
    at most the previous width times `vocab` (the candidates one step can offer)."""
    if len(beams) != sid_length or beams[0] != 1 or min(beams) < 1:
        raise ValueError(f"beam schedule needs {sid_length} positive widths starting at 1: {beams}")
    for t in range(1, sid_length):
        if beams[t] > beams[t - 1] * vocab:
            raise ValueError(f"M_{t + 1}={beams[t]} exceeds M_{t}·{vocab} candidates")
