"""How many candidate slots a compacted top-k would need per request (docs/PERFORMANCE.md,
"What would close the last 0.9 ms"): at decode step t a request's M_t beam rows sit on
nodes of trie level t, and only their children are candidates. The most any request can
have is the sum of the M_t largest child counts at that level — a capacity known at
index load that never overflows — against the dense M_t × vocab the top-k scans now.
Reads only the trie's offsets (no model, no GPU). Results:
bench/results/topk_capacity.json.

    .venv/bin/python bench/bench_topk_capacity.py --index-root /tmp/p2m/index /tmp/p8m/index
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from contracts.index_format import VOCAB_SIZE, read_index_dir
from index_builder.publish import current_version
from service.model.config import PROFILES


def capacities(index_dir: Path, beams: tuple[int, ...]) -> dict:
    """Per decode step: trie nodes at that level, their mean and largest child counts,
    the never-overflowing capacity and the dense width, for one index version."""
    manifest, arrays = read_index_dir(index_dir, verify_checksums=False)
    level = np.asarray(arrays.trie.level_offsets)
    children = np.diff(np.asarray(arrays.trie.node_offsets))
    steps = []
    for t, m in enumerate(beams):
        per_node = children[level[t] : level[t + 1]]
        bound = int(np.sort(per_node)[::-1][:m].sum())
        steps.append({
            "step": t + 1, "beams": m, "nodes": len(per_node),
            "children_mean": round(float(per_node.mean()), 2),
            "children_max": int(per_node.max()),
            "capacity": bound, "dense": m * VOCAB_SIZE,
            "dense_over_capacity": round(m * VOCAB_SIZE / bound, 2),
        })  # fmt: skip
    return {"index": str(index_dir), "ads": manifest.get("counts", {}).get("ads"),
            "steps": steps}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index-root", type=Path, nargs="+", required=True,
                   help="index roots with CURRENT (or version directories)")  # fmt: skip
    p.add_argument("--beams", type=int, nargs=4, default=list(PROFILES["paper"].beams),
                   help="beam widths M_1..M_4 (the paper profile's)")  # fmt: skip
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/topk_capacity)")
    args = p.parse_args(argv)
    out = []
    for root in args.index_root:
        version = current_version(root)
        out.append(capacities(root / version if version else root, tuple(args.beams)))
        for s in out[-1]["steps"]:
            print(f"{root} step {s['step']}: capacity {s['capacity']:,} of {s['dense']:,} "
                  f"({s['dense_over_capacity']}x fewer); children mean {s['children_mean']}, "
                  f"max {s['children_max']}")  # fmt: skip
    print(write_result("topk_capacity", {"beams": args.beams, "indexes": out}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
