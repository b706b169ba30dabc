"""Model hot swap under load (docs/PERFORMANCE.md, "Model rollout"): offer RATE req/s
open-loop to a running `grace serve --model REPO`, publish a checkpoint into REPO
(`publish_model`, as `grace publish-model` does) after PUBLISH_AT seconds, and measure

* publish -> first answer of the new model: from the moment CURRENT moved to the first
  OK answer carrying the new model version (what the server spent loading, verifying,
  capturing CUDA graphs and swapping, plus one request's latency);
* latency (P50/P99) and failures before the publish, during the swap (publish until the
  first new answer, plus one second) and after it — the same run, the same load;
* which model answered each call: with one serving process, once the new model has
  answered no later call is answered by the old one; with several workers (each swaps on
  its own, like replicas) the last old answer bounds when the last worker swapped.

The load is spread over PROCESSES spawned senders (one Python process tops out near
1,000 calls/s), each parsing its replies for their model version; all clocks are
`time.time()` on one machine. Usage (the H200 run, docs/PERFORMANCE.md):

    python3 bench/bench_model_swap.py --target localhost:50051 --repo /tmp/paper/models \\
        --checkpoint /tmp/paper/model-b --world /tmp/paper/world --rate 1000 --seconds 60 \\
        --publish-at 15 --processes 4 --out bench/results/model_swap_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.common import header  # noqa: E402
from loadtest.overload import world_requests  # noqa: E402
from loadtest.overload_sender import CHANNEL_OPTIONS, METHOD, arrival_offsets  # noqa: E402

Record = tuple[float, float, str, str]  # (sent at, latency s, status, model version)


async def _send(target: str, requests: list[bytes], rate: float, start: float, seconds: float,
                seed: int) -> list[Record]:  # fmt: skip
    import grpc

    from service.rpc.grace.v1 import retrieval_pb2

    channels = [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(4)]
    await asyncio.gather(*(ch.channel_ready() for ch in channels))
    methods = [ch.unary_unary(METHOD) for ch in channels]
    records: list[Record] = []
    rng = random.Random(seed)

    async def call(k: int) -> None:
        sent = time.time()
        try:
            raw = await methods[k % len(methods)](requests[k % len(requests)], timeout=2.0)
            version = retrieval_pb2.RetrieveResponse.FromString(raw).model_version
            records.append((sent, time.time() - sent, "OK", version))
        except grpc.aio.AioRpcError as exc:
            records.append((sent, time.time() - sent, exc.code().name, ""))

    tasks = []
    for k, due in enumerate(arrival_offsets(rate, rng, poisson=True)):
        if due >= seconds:
            break
        wait = start + due - time.time()
        await asyncio.sleep(max(wait, 0.0))
        tasks.append(asyncio.ensure_future(call(k)))
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    return records


def _child(target: str, requests: list[bytes], rate: float, start: float, seconds: float,
           seed: int, out: multiprocessing.Queue) -> None:  # fmt: skip
    out.put(asyncio.run(_send(target, requests, rate, start, seconds, seed)))


def timeline(records: list[Record], published: float, swap_end: float,
             margin: float = 5.0) -> list[dict]:  # fmt: skip
    """Per second of send time, from `margin` s before CURRENT moved to `margin` s after
    the swap: calls, failed calls (by status) and the P99, each second's `t` counted from
    the publish and `unix` its start, to line up with the server log's timestamps (the
    load phases a worker logs: which of them costs the refusals)."""
    rows = []
    for t in range(-int(margin), int(np.ceil(swap_end - published + margin))):
        lo = published + t
        inside = [(lat, status) for s, lat, status, _ in records if lo <= s < lo + 1]
        if not inside:
            continue
        lat = np.array([x for x, _ in inside]) * 1e3
        failed: dict[str, int] = {}
        for _, status in inside:
            if status != "OK":
                failed[status] = failed.get(status, 0) + 1
        rows.append({"t": t, "unix": round(lo, 3), "calls": len(inside), "failed": failed,
                     "p99_ms": round(float(np.percentile(lat, 99)), 2)})  # fmt: skip
    return rows


def summarise(records: list[Record], published: float, old: str, new: str,
              warmup: float, start: float) -> dict:  # fmt: skip
    """The figures of one run from its records (pure: tests/ops/test_bench_tools.py):
    `published` is when CURRENT moved (unix seconds, also written as `published_unix`)."""
    ok_new = [s + lat for s, lat, status, v in records if status == "OK" and v == new]
    first_new = min(ok_new) if ok_new else None
    old_sent = [s for s, _, status, v in records if status == "OK" and v == old and s >= published]
    last_old = max(old_sent) if old_sent else published  # calls sent later: the new model's
    swap_end = max(last_old, first_new if first_new is not None else published) + 1.0
    windows = {"before": (start + warmup, published), "during_swap": (published, swap_end),
               "after": (swap_end, float("inf"))}  # fmt: skip
    out: dict = {
        "calls": len(records),
        "published_unix": round(published, 3),
        "publish_to_first_new_answer_s": None if first_new is None else first_new - published,
        # with several workers each swaps on its own: the last old answer's call bounds
        # when the last of them did (one worker: no old answer after the first new one)
        "publish_to_last_old_call_s": None if first_new is None else last_old - published,
        "failed_calls": sum(status != "OK" for _, _, status, _ in records),
        "answered_by": {v: sum(r[3] == v for r in records) for v in sorted({old, new})},
        "old_model_after_first_new": None
        if first_new is None
        else sum(1 for s, _, status, v in records if status == "OK" and v == old and s > first_new),
        "windows": {},
    }
    out["timeline"] = timeline(records, published, swap_end)
    for name, (lo, hi) in windows.items():
        lat = np.array([lat for s, lat, _, _ in records if lo <= s < hi]) * 1e3
        statuses = [status for s, _, status, _ in records if lo <= s < hi]
        span = (max(s for s, *_ in records) if hi == float("inf") else hi) - lo
        out["windows"][name] = {
            "seconds": round(span, 2),
            "calls": len(statuses),
            "failed": sum(s != "OK" for s in statuses),
            "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:50051")
    p.add_argument("--repo", required=True, help="the model repository the server follows")
    p.add_argument("--checkpoint", required=True, help="the checkpoint to publish")
    p.add_argument("--world", required=True, help="world whose users the requests are for")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--publish-at", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds not judged at the start")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--device", default="", help="what the server runs on, for the record")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)

    from service.model.repository import publish_model, resolve_checkpoint

    old = json.loads((resolve_checkpoint(Path(args.repo)) / "config.json").read_text())
    new = json.loads((Path(args.checkpoint) / "config.json").read_text())
    if old["model_version"] == new["model_version"]:
        print("the checkpoint to publish is the one served: nothing would change", file=sys.stderr)
        return 2
    requests = world_requests(Path(args.world), 256)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.time() + 5.0  # every sender connected by then
    procs = [ctx.Process(target=_child, args=(args.target, requests, args.rate / args.processes,
                                              start, args.seconds, i, queue))
             for i in range(args.processes)]  # fmt: skip
    for proc in procs:
        proc.start()
    time.sleep(max(start + args.publish_at - time.time(), 0.0))
    t0 = time.time()
    version = publish_model(Path(args.checkpoint), Path(args.repo))
    published = time.time()  # CURRENT has moved
    records: list[Record] = []
    for _ in procs:
        records.extend(queue.get())
    for proc in procs:
        proc.join()
    figures = summarise(records, published, old["model_version"], new["model_version"],
                        args.warmup, start)  # fmt: skip
    figures["publish_seconds"] = round(published - t0, 2)
    result = {
        **header(),
        "command": " ".join(["python3", "bench/bench_model_swap.py", *(argv or sys.argv[1:])]),
        "device": args.device,
        "rate": args.rate,
        "seconds": args.seconds,
        "published_version": version,
        "old_model": old["model_version"],
        "new_model": new["model_version"],
        "figures": figures,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if figures["publish_to_first_new_answer_s"] is not None else 1  # it swapped


if __name__ == "__main__":
    raise SystemExit(main())
