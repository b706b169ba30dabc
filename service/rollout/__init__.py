"""Rollout of models and indexes without a restart (docs/ARCHITECTURE.md §3).

follower.py  `Follower`: one versioned root — CURRENT, pending versions, failures and
             their backoff
rollout.py   `Rollout`: chooses, loads, prepares and hot-swaps the (model, index) pair
"""
