"""Synthetic ads world generator (docs/ARCHITECTURE.md §8, docs/SYNTH.md): seeded,
vectorised. Flow: `profiles` → `geography` → `advertisers` → `ads` (chunks, `campaigns`)
→ `users` → `histories` → `calibration` → `writer`, tied together by `world`.
"""

from __future__ import annotations

from index_builder.synth.profiles import PROFILES, WorldProfile
from index_builder.synth.world import World, generate_world, load_world

__all__ = ["PROFILES", "World", "WorldProfile", "generate_world", "load_world"]
