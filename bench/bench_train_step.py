"""Training steps per second of `grace train` (docs/PERFORMANCE.md, "Training"), against
the step loop it replaced, measured in one run on one world:

* `baseline_fp32`: the loop before (kept here as the baseline): fp32, the batch built
  inline before each step, AdamW unfused, the loss read back after every step; timed
  after WARMUP untimed steps (it runs first, in a fresh process);
* `train_fp32` / `train_bf16`: `training.train.train` itself (`--precision fp32` / `bf16`):
  batches built and page-locked on a background thread, fused AdamW on CUDA, losses read
  back every 50 steps. Its time is the whole loop, first steps included, with a state
  checkpoint every 200 steps (the `study` world has no validation split).

A `study` world (`grace synth`, code-mode SIDs as bench/study.sh trains) of ADS ads and
USERS users, the `demo` model, batch 256. Usage (lent GPU, `. bench/gpu_env.sh`):
    python3 bench/bench_train_step.py [--device cuda] [--steps 300] [--out PATH]
CPU smoke: python3 bench/bench_train_step.py --device cpu --profile tiny --ads 20000 \
    --users 1000 --steps 20 --batch-size 64 --out /tmp/train_step.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result
from service.index.loaded import LoadedIndex
from service.model.config import profile
from service.model.retriever import GenerativeRetriever
from training.data import Examples
from training.train import TrainingData, TrainSettings, prepare, train

WARMUP = 10  # untimed first steps of the baseline


def baseline(world_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """The step loop as it was: fp32, inline batches, unfused AdamW, a sync per step."""
    world, _, arrays = prepare(TrainingData(world=world_dir), work, None, False, None, "code")
    config = profile(args.profile)
    index = LoadedIndex.from_arrays(arrays, args.device)
    examples = Examples(world, index.lookup, config)
    torch.manual_seed(0)
    model = GenerativeRetriever(config).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    order = list(examples.epoch(args.batch_size, np.random.default_rng(0)))
    order = order[: args.steps + WARMUP]

    def step(pairs: np.ndarray) -> None:
        batch = examples.batch(pairs)
        logits = model.forward_train(
            batch.features.to(args.device), batch.target_sid.to(args.device)
        )
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), batch.target_sid.reshape(-1).to(logits.device)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()

    for pairs in order[:WARMUP]:  # cuBLAS handles, allocator, kernel choices: not timed
        step(pairs)
    t0 = time.perf_counter()
    for pairs in order[WARMUP:]:
        step(pairs)
    seconds = time.perf_counter() - t0
    timed = len(order) - WARMUP
    return {"steps": timed, "seconds": round(seconds, 2), "pairs": len(examples),
            "steps_per_s": round(timed / seconds, 2)}  # fmt: skip


def today(
    world_dir: Path, tmp: Path, args: argparse.Namespace, precision: str, pairs: int
) -> dict[str, float]:
    """`train` for `args.steps` steps at `precision`."""
    per_epoch = pairs // args.batch_size
    settings = TrainSettings(
        profile=args.profile, epochs=args.steps / per_epoch, batch_size=args.batch_size,
        lr=1e-3, eval_users=50, device=args.device, last_token="code",
        precision=precision,  # type: ignore[arg-type]
    )  # fmt: skip
    metrics = train(TrainingData(world=world_dir), tmp / f"model-{precision}", settings,
                    tokenizer_path=tmp / "tokenizer", progress=False)  # fmt: skip
    seconds = float(metrics["train_seconds"])
    return {"steps": metrics["steps"], "seconds": seconds,
            "steps_per_s": round(metrics["steps"] / seconds, 2),
            "final_loss": round(float(metrics["final_loss"]), 4)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="demo")
    ap.add_argument("--ads", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=5_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        world_dir = tmp / "world"
        subprocess.run([sys.executable, "-m", "cli", "synth", "--profile", "study", "--seed", "0",
                        "--ads", str(args.ads), "--users", str(args.users), "--out",
                        str(world_dir), "--no-jsonl", "--no-progress"], check=True,
                       cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        base = baseline(world_dir, tmp / "base", args)
        (tmp / "base" / "tokenizer").rename(tmp / "tokenizer")  # one tokenizer for all three
        figures: dict[str, object] = {"baseline_fp32": base}
        for precision in ("fp32", "bf16"):
            run = today(world_dir, tmp, args, precision, int(base["pairs"]))
            figures[f"train_{precision}"] = run
            figures[f"train_{precision}_vs_baseline"] = round(
                run["steps_per_s"] / base["steps_per_s"], 2
            )
    figures["setup"] = {"profile": args.profile, "ads": args.ads, "users": args.users,
                        "batch_size": args.batch_size, "device": args.device}  # fmt: skip
    path = write_result("train_step", figures, args.out)
    print(path)
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
