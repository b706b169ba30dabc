"""Command line: a thin wrapper over `generate_world` that prints the world's counts,
eligibility figures and timings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from index_builder.parallel import default_workers
from index_builder.synth import PROFILES, generate_world


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m index_builder.synth", description=__doc__)
    ap.add_argument("profile", choices=sorted(PROFILES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ads", type=int, default=None, help="override the profile's ad count")
    ap.add_argument("--users", type=int, default=None, help="override the profile's user count")
    ap.add_argument("--workers", type=int, default=None, help="processes drawing ads (all CPUs)")
    ap.add_argument("--no-jsonl", action="store_true", help="write the catalog as Parquet only")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    s = generate_world(
        a.profile,
        a.seed,
        a.out,
        n_ads=a.ads,
        n_users=a.users,
        progress=not a.quiet,
        workers=a.workers or default_workers(),
        jsonl=not a.no_jsonl,
    )
    print(json.dumps({k: s[k] for k in ("counts", "eligibility", "timings_s")}, indent=2))


if __name__ == "__main__":
    main()
