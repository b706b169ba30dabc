"""Training and evaluation examples from users' histories: a synthetic world
(index_builder/synth) or a team's own interactions and users (`training/user_data.py`).
A training example is (user, i): the events before event i are the history, the SID of
event i's ad the target (teacher-forced next-SID prediction); a user's held-out example is
the whole history with the held-out next interaction as target. Every event was eligible
for its user when it happened, so the targets are ads the service may return.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from index_builder.synth.reader import UserHistories
from service.model.config import ModelConfig
from service.model.features import FeatureBatch, SidLookup, UserFeatures, prepare_features


@dataclass(frozen=True)
class Batch:
    features: FeatureBatch
    target_sid: torch.Tensor  # int64 [B, sid_length]
    users: np.ndarray  # int64 [B]: user positions in the world
    target_ad: np.ndarray  # int64 [B]


class Examples:
    """Index of (user, event) training pairs of a world, with SIDs from one index."""

    def __init__(self, world: UserHistories, lookup: SidLookup, config: ModelConfig) -> None:
        self.world, self.lookup, self.config = world, lookup, config
        off = world.history_offsets
        lengths = np.diff(off)
        user = np.repeat(np.arange(world.n_users), lengths)
        pos = np.arange(len(user)) - off[user]
        _, known = lookup.lookup(world.history_ad_ids)
        # each user's validation event's position in its history; -1: none (a world has none)
        self.valid_index = getattr(world, "valid_index", np.full(world.n_users, -1, np.int64))
        held = pos == self.valid_index[user]  # validation targets are never trained on
        self.pairs = np.stack([user, pos], axis=1)[(pos >= 1) & known & ~held]  # [P, 2]
        # users whose validation event has a SID (and a history before it)
        has = np.flatnonzero(self.valid_index >= 1)
        self.validation_users = has[known[off[has] + self.valid_index[has]]]

    def __len__(self) -> int:
        return len(self.pairs)

    def _user(self, u: int, end: int | None, now_ms: int | None) -> UserFeatures:
        ads, types, ts = self.world.history(u)
        s = slice(0, end)
        return UserFeatures(
            user_id=int(self.world.user_ids[u]),
            targeting=self.world.targeting[u],
            history_ad_ids=ads[s],
            history_types=types[s].astype(np.int64),
            history_ts_ms=ts[s],
            now_ms=now_ms,
        )

    def batch(self, pairs: np.ndarray) -> Batch:
        """Training batch for pairs [B, 2] of (user, event position)."""
        users, target_ad, features = [], [], []
        for u, i in pairs.tolist():
            ads, _, ts = self.world.history(u)
            features.append(self._user(u, i, int(ts[i])))
            users.append(u)
            target_ad.append(int(ads[i]))
        return self._finish(features, np.array(users), np.array(target_ad, dtype=np.int64))

    def validation(self, users: np.ndarray) -> Batch:
        """Validation batch: each user's history before its validation event -> that event."""
        return self.batch(np.stack([users, self.valid_index[users]], axis=1))

    def heldout(self, users: np.ndarray) -> Batch:
        """Evaluation batch: full histories, held-out next interactions as targets."""
        features = [self._user(int(u), None, int(self.world.heldout_ts[u])) for u in users.tolist()]
        return self._finish(features, users, self.world.heldout_ad_ids[users])

    def _finish(self, features: list[UserFeatures], users, target_ad) -> Batch:
        sid, _ = self.lookup.lookup(target_ad)
        return Batch(
            features=prepare_features(features, self.lookup, self.config),
            target_sid=torch.from_numpy(sid),
            users=np.asarray(users, dtype=np.int64),
            target_ad=target_ad,
        )

    def epoch(self, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
        order = rng.permutation(len(self.pairs))
        for s in range(0, len(order) - batch_size + 1, batch_size):
            yield self.pairs[order[s : s + batch_size]]
