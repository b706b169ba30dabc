"""Paper-scale index build: synthetic world -> SID tokenizer -> published index, timed.

One command makes what the paper-scale serving benchmarks (#5) load, through the same
library calls as `grace synth --no-jsonl`, `grace train-tokenizer` and `grace
build-index`, and reports docs/ARCHITECTURE.md §9's index-build figure (30 M SIDs <= 5 min on 16
cores; GPU matcher tables <= 390 MB after dedup):

  1. world: `generate_world("paper", n_ads, n_users)` (knobs: `--set`) on `--workers`
     processes, Parquet catalog only (users: only what the benchmark's requests need);
  2. tokenizer: read the catalog's embedding column, train RQ-KMeans on its 200 k-row
     sample (CPU, `--workers` threads), save it;
  3. index: `build_index` (read + validate the catalog, SIDs on `--device`, trie, dedup,
     SID -> ad and targeting indexes, write + publish), then load the trie's `GtmTables`
     on the device and count their bytes.

Prints each phase as it ends and a table at the end; writes bench/results/paper_index.json
(or `--json PATH`) with per-phase seconds, peak RSS, bytes on disk, GPU matcher bytes,
trie nodes per level and matcher storage before/after dedup. On the H200 machine:

    python bench/bench_paper_index.py --ads 30000000 --users 1000 --out /tmp/paper \\
        --workers 16 --device cuda

Outputs replace OUT/world (catalog.parquet, users.parquet, ...), OUT/tokenizer and
OUT/index (an index root with CURRENT) and stay there for the serving benchmarks. Disk at
30 M ads: ~4.4 GB catalog + ~3.2 GB index, plus a 3.8 GB scratch file while the world is
drawn.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from index_builder.parallel import default_workers  # noqa: E402

# the trie's arrays GtmTables holds; the last four are the matcher's
TRIE_ARRAYS = ("node_offsets", "csr_child_nodes", "csr_tokens", "bitmask_index", "bloom_index",
               "bitmask_table", "bloom_table")  # fmt: skip


def _peak_rss_gib() -> dict[str, float]:
    """Peak resident memory so far of this process and of its largest child (Linux: KiB)."""
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"self": round(me / 2**20, 2), "largest_child": round(kids / 2**20, 2)}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Phases:
    """Wall time and peak RSS after each phase, printed as it ends."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def run(self, name: str, fn: Any) -> Any:
        print(f"\n=== {name} …", flush=True)
        t = time.perf_counter()
        out = fn()
        row = {"phase": name, "seconds": round(time.perf_counter() - t, 2), **_peak_rss_gib()}
        self.rows.append(row)
        print(f"=== {name}: {row['seconds']} s, peak RSS {row['self']} GiB", flush=True)
        return out

    @property
    def total(self) -> float:
        return round(time.perf_counter() - self._t0, 2)


