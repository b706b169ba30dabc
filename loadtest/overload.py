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

The records and summaries are `overload_results.py`'s; this module is the generator
(open loop, its processes, the closed-loop probe) and its command line, kept together
because they share the channel set-up and the per-call loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import queue
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from loadtest.overload_results import (
    CLIENT_ERROR,
    LAG_LIMIT_S,
    OK,
    CapacityResult,
    OverloadResult,
    Samples,
    format_capacity,
    format_result,
    summarise,
)

METHOD = "/grace.v1.AdRetrieval/Retrieve"
CHANNEL_OPTIONS = [
    # channels with equal arguments share one subchannel (one TCP connection) through
    # gRPC's global pool: a local pool gives each channel its own connection
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 64 * 2**20),
]


def arrival_offsets(rate: float, rng: random.Random, poisson: bool) -> Iterator[float]:
    """Arrival instants in seconds from the start, `rate` per second on average.

    Uniform: `phase + k / rate` with a random phase in the first gap (several processes
    at the same rate interleave instead of firing together), never a sum of rounded gaps.
    Poisson: exponential gaps."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if poisson:
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            yield t
    phase = rng.random() / rate
    for k in itertools.count():
        yield phase + k / rate


def _channels(target: str, n: int) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(max(1, n))]


async def _connect(channels: Sequence[grpc.aio.Channel], timeout_s: float) -> None:
    """Every channel connected before the clock starts (connecting is not load)."""
    try:
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), timeout_s)
    except TimeoutError:
        raise ConnectionError(f"could not connect within {timeout_s:.0f} s") from None


async def _open_loop_samples(
    target: str,
    requests: Sequence[bytes],
    rate: float,
    seconds: float,
    timeout_s: float,
    *,
    channels: int,
    poisson: bool,
    seed: int | None,
    stop: asyncio.Event | None = None,
    connect_timeout_s: float = 30.0,
    ready: Any = None,  # a multiprocessing Barrier: start together with the other processes
) -> Samples:
    if not requests:
        raise ValueError("no requests to send")
    rng = random.Random(seed)
    samples = Samples()
    chans = _channels(target, channels)
    try:
        await _connect(chans, connect_timeout_s)
        methods = [ch.unary_unary(METHOD) for ch in chans]  # raw bytes both ways
        if ready is not None:
            ready.wait(connect_timeout_s)
        offset = rng.randrange(len(requests))
        loop = asyncio.get_running_loop()
        inflight: set[asyncio.Task[None]] = set()
        clock = time.perf_counter
        start = clock()

        async def call(method: Any, payload: bytes, due: float, lag: float) -> None:
            t = clock()
            try:
                reply = await method(payload, timeout=timeout_s)
                outcome = OK
                samples.reply_bytes += len(reply)
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code().name
            except asyncio.CancelledError:
                raise
            except Exception:
                outcome = CLIENT_ERROR
            samples.add(due, lag, clock() - t, outcome)

        for k, due in enumerate(arrival_offsets(rate, rng, poisson)):
            if due >= seconds or (stop is not None and stop.is_set()):
                break
            wait = due - (clock() - start)
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                await asyncio.sleep(0)  # behind schedule: still let calls in flight progress
            lag = max(0.0, clock() - start - due)
            task = loop.create_task(
                call(methods[k % len(methods)], requests[(offset + k) % len(requests)], due, lag)
            )
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        stopped_early = stop is not None and stop.is_set()
        samples.offered_seconds = min(seconds, clock() - start) if stopped_early else seconds
        if inflight:  # every call ends by its timeout: wait for all outcomes
            await asyncio.gather(*inflight)
    finally:
        await asyncio.gather(*(ch.close() for ch in chans), return_exceptions=True)
    return samples


@dataclass(frozen=True)
class _Share:
    """What one spawned generator process offers."""

    target: str
    requests: list[bytes]
    rate: float
    seconds: float
    timeout_s: float
    channels: int
    poisson: bool
    seed: int | None


def _child(share: _Share, results: Any, ready: Any) -> None:
    """One spawned generator process: runs its share, puts its Samples (or an error)."""
    try:
        s = asyncio.run(
            _open_loop_samples(share.target, share.requests, share.rate, share.seconds,
                               share.timeout_s, channels=share.channels,
                               poisson=share.poisson, seed=share.seed, ready=ready)
        )  # fmt: skip
        results.put(("ok", asdict(s)))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            ready.abort()  # the others stop waiting for this one
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _run_processes(share: _Share, processes: int) -> Samples:
    """`processes` spawned generators, `share.rate / processes` each; merged records."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ready = ctx.Barrier(processes)
    procs = []
    for i in range(processes):
        seed = None if share.seed is None else share.seed + i
        part = replace(share, rate=share.rate / processes, seed=seed)
        procs.append(ctx.Process(target=_child, args=(part, results, ready), daemon=True))
    for p in procs:
        p.start()
    merged = Samples()
    errors: list[str] = []
    try:
        for _ in procs:  # read before join: a child blocks until its result is taken
            try:
                kind, payload = results.get(timeout=share.seconds + share.timeout_s + 180)
            except queue.Empty:
                errors.append("a generator process sent no result")
                break
            if kind == "ok":
                merged.extend(Samples(**payload))
            else:
                errors.append(payload)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("generator process failed: " + "; ".join(errors))
    return merged


