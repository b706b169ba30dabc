"""`grace query`: a small client for people — one Retrieve, printed readably."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc


def request_for_user(
    world_dir: Path, user: int, max_ads: int, mode: int, *, user_id: int | None = None
) -> retrieval_pb2.RetrieveRequest:
    """The request of the world's user at position `user`, or of the user `user_id`."""
    from index_builder.synth import load_world

    world = load_world(world_dir)
    if user_id is not None:
        found = (world.user_ids == user_id).nonzero()[0]
        if len(found) == 0:
            raise SystemExit(f"--user-id {user_id}: no such user in {world_dir}")
        user = int(found[0])
    if not 0 <= user < world.n_users:
        raise SystemExit(f"--user must be in [0, {world.n_users})")
    t = world.targeting[user]
    ads, types, ts = world.history(user)
    return retrieval_pb2.RetrieveRequest(
        request_id=f"query-{user}",
        user=retrieval_pb2.User(
            user_id=int(world.user_ids[user]),
            history=[
                retrieval_pb2.Event(ad_id=int(a), type=int(k), timestamp_ms=int(s))
                for a, k, s in zip(ads, types, ts, strict=True)
            ],
        ),
        targeting=retrieval_pb2.Targeting(
            country=t.country, age=t.age, gender=t.gender, locations=list(t.locations)
        ),
        options=retrieval_pb2.Options(max_ads=max_ads, filter_mode=mode, include_sids=True),
    )


def query(args: argparse.Namespace) -> int:
    if args.request_json:
        text = sys.stdin.read() if args.request_json == "-" else Path(args.request_json).read_text()
        try:
            request = json_format.Parse(text, retrieval_pb2.RetrieveRequest())
        except json_format.ParseError as exc:
            why = " ".join(str(exc).split())  # protobuf's message spans lines
            print(f"grace query: --request-json is not a RetrieveRequest: {why}", file=sys.stderr)
            return 2
    else:
        mode = retrieval_pb2.CD_ONLY if args.mode == "cd_only" else retrieval_pb2.CD_GTM
        request = request_for_user(Path(args.world), args.user, args.max_ads, mode,
                                   user_id=args.user_id)  # fmt: skip
    with grpc.insecure_channel(args.target) as channel:
        stub = retrieval_pb2_grpc.AdRetrievalStub(channel)
        try:
            response = stub.Retrieve(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    t = request.targeting
    print(f"user {request.user.user_id} ({t.country or '?'}, age {t.age or '?'}, "
          f"{t.gender or '?'}, {len(t.locations)} locations, "
          f"{len(request.user.history)} history events)")  # fmt: skip
    print(f"index {response.index_version}  model {response.model_version}")
    print(f"{'rank':>4}  {'ad_id':>20}  {'score':>8}  sid")
    for i, ad in enumerate(response.ads, 1):
        print(f"{i:>4}  {ad.ad_id:>20}  {ad.score:>8.3f}  {list(ad.sid)}")
    s = response.stats
    stages = "  ".join(f"{k} {v:.1f}" for k, v in s.stage_ms.items())
    print(f"SIDs generated {s.sids_generated}, ads expanded {s.ads_expanded}, "
          f"eligible {s.ads_eligible}; stage ms: {stages}")  # fmt: skip
    return 0