def make_world(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from index_builder.synth import PROFILES, generate_world

    knobs = dict(pair.split("=", 1) for pair in args.set)
    return generate_world(
        PROFILES["paper"].with_knobs(knobs),
        args.seed,
        out,
        n_ads=args.ads,
        n_users=args.users,
        progress=not args.quiet,
        workers=args.workers,
        jsonl=False,
    )


def read_embeddings(catalog: Path) -> Any:
    """float32 [N, dim] view of the catalog's embedding column (Arrow reads it threaded)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pq.read_table(catalog, columns=["embedding"])["embedding"]
    # 64-bit offsets: past 67 M ads of dim 32 the values overflow a list<float>'s
    column = column.cast(pa.large_list(column.type.value_type)).combine_chunks()
    values = column.flatten().to_numpy()
    return values.reshape(len(column), -1).astype(np.float32, copy=False)


def train_tokenizer(args: argparse.Namespace, embeddings: Any, out: Path) -> str:
    from index_builder.tokenizer import SIDTokenizer, TokenizerConfig

    tok = SIDTokenizer.train(
        embeddings, TokenizerConfig(seed=args.seed), progress=not args.quiet, workers=args.workers
    )
    tok.save(out)
    return tok.fingerprint


def gpu_tables(version_dir: Path, device: str) -> dict[str, Any]:
    """Bytes of the arrays `GtmTables` holds on `device` (what the decoder's mask reads),
    and of the same arrays in their on-disk dtypes."""
    import torch

    from contracts.index_format import read_index_dir
    from contracts.tensors import GtmTables

    trie = read_index_dir(version_dir, verify_checksums=False)[1].trie
    t = time.perf_counter()
    tables = GtmTables.from_arrays(trie, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    held = {
        name: int(v.numel() * v.element_size())
        for name, v in vars(tables).items()
        if isinstance(v, torch.Tensor)
    }
    on_disk = {name: int(getattr(trie, name).nbytes) for name in TRIE_ARRAYS}
    matcher = TRIE_ARRAYS[3:]
    out = {
        "device": device,
        "load_seconds": round(load_s, 2),
        "held_bytes": held,
        "held_total_bytes": sum(held.values()),
        "held_matcher_bytes": sum(held[k] for k in matcher),
        "native_dtype_bytes": on_disk,
        "native_total_bytes": sum(on_disk.values()),
        "native_matcher_bytes": sum(on_disk[k] for k in matcher),
    }
    del tables
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _gb(n: float) -> float:
    return round(n / 1e9, 3)


def _mb(n: float) -> float:
    return round(n / 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ads", type=int, default=30_000_000)
    ap.add_argument("--users", type=int, default=1_000, help="users (request targeting)")
    ap.add_argument("--out", type=Path, required=True, help="directory for world, tokenizer, index")
    ap.add_argument("--workers", type=int, default=default_workers(), help="CPU processes/threads")
    ap.add_argument("--device", default="cuda", help="torch device for SIDs and GtmTables")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the result here, not bench/results/")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a world knob (docs/SYNTH.md), e.g. --set n_audiences=20000: richer "
                    "targeting, the index built by the world's schema")  # fmt: skip
    args = ap.parse_args()
    if not sys.stdout.isatty():  # a captured log: one progress line every 10 s, not 100s
        os.environ.setdefault("TQDM_MININTERVAL", "10")
    args.out.mkdir(parents=True, exist_ok=True)
    world_dir, tok_dir, index_root = args.out / "world", args.out / "tokenizer", args.out / "index"
    for old in (world_dir, tok_dir, index_root):  # a fresh run; at most one copy on disk
        shutil.rmtree(old, ignore_errors=True)
    print(f"paper-scale index: {args.ads:,} ads, {args.users:,} users, {args.workers} workers, "
          f"device {args.device}, into {args.out}", flush=True)  # fmt: skip

    phases = Phases()
    # the world first: its workers fork before torch or CUDA start any thread here
    world = phases.run("world", lambda: make_world(args, world_dir))
    catalog = world_dir / "catalog.parquet"
    embeddings = phases.run("read embeddings", lambda: read_embeddings(catalog))
    fingerprint = phases.run("train tokenizer", partial(train_tokenizer, args, embeddings, tok_dir))
    del embeddings

    import numpy as np

    from contracts.index_manifest import read_manifest
    from index_builder.build import build_index
    from index_builder.synth import load_world_schema

    version, report = phases.run(
        "build index",
        lambda: build_index(
            catalog,
            index_root,
            tokenizer_path=tok_dir,
            keep=1,
            progress=not args.quiet,
            device=args.device,
            workers=args.workers,
            schema=load_world_schema(world_dir),
        ),
    )
    version_dir = index_root / version
    gpu = phases.run("GtmTables", lambda: gpu_tables(version_dir, args.device))
    counts = read_manifest(version_dir)["counts"]
    level_offsets = np.load(version_dir / "trie.level_offsets.npy").tolist()
    nodes_per_depth = [b - a for a, b in itertools.pairwise(level_offsets)]
    steps = report.levels
    figures = {
        "ads": args.ads,
        "knobs": dict(pair.split("=", 1) for pair in args.set),
        "users": world["counts"]["users"],
        "workers": args.workers,
        "device": args.device,
        "total_seconds": phases.total,
        "phases": phases.rows,
        "build_seconds": report.seconds,
        "world_seconds": world["timings_s"],
        "tokenizer_fingerprint": fingerprint,
        "collisions": report.collisions,
        "counts": counts,
        "nodes_per_depth": nodes_per_depth,  # depth 0 = root … depth 4 = leaves (SIDs)
        "matcher_storage_per_step": steps,
        "matcher_bytes_before_dedup": sum(s["bitmask_bytes"] + s["bloom_bytes"] for s in steps),
        "matcher_table_bytes_after_dedup": counts["matcher_table_bytes"],
        "gpu_tables": gpu,
        "disk_bytes": {
            "world": _dir_bytes(world_dir),
            "catalog_parquet": catalog.stat().st_size,
            "tokenizer": _dir_bytes(tok_dir),
            "index_version": _dir_bytes(version_dir),
        },
        "peak_rss_gib": _peak_rss_gib(),
        "eligibility": world["eligibility"],
    }
    build_s = next(r["seconds"] for r in phases.rows if r["phase"] == "build index")
    figures["design_targets"] = {  # docs/ARCHITECTURE.md §9, for 30 M SIDs on 16 cores
        "index_build_seconds": {"measured": build_s, "target": 300},
        "gpu_matcher_bytes_held": {"measured": gpu["held_matcher_bytes"], "target": 390e6},
        "gpu_matcher_bytes_native_dtypes": {
            "measured": gpu["native_matcher_bytes"],
            "target": 390e6,
        },
    }
    _print_table(figures)
    print(f"\nwrote {write_result('paper_index', figures, args.json)}")


def _print_table(f: dict[str, Any]) -> None:
    print(f"\n{'phase':<18} {'seconds':>9} {'peak RSS GiB':>13}")
    for row in f["phases"]:
        print(f"{row['phase']:<18} {row['seconds']:>9.2f} {row['self']:>13.2f}")
    print(f"{'total':<18} {f['total_seconds']:>9.2f}")
    print(f"  world phases (s): {f['world_seconds']}")
    print(f"  build phases (s): {f['build_seconds']}")
    print(f"  SIDs: {f['counts']['sids']:,} for {f['counts']['ads']:,} ads; {f['collisions']}")
    print(f"  trie nodes per depth: {f['nodes_per_depth']}")
    g = f["gpu_tables"]
    print(
        f"  matcher storage: {_mb(f['matcher_bytes_before_dedup'])} MB before dedup -> "
        f"{_mb(f['matcher_table_bytes_after_dedup'])} MB of tables "
        f"({f['counts']['bitmask_rows']:,} bitmask + {f['counts']['bloom_rows']:,} Bloom rows)"
    )
    print(
        f"  GtmTables on {g['device']}: matcher {_mb(g['held_matcher_bytes'])} MB "
        f"(indexes + tables), all {_mb(g['held_total_bytes'])} MB; in on-disk dtypes "
        f"matcher {_mb(g['native_matcher_bytes'])} MB, all {_mb(g['native_total_bytes'])} MB"
    )
    t = f["design_targets"]
    print(
        f"  DESIGN §9: build_index {t['index_build_seconds']['measured']} s (target <= 300 s "
        f"at 30 M on 16 cores); GPU matcher tables {_mb(g['held_matcher_bytes'])} MB as "
        f"GtmTables holds them, {_mb(g['native_matcher_bytes'])} MB in int32 (target <= 390 MB)"
    )
    d = f["disk_bytes"]
    print(
        f"  disk: world {_gb(d['world'])} GB (catalog {_gb(d['catalog_parquet'])} GB), "
        f"index {_gb(d['index_version'])} GB; peak RSS {f['peak_rss_gib']}"
    )


if __name__ == "__main__":
    main()
