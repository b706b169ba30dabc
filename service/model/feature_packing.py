"""A FeatureBatch as one int64 buffer, so stage 1's host -> device copy is one pinned,
non-blocking copy (`service/pipeline/stages.py`); the device side views it
(`unpack_features`), and `static_features.py`'s graphs take it as their one static input.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from service.model.features import FeatureBatch

# Packed layout: one int64 row of K = 4 + L * (sid_length + 3) columns per request,
#   user_hash, country, age_bucket, gender, then for each history position l < L:
#   hist_sid[l, 0 .. sid_length-1], hist_type[l], hist_gap[l], hist_mask[l] (0 / 1).
# Event-major, so padding a row to a larger L appends zeros, and an all-zero event is the
# padding prepare_features writes (mask 0, type 0, SID 0, gap 0).
_HEAD = 4  # the non-sequence columns
_EVENT_EXTRA = 3  # columns of an event besides its SID tokens: type, gap, mask


def packed_columns(width: int, sid_length: int) -> int:
    """K, the columns of a packed row with history width L."""
    return _HEAD + width * (sid_length + _EVENT_EXTRA)


def pack_features(f: FeatureBatch, *, pin_memory: bool = False) -> torch.Tensor:
    """f as one int64 [B, K] buffer (layout above) on f's device; `pin_memory` (CPU only)
    page-locks it, so that one `.to(cuda, non_blocking=True)` moves the whole batch."""
    b, width, sid_length = f.hist_sid.shape
    packed = torch.empty(
        (b, packed_columns(width, sid_length)),
        dtype=torch.int64,
        device=f.hist_sid.device,
        pin_memory=pin_memory,
    )
    for column, field in zip(_columns(packed, sid_length), fields(FeatureBatch), strict=True):
        column.copy_(getattr(f, field.name))
    return packed


def unpack_features(packed: torch.Tensor, sid_length: int) -> PackedFeatureBatch:
    """The FeatureBatch of a packed int64 [B, K] buffer: views of it, the mask derived."""
    *ints, mask = _columns(packed, sid_length)
    return PackedFeatureBatch(*ints, mask != 0, packed=packed)


def _columns(packed: torch.Tensor, sid_length: int) -> list[torch.Tensor]:
    """Views of a packed buffer, one per FeatureBatch field in field order (the mask as
    its 0 / 1 int64 column)."""
    b, k = packed.shape
    width, rest = divmod(k - _HEAD, sid_length + _EVENT_EXTRA)
    if width < 0 or rest:
        raise ValueError(f"{k} columns are not a packed row for sid_length {sid_length}")
    events = packed[:, _HEAD:].view(b, width, sid_length + _EVENT_EXTRA)  # [B, L, S + 3]
    return [
        *packed[:, :_HEAD].unbind(1),
        events[..., :sid_length],
        *events[..., sid_length:].unbind(2),
    ]


@dataclass(frozen=True)
class PackedFeatureBatch(FeatureBatch):
    """A FeatureBatch over one packed buffer (`unpack_features`; do not `replace` fields):
    every field but the mask views `packed`, so pinning or moving it is one copy."""

    packed: torch.Tensor  # int64 [B, K], the layout of pack_features

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedFeatureBatch:
        moved = self.packed.to(device, non_blocking=non_blocking)
        return unpack_features(moved, self.hist_sid.shape[2])

    def pin_memory(self) -> PackedFeatureBatch:
        return unpack_features(self.packed.pin_memory(), self.hist_sid.shape[2])
