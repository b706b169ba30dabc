"""`grace query`: one Retrieve for people, printed readably — for a user of a synthetic
world (`request_for_user`, also what `grace record` and loadtest/ send; it reads worlds
through index_builder, which the server never imports) or any RetrieveRequest as JSON.
A user of a world is a request only for a server of that world's catalog: when none of
the ads that come back is in it, `query` says so instead of printing ads for a stranger.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cli.common import EXIT_BAD_INPUT, AddCommand, add_tls_flags, channel
from cli.health import default_target

if TYPE_CHECKING:
    from contracts.targeting import Targeting
    from service.rpc.grace.v1 import retrieval_pb2


def default_world() -> Path:
    """The demo world of `grace serve` run with its default data directory."""
    return Path(os.environ.get("GRACE_DATA_DIR") or "data") / "world"


def request_for_user(
    world_dir: Path, user: int, max_ads: int, mode: int, *, user_id: int | None = None
) -> retrieval_pb2.RetrieveRequest:
    """The request of the world's user at position `user`, or of the user `user_id`."""
    from index_builder.synth import load_world
    from service.rpc.grace.v1 import retrieval_pb2

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
        targeting=targeting_message(t),
        options=retrieval_pb2.Options(max_ads=max_ads, filter_mode=mode, include_sids=True),
    )


def targeting_message(t: Targeting) -> retrieval_pb2.Targeting:
    """A world user's targeting as the RPC carries it: the named fields, every other
    attribute of the world's schema, and the user's blocks."""
    from service.rpc.grace.v1 import retrieval_pb2

    out = retrieval_pb2.Targeting(
        country=t.country, age=t.age, gender=t.gender, locations=list(t.locations),
        exclude_ad_ids=list(t.exclude_ad_ids), exclude_campaign_ids=list(t.exclude_campaign_ids),
        exclude_advertiser_ids=list(t.exclude_advertiser_ids),
    )  # fmt: skip
    for name, values in t.attributes:
        out.attributes[name].values.extend(values)
    return out


def _of_world(world: Path, ad_ids: list[int]) -> bool:
    """Whether any of `ad_ids` is an ad of the world's catalog."""
    import numpy as np
    import pyarrow.parquet as pq

    from index_builder.synth.writer import CATALOG_PARQUET

    catalog = pq.read_table(world / CATALOG_PARQUET, columns=["ad_id"])["ad_id"].to_numpy()
    return bool(np.isin(np.asarray(ad_ids, dtype=np.int64), catalog).any())


