"""The senders of the overload generator (loadtest/overload.py): the open-loop arrival
schedule and the per-process open-loop sender, and the closed-loop capacity probe.

Both open `channels` gRPC channels (each its own HTTP/2 connection), connect them all
before the clock starts, and call /grace.v1.AdRetrieval/Retrieve with raw bytes
(`channel.unary_unary` without (de)serialisers), round robin over the channels, every
call with its timeout. `open_loop_samples` sends arrival k when it is due whatever
earlier calls are doing and records each call's outcome in `Samples`; `probe_capacity`
keeps `concurrency` callers back to back. Spreading the open loop over processes and
summarising it is `overload_runner.py`'s; the records are `overload_results.py`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from loadtest.overload_results import CLIENT_ERROR, OK, CapacityResult, Samples

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


async def open_loop_samples(
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
    """One process's open loop: `rate` arrivals per second for `seconds` (or until `stop`),
    each sent when due with `timeout_s`; returns once every call has its outcome."""
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
