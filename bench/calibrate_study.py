"""Which campaign knobs put a trained model in the paper's regime (docs/EVALUATION.md,
"Calibrating the world"): for each knob setting, a scaled-down `study` world, the tiny
model trained on it for one epoch with a code-mode tokenizer (a SID holds a creative's
ads), its index, and `training/study.py` over CD only and CD+GTM — the final pass rates,
their ratio (the paper: 0.236 and 0.404, 1.72x), eligible ads and recall@100 of each.

    .venv/bin/python bench/calibrate_study.py --out bench/results/study_calibration_cpu.json

Settings are `name:geo_share:demo_share:style_mix:by_creative[:fresh_share]` (style_mix as
four comma-separated shares, by_creative 0 or 1, fresh_share the share of creatives
launched after the log, 0 when left out); the defaults are the grid behind the docs.
`--set KNOB=VALUE` adds a world knob to every setting (audiences, exclusions, blocks:
docs/SYNTH.md); the index is built by the world's targeting schema.
Worlds, models and indexes are kept under --work, so a rerun only re-evaluates.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result
from contracts.index_manifest import manifest_schema
from contracts.index_validation import validate_index
from contracts.request import FilterMode
from index_builder.build import build_index
from index_builder.publish import resolve
from index_builder.synth import PROFILES, generate_world, load_world, load_world_schema
from service.model.checkpoint import load_checkpoint
from service.model.features import SidLookup
from training.data import Examples
from training.study import Variant, run_study, sample_users
from training.train import TrainSettings, train

GRID = (
    "A:0.35:0.25:0.50,0.32,0.11,0.07:0",  # the study profile before calibration
    "B:0.8:0.25:0.50,0.32,0.11,0.07:0",
    "C:0.8:0.5:0.7,0.2,0.05,0.05:0",
    "D:0.8:0.5:0.50,0.32,0.11,0.07:1",
    "E:0.9:0.7:0.7,0.2,0.05,0.05:1",
    "F:1.0:0.9:0.8,0.1,0.05,0.05:1",
    "G:0.95:0.8:0.7,0.2,0.05,0.05:1",  # the study profile of the first scaled run (1.40x)
    "K:0.95:0.8:0.15,0.05,0.50,0.30:1",  # the study markets (regional / local), no fresh ads
)


def probe(spec: str, args: argparse.Namespace) -> dict:
    name, geo, demo, style, by_creative, *rest = spec.split(":")
    root = args.work / name
    profile = dataclasses.replace(
        PROFILES["study"].with_knobs({
            "campaign_geo_share": geo, "campaign_demo_share": demo, "style_mix": style,
            "campaign_geo_by_creative": by_creative, "fresh_share": rest[0] if rest else "0",
            **dict(pair.split("=", 1) for pair in args.set),
        }),
        name=f"study-{name}", n_ads=args.ads, n_users=args.users,
    )  # fmt: skip
    fresh = profile.fresh_share
    t0 = time.time()
    if not (root / "world" / "world.json").exists():
        generate_world(profile, 0, root / "world", progress=False)
    if not (root / "model" / "config.json").exists():
        lr = 2e-3 if args.model == "tiny" else 1e-3
        settings = TrainSettings(profile=args.model, epochs=args.epochs, batch_size=256, lr=lr,
                                 eval_users=100, eval_ks=(10, 100), last_token="code",
                                 device=args.device)  # fmt: skip
        train(root / "world", root / "model", settings, progress=False)
    if not (root / "index" / "CURRENT").exists():
        build_index(root / "world" / "catalog.parquet", root / "index",
                    tokenizer_path=root / "model" / "tokenizer", progress=False,
                    schema=load_world_schema(root / "world"))  # fmt: skip
    loaded = load_checkpoint(root / "model", args.device)
    index = validate_index(resolve(root / "index"), expect_tokenizer=loaded.sid_space)
    arrays, schema = index.arrays, manifest_schema(index.manifest)
    world = load_world(root / "world")
    examples = Examples(world, SidLookup.from_ads(arrays.ads), loaded.config)
    users = sample_users(world.n_users, args.eval_users, 0)
    variants = [Variant("cd_only", arrays, FilterMode.CD_ONLY),
                Variant("cd_gtm", arrays, FilterMode.CD_GTM)]  # fmt: skip
    cd, gtm = run_study(loaded.model, examples, variants, users, tuple(args.beams), (10, 100),
                        resamples=200, device=args.device, progress=False,
                        schema=schema)  # fmt: skip
    return {
        "name": name, "campaign_geo_share": profile.campaign_geo_share,
        "campaign_demo_share": profile.campaign_demo_share,
        "style_mix": profile.style_mix,
        "campaign_geo_by_creative": profile.campaign_geo_by_creative, "fresh_share": fresh,
        "cd_only_final_pass": round(cd["final_pass"], 3),
        "cd_gtm_final_pass": round(gtm["final_pass"], 3),
        "ratio": round(gtm["final_pass"] / max(cd["final_pass"], 1e-9), 2),
        "cd_only_bitmask_location_pass": [round(cd["bitmask_pass"], 3),
                                          round(cd["location_pass"], 3)],
        "ads_generated_per_user": round(cd["ads_generated_per_user"], 1),
        "eligible_ads_per_user": [round(cd["eligible_ads_per_user"], 1),
                                  round(gtm["eligible_ads_per_user"], 1)],
        "recall@100": [round(cd["recall@100"], 3), round(gtm["recall@100"], 3)],
        "recall@100_gtm_minus_cd": gtm["vs_first"]["recall@100"],
        "removed_share": [{k: round(v, 4) for k, v in r["removed_share"].items()}
                          for r in (cd, gtm)],
        **({"knobs": dict(pair.split("=", 1) for pair in args.set)} if args.set else {}),
        **_by_launch(cd, gtm),
        "seconds": round(time.time() - t0),
    }  # fmt: skip


def _by_launch(cd: dict, gtm: dict) -> dict:
    """recall@100 of CD only and CD+GTM for logged and for fresh held-out ads (a world
    with fresh creatives only)."""
    if "recall_by_launch" not in cd:
        return {}
    split = [[round(r["recall_by_launch"][s]["recall@100"], 3) for s in ("logged", "fresh")]
             for r in (cd, gtm)]  # fmt: skip
    return {"recall@100_logged_fresh": split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="*", default=list(GRID), help="name:geo:demo:style:byc")
    ap.add_argument("--ads", type=int, default=20_000)
    ap.add_argument("--users", type=int, default=1_500)
    ap.add_argument("--eval-users", type=int, default=300)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--beams", type=int, nargs=4, default=[1, 16, 64, 64])
    ap.add_argument("--model", default="tiny", help="model profile trained on each world")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a further world knob for every setting (docs/SYNTH.md), e.g. "
                    "--set n_audiences=20000")  # fmt: skip
    ap.add_argument("--work", type=Path, default=None,
                    help="worlds, models and indexes (/tmp/grace-calibration-MODEL)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results)")
    args = ap.parse_args()
    args.work = args.work or Path(f"/tmp/grace-calibration-{args.model}")
    knobs = {"ads": args.ads, "users": args.users, "eval_users": args.eval_users,
             "epochs": args.epochs, "beams": args.beams, "model": args.model,
             "device": args.device, "last_token": "code"}  # fmt: skip
    name = "study_calibration_cpu" if args.model == "tiny" else f"study_calibration_{args.model}"
    rows: list[dict] = []
    path = None
    for spec in args.settings:  # the JSON is rewritten after each setting: a cut run keeps its rows
        rows.append(probe(spec, args))
        print(rows[-1], flush=True)
        path = write_result(name, {**knobs, "settings": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