def _query(args: argparse.Namespace) -> int:
    """send one Retrieve and print the ads

    Send a Retrieve for a user of a synthetic world, or any RetrieveRequest given as JSON,
    and print the ads and stats. The world must be the one the server serves: `grace serve
    --data-dir DIR` keeps its demo world in DIR/world, and --world defaults to
    $GRACE_DATA_DIR/world, else data/world, as serve's data directory does. When none of the
    ads that come back is in that world's catalog, the server serves another catalog
    (another --data-dir, --catalog, your own data): query refuses in one line (exit 2)
    rather than print answers for a user of another world. For a server of your own data,
    send --request-json FILE (examples/request.json for examples/). A TLS port needs --tls-ca
    (mutual TLS also --tls-cert and --tls-key), or their GRACE_TLS_* variables."""
    import grpc
    from google.protobuf import json_format

    from index_builder.synth.writer import WORLD_JSON
    from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

    world = Path(args.world) if args.world else default_world()
    if args.request_json:
        text = sys.stdin.read() if args.request_json == "-" else Path(args.request_json).read_text()
        try:
            request = json_format.Parse(text, retrieval_pb2.RetrieveRequest())
        except json_format.ParseError as exc:
            why = " ".join(str(exc).split())  # protobuf's message spans lines
            print(f"grace query: --request-json is not a RetrieveRequest: {why}", file=sys.stderr)
            return EXIT_BAD_INPUT
    elif not (world / WORLD_JSON).is_file():
        print(f"grace query: no world at {world} to take a user from: name the world the "
              "server serves (--world) or send a request (--request-json FILE)",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    else:
        mode = retrieval_pb2.CD_ONLY if args.mode == "cd_only" else retrieval_pb2.CD_GTM
        request = request_for_user(world, args.user, args.max_ads, mode, user_id=args.user_id)
    for text in args.attribute or ():
        name, eq, values = text.partition("=")
        if not (name and eq):
            print(f"grace query: --attribute {text!r}: not NAME=V1,V2,...", file=sys.stderr)
            return EXIT_BAD_INPUT
        request.targeting.attributes[name].values.extend(v for v in values.split(",") if v)
    for field, ids in (("exclude_ad_ids", args.exclude_ads),
                       ("exclude_campaign_ids", args.exclude_campaigns),
                       ("exclude_advertiser_ids", args.exclude_advertisers)):  # fmt: skip
        getattr(request.targeting, field).extend(ids or ())
    target = args.target or default_target()
    with channel(target, args) as ch:
        stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
        try:
            response = stub.Retrieve(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    ads = [ad.ad_id for ad in response.ads]
    if not args.request_json and ads and not _of_world(world, ads):
        print(f"grace query: the server at {target} (index {response.index_version}) serves "
              f"another catalog than {world}'s: name its world (--world) or send a request "
              "(--request-json FILE)", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    t = request.targeting
    print(f"user {request.user.user_id} ({t.country or '?'}, age {t.age or '?'}, "
          f"{t.gender or '?'}, {len(t.locations)} locations, "
          f"{len(request.user.history)} history events)")  # fmt: skip
    seq = response.stats.catalog_seq  # the live changes it was answered at (0: as built)
    print(f"index {response.index_version}  model {response.model_version}"
          + (f"  catalog_seq {seq}" if seq else ""))  # fmt: skip
    print(f"{'rank':>4}  {'ad_id':>20}  {'score':>8}  sid")
    for i, ad in enumerate(response.ads, 1):
        print(f"{i:>4}  {ad.ad_id:>20}  {ad.score:>8.3f}  {list(ad.sid)}")
    s = response.stats
    stages = "  ".join(f"{k} {v:.1f}" for k, v in s.stage_ms.items())
    removed = "".join(f", {k} {v}" for k, v in sorted(s.ads_removed.items()))
    print(f"SIDs generated {s.sids_generated}, ads expanded {s.ads_expanded}, "
          f"eligible {s.ads_eligible}{removed and '; removed' + removed[1:]}; "
          f"stage ms: {stages}")  # fmt: skip
    return 0


def id_list(text: str) -> list[int]:
    """`1,2,3` as ints (argparse names the flag when this raises)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated ids") from None


def register(add: AddCommand) -> None:
    p = add("query", _query)
    p.add_argument("--target", help="host:port (default 127.0.0.1:$GRACE_PORT, else :50051)")
    p.add_argument("--world", help="the served world to take the user from "
                   "($GRACE_DATA_DIR/world, else data/world)")  # fmt: skip
    who = p.add_mutually_exclusive_group()
    who.add_argument("--user", type=int, default=0, help="user position in the world (0)")
    who.add_argument("--user-id", type=int, help="the user with this id (what query prints)")
    p.add_argument("--request-json", help="a RetrieveRequest as JSON (file, or - for stdin)")
    p.add_argument("--max-ads", type=int, default=10)
    p.add_argument("--mode", choices=["cd_gtm", "cd_only"], default="cd_gtm")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds")
    p.add_argument("--attribute", action="append", metavar="NAME=V1,V2",
                   help="an attribute of the served index's targeting schema, e.g. "
                   "platform=ios or audiences=a17,a9 (repeatable; docs/FORMAT.md §1)")  # fmt: skip
    p.add_argument("--exclude-ads", type=id_list, metavar="IDS",
                   help="block these ads (comma-separated ids)")  # fmt: skip
    p.add_argument("--exclude-campaigns", type=id_list, metavar="IDS",
                   help="block the ads of these campaigns")  # fmt: skip
    p.add_argument("--exclude-advertisers", type=id_list, metavar="IDS",
                   help="block the ads of these advertisers")  # fmt: skip
    add_tls_flags(p)
