"""What tracing costs (docs/ops/tracing.md), on this machine's CPU:

* hooks: the tracing calls of one Retrieve (its RPC span, its context for the batch) and
  its share of a batch of 16 (the batch span linked to 16 calls, four stage spans), off
  and on (the SDK's batch processor, an exporter that drops the spans);
* gRPC: Retrieve P50/P99 and throughput of the CPU demo stack (tiny profile,
  bench/bench_serve_cpu.py's world) at concurrency 16, closed loop, with `tracing` off and
  `otlp` at 100 % sampling exporting to a collector on localhost, rounds interleaved
  side by side so a busy machine slows both alike.

    python bench/bench_tracing.py [--calls 20000] [--rounds 5] [--requests 480] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from unittest import mock

import grpc
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_serve_cpu import closed_loop, prepare
from bench.common import percentiles, write_result
from service import tracing as tracing_module
from service.tracing import Tracing

BATCH = 16


class Dropped(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def per_call_us(tr: Tracing, calls: int) -> float:
    """Microseconds of hooks per call: `calls` RPCs and calls/16 batches of 4 stages."""
    meta = (("traceparent", "00-0000000000000000000000000000abcd-00000000000012ab-01"),)
    t0 = time.perf_counter()
    for _ in range(calls // BATCH):
        contexts = []
        for _ in range(BATCH):
            with tr.rpc("/grace.v1.AdRetrieval/Retrieve", meta):
                contexts.append(tr.current())
        span = tr.batch(contexts, {"grace.batch.size": BATCH})
        for stage in ("input", "features", "compute", "post"):
            with tr.stage(span, stage):
                pass
        Tracing.end(span, None, **{"grace.batch.answered": BATCH})
    return (time.perf_counter() - t0) / calls * 1e6


def collector() -> tuple[grpc.Server, list[int]]:
    """An OTLP/gRPC trace collector on localhost that counts and drops what it gets."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = [0]

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received[0] += sum(len(s.spans) for r in request.resource_spans
                               for s in r.scope_spans)  # fmt: skip
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    return server, received


def grpc_figures(rounds: int, requests: int, concurrency: int = 16) -> dict:
    server, received = collector()
    lat: dict[str, list[float]] = {"off": [], "otlp": []}
    rps: dict[str, list[float]] = {"off": [], "otlp": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            prepare(root)
            for r in range(rounds):
                for mode in ("off", "otlp") if r % 2 == 0 else ("otlp", "off"):
                    per = requests // concurrency
                    got, rate = asyncio.run(
                        closed_loop(root, concurrency, per, "cpu", tracing=mode)
                    )
                    lat[mode] += got
                    rps[mode].append(rate)
                    print(f"round {r} {mode}: P50 {statistics.median(got):.1f} ms, "
                          f"{rate:.0f} req/s", flush=True)  # fmt: skip
    finally:
        server.stop(0)
    out = {
        mode: {"calls": len(v), **percentiles(v, 1),
               "throughput_rps_median": round(statistics.median(rps[mode]), 1)}
        for mode, v in lat.items()
    }  # fmt: skip
    out["spans_received_by_the_collector"] = received[0]
    out["concurrency"], out["rounds"] = concurrency, rounds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="hook benchmark: calls per run")
    ap.add_argument("--repeats", type=int, default=5, help="hook benchmark: runs per mode")
    ap.add_argument("--rounds", type=int, default=5, help="gRPC benchmark: rounds per mode")
    ap.add_argument("--requests", type=int, default=480, help="gRPC benchmark: calls per round")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    with mock.patch.object(tracing_module, "exporter_for", lambda kind: Dropped()):
        off, on = Tracing(), Tracing.from_settings("console")  # "on": its spans dropped
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
        runs["off"].append(per_call_us(off, args.calls))
        runs["on"].append(per_call_us(on, args.calls))
    on.shutdown()
    hooks = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    print(f"tracing hooks per call (median of {args.repeats}): off {hooks['off']} us, "
          f"on {hooks['on']} us", flush=True)  # fmt: skip
    served = grpc_figures(args.rounds, args.requests)
    print(json.dumps(served, indent=1))
    figures = {"hooks_us_per_call_median": hooks, "hook_runs_us": runs,
               "grpc_tiny_cpu_concurrency_16": served}  # fmt: skip
    if args.json:
        write_result("tracing_cpu", figures, args.json)


if __name__ == "__main__":
    main()
