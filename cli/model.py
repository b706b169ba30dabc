"""`grace` commands of the model side: train, init-model, eval, flops."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.common import (
    AUTOTUNE_HELP,
    LAST_TOKEN_HELP,
    SID_SPACE_HELP,
    AddCommand,
    offline_kernels,
    positive_float,
    positive_int,
    show_progress,
)
from contracts.data_format import EVENT_MAP_FLAG, UNMAPPED_FLAG, UNMAPPED_POLICIES, EventMap
from contracts.request import SCORINGS
from contracts.sid_space import LAST_TOKENS
from training.steps import PRECISIONS

EVAL_FORMAT_VERSION = 3  # of `grace eval --out` (docs/EVALUATION.md, "The report")


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
    paths = {k: Path(v) for k, v in files.items() if v}
    events = (EventMap.parse(args.event_map, args.unmapped) if args.event_map
              else EventMap(unmapped=args.unmapped))  # fmt: skip
    data = TrainingData(world=Path(args.world) if args.world else None, events=events, **paths)
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


def _eval(args: argparse.Namespace) -> int:
    """GTM effectiveness study: pass rates per filter variant and recall@K

    Decode held-out requests of a world with a trained model against an index, for CD only,
    CD+GTM (each with every --scoring) and (with --kway) partitioned GTM; report exact
    ad-level pass rates (bitmask, Bloom, location, final) overall, per bucket of ads generated
    (the paper's Table 3) and among the first N generated (--fixed), eligible ads per
    request, and recall@K / NDCG@K of the held-out next interaction with bootstrap intervals
    and each variant's paired difference to cd_only. --out writes the JSON report, --plots
    the PNGs (docs/EVALUATION.md)."""
    offline_kernels(args.autotune)
    import torch

    from contracts.index_validation import validate_index
    from contracts.request import FilterMode
    from index_builder.build import with_partitions
    from index_builder.kway import KwaySpec
    from index_builder.publish import resolve
    from index_builder.synth import load_world
    from service.model.checkpoint import load_checkpoint
    from service.model.features import SidLookup
    from service.model.repository import resolve_checkpoint
    from training.data import Examples
    from training.study import Variant, run_study, sample_users
    from training.study_plots import MissingPlotting, require_plotting, write_plots

    if args.plots:  # a missing matplotlib is a one-line error before minutes of decoding
        try:
            require_plotting()
        except MissingPlotting as e:
            print(f"grace eval: {e}", file=sys.stderr)
            return 2
    loaded = load_checkpoint(resolve_checkpoint(Path(args.model)), args.device)
    loaded.model.to(getattr(torch, args.dtype))  # every variant, and the FP8 ones' twins
    index = validate_index(resolve(Path(args.index)), expect_tokenizer=loaded.sid_space)
    arrays = index.arrays
    world = load_world(Path(args.world))
    if args.users > world.n_users:
        print(f"grace eval: --users {args.users} exceeds the world's {world.n_users} users",
              file=sys.stderr)  # fmt: skip
        return 2
    examples = Examples(world, SidLookup.from_ads(arrays.ads), loaded.config)
    users = sample_users(world.n_users, args.users, args.seed)
    beams = tuple(args.beams) if args.beams else loaded.config.beams
    scorings = list(dict.fromkeys(args.scoring))
    variants = []
    for scoring in scorings:  # the first variant (cd_only, first scoring) is the base
        suffix = "" if scoring == "masked" else f"_{scoring}"
        variants += [Variant(f"cd_only{suffix}", arrays, FilterMode.CD_ONLY, scoring),
                     Variant(f"cd_gtm{suffix}", arrays, FilterMode.CD_GTM, scoring)]  # fmt: skip
    for spec in filter(None, (args.kway or "").split("+")):  # in the first scoring
        kway = KwaySpec.parse(spec)
        suffix = "" if scorings[0] == "masked" else f"_{scorings[0]}"
        variants.append(Variant(f"{kway.mode}_kway{suffix}", with_partitions(arrays, kway),
                                FilterMode.CD_GTM_KWAY, scorings[0]))  # fmt: skip
    if args.fp8:  # the same two filters in FP8, in the first scoring
        suffix = "" if scorings[0] == "masked" else f"_{scorings[0]}"
        for mode, name in ((FilterMode.CD_ONLY, "cd_only"), (FilterMode.CD_GTM, "cd_gtm")):
            variants.append(Variant(f"{name}{suffix}_fp8", arrays, mode, scorings[0], fp8=True))
    rows = run_study(loaded.model, examples, variants, users, beams, tuple(args.k),
                     fixed=tuple(args.fixed), device=args.device, resamples=args.resamples,
                     seed=args.seed, progress=show_progress(args))  # fmt: skip
    report = {
        "format": "grace.eval",
        "format_version": EVAL_FORMAT_VERSION,
        "world": str(args.world),
        "index_version": index.manifest["index_version"],
        "model_version": loaded.model_version,
        "dtype": args.dtype,
        "beams": list(beams),
        "users": len(users),
        "seed": args.seed,
        "resamples": args.resamples,
        "ks": list(args.k),
        "variants": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    cols = ["bitmask_pass", "bloom_pass", "location_pass", "final_pass", "eligible_ads_per_user"]
    cols += [f"recall@{k}" for k in args.k]
    print(f"{'variant':<20}" + "".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(f"{r['variant']:<20}" + "".join(f"{r[c]:>22.4f}" for c in cols))
    for r in rows[1:]:
        k = max(args.k)
        d = r["vs_first"][f"recall@{k}"]
        note = " resolved" if d["resolved"] else ""
        print(f"{r['variant']} - {rows[0]['variant']}: recall@{k} {d['mean']:+.4f} "
              f"[{d['lo']:+.4f}, {d['hi']:+.4f}]{note}")  # fmt: skip
    if args.plots:
        for path in write_plots(report, Path(args.plots)):
            print(f"wrote {path}")
    return 0


def _publish_model(args: argparse.Namespace) -> int:
    """publish a checkpoint into a model repository (servers hot-swap it in)

    Verify a checkpoint (every checksum, the tokenizer, each tensor against the config),
    pass the model gate (finite weights; with --index, a canary: requests of --world or
    --requests retrieved on that index must bring ads; without it only finiteness), copy it
    into ROOT/<version>/ with the gate's figures (gate.json), verify the copy and move
    ROOT/CURRENT to it atomically; servers whose --model is ROOT swap it in between batches
    if its SID space fits their index (docs/MODEL.md, 'Model repository', 'The model
    gate'). A checkpoint refused is named on one line and nothing changes."""
    from service.model.repository import publish_model

    if (args.index is None) != (args.world is None and args.requests is None):
        print("grace publish-model: the canary needs --index and --world or --requests",
              file=sys.stderr)  # fmt: skip
        return 2
    source, canary = Path(args.checkpoint), lambda: _canary(args, Path(args.checkpoint))
    try:
        version = publish_model(source, Path(args.root), keep=args.keep,
                                canary=canary if args.index else None)  # fmt: skip
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

    p = add("eval", _eval)
    p.add_argument("--world", required=True)
    p.add_argument("--index", required=True, help="index root (CURRENT) or version dir")
    p.add_argument("--model", required=True,
                   help="checkpoint directory (grace train) or model repository")  # fmt: skip
    p.add_argument("--users", type=int, default=1000, help="held-out users to evaluate")
    p.add_argument("--kway", default="static+dynamic", help="k-way variants, '+'-separated")
    p.add_argument("--beams", type=int, nargs=4, metavar="M", help="override the schedule")
    p.add_argument("--k", type=int, nargs="+", default=[10, 100, 1000],
                   help="recall@K and NDCG@K cut-offs (10 100 1000); the largest is the "
                   "number of ads returned")  # fmt: skip
    p.add_argument("--scoring", nargs="+", choices=SCORINGS, default=["masked"],
                   help="beam scorings to compare, each for CD only and CD+GTM: masked "
                   "(log-softmax over the allowed tokens, the served default) and/or "
                   "unmasked (the model's own log-probabilities)")  # fmt: skip
    p.add_argument("--fp8", action="store_true",
                   help="also decode CD only and CD+GTM with the decoder step's linear "
                   "layers in FP8 e4m3 (setting dtype = fp8), in the first scoring")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's weights in every variant (float32, the checkpoint's "
                   "own); bfloat16 is what a GPU serves, so with --fp8 it compares FP8 "
                   "with the served dtype")  # fmt: skip
    p.add_argument("--fixed", type=int, nargs="*", default=[], metavar="N",
                   help="also compare pass rates among the first N generated ads (users "
                   "with at least N), e.g. --fixed 1000 5000")  # fmt: skip
    p.add_argument("--resamples", type=positive_int, default=1000,
                   help="bootstrap resamples of the users for the intervals (1000)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="user sample and bootstrap seed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="also write the report as JSON here")
    p.add_argument("--autotune", action="store_true", help=AUTOTUNE_HELP)
    p.add_argument("--plots", metavar="DIR",
                   help="write the report's pictures as PNGs here (needs matplotlib: the "
                   "eval extra)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")

    p = add("publish-model", _publish_model)
    p.add_argument("checkpoint", help="checkpoint directory (grace train --out)")
    p.add_argument("--root", required=True, help="model repository root (made if missing)")
    p.add_argument("--keep", type=int, default=3,
                   help="valid versions to keep, besides CURRENT's (3)")  # fmt: skip
    p.add_argument("--index", metavar="ROOT", help="the gate's canary: refuse a model that "
                   "brings no ads to the requests of --world or --requests on this index (root "
                   "or version); without it only the weights' finiteness is checked")  # fmt: skip
    p.add_argument("--world", help="canary requests: the first users of this world")
    p.add_argument("--requests", metavar="FILE", help="canary requests: a replay (grace record)")
    p.add_argument("--canary", type=positive_int, default=64, metavar="N", help="how many (64)")
    p.add_argument("--device", default="cpu", help="where the canary runs (cpu)")

    p = add("flops", _flops)
    p.add_argument("--profile", choices=["tiny", "demo", "paper"], default="paper")
    p.add_argument("--beams", type=int, nargs=4, metavar="M")
