"""Synthetic ads world generator (docs/ARCHITECTURE.md §8, docs/SYNTH.md): seeded,
vectorised. Flow: `profiles` → `geography` → `advertisers` → `ads` (chunks, `campaigns`,
`attributes`) → `users` (`user_attributes`) → `histories` → `calibration` → `blocks` →
`writer`, tied together by `world`; `reader` reads a world back.
"""

from __future__ import annotations

from index_builder.synth.attributes import load_world_schema
from index_builder.synth.profiles import PROFILES, WorldProfile
from index_builder.synth.reader import World, load_world
from index_builder.synth.world import generate_world

__all__ = ["PROFILES", "World", "WorldProfile", "generate_world", "load_world", "load_world_schema"]
