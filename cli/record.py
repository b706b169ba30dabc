"""`grace record`: write a replay file (JSON Lines of RetrieveRequest) from a world's users,
in the format of the server's request log (setting `request_log`; service/request_log.py
owns it), so live traffic and synthetic traffic replay alike in `loadtest/`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.common import AddCommand


def _record(args: argparse.Namespace) -> int:
    """write a replay file of Retrieve requests from a world's users

    Write JSON Lines of grace.v1 RetrieveRequest (protobuf JSON, one per line) for the first
    N users of a synthetic world, repeating them when N exceeds the world's users. The
    server's request log (GRACE_REQUEST_LOG) writes the same format from live traffic;
    loadtest/locustfile.py --replay sends either."""
    from cli.query import request_for_user
    from index_builder.synth import load_world
    from service.request_log import write_requests
    from service.rpc.grace.v1 import retrieval_pb2

    if args.users < 1:
        raise ValueError(f"--users must be >= 1, got {args.users}")
    mode = retrieval_pb2.CD_ONLY if args.mode == "cd_only" else retrieval_pb2.CD_GTM
    world = Path(args.world)
    n_users = load_world(world).n_users
    built: dict[int, retrieval_pb2.RetrieveRequest] = {}

    def requests():
        # Past the world's last user the users repeat, each line with its own request_id.
        for i in range(args.users):
            u = i % n_users
            if u not in built:
                built[u] = request_for_user(world, u, args.max_ads, mode)
            request = retrieval_pb2.RetrieveRequest()
            request.CopyFrom(built[u])
            request.request_id = f"record-{i}-user-{u}"
            yield request

    n = write_requests(args.out, requests())
    print(f"wrote {n} requests ({min(n, n_users)} distinct users of {world}) to {args.out}")
    return 0


def register(add: AddCommand) -> None:
    p = add("record", _record)
    p.add_argument("--world", default="data/world", help="world to take the users from")
    p.add_argument("--users", type=int, required=True, help="number of requests (lines)")
    p.add_argument("--out", required=True, help="file to write (replaced)")
    p.add_argument("--max-ads", type=int, default=100, help="options.max_ads of each request")
    p.add_argument("--mode", choices=["cd_gtm", "cd_only"], default="cd_gtm")
