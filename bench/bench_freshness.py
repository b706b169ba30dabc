"""Freshness of live changes on the CPU demo (docs/DATA.md "Live changes"): a change
written to the feed → the first reply that reflects it, at each --rates changes/s, with
the serving P99 and req/s of the same run beside a run without changes.

The served world of tests/helpers/serving.py, a real `grace builder --changes FEED` on its
catalog and tokenizer (nothing to rebuild: it only publishes) and a real `grace serve`;
per phase (no changes, then each rate) --callers closed-loop Retrieve callers for
--seconds while a writer appends pause/resume records of random ads to the feed every
10 ms (with `--upserts SHARE`, that share upserts of catalog rows, every other one with
its countries narrowed: targeting changes served in place), keeping each record's write
time. A change's freshness is the arrival of the first
reply at `catalog_seq` >= its seq less its write time. Also: bytes of published segments
per million changes.

    .venv/bin/python bench/bench_freshness.py        # ~2 minutes

`--data DIR` runs it on a world that bench/gpu_loadtest.sh laid out (DIR/world,
DIR/tokenizer, DIR/model, DIR/index; the paper's 30 M ads on a GPU):

    python3 bench/bench_freshness.py --data /tmp/paper --device cuda --profile paper \
        --callers 64 --out /tmp/freshness_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentiles, write_result
from contracts.deltas import DELTAS
from loadtest.overload import world_requests
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import ServerProcess
from tests.helpers.serving import make_serving_data


def writer(feed: Path, rate: float, seconds: float, ads: list[int], seq0: int,
           rows: list[dict], upserts: float) -> list:  # fmt: skip
    """Append pause/resume records at `rate` per second, a share `upserts` of them
    upserts of `rows` (catalog rows), every other one with its countries narrowed to one
    (served in place); [(seq, write time)]."""
    rng, written, seq = random.Random(rate), [], seq0
    end = time.time() + seconds
    with (feed / f"{seq0:012d}.jsonl").open("a") as fh:
        while (now := time.time()) < end:
            due = int(rate * (now - (end - seconds))) - (seq - seq0)
            lines = []
            for _ in range(max(due, 0)):
                seq += 1
                if rows and rng.random() < upserts:
                    row = dict(rng.choice(rows))
                    if seq % 2:
                        row["countries"] = (row.get("countries") or ["US"])[:1]
                    lines.append(json.dumps({"seq": seq, "op": "upsert", **row}))
                    continue
                op = "pause" if seq % 2 else "resume"
                lines.append(json.dumps({"seq": seq, "op": op, "ad_id": rng.choice(ads)}))
            if lines:
                fh.write("\n".join(lines) + "\n")
                fh.flush()
                written += [(s, time.time()) for s in range(seq - len(lines) + 1, seq + 1)]
            time.sleep(0.01)
    return written


async def callers(port: int, requests: list[bytes], n: int, seconds: float) -> list:
    """Closed-loop Retrieve for `seconds`: [(arrival, latency s, catalog_seq)]."""
    out: list[tuple[float, float, int]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
        end = time.time() + seconds

        async def one(k: int) -> None:
            while time.time() < end:
                req = retrieval_pb2.RetrieveRequest.FromString(requests[k % len(requests)])
                t = time.time()
                reply = await stub.Retrieve(req, timeout=30)
                out.append((time.time(), time.time() - t, reply.stats.catalog_seq))
                k += n

        await asyncio.gather(*(one(k) for k in range(n)))
    return out


def phase(server: ServerProcess, feed: Path, requests: list, ads: list, rows: list[dict],
          rate: float, a: argparse.Namespace, seq0: int) -> tuple[dict, int]:  # fmt: skip
    written: list = []
    if rate:
        t = threading.Thread(target=lambda: written.extend(
            writer(feed, rate, a.seconds, ads, seq0, rows, a.upserts)))  # fmt: skip
        t.start()
    replies = asyncio.run(callers(server.port, requests, a.callers, a.seconds + 2))
    if rate:
        t.join()
    replies.sort()
    row = {"changes_per_s": rate, "replies_per_s": round(len(replies) / (a.seconds + 2), 1),
           "serving": percentiles([1e3 * lat for _, lat, _ in replies])}  # fmt: skip
    if written:
        arrival = np.array([r[0] for r in replies])
        seen = np.maximum.accumulate(np.array([r[2] for r in replies]))
        fresh = []
        for seq, wrote in written:
            at = int(np.searchsorted(seen, seq))  # the first reply at catalog_seq >= seq
            if at < len(seen):
                fresh.append(1e3 * (arrival[at] - wrote))
        row |= {"changes": len(written), "reflected": len(fresh),
                "freshness": percentiles(fresh)}  # fmt: skip
    return row, seq0 + len(written)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[100, 1000])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/)")
    p.add_argument("--data", type=Path, help="serve this laid-out world (default: a tiny one)")
    p.add_argument("--device", default="cpu", help="the server's --device (%(default)s)")
    p.add_argument("--profile", default="tiny", help="the server's model profile (%(default)s)")
    p.add_argument("--upserts", type=float, default=0.0, metavar="SHARE",
                   help="share of the changes that are upserts of 1,000 sampled catalog rows, "
                   "every other one with its countries narrowed (served in place; default 0: "
                   "pauses and resumes only)")  # fmt: skip
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fresh-") as tmp:
        root, feed = a.data or make_serving_data(Path(tmp) / "data"), Path(tmp) / "feed"
        feed.mkdir()
        catalog = root / "world" / "catalog.parquet"
        tokenizer = root / "tokenizer" if a.data else root / "model" / "tokenizer"
        ads = pq.read_table(catalog, columns=["ad_id"]).column("ad_id").to_pylist()
        sample = random.Random(0).sample(ads, min(1000, len(ads))) if a.upserts else []
        table = pq.read_table(catalog, filters=[("ad_id", "in", sample)]) if sample else None
        rows = [{k: v for k, v in r.items() if v is not None}
                for r in (table.to_pylist() if table is not None else [])]  # fmt: skip
        builder = subprocess.Popen(
            [sys.executable, "-m", "cli", "builder", "--catalog", str(catalog), "--out",
             str(root / "index"), "--tokenizer", str(tokenizer), "--changes", str(feed)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = ServerProcess.start(
            root, Path(tmp) / "server.log", device=a.device, index_root=root / "index",
            env={"GRACE_PROFILE": a.profile}, args=["--model", str(root / "model")],
        )  # fmt: skip
        try:
            server.wait_serving()
            requests = world_requests(root / "world", 64)
            asyncio.run(callers(server.port, requests, a.callers, 3))  # warm-up
            rows, seq = [], 0
            for rate in [0.0, *a.rates]:
                row, seq = phase(server, feed, requests, ads, rows, rate, a, seq)
                rows.append(row)
                print(json.dumps(row), flush=True)
            segs = list((root / "index" / DELTAS).rglob("*.jsonl"))
            per_m = sum(s.stat().st_size for s in segs) / max(seq, 1) * 1e6
        finally:
            server.stop()
            builder.terminate()
            builder.wait(30)
    world = f"{len(ads):,} ads, {a.profile} model on {a.device}"
    figures = {"setup": {"world": world, "callers": a.callers, "seconds": a.seconds,
                         "upserts_share": a.upserts,
                         "builder_changes_interval_s": 0.2, "server_live_poll_s": 0.1},
               "phases": rows, "segment_bytes_per_million_changes": round(per_m)}  # fmt: skip
    print("written", write_result(f"freshness_{a.device}", figures, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
