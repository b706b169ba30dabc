"""How much a model load's copy to the GPU stalls serving (docs/PERFORMANCE.md, "Model
rollout"): a probe thread stands in for a pipeline stage — a pinned 1 MiB host-to-device
copy and a small kernel on a stream of its own, then a wait — and records how long each
round takes, while the main thread copies a table the size of the paper model's user
embeddings (4.3 GB of float32, read from a safetensors file as `load_checkpoint` reads it)
three ways:

* `pageable`: one `.to("cuda")` of the whole tensor, as the load did before;
* `chunked`: `contracts/tensors.py`'s `to_device` (what model and index loads use), 64
  MiB at a time through a pinned staging buffer;
* `chunked_paced`: the same with `Pace(0.25)` between chunks (a swap beside serving).

Reported per way: the copy's seconds and the probe's rounds (P50 / P99 / max) during it,
against the probe alone before. Usage (lent GPU, `. bench/gpu_env.sh`):
    python3 bench/bench_weights_copy.py [--gb 4.3] [--out bench/results/weights_copy_h200.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import percentiles, write_result
from contracts.tensors import COPY_CHUNK, to_device
from service.pace import Pace


class Probe(threading.Thread):
    """Rounds of a tiny copy + kernel + wait, each round's seconds recorded."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stream = torch.cuda.Stream()
        self.host = torch.ones(1 << 18, pin_memory=True)  # 1 MiB of float32
        self.rounds: list[tuple[float, float]] = []  # (start, seconds)
        self.stop = threading.Event()

    def run(self) -> None:
        with torch.cuda.stream(self.stream):
            dev = torch.empty_like(self.host, device="cuda")
            while not self.stop.is_set():
                t = time.perf_counter()
                dev.copy_(self.host, non_blocking=True)
                dev.mul_(1.0001)
                self.stream.synchronize()
                self.rounds.append((t, time.perf_counter() - t))
                time.sleep(0.001)

    def during(self, t0: float, t1: float) -> dict[str, float]:
        ms = [s * 1e3 for start, s in self.rounds if t0 <= start < t1]
        return {**percentiles(ms), "max_ms": round(max(ms), 3), "rounds": len(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.3, help="table size in GB (float32)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results)")
    args = ap.parse_args()
    rows = int(args.gb * 1e9 / 4 / 256)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_file({"user_emb": torch.randn(rows, 256)}, str(path))
        probe = Probe()
        probe.start()
        time.sleep(2.0)
        t_idle = time.perf_counter()
        time.sleep(3.0)
        figures: dict = {"table_gb": round(rows * 256 * 4 / 1e9, 2), "chunk_bytes": COPY_CHUNK,
                         "idle": probe.during(t_idle, time.perf_counter())}  # fmt: skip
        ways = {
            "pageable": lambda t: t.to("cuda"),
            "chunked": lambda t: to_device(t, "cuda"),
            "chunked_paced": lambda t: to_device(t, "cuda", pace),
        }
        pace = Pace(0.25, device="cuda")
        for name, copy in ways.items():
            weights = load_file(str(path), device="cpu")  # mapped, as load_checkpoint reads
            torch.cuda.synchronize()
            time.sleep(1.0)
            pace.begin()
            t0 = time.perf_counter()
            out = copy(weights["user_emb"])
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            every = max(1, rows // 1000)
            assert torch.equal(out[::every].cpu(), weights["user_emb"][::every]), name
            figures[name] = {"copy_s": round(t1 - t0, 3), "probe": probe.during(t0, t1)}
            print(name, figures[name], flush=True)
            del out, weights
            torch.cuda.empty_cache()
        probe.stop.set()
        probe.join()
    print("idle", figures["idle"])
    print("wrote", write_result("weights_copy", figures, args.out))


if __name__ == "__main__":
    main()