async def run_open_loop(
    target: str,
    requests: Sequence[bytes],
    rate: float,
    seconds: float,
    deadline_s: float,
    *,
    timeout_s: float | None = None,
    channels: int = 8,
    processes: int = 1,
    poisson: bool = False,
    warmup: float = 0.2,
    seed: int | None = None,
    lag_limit_s: float = LAG_LIMIT_S,
    stop: asyncio.Event | None = None,
) -> OverloadResult:
    """Offer `rate` Retrieve calls per second for `seconds` to `target` ("host:port").

    `requests`: serialised RetrieveRequests, sent round robin from a random offset.
    Each call carries `timeout_s` (default `deadline_s`) as its gRPC timeout; an OK is
    goodput when it answered within `deadline_s`. `processes` > 1 spawns that many
    generator processes (the caller's loop only waits). `stop` (one process only) ends
    the arrivals early; the result then covers the time they ran. Returns once every
    call has its outcome (at most `timeout_s` after the last arrival)."""
    if rate <= 0 or seconds <= 0 or deadline_s <= 0:
        raise ValueError("rate, seconds and deadline_s must be positive")
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup must be in [0, 1), got {warmup}")
    timeout = deadline_s if timeout_s is None else timeout_s
    if processes > 1:
        if stop is not None:
            raise ValueError("stop works with one process only")
        share = _Share(target, list(requests), rate, seconds, timeout, channels, poisson, seed)
        samples = await asyncio.to_thread(_run_processes, share, processes)
    else:
        samples = await _open_loop_samples(target, requests, rate, seconds, timeout,
                                           channels=channels, poisson=poisson, seed=seed,
                                           stop=stop)  # fmt: skip
    return summarise(
        samples,
        target=target,
        rate=rate,
        deadline_s=deadline_s,
        timeout_s=timeout,
        warmup=warmup,
        processes=max(1, processes),
        channels=channels,
        poisson=poisson,
        lag_limit_s=lag_limit_s,
    )


async def probe_capacity(
    target: str,
    requests: Sequence[bytes],
    *,
    concurrency: int = 16,
    seconds: float = 10.0,
    warmup_s: float = 0.0,
    timeout_s: float = 30.0,
    channels: int = 8,
) -> CapacityResult:
    """Closed loop: `concurrency` callers, each sending its next request as soon as the
    previous one answered, for `warmup_s` unrecorded and then `seconds` recorded. Calls
    that finish after the window are not counted."""
    if concurrency < 1 or seconds <= 0:
        raise ValueError("concurrency must be >= 1 and seconds positive")
    if not requests:
        raise ValueError("no requests to send")
    chans = _channels(target, channels)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    clock = time.perf_counter
    try:
        await _connect(chans, 30.0)
        methods = [ch.unary_unary(METHOD) for ch in chans]

        async def caller(c: int, until: float, record: bool) -> None:
            method = methods[c % len(methods)]
            for i in itertools.count(c * 7919):
                if clock() >= until:
                    return
                t = clock()
                try:
                    await method(requests[i % len(requests)], timeout=timeout_s)
                    outcome = OK
                except grpc.aio.AioRpcError as exc:
                    outcome = exc.code().name
                done = clock()
                if record and done <= until:
                    if outcome == OK:
                        latencies.append(done - t)
                    else:
                        errors[outcome] = errors.get(outcome, 0) + 1

        if warmup_s > 0:
            until = clock() + warmup_s
            await asyncio.gather(*(caller(c, until, False) for c in range(concurrency)))
        until = clock() + seconds
        await asyncio.gather(*(caller(c, until, True) for c in range(concurrency)))
    finally:
        await asyncio.gather(*(ch.close() for ch in chans), return_exceptions=True)
    return CapacityResult.of(target, concurrency, seconds, latencies, errors)


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
