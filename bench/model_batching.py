"""A discrete-event model of the GPU server's batching, to rank `graph_buckets` and batcher
settings before spending GPU time on load tests (docs/OPERATIONS.md). Its output is a
model's, not a measurement: it leaves out CPU contention, the GIL, context switches
between workers and the client's own jitter, and under-predicts P99 near saturation
(`--check` prints it next to the measured runs).

What it models, one event per arrival, batch close, GPU start and batch end:
- Poisson arrivals spread at random over W workers, evenly unless `shares` says otherwise
  (connections are spread over workers by the kernel's SO_REUSEPORT hash, requests follow
  their connection: on the H200 the measured split of 64 connections' requests ranged
  from 48/52 to 65/35 between runs, `--shares 0.65,0.35`);
- each worker's batching by the server's own policy (`service/batch_policy.py`: when a
  forming batch closes, at most `max_inflight` batches in flight; one decode group); a
  bounded queue refuses the overflow (here it also holds the batch being filled, which
  the real batcher has already taken out: a capacity below `max_batch` caps batches);
- stage 1 on the worker's CPU (`cpu_ms` + `cpu_ms_per_request`), then the one GPU shared
  by all workers in arrival order, running the batch at its graph bucket's cost, then
  the post stage (`post_ms`).
GPU cost per batch: the decode loop at its bucket — `decode_ms = a + b · bucket`, fitted
to `bench/results/decoder_loop_buckets.json` (measured on the H200) — plus
`other_gpu_ms` per batch (embedder, encoder, copies: ~1.5 ms, from the load tests).

    python bench/model_batching.py --buckets 4,8,12,16 --rates 700 800 900 1000 --seeds 5
    python bench/model_batching.py --check      # the model against the measured runs
    python bench/model_batching.py --buckets 2,4,6,8,10,12,14,16 --busy-batches 1 \
        --shares 0.65,0.35 --rates 900 950    # one worker given 65 % of the requests
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.batch_policy import BatchPolicy
from service.capture import bucket_of
from service.pipeline.stages import graph_buckets
from service.settings import BUSY_BATCHES_GPU

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Server:
    buckets: tuple[int, ...] = (4, 8, 12, 16)
    workers: int = 2
    max_batch: int = 16
    max_wait_ms: float = 5.0
    max_wait_busy_ms: float = 20.0
    max_inflight: int = 4
    busy_batches: int = BUSY_BATCHES_GPU
    queue_capacity: int = 128
    decode_ms: tuple[float, float] = (0.96, 0.72)  # a + b · bucket, see fit_decode_cost
    other_gpu_ms: float = 1.5
    cpu_ms: float = 0.25
    cpu_ms_per_request: float = 0.3
    post_ms: float = 1.0
    shares: tuple[float, ...] | None = None  # each worker's share of arrivals (None: even)

    def __post_init__(self) -> None:
        if self.shares is not None and (
            len(self.shares) != self.workers or min(self.shares) < 0 or sum(self.shares) <= 0
        ):
            raise ValueError(f"shares needs {self.workers} non-negative weights, got {self.shares}")

    def policy(self) -> BatchPolicy:
        return BatchPolicy(self.max_batch, self.max_wait_ms / 1e3, self.max_wait_busy_ms / 1e3,
                           self.busy_batches, max_inflight=self.max_inflight)  # fmt: skip

    def gpu_s(self, size: int) -> float:
        a, b = self.decode_ms
        return (a + b * bucket_of(self.buckets, size) + self.other_gpu_ms) / 1e3


def fit_decode_cost(path: Path = RESULTS / "decoder_loop_buckets.json") -> tuple[float, float]:
    """Least-squares `a + b · bucket` through the measured decode loop per bucket."""
    per = json.loads(path.read_text())["figures"]["per_batch"]
    xs = [float(k) for k in per]
    ys = [per[k]["p50_ms"] for k in per]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return round(my - b * mx, 3), round(b, 3)


def simulate(server: Server, rate: float, seconds: float = 20.0, seed: int = 0) -> dict:
    """Latency percentiles, refusals, mean batch and GPU padding at one offered rate."""
    rnd = random.Random(seed)
    events: list[tuple[float, int, str, object]] = []
    n = 0

    def at(t: float, kind: str, data: object = None) -> None:
        nonlocal n
        n += 1
        heapq.heappush(events, (t, n, kind, data))

    t = rnd.expovariate(rate)
    while t < seconds:
        w = (
            rnd.randrange(server.workers)
            if server.shares is None
            else rnd.choices(range(server.workers), server.shares)[0]
        )
        at(t, "arrive", w)
        t += rnd.expovariate(rate)
    queues: list[list[float]] = [[] for _ in range(server.workers)]
    # when each worker's forming batch opened: the batcher takes a slot, then its first
    # request, and times max_wait from there (not from that request's arrival)
    opened: list[float | None] = [None] * server.workers
    inflight = [0] * server.workers
    cpu_free = [0.0] * server.workers
    gpu_free = 0.0
    latencies: list[float] = []
    sizes: list[int] = []
    padding = refused = 0
    policy = server.policy()

    def close(w: int, now: float) -> None:
        nonlocal padding
        q = queues[w]
        if not q or inflight[w] >= policy.max_inflight:
            return
        if opened[w] is None:
            opened[w] = now
        look = policy.look_again(len(q), opened[w], now, inflight[w])
        if look is not None:
            at(look, "look", w)
            return
        batch = q[: server.max_batch]
        del q[: server.max_batch]
        opened[w] = None
        inflight[w] += 1
        sizes.append(len(batch))
        padding += bucket_of(server.buckets, len(batch)) - len(batch)
        start = max(now, cpu_free[w])
        cpu_free[w] = start + (server.cpu_ms + server.cpu_ms_per_request * len(batch)) / 1e3
        at(cpu_free[w], "gpu", (w, batch))
        if q:
            at(now, "look", w)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            w = int(data)  # type: ignore[call-overload]
            if len(queues[w]) >= server.queue_capacity:
                refused += 1
            else:
                queues[w].append(now)
                close(w, now)
        elif kind == "look":
            close(int(data), now)  # type: ignore[call-overload]
        elif kind == "gpu":
            w, batch = data  # type: ignore[misc]
            gpu_free = max(now, gpu_free) + server.gpu_s(len(batch))
            at(gpu_free + server.post_ms / 1e3, "done", (w, batch))
        else:  # done
            w, batch = data  # type: ignore[misc]
            inflight[w] -= 1
            latencies.extend(now - a for a in batch)
            close(w, now)
    latencies.sort()
    requests = sum(sizes)

    def pct(p: float) -> float:
        return round(1e3 * latencies[min(len(latencies) - 1, int(p * len(latencies)))], 1)

    return {
        "offered_rps": rate,
        "ok_rps": round(len(latencies) / seconds, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "refused": refused,
        "mean_batch": round(requests / len(sizes), 2) if sizes else 0.0,
        "padding_share": round(padding / (padding + requests), 3) if requests else 0.0,
    }


def over_seeds(server: Server, rate: float, seconds: float, seeds: int) -> dict:
    """Medians over `seeds` arrival sequences, with the P99's range: one sequence's P99
    near saturation moves by ±10 %."""
    runs = [simulate(server, rate, seconds, seed) for seed in range(seeds)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["p99_min_ms"] = min(r["p99_ms"] for r in runs)
    out["p99_max_ms"] = max(r["p99_ms"] for r in runs)
    return out


# measured on the H200 (bench/results/gpu_loadtest_workers.json, 2 workers): P99 (ms) per
# offered rate, for the configurations the runs used
FINE = (2, 4, 6, 8, 10, 12, 14, 16)
MEASURED: list[tuple[str, dict, dict[int, tuple[int, ...]]]] = [
    ("buckets 4/8/16, busy from 2", {"buckets": (4, 8, 16), "busy_batches": 2},
     {700: (59,), 800: (160,), 900: (220,)}),
    ("buckets 2..16 even, busy from 1", {"buckets": FINE, "busy_batches": 1},
     {800: (56,), 850: (63,), 900: (160, 140), 950: (350,), 1000: (220,)}),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", default="4,8,12,16", help="graph bucket sizes, increasing")
    ap.add_argument("--rates", type=float, nargs="+", default=[700, 800, 900, 1000, 1100])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--max-wait-busy-ms", type=float, default=20.0)
    ap.add_argument("--busy-batches", type=int, default=BUSY_BATCHES_GPU)
    ap.add_argument(
        "--shares",
        default=None,
        help="each worker's share of the requests, e.g. 0.65,0.35 (default: even)",
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="modelled time per rate")
    ap.add_argument("--seeds", type=int, default=5, help="arrival sequences per rate (medians)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="model the measured configurations at their rates and print both (their own "
        "buckets and busy threshold: --buckets, --busy-batches and --shares do not apply)",
    )
    a = ap.parse_args()
    try:
        buckets = graph_buckets(16, tuple(int(b) for b in a.buckets.split(",")))
    except ValueError:
        ap.error(f"--buckets must be increasing integers >= 1, got {a.buckets!r}")
    if a.seeds < 1 or a.seconds <= 0 or a.busy_batches < 1:
        ap.error("--seeds and --busy-batches must be >= 1 and --seconds positive")
    decode_ms = fit_decode_cost()
    try:  # a share that is no number, or Server's own check of the shares
        shares = tuple(float(x) for x in a.shares.split(",")) if a.shares else None
        server = Server(buckets=buckets, workers=a.workers, max_wait_ms=a.max_wait_ms,
                        max_wait_busy_ms=a.max_wait_busy_ms, busy_batches=a.busy_batches,
                        decode_ms=decode_ms, shares=shares)  # fmt: skip
    except ValueError:
        ap.error(f"--shares needs {a.workers} non-negative numbers, got {a.shares!r}")
    runs = [("", server, {})]
    if a.check:
        runs = [(label, dataclasses.replace(server, shares=None, **kw), seen)
                for label, kw, seen in MEASURED]  # fmt: skip
    for label, srv, seen in runs:
        print(f"model (not a measurement): buckets {srv.buckets}, {srv.workers} workers, "
              f"busy from {srv.busy_batches} batch(es), decode {srv.decode_ms[0]} + "
              f"{srv.decode_ms[1]}·bucket ms, request shares {srv.shares or 'even'}"
              + (f" [{label}]" if label else ""))  # fmt: skip
        for rate in sorted(seen) if a.check else a.rates:
            r = over_seeds(srv, rate, a.seconds, a.seeds)
            p99 = ", ".join(str(x) for x in seen.get(int(rate), ()))
            note = f"  measured P99 {p99} ms" if p99 else ""
            print(f"{rate:7.0f} req/s: OK {r['ok_rps']:7.1f}  P50 {r['p50_ms']:6.1f}  P99 "
                  f"{r['p99_ms']:6.1f} ms ({r['p99_min_ms']:.0f}–{r['p99_max_ms']:.0f})  batch "
                  f"{r['mean_batch']:5.2f}  padding {100 * r['padding_share']:4.1f} %  refused "
                  f"{r['refused']}{note}")  # fmt: skip


if __name__ == "__main__":
    main()
