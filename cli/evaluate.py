"""`grace eval`: the GTM effectiveness study of a trained model on an index
(`training/study.py`; docs/EVALUATION.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.common import AUTOTUNE_HELP, AddCommand, offline_kernels, positive_int, show_progress
from contracts.request import SCORINGS

EVAL_FORMAT_VERSION = 3  # of `grace eval --out` (docs/EVALUATION.md, "The report")


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

    from contracts.index_manifest import manifest_schema
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
    arrays, schema = index.arrays, manifest_schema(index.manifest)
    world = load_world(Path(args.world))
    if args.users > world.n_users:
        print(f"grace eval: --users {args.users} exceeds the world's {world.n_users} users",
              file=sys.stderr)  # fmt: skip
        return 2
    examples = Examples(world, SidLookup.from_ads(arrays.ads), loaded.config)
    users = sample_users(world.n_users, args.users, args.seed)
    beams = tuple(args.beams) if args.beams else loaded.config.beams
    scorings = list(dict.fromkeys(args.scoring))
    suffix = {s: "" if s == "masked" else f"_{s}" for s in scorings}  # of variant names
    filters = ((FilterMode.CD_ONLY, "cd_only"), (FilterMode.CD_GTM, "cd_gtm"))
    variants = []
    for scoring in scorings:  # the first variant (cd_only, first scoring) is the base
        for mode, name in filters:
            variants.append(Variant(f"{name}{suffix[scoring]}", arrays, mode, scoring))
    first = scorings[0]  # the k-way and FP8 variants' scoring
    for spec in filter(None, (args.kway or "").split("+")):
        kway = KwaySpec.parse(spec)
        variants.append(Variant(f"{kway.mode}_kway{suffix[first]}",
                                with_partitions(arrays, kway, schema),
                                FilterMode.CD_GTM_KWAY, first))  # fmt: skip
    if args.fp8:  # the same two filters in FP8
        for mode, name in filters:
            variants.append(Variant(f"{name}{suffix[first]}_fp8", arrays, mode, first, fp8=True))
    rows = run_study(loaded.model, examples, variants, users, beams, tuple(args.k),
                     fixed=tuple(args.fixed), device=args.device, resamples=args.resamples,
                     seed=args.seed, progress=show_progress(args), schema=schema)  # fmt: skip
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


def register(add: AddCommand) -> None:
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
