"""Index build benchmark: time and peak memory of `grace build-index` at 100 k and 1 M
ads, and at demo scale the paper's Table 1 (matcher storage per step, before/after
dedup) and Table 2 (matcher fill per step, plain vs static vs dynamic k-way).

Worlds and tokenizers are generated once into --work (not timed); each build runs in a
fresh child process so its peak RSS is its own. Results: bench/results/index_build.json.

    .venv/bin/python bench/bench_index_build.py                 # 100k and 1M, demo tables
    .venv/bin/python bench/bench_index_build.py --sizes 20000 --table-ads 20000  # quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, write_result

MATCHERS, DEDUP = ("bitmask", "bloom"), ("", "_dedup")

CHILD = """
import json, resource, sys
from index_builder.build import build_index
from index_builder.kway import KwaySpec
catalog, out, tok, kway = sys.argv[1:5]
version, report = build_index(catalog, out, tokenizer_path=tok,
                              kway=KwaySpec.parse(kway) if kway else None, progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"version": version, "peak_rss_bytes": peak, **vars(report)}))
"""


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def prepare(work: Path, n_ads: int, seed: int) -> tuple[Path, Path, float]:
    """World + tokenizer for n_ads (cached); returns (catalog, tokenizer, train seconds)."""
    world, tok = work / f"world_{n_ads}", work / f"tokenizer_{n_ads}"
    if not (world / "world.json").is_file():
        from index_builder.synth import generate_world

        print(f"generating a {n_ads}-ad world in {world} …", flush=True)
        generate_world("demo", seed, world, n_ads=n_ads, n_users=2000, progress=True)
    timing = work / f"tokenizer_{n_ads}.seconds"
    if not tok.exists():
        t = time.perf_counter()
        catalog = str(world / "catalog.parquet")
        cli = [sys.executable, "-m", "cli", "train-tokenizer", "--no-progress"]
        _run([*cli, "--catalog", catalog, "--out", str(tok)])
        timing.write_text(f"{time.perf_counter() - t:.2f}\n")
    return world / "catalog.parquet", tok, float(timing.read_text())


def build(catalog: Path, out: Path, tok: Path, kway: str = "") -> dict[str, Any]:
    t = time.perf_counter()
    stdout = _run([sys.executable, "-c", CHILD, str(catalog), str(out), str(tok), kway])
    result = json.loads(stdout.strip().splitlines()[-1])
    result["wall_seconds"] = round(time.perf_counter() - t, 2)
    return result


def table1(levels: list[dict]) -> list[dict]:
    """Matcher storage per step in kB (demo-scale tables are small: kB keeps the dedup
    column readable): bitmask_kB, bitmask_kB_dedup, bloom_kB, bloom_kB_dedup."""
    rows = []
    for lv in levels:
        kb = {f"{m}_kB{d}": round(lv[f"{m}_bytes{d}"] / 1e3, 1) for m in MATCHERS for d in DEDUP}
        rows.append({"step": lv["step"], "entries": lv["entries"], **kb})
    return rows


def table2(plain: dict, static: dict, dynamic: dict) -> list[dict]:
    """Matcher fill per step, plain vs static vs dynamic k-way, and the mean k of each k-way."""
    rows = []
    for p, s, d in zip(plain["levels"], static["kway_levels"], dynamic["kway_levels"], strict=True):
        by = {"plain": p, "static": s, "dynamic": d}
        row = {f"{m}_fill_{b}": round(lv[f"{m}_fill"], 4) for m in MATCHERS for b, lv in by.items()}
        mean_k = {f"mean_k_{b}": round(by[b]["mean_k"], 2) for b in ("static", "dynamic")}
        rows.append({"step": p["step"], **row, **mean_k})
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if rows:
        keys = list(rows[0])
        print("  ".join(f"{k:>14}" for k in keys))
        for r in rows:
            print("  ".join(f"{r[k]!s:>14}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--table-ads", type=int, default=200_000, help="ads for Tables 1–2")
    ap.add_argument("--work", type=Path, default=ROOT / "data" / "bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="index_build")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    scale = []
    for n in args.sizes:
        catalog, tok, train_s = prepare(args.work, n, args.seed)
        r = build(catalog, args.work / f"index_{n}", tok)
        scale.append(
            {
                "ads": n,
                "build_seconds": r["seconds"]["total"],
                "peak_rss_GB": round(r["peak_rss_bytes"] / 1e9, 2),
                "phases": r["seconds"],
                "tokenizer_train_seconds": round(train_s, 2),
                "counts": r["counts"],
            }
        )
        print(f"{n} ads: build {r['seconds']['total']} s, peak {scale[-1]['peak_rss_GB']} GB")
    brief = ("ads", "build_seconds", "peak_rss_GB", "tokenizer_train_seconds")
    show("Build time and peak memory", [{k: s[k] for k in brief} for s in scale])

    catalog, tok, _ = prepare(args.work, args.table_ads, args.seed)
    plain = build(catalog, args.work / "index_tables", tok)
    builds = {"plain": plain} | {k: build(catalog, args.work / f"index_{k}", tok, k)
                                 for k in ("static", "dynamic")}  # fmt: skip
    t1, t2 = table1(plain["levels"]), table2(*builds.values())
    show(f"Table 1 analogue ({args.table_ads} ads): matcher storage per step", t1)
    show(f"Table 2 analogue ({args.table_ads} ads): mean matcher fill per step", t2)
    path = write_result(
        args.name,
        {
            "scale": scale,
            "table1": {"ads": args.table_ads, "counts": plain["counts"], "rows": t1},
            "table2": {"ads": args.table_ads, "rows": t2},
            "kway_build_seconds": {k: r["seconds"]["total"] for k, r in builds.items()},
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
