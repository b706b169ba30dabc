"""The open-loop runs of the overload generator (loadtest/overload.py): `run_open_loop`
offers a rate in this process or spread over spawned generator processes, and
summarises the records into an `OverloadResult`.

One process runs `overload_sender.open_loop_samples` on the caller's loop. With
`processes` > 1, each spawned process offers `rate / processes` (its own seed, its own
channels), all start together at a barrier once connected, and their `Samples` are
merged before `overload_results.summarise`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from loadtest.overload_results import LAG_LIMIT_S, OverloadResult, Samples, summarise
from loadtest.overload_sender import open_loop_samples


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
            open_loop_samples(share.target, share.requests, share.rate, share.seconds,
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
        samples = await open_loop_samples(target, requests, rate, seconds, timeout,
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
