"""Where the load test's requests come from: a synthetic world's users, or a replay file.

Both give a list of `RetrieveRequest`s built once per locust process, before any user
starts; each user walks the list from its own random offset, round and round, so the
requests cost nothing to make while the test runs. A replay file is the JSON Lines of
service/request_log.py: `grace record` output or the server's request log.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from service.rpc.grace.v1 import retrieval_pb2

Request = retrieval_pb2.RetrieveRequest


def from_world(world: Path, users: int, max_ads: int, mode: str) -> list[Request]:
    """Requests for the world's first `users` users (all of them when fewer)."""
    from cli.query import request_for_user
    from index_builder.synth import load_world

    n = min(users, load_world(world).n_users)
    filter_mode = retrieval_pb2.CD_ONLY if mode == "cd_only" else retrieval_pb2.CD_GTM
    return [request_for_user(world, u, max_ads, filter_mode) for u in range(n)]


def from_replay(path: Path) -> list[Request]:
    """Every request of a replay file, in order."""
    from service.request_log import read_requests

    requests = list(read_requests(path))
    if not requests:
        raise ValueError(f"{path}: no requests in the replay file")
    return requests


def cycle_from_random_offset(requests: Sequence[Request], rng: random.Random) -> Iterator[Request]:
    """The requests in order, endlessly, starting at a random position."""
    start = rng.randrange(len(requests))
    return itertools.cycle(itertools.chain(requests[start:], requests[:start]))
