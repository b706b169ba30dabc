"""Retrieve latency through gRPC on CPU (issue #4): the tiny profile served by the full
stack (validation, batcher, four-stage pipeline, C++ post stage) on localhost, at
concurrency 1 and 16 (closed loop). P50/P99 per request, throughput.
Results: bench/results/serve_cpu.json.

    .venv/bin/python bench/bench_serve_cpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentiles, write_result
from cli.query import request_for_user
from index_builder.build import build_index
from index_builder.synth import generate_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from service.app import start
from service.model.checkpoint import save_checkpoint
from service.model.config import PROFILES
from service.model.retriever import GenerativeRetriever
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings


def prepare(root: Path) -> None:
    """Tiny world, its tokenizer, a tiny model (weights don't change latency), an index."""
    from index_builder.catalog import read_catalog

    generate_world("tiny", 0, root / "world", progress=False)
    emb = read_catalog(root / "world" / "catalog.parquet", progress=False).embedding
    tok = SIDTokenizer.train(emb, TokenizerConfig(), progress=False)
    torch.manual_seed(0)
    save_checkpoint(GenerativeRetriever(PROFILES["tiny"]), tok, root / "model")
    build_index(root / "world" / "catalog.parquet", root / "index",
                tokenizer_path=root / "model" / "tokenizer", progress=False)  # fmt: skip


async def closed_loop(
    root: Path, concurrency: int, per_client: int, device: str, **overrides: object
) -> tuple[list[float], float]:
    """A fresh server on `root` (settings `overrides`), 8 warm-up calls, then `concurrency`
    clients of `per_client` calls each back to back: every call's latency (ms) and the
    calls per second."""
    t0 = time.perf_counter()
    app = await start(load_settings({"port": 0, "metrics_port": 0, "host": "127.0.0.1",
                                     "data_dir": root, "device": device, **overrides}))  # fmt: skip
    print(f"server SERVING after {time.perf_counter() - t0:.1f} s", flush=True)
    requests = [request_for_user(root / "world", u, 100, retrieval_pb2.CD_GTM) for u in range(64)]
    latencies: list[float] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            for r in requests[:8]:  # warm-up
                await stub.Retrieve(r)

            async def client(c: int) -> None:
                for i in range(per_client):
                    t = time.perf_counter()
                    await stub.Retrieve(requests[(c * per_client + i) % len(requests)])
                    latencies.append((time.perf_counter() - t) * 1e3)

            t0 = time.perf_counter()
            await asyncio.gather(*(client(c) for c in range(concurrency)))
            wall = time.perf_counter() - t0
    finally:
        await app.drain()
    return latencies, len(latencies) / wall


async def load(root: Path, concurrency: int, per_client: int, device: str) -> dict[str, float]:
    latencies, rate = await closed_loop(root, concurrency, per_client, device)
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        **percentiles(latencies, 1),
        "throughput_rps": round(rate, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="per concurrency level")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the same stack on the GPU)")
    ap.add_argument("--name", default="serve_cpu", help="result file name")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        print(f"[{time.perf_counter() - t0:.0f} s] world, tokenizer, model, index", flush=True)
        rows = []
        for c in (1, 16):
            rows.append(asyncio.run(load(root, c, max(1, args.requests // c), args.device)))
            print(f"[{time.perf_counter() - t0:.0f} s] {rows[-1]}", flush=True)
    figures = {"profile": "tiny", "beams": list(PROFILES["tiny"].beams), "device": args.device,
               "torch_threads": torch.get_num_threads(), "levels": rows}  # fmt: skip
    print(f"wrote {write_result(args.name, figures)}")


if __name__ == "__main__":
    main()
