"""Rollout of models and indexes without a restart (docs/ARCHITECTURE.md §3): `rollout.py`
chooses, loads, prepares and hot-swaps the pair; `follower.py` follows one versioned root.
"""
