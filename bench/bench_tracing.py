"""What tracing costs the event loop and the stage threads per call (docs/ops/tracing.md):
the hooks of one Retrieve (its RPC span, its context for the batch) and of one batch of
16 (the batch span linked to 16 calls, four stage spans), with tracing off and on (the
SDK's batch processor and an exporter that drops the spans), on this machine's CPU.

    python bench/bench_tracing.py [--calls 20000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    tracing_module.exporter_for = lambda kind: Dropped()  # type: ignore[assignment]
    off, on = Tracing(), Tracing.from_settings("console")
    runs = {"off": [], "on": []}
    for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
        runs["off"].append(per_call_us(off, args.calls))
        runs["on"].append(per_call_us(on, args.calls))
    on.shutdown()
    figures = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    out = {"command": "python bench/bench_tracing.py", "git_commit": commit,
           "device": f"{platform.processor() or platform.machine()} CPU",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "figures": {"hooks_us_per_call_median": figures, "runs_us": runs}}  # fmt: skip
    print(f"tracing hooks per call (median of {args.repeats}): off {figures['off']} us, "
          f"on {figures['on']} us")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
