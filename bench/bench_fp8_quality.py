"""FP8 variants on a trained model, side by side in one run: the served FP8 step, the same
model in the served dtype, and bench variants of the FP8 FFN that the server cannot run
(`bench/baselines/decode_variants.py`, `DecodeOptions.fp8_ffn`: `rowwise`, the FFN with
rowwise scales served before the 1 x 128 one; `exp_tanh`, the GELU's tanh from exp;
`promoted`, the up GEMM's sums in fp32), each decoding the same users (docs/FP8.md,
"Quality on a trained model").

`grace eval --fp8` compares served FP8 with the model's dtype only; this asks what a
variant changes against served FP8 itself: every row after the first carries `vs_first`,
its paired recall@K / NDCG@K difference to served FP8, and each FP8 row
`vs_full_precision`, against the model's dtype (with the top-SID overlap). It runs
`training.study.run_study`, the study's own loop, with the variants' engines.

    python3 bench/bench_fp8_quality.py --world W --index I --model M --users 1000 \
        --device cuda --out bench/results/fp8_quality_h200.json

On a CPU the variants' Triton kernels run under the interpreter, where served FP8 runs
torch's reference (the hardware tanh exists on a GPU only): there the rows test the
wiring, not the numerics.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli.common import offline_kernels

FFN_VARIANTS = ("rowwise", "exp_tanh", "promoted", "triton_down")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--world", required=True, help="world directory (grace synth)")
    ap.add_argument("--index", required=True, help="index root (CURRENT) or version dir")
    ap.add_argument("--model", required=True, help="checkpoint directory (grace train)")
    ap.add_argument("--users", type=int, default=1000, help="held-out users (the first of "
                    "grace eval's sample with the same --seed)")  # fmt: skip
    ap.add_argument(
        "--variants",
        default="rowwise,exp_tanh",
        help=f"FP8 FFN variants, comma-separated, of {', '.join(FFN_VARIANTS)}",
    )
    ap.add_argument("--mode", choices=("cd_gtm", "cd_only"), default="cd_gtm")
    ap.add_argument("--beams", type=int, nargs=4, metavar="M", default=[1, 512, 1024, 1024])
    ap.add_argument("--k", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model's dtype (bfloat16: what a GPU serves)")  # fmt: skip
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autotune", action="store_true", help="autotune the Triton kernels")
    ap.add_argument("--out", type=Path, help="result JSON (default bench/results/fp8_quality.json)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(names) - set(FFN_VARIANTS))
    if unknown:
        ap.error(f"unknown --variants {', '.join(unknown)}: choose from {', '.join(FFN_VARIANTS)}")
    a.variants = names
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    offline_kernels(a.autotune)  # before the kernels are imported
    if a.device == "cpu":  # the variants' Triton kernels, under the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from bench.baselines.decode_variants import DecodeOptions, VariantEngine
    from bench.common import write_result
    from contracts.request import FilterMode
    from index_builder.publish import resolve
    from index_builder.synth import load_world
    from index_builder.validate import validate_index
    from service.model.checkpoint import load_checkpoint
    from service.model.features import SidLookup
    from service.model.repository import resolve_checkpoint
    from training.data import Examples
    from training.study import Variant, run_study, sample_users

    loaded = load_checkpoint(resolve_checkpoint(Path(a.model)), a.device)
    loaded.model.to(getattr(torch, a.dtype))
    arrays = validate_index(resolve(Path(a.index)), expect_tokenizer=loaded.sid_space).arrays
    world = load_world(Path(a.world))
    examples = Examples(world, SidLookup.from_ads(arrays.ads), loaded.config)
    users = sample_users(world.n_users, min(a.users, world.n_users), a.seed)
    mode = FilterMode.CD_GTM if a.mode == "cd_gtm" else FilterMode.CD_ONLY
    variants = [Variant(f"{a.mode}_fp8", arrays, mode, fp8=True),  # the first: vs_first
                Variant(a.mode, arrays, mode)]  # fmt: skip
    for name in a.variants:
        options = DecodeOptions(fp8=True, fp8_ffn=name)
        engine = functools.partial(VariantEngine, options=options)
        variants.append(Variant(f"{a.mode}_fp8_{name}", arrays, mode, fp8=True, engine=engine))
    rows = run_study(loaded.model, examples, variants, users, tuple(a.beams), tuple(a.k),
                     device=a.device, resamples=a.resamples, seed=a.seed,
                     progress=not a.no_progress)  # fmt: skip
    figures = {"model_version": loaded.model_version, "dtype": a.dtype, "beams": a.beams,
               "users": len(users), "seed": a.seed, "variants": rows}  # fmt: skip
    print_summary(rows, a.k)
    print(write_result("fp8_quality", figures, a.out))
    return 0


def _diff(d: dict, key: str) -> str:
    x = d[key]
    return f"{x['mean']:+.4f} [{x['lo']:+.4f}, {x['hi']:+.4f}]{' *' if x['resolved'] else ''}"


def print_summary(rows: list[dict], ks: list[int]) -> None:
    """A line per variant: its recall@K, and its differences to served FP8 and to the
    model's dtype at the middle K (* resolved: the 95 % interval excludes 0)."""
    k = f"recall@{sorted(ks)[len(ks) // 2]}"
    for row in rows:
        parts = [f"{row['variant']:<28}", *(f"recall@{x} {row[f'recall@{x}']:.3f}" for x in ks)]
        if "vs_first" in row:
            parts.append(f"{k} - {row['vs_first']['variant']} {_diff(row['vs_first'], k)}")
        if "vs_full_precision" in row:
            full = row["vs_full_precision"]
            kept = ", ".join(f"{n} {v['mean']:.3f}" for n, v in full["sid_overlap"].items())
            parts.append(f"{k} - {full['variant']} {_diff(full, k)}; SIDs kept {kept}")
        print("  ".join(parts))
    print("* resolved: the paired 95 % interval excludes 0")


if __name__ == "__main__":
    sys.exit(main())
