"""Synthetic ads world generator (docs/ARCHITECTURE.md §8): seeded, realistic, vectorised.

Flow: `profiles` (knobs) → `geography` → `advertisers` → `ads` (streamed chunks) →
`users` → `histories` → `calibration` → `writer`; `world` ties them together and reads
a world back. `docs/SYNTH.md` describes the world, its knobs and measured scale.
"""

from __future__ import annotations

from index_builder.synth.profiles import PROFILES, WorldProfile
from index_builder.synth.world import World, generate_world, load_world

__all__ = ["PROFILES", "World", "WorldProfile", "generate_world", "load_world"]
