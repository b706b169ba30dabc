"""Open-loop overload generator for grace.v1.AdRetrieval/Retrieve on asyncio (grpc.aio).

What it measures is how a server behaves past its capacity: how many answers still come
back in time (goodput), how fast it says no (RESOURCE_EXHAUSTED), and how many callers
wait out their deadline (DEADLINE_EXCEEDED). Locust (loadtest/locustfile.py) is the
general load test; this is the lean tool for offering thousands of requests per second
with exact arrival times and a per-outcome split, no gevent.

Open loop: arrival k is due at `k / rate` (uniform, random phase) or after exponential
gaps (Poisson), and is sent when due whatever earlier calls are doing; the offered rate
stays what was asked for even when the server stalls. Every call carries the client
deadline as its gRPC timeout. Requests are serialised once and sent as raw bytes
(`channel.unary_unary` without (de)serialisers); replies are not parsed, only their
length is kept. Calls go round robin over `channels` channels, each its own HTTP/2
connection; `processes` > 1 spawns that many processes offering `rate / processes`
each, with merged results.

Per outcome (OK, or the gRPC status code name, or CLIENT_ERROR) it records the count
and the latency from send to answer. Goodput is OK answers within the deadline per
second: over the whole run (every arrival's answer, late backlog included, per offered
second), and in the steady state (answers completed between the first `warmup` fraction
of the run and its end, per second of that window: the useful throughput while the
load ran, not a backlog drained after it). Generator lag is how late arrivals went out against
their due time; a run whose lag P99 exceeds `lag_limit_s` is flagged `generator_behind`
(its figures describe the generator as much as the server).

`probe_capacity` is the closed-loop counterpart: `concurrency` callers, each sending the
next request when the previous one answered, for `seconds`; its OK req/s is the capacity
the overload sweeps are scaled to.

    python -m loadtest.overload --target 127.0.0.1:50051 --world data/world \\
        --rate 400 --deadline-ms 1000 --seconds 15 --json build/overload.json
    python -m loadtest.overload --target 127.0.0.1:50051 --world data/world --closed-loop 16

This module is the command line (and `world_requests`, the requests it sends) and the
public entry: `run_open_loop` is `overload_runner.py`'s (one process or spawned ones),
`probe_capacity` and the per-process sender with its arrival schedule are
`overload_sender.py`'s, the records and summaries `overload_results.py`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loadtest.overload_results import CapacityResult, OverloadResult, format_capacity, format_result
from loadtest.overload_runner import run_open_loop
from loadtest.overload_sender import probe_capacity

__all__ = ["main", "probe_capacity", "run_open_loop", "world_requests"]


def world_requests(
    world: Path, users: int, max_ads: int = 100, mode: str = "cd_gtm"
) -> list[bytes]:
    """Serialised requests for the world's first `users` users (`request_for_user`)."""
    from loadtest.sources import from_world

    return [r.SerializeToString() for r in from_world(Path(world), users, max_ads, mode)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.overload",
        description=__doc__.split("\n\n")[0] + " Offers --rate calls per second for "
        "--seconds (open loop, never waiting for answers), each with a --deadline-ms gRPC "
        "timeout, and prints per-outcome counts and latencies, goodput (OK within the "
        "deadline per second), refusal latency and the generator's own lag. "
        "--closed-loop N instead measures capacity with N back-to-back callers.",
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT (%(default)s)")
    p.add_argument(
        "--world",
        type=Path,
        default=Path("data/world"),
        help="synthetic world whose users become the requests (%(default)s)",
    )
    p.add_argument("--users", type=int, default=64, help="how many of its users, the first N")
    p.add_argument(
        "--replay",
        type=Path,
        help="send the requests of this replay file instead (JSON Lines: `grace record` "
        "or the server's request log); quicker than building them from a large world",
    )
    p.add_argument("--max-ads", type=int, default=100, help="options.max_ads (%(default)s)")
    p.add_argument(
        "--filter-mode",
        choices=["cd_gtm", "cd_only"],
        default="cd_gtm",
        help="options.filter_mode (%(default)s)",
    )
    p.add_argument("--rate", type=float, default=100.0, help="offered calls per second in total")
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=1000.0,
        help="client deadline of every call (its gRPC timeout), ms (%(default)s)",
    )
    p.add_argument(
        "--seconds", type=float, default=10.0, help="how long to offer load (%(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="fraction of the run left out of steady-state goodput (%(default)s)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="generator processes, each offering rate/P (for thousands of req/s)",
    )
    p.add_argument(
        "--channels",
        type=int,
        default=8,
        help="gRPC channels (connections) per process, round robin (%(default)s)",
    )
    p.add_argument("--poisson", action="store_true", help="exponential gaps, not even spacing")
    p.add_argument("--seed", type=int, default=None, help="arrival phase / Poisson seed")
    p.add_argument(
        "--closed-loop",
        type=int,
        metavar="N",
        default=0,
        help="measure capacity instead: N callers back to back for --seconds, "
        "with --deadline-ms as each call's timeout",
    )
    p.add_argument("--json", type=Path, help="write the result (to_dict) here")
    a = p.parse_args(argv)
    if a.processes < 1 or a.channels < 1 or a.users < 1:
        p.error("--processes, --channels and --users must be >= 1")
    if a.replay is not None:
        from loadtest.sources import from_replay

        requests = [r.SerializeToString() for r in from_replay(a.replay)]
    else:
        requests = world_requests(a.world, a.users, a.max_ads, a.filter_mode)
    result: OverloadResult | CapacityResult
    try:
        if a.closed_loop:
            result = asyncio.run(
                probe_capacity(
                    a.target,
                    requests,
                    concurrency=a.closed_loop,
                    seconds=a.seconds,
                    channels=a.channels,
                    timeout_s=a.deadline_ms / 1e3,
                )
            )
            print(format_capacity(result))
        else:
            result = asyncio.run(
                run_open_loop(
                    a.target,
                    requests,
                    a.rate,
                    a.seconds,
                    a.deadline_ms / 1e3,
                    channels=a.channels,
                    processes=a.processes,
                    poisson=a.poisson,
                    warmup=a.warmup,
                    seed=a.seed,
                )
            )
            print(format_result(result))
    except ConnectionError as exc:
        print(f"{a.target}: {exc}", file=sys.stderr)
        return 1
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
