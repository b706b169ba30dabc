"""Server start-up before any CUDA graph: the two loads every worker pays at start and
(the index) on every hot swap — the model checkpoint (`load_checkpoint`, then the cast to
the serving dtype) and one index version (`load_index`: checksums, the full
validation of `contracts.index_validation`, the device tables and the post stage). Medians
over repeated loads in this one process (the files stay in the page cache after the
first). Results: bench/results/startup_<device>.json.

Build the inputs with the project's own commands, e.g. an 8 M-ad paper-tokenizer index
and an untrained paper model (docs/OPERATIONS.md, "Figures": start-up loads):

    .venv/bin/python bench/bench_paper_index.py --ads 8000000 --users 100 --out /tmp/p8m \\
        --device cpu --quiet
    .venv/bin/python -m cli init-model --profile paper \\
        --tokenizer /tmp/p8m/tokenizer --out /tmp/p8m/model
    .venv/bin/python bench/bench_startup.py --index-root /tmp/p8m/index --model /tmp/p8m/model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import write_result
from index_builder.publish import current_version
from service.index.loaded import LoadedIndex, load_index
from service.model.checkpoint import load_checkpoint

T = TypeVar("T")


def _seconds(load: Callable[[], T], repeat: int) -> tuple[list[float], T | None]:
    """Seconds of each of `repeat` loads, and the last one loaded. The previous result is
    freed before the next timer starts, so no load pays for freeing another."""
    out: list[float] = []
    last: T | None = None
    for _ in range(repeat):
        last = None
        t = time.perf_counter()
        last = load()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(round(time.perf_counter() - t, 3))
    return out, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index-root", type=Path, required=True, help="index root with CURRENT")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None, help="serving dtype (bfloat16 on cuda, float32)")
    p.add_argument("--repeat", type=int, default=3, help="loads of each (median reported)")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/startup_DEVICE)")
    args = p.parse_args(argv)
    version = current_version(args.index_root)
    if version is None:
        p.error(f"{args.index_root}: no CURRENT version (build an index first)")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device != "cpu" else "float32"))

    def model() -> object:
        return load_checkpoint(args.model, args.device).model.to(dtype)

    def index() -> LoadedIndex:
        return load_index(args.index_root / version, tokenizer_fingerprint=None,
                                  device=args.device)  # fmt: skip

    model_s, _ = _seconds(model, args.repeat)
    index_s, served = _seconds(index, args.repeat)
    figures = {
        "index_version": version,
        "ads": served.post.ads.num_ads if served and served.post else None,
        "model": str(args.model),
        "device": args.device,
        "model_load_s": model_s,
        "model_load_median_s": statistics.median(model_s),
        "index_load_and_validate_s": index_s,
        "index_load_and_validate_median_s": statistics.median(index_s),
    }
    path = write_result(f"startup_{args.device.split(':')[0]}", figures, args.out)
    print(f"model load {figures['model_load_median_s']:.2f} s, index load and validation "
          f"{figures['index_load_and_validate_median_s']:.2f} s (medians of {args.repeat}); "
          f"wrote {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
