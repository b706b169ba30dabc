"""`grace` commands of the model side: train, init-model, publish-model, flops (`grace
eval` is `evaluate.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.common import (
    AUTOTUNE_HELP,
    LAST_TOKEN_HELP,
    SCHEMA_HELP,
    SID_SPACE_HELP,
    AddCommand,
    offline_kernels,
    positive_float,
    positive_int,
    show_progress,
    targeting_schema,
)
from contracts.data_format import EVENT_MAP_FLAG, UNMAPPED_FLAG, UNMAPPED_POLICIES, EventMap
from contracts.sid_space import LAST_TOKENS
from training.steps import PRECISIONS


def _train(args: argparse.Namespace) -> int:
    """train the generative retriever on a synthetic world or on your own data

    Teacher-forced next-SID training on users' interaction histories — a synthetic world
    (--world) or your catalog, interactions and users files (docs/DATA.md) — with a held-out
    recall@K evaluation against an eligible-popularity baseline at the end. Trains the SID
    tokenizer too unless --tokenizer is given. Resumable: rerun the same command after an
    interruption."""
    offline_kernels(args.autotune)
    from index_builder.catalog import CatalogError
    from training.steps import Diverged
    from training.train import TrainingData, TrainSettings, train
    from training.user_data import DataError

    flags = ("profile", "epochs", "batch_size", "lr", "seed", "eval_users", "device")
    flags += ("last_token", "precision")
    settings = TrainSettings(**{f: getattr(args, f) for f in flags})
    files = {"catalog": args.catalog, "interactions": args.interactions, "users": args.users}
    given = sum(v is not None for v in files.values())
    if given != (0 if args.world is not None else 3):
        print(
            "grace train: give --world, or --catalog, --interactions and --users", file=sys.stderr
        )
        return 2
    if args.world is not None and args.targeting_schema:
        print("grace train: --targeting-schema is for --catalog; a world carries its own "
              "(WORLD/targeting_schema.yaml)", file=sys.stderr)  # fmt: skip
        return 2
    paths = {k: Path(v) for k, v in files.items() if v}
    events = (EventMap.parse(args.event_map, args.unmapped) if args.event_map
              else EventMap(unmapped=args.unmapped))  # fmt: skip
    data = TrainingData(world=Path(args.world) if args.world else None, events=events,
                        schema=targeting_schema(args), **paths)  # fmt: skip
    try:
        metrics = train(
            data,
            Path(args.out),
            settings,
            tokenizer_path=Path(args.tokenizer) if args.tokenizer else None,
            progress=show_progress(args),
            sid_space=args.sid_space,
        )
    except (DataError, CatalogError, Diverged) as e:
        print(f"grace train: {e}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=1))
    return 0


def _init_model(args: argparse.Namespace) -> int:
    """write an untrained checkpoint (latency and throughput tests only)

    Random weights of a profile, saved with a SID tokenizer as a checkpoint that `grace
    serve --model` loads: serving speed does not depend on the weights, so load tests and
    benchmarks of large profiles need no training run. Its answers are eligible but not
    relevant; the model version says 'untrained'."""
    import torch

    from index_builder.tokenizer import SIDTokenizer
    from service.model.checkpoint import save_checkpoint
    from service.model.config import profile
    from service.model.retriever import GenerativeRetriever

    tokenizer = SIDTokenizer.load(Path(args.tokenizer))
    torch.manual_seed(args.seed)
    model = GenerativeRetriever(profile(args.profile))
    name = f"{args.profile}-untrained-seed{args.seed}"
    version = save_checkpoint(model, tokenizer, Path(args.out), model_version=name)
    print(f"wrote untrained {args.profile} model {version} to {args.out}")
    return 0


def _publish_model(args: argparse.Namespace) -> int:
    """publish a checkpoint into a model repository (servers hot-swap it in)

    Verify a checkpoint (every checksum, the tokenizer, each tensor against the config),
    pass the model gate (finite weights; with --index, a canary: requests of --world or
    --requests retrieved on that index must bring ads; without it only finiteness), copy it
    into ROOT/<version>/ with the gate's figures (gate.json), verify the copy and move
    ROOT/CURRENT to it atomically; servers whose --model is ROOT swap it in between batches
    if its SID space fits their index (docs/MODEL.md, 'Model repository', 'The model
    gate'). A checkpoint refused is named on one line and nothing changes. With --index
    and --world the version also gets an FP8 quality record (FP8 against bfloat16 on
    held-out users): where it passes, servers with dtype auto on a GPU with FP8 serve the
    version in FP8 (docs/FP8.md, 'FP8 by default')."""
    from service.model.repository import publish_model

    if (args.index is None) != (args.world is None and args.requests is None):
        print("grace publish-model: the canary needs --index and --world or --requests",
              file=sys.stderr)  # fmt: skip
        return 2
    source, canary = Path(args.checkpoint), lambda: _canary(args, Path(args.checkpoint))
    fp8 = None
    if args.index and args.world and args.fp8_users > 0:
        fp8 = lambda: _fp8_record(args, Path(args.checkpoint))  # noqa: E731
    elif args.index:
        print("grace publish-model: no FP8 quality record (it needs --world and --fp8-users "
              "> 0): dtype auto serves this version in bfloat16")  # fmt: skip
    try:
        version = publish_model(source, Path(args.root), keep=args.keep,
                                canary=canary if args.index else None, fp8=fp8)  # fmt: skip
    except (ValueError, FileNotFoundError) as e:  # CheckpointError, ModelRefused, an index's
        print(f"grace publish-model: {' '.join(str(e).split())}; nothing published",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"published model {args.checkpoint} as version {version} of {args.root}")
    return 0


def _canary(args: argparse.Namespace, checkpoint: Path) -> dict[str, object]:
    """The gate's canary (service/model/gate.py) of `checkpoint` on --index, as the server
    would retrieve: its figures, or ModelRefused when no request gets an ad."""
    import itertools

    from contracts.versions import resolve
    from index_builder.synth import load_world
    from service.index.loaded import load_index
    from service.model.checkpoint import load_checkpoint
    from service.model.features import UserFeatures
    from service.model.gate import ModelRefused, canary
    from service.pipeline.stages import Stages
    from service.request_log import read_requests
    from service.validation import Limits, validate_request

    loaded = load_checkpoint(checkpoint, args.device)
    index = load_index(resolve(Path(args.index)), tokenizer_fingerprint=loaded.sid_space,
                       device=args.device)  # fmt: skip
    if args.world:
        world = load_world(Path(args.world))
        users = [UserFeatures(int(world.user_ids[u]), world.targeting[u], *world.history(u))
                 for u in range(min(args.canary, world.n_users))]  # fmt: skip
    else:  # as the server reads them (beams and modes aside: the canary uses the model's)
        limits = Limits(100, 1 << 30, loaded.config.beams, (1 << 30,) * len(loaded.config.beams))
        valid = [validate_request(r, limits)
                 for r in itertools.islice(read_requests(args.requests), args.canary)]  # fmt: skip
        users = [UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types,
                              r.history_ts_ms) for r in valid]  # fmt: skip
    runtime = Stages(args.device).runtime(loaded.model, version=loaded.model_version,
                                          sid_space=loaded.sid_space)  # fmt: skip
    figures = canary(runtime, index, users, loaded.config.beams)
    if figures.ads_per_request == 0:
        raise ModelRefused(f"checkpoint {checkpoint}: no ads for any of {figures.requests} "
                           f"canary requests on index {index.version}")  # fmt: skip
    print(f"canary: {figures.requests} requests on index {index.version}, "
          f"{figures.ads_per_request:g} ads per request")  # fmt: skip
    return vars(figures)


def _fp8_record(args: argparse.Namespace, checkpoint: Path) -> dict[str, object]:
    """The FP8 quality record of `checkpoint` on --index and held-out users of --world
    (`training/fp8_record.py`), printed on one line."""
    from contracts.index_manifest import manifest_schema
    from contracts.index_validation import validate_index
    from contracts.versions import resolve
    from index_builder.synth import load_world
    from service.model.checkpoint import load_checkpoint
    from training.fp8_record import fp8_record

    loaded = load_checkpoint(checkpoint, args.device)
    index = validate_index(resolve(Path(args.index)), expect_tokenizer=loaded.sid_space)
    record = fp8_record(
        loaded.model, load_world(Path(args.world)), index.arrays, manifest_schema(index.manifest),
        users=args.fp8_users, device=args.device, tolerance=args.fp8_tolerance,
        progress=show_progress(args),
    )  # fmt: skip
    record["index_version"] = index.manifest["index_version"]
    verdict = "passes" if record["passed"] else "fails"
    print(f"FP8 quality record ({record['users']} users) {verdict}: {record['why']}")
    return record


def _flops(args: argparse.Namespace) -> int:
    """decoder FLOPs per request of a model profile

    Count decoder FLOPs per request (a multiply-add is 2) by term and step for a profile's
    beam schedule or the one given."""
    from service.model.config import profile
    from service.model.flops import decoder_flops

    report = decoder_flops(profile(args.profile), tuple(args.beams) if args.beams else None)
    print(report.table())
    return 0


def register(add: AddCommand) -> None:
    p = add("train", _train)
    p.add_argument("--world", help="world directory (grace synth)")
    p.add_argument("--catalog", help="your catalog, instead of --world (docs/DATA.md)")
    p.add_argument("--interactions", help="your interactions file: .parquet, .csv or .jsonl")
    p.add_argument("--users", help="your users file: .parquet, .csv or .jsonl")
    p.add_argument("--targeting-schema", metavar="FILE",
                   help="with --catalog: " + SCHEMA_HELP)  # fmt: skip
    p.add_argument(EVENT_MAP_FLAG, metavar="SOURCE=TARGET,...",
                   help="your interactions' own event types as view, click or conversion, "
                   "e.g. impression=view,purchase=conversion (docs/DATA.md)")  # fmt: skip
    p.add_argument(UNMAPPED_FLAG, choices=UNMAPPED_POLICIES, default=UNMAPPED_POLICIES[0],
                   help="rows of an event type neither known nor mapped: refuse the file "
                   "(default: a typo in the map must not drop data) or skip them, counted "
                   "per type")  # fmt: skip
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="tiny")
    p.add_argument("--tokenizer", help="use this SID tokenizer instead of training one")
    p.add_argument("--sid-space", metavar="NAME", help=SID_SPACE_HELP)
    p.add_argument("--last-token", choices=LAST_TOKENS,
                   help=LAST_TOKEN_HELP + " (for the tokenizer trained here; rank by "
                   "default)")  # fmt: skip
    p.add_argument("--epochs", type=positive_float, default=4.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-users", type=int, default=400, help="held-out users to evaluate")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default), or bf16 autocast: matmuls in bf16, weights, "
                   "optimizer and loss in fp32 (slower at the demo profile on an H200: "
                   "docs/MODEL.md, \"Training\")")  # fmt: skip
    p.add_argument("--autotune", action="store_true", help=AUTOTUNE_HELP)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar; log a line each tenth of the run instead")  # fmt: skip

    p = add("init-model", _init_model)
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], required=True)
    p.add_argument("--tokenizer", required=True, help="SID tokenizer directory")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)

    p = add("publish-model", _publish_model)
    p.add_argument("checkpoint", help="checkpoint directory (grace train --out)")
    p.add_argument("--root", required=True, help="model repository root (made if missing)")
    p.add_argument("--keep", type=int, default=3,
                   help="valid versions to keep, besides CURRENT's (3)")  # fmt: skip
    p.add_argument("--index", metavar="ROOT", help="the gate's canary: refuse a model that "
                   "brings no ads to the requests of --world or --requests on this index (root "
                   "or version); without it only the weights' finiteness is checked")  # fmt: skip
    p.add_argument("--world", help="canary requests: the first users of this world; its "
                   "held-out users make the FP8 quality record")  # fmt: skip
    p.add_argument("--requests", metavar="FILE", help="canary requests: a replay (grace record)")
    p.add_argument("--canary", type=positive_int, default=64, metavar="N", help="how many (64)")
    p.add_argument("--device", default="cpu",
                   help="where the canary and the FP8 record run (cpu; cuda: faster)")  # fmt: skip
    p.add_argument("--fp8-users", type=int, default=1000, metavar="N",
                   help="with --index and --world: held-out users of the FP8 quality "
                   "record (1000, at most the world's; 0: no record, dtype auto serves "
                   "bfloat16)")  # fmt: skip
    p.add_argument("--fp8-tolerance", type=positive_float, default=0.01, metavar="R",
                   help="the record passes when, over >= 200 users, FP8 is not shown to lose "
                   "more than R of recall@100 and @1000 against bfloat16 (0.01: the lower end "
                   "of the paired 95%% interval >= -R) and keeps >= 0.95 of its top-K "
                   "SIDs")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = add("flops", _flops)
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="paper")
    p.add_argument("--beams", type=int, nargs=4, metavar="M")
