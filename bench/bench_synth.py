"""Synthetic world generation at scale: rate, peak memory, projection to `paper`.

Runs `generate_world` in a fresh child process (so peak RSS is its own) at `--ads` and,
as the baseline of the same run, at half of it, then projects to the `paper` profile
(30 M ads, 100 k users): ad-side time proportional to the larger run, user-side time
proportional to users, peak memory linear in ads through both runs. Prints a table and writes
`bench/results/synth_<ads>.json` with the command, git commit, device and date.

    .venv/bin/python bench/bench_synth.py --ads 1000000 --users 20000
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from index_builder.synth import PROFILES, generate_world  # noqa: E402

AD_PHASES = ("advertisers", "ads")  # scale with the number of ads
USER_PHASES = ("users", "histories", "write_users")  # scale with the number of users


def _child(args: argparse.Namespace) -> None:
    out = Path(args.out)
    t = time.perf_counter()
    summary = generate_world(
        args.profile, args.seed, out, n_ads=args.ads, n_users=args.users, progress=False
    )
    wall = time.perf_counter() - t
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    shutil.rmtree(out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        json.dumps(
            {
                "ads": args.ads,
                "users": args.users,
                "wall_s": wall,
                "peak_rss_bytes": peak,
                "timings_s": summary["timings_s"],
                "file_bytes": files,
                "eligibility": summary["eligibility"],
                "counts": summary["counts"],
            }
        )
    )


def _run(args: argparse.Namespace, n_ads: int, scratch: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--profile", args.profile, "--seed",
           str(args.seed), "--ads", str(n_ads), "--users", str(args.users),
           "--out", str(scratch / f"w{n_ads}")]  # fmt: skip
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def phase_s(run: dict[str, Any], phases: tuple[str, ...]) -> float:
    """Seconds a run's world generation spent in `phases`."""
    return sum(run["timings_s"][k] for k in phases)


def _linear(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y1 + (y1 - y0) / (x1 - x0) * (x - x1) if x1 != x0 else y1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ads", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--profile", default="paper", choices=sorted(PROFILES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    target = PROFILES["paper"]
    with tempfile.TemporaryDirectory(prefix="bench_synth_") as scratch:
        base = _run(args, max(1, args.ads // 2), Path(scratch))
        main_run = _run(args, args.ads, Path(scratch))

    n0, n1, n = base["ads"], main_run["ads"], target.n_ads
    # time: proportional to the larger run (conservative: its fixed costs scale too);
    # memory: linear through both runs, since chunk buffers are a fixed cost
    proj_ad_s = phase_s(main_run, AD_PHASES) * n / n1
    proj_user_s = phase_s(main_run, USER_PHASES) * target.n_users / args.users
    proj_total = proj_ad_s + proj_user_s + main_run["timings_s"]["eligibility"]
    proj_rss = _linear(n0, base["peak_rss_bytes"], n1, main_run["peak_rss_bytes"], n)
    disk_per_ad = sum(
        main_run["file_bytes"].get(f, 0) for f in ("catalog.jsonl", "catalog.parquet")
    )
    figures = {
        "runs": [base, main_run],
        "ads_per_s": n1 / phase_s(main_run, AD_PHASES),
        "users_per_s": args.users / phase_s(main_run, USER_PHASES),
        "peak_rss_gib": main_run["peak_rss_bytes"] / 2**30,
        "projection_paper": {
            "n_ads": n,
            "n_users": target.n_users,
            "total_s": proj_total,
            "ads_phase_s": proj_ad_s,
            "user_phases_s": proj_user_s,
            "peak_rss_gib": proj_rss / 2**30,
            "catalog_disk_gib": disk_per_ad / n1 * n / 2**30,
            "method": "ads phases proportional to ads (larger run); RSS linear in ads "
            "through both runs; user phases proportional to users",
        },
    }
    print(f"{'ads':>12} {'users':>8} {'wall s':>8} {'ads/s':>10} {'peak RSS GiB':>13}")
    for r in (base, main_run):
        print(
            f"{r['ads']:>12,} {r['users']:>8,} {r['wall_s']:>8.1f} "
            f"{r['ads'] / phase_s(r, AD_PHASES):>10,.0f} {r['peak_rss_bytes'] / 2**30:>13.2f}"
        )
    pj = figures["projection_paper"]
    print(
        f"projection paper: {pj['total_s'] / 60:.1f} min, peak RSS {pj['peak_rss_gib']:.1f} GiB, "
        f"catalog files {pj['catalog_disk_gib']:.1f} GiB"
    )
    figures["profile"] = args.profile
    path = write_result(f"synth_{args.ads}", figures)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
