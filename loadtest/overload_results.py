"""The records and summaries of loadtest/overload.py's runs: raw per-call `Samples`,
the `OverloadResult` of an open-loop run (`summarise`: counts, latency percentiles,
goodput within the deadline, refusal latency, generator lag) and the `CapacityResult` of
a closed-loop probe, with their short text tables. No gRPC calls here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

OK = "OK"
CLIENT_ERROR = "CLIENT_ERROR"  # anything that is not a gRPC status (a bug, a closed loop)
REFUSED = "RESOURCE_EXHAUSTED"
LAG_LIMIT_S = 0.05  # lag P99 above this: the generator could not keep its schedule


def _ms(seconds: float | None, digits: int = 2) -> float | None:
    return None if seconds is None else round(seconds * 1e3, digits)


def _pct(xs: np.ndarray, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


@dataclass
class Samples:
    """Raw per-call records of one run (parallel lists, one entry per arrival)."""

    due: list[float] = field(default_factory=list)  # seconds after the run's start
    lag: list[float] = field(default_factory=list)  # seconds sent after `due`
    latency: list[float] = field(default_factory=list)  # seconds from send to answer
    outcome: list[str] = field(default_factory=list)  # "OK", a status code name, ...
    reply_bytes: int = 0  # total length of the OK replies
    offered_seconds: float = 0.0  # how long arrivals were offered

    def add(self, due: float, lag: float, latency: float, outcome: str) -> None:
        self.due.append(due)
        self.lag.append(lag)
        self.latency.append(latency)
        self.outcome.append(outcome)

    def extend(self, other: Samples) -> None:
        """Merge another process's records (same clock origin, same offered window)."""
        self.due += other.due
        self.lag += other.lag
        self.latency += other.latency
        self.outcome += other.outcome
        self.reply_bytes += other.reply_bytes
        self.offered_seconds = max(self.offered_seconds, other.offered_seconds)


@dataclass
class OutcomeStats:
    count: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


@dataclass
class OverloadResult:
    """The summary of one open-loop run; `to_dict()` is what --json writes."""

    target: str
    rate: float  # req/s asked for
    seconds: float  # how long arrivals were offered
    deadline_s: float  # an OK counts as goodput when its latency is at most this
    timeout_s: float  # the gRPC timeout each call carried (normally = deadline_s)
    warmup: float  # fraction of `seconds` left out of the steady-state window
    processes: int
    channels: int
    poisson: bool
    arrivals: int  # calls sent (each has exactly one outcome)
    offered_rps: float  # arrivals / seconds
    outcomes: dict[str, OutcomeStats]
    ok_in_deadline: int
    goodput_rps: float  # OK within the deadline / seconds, whole run
    steady_arrivals: int  # arrivals due after the warm-up
    steady_goodput_rps: float  # OK within the deadline completed in [warmup*T, T], per s
    ok_p50_ms: float | None
    ok_p99_ms: float | None
    refusal_p50_ms: float | None  # RESOURCE_EXHAUSTED latency
    refusal_p99_ms: float | None
    lag_p99_ms: float | None
    lag_max_ms: float | None
    lag_limit_ms: float
    generator_behind: bool  # lag P99 above the limit: the offered schedule was not kept
    mean_reply_bytes: float | None

    def count(self, outcome: str) -> int:
        s = self.outcomes.get(outcome)
        return s.count if s else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    samples: Samples,
    *,
    target: str,
    rate: float,
    deadline_s: float,
    timeout_s: float | None = None,
    warmup: float = 0.2,
    processes: int = 1,
    channels: int = 1,
    poisson: bool = False,
    lag_limit_s: float = LAG_LIMIT_S,
) -> OverloadResult:
    """Counts, latency percentiles, goodput and lag of a run's raw records."""
    seconds = samples.offered_seconds
    due = np.asarray(samples.due, dtype=np.float64)
    lat = np.asarray(samples.latency, dtype=np.float64)
    lag = np.asarray(samples.lag, dtype=np.float64)
    outcome = np.asarray(samples.outcome, dtype=object)
    outcomes: dict[str, OutcomeStats] = {}
    for name in sorted(set(samples.outcome), key=lambda n: (n != OK, n)):
        xs = lat[outcome == name]
        outcomes[name] = OutcomeStats(
            len(xs), _ms(_pct(xs, 50)), _ms(_pct(xs, 99)), _ms(float(xs.max()))
        )
    ok = outcome == OK
    good = ok & (lat <= deadline_s)
    steady = due >= warmup * seconds
    # steady-state goodput counts answers *completed* inside the window [warmup*T, T]:
    # the useful throughput while the load ran, not the backlog drained after it
    done = due + lag + lat
    in_window = (done >= warmup * seconds) & (done <= seconds)
    steady_seconds = seconds * (1.0 - warmup)
    lag_p99 = _pct(lag, 99)
    refusals = lat[outcome == REFUSED]
    n_ok = int(ok.sum())
    return OverloadResult(
        target=target,
        rate=rate,
        seconds=round(seconds, 4),
        deadline_s=deadline_s,
        timeout_s=deadline_s if timeout_s is None else timeout_s,
        warmup=warmup,
        processes=processes,
        channels=channels,
        poisson=poisson,
        arrivals=len(due),
        offered_rps=round(len(due) / seconds, 2) if seconds > 0 else 0.0,
        outcomes=outcomes,
        ok_in_deadline=int(good.sum()),
        goodput_rps=round(int(good.sum()) / seconds, 2) if seconds > 0 else 0.0,
        steady_arrivals=int(steady.sum()),
        steady_goodput_rps=(
            round(int((good & in_window).sum()) / steady_seconds, 2) if steady_seconds > 0 else 0.0
        ),
        ok_p50_ms=_ms(_pct(lat[ok], 50)),
        ok_p99_ms=_ms(_pct(lat[ok], 99)),
        refusal_p50_ms=_ms(_pct(refusals, 50), 3),
        refusal_p99_ms=_ms(_pct(refusals, 99), 3),
        lag_p99_ms=_ms(lag_p99, 3),
        lag_max_ms=_ms(float(lag.max()) if len(lag) else None, 3),
        lag_limit_ms=round(lag_limit_s * 1e3, 3),
        generator_behind=lag_p99 is not None and lag_p99 > lag_limit_s,
        mean_reply_bytes=round(samples.reply_bytes / n_ok, 1) if n_ok else None,
    )


@dataclass
class CapacityResult:
    """Closed loop: what `concurrency` back-to-back callers got through in `seconds`."""

    target: str
    concurrency: int
    seconds: float
    ok: int
    errors: dict[str, int]  # non-OK outcomes by name
    ok_rps: float
    p50_ms: float | None  # OK latency
    p99_ms: float | None

    @classmethod
    def of(
        cls,
        target: str,
        concurrency: int,
        seconds: float,
        latencies: list[float],
        errors: dict[str, int],
    ) -> CapacityResult:
        """From the OK answers' latencies (seconds) and the other outcomes' counts."""
        lat = np.asarray(latencies)
        ok_rps = round(len(latencies) / seconds, 2)
        p50, p99 = _ms(_pct(lat, 50)), _ms(_pct(lat, 99))
        return cls(target, concurrency, seconds, len(latencies), errors, ok_rps, p50, p99)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def format_result(r: OverloadResult) -> str:
    """A short human-readable table of one run."""
    arrivals = "Poisson" if r.poisson else "uniform"
    lines = [
        f"offered {r.offered_rps:.1f} req/s ({r.arrivals} {arrivals} arrivals in "
        f"{r.seconds:.1f} s; asked {r.rate:g}) to {r.target}, deadline "
        f"{r.deadline_s * 1e3:.0f} ms, {r.processes} process(es) x {r.channels} channels",
        f"{'outcome':<22}{'count':>8}{'share':>9}{'P50 ms':>10}{'P99 ms':>10}{'max ms':>10}",
    ]

    def cell(v: float | None) -> str:
        return f"{v:>10.1f}" if v is not None else f"{'-':>10}"

    for name, s in r.outcomes.items():
        share = 100 * s.count / r.arrivals if r.arrivals else 0.0
        lines.append(
            f"{name:<22}{s.count:>8}{share:>8.1f}%{cell(s.p50_ms)}{cell(s.p99_ms)}{cell(s.max_ms)}"
        )
    lines.append(
        f"goodput {r.goodput_rps:.1f} req/s (OK within the deadline); steady state "
        f"after {100 * r.warmup:.0f} % warm-up: {r.steady_goodput_rps:.1f} req/s"
    )
    if r.refusal_p50_ms is not None:
        lines.append(
            f"refusals (RESOURCE_EXHAUSTED): P50 {r.refusal_p50_ms:.2f} ms, "
            f"P99 {r.refusal_p99_ms:.2f} ms"
        )
    lines.append(
        f"generator lag: P99 {r.lag_p99_ms or 0:.2f} ms, max {r.lag_max_ms or 0:.2f} ms"
        + (
            f"  ** BEHIND SCHEDULE (P99 > {r.lag_limit_ms:.0f} ms): add --processes"
            if r.generator_behind
            else ""
        )
    )
    return "\n".join(lines)


def format_capacity(c: CapacityResult) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(c.errors.items())) or "none"
    return (
        f"closed loop, concurrency {c.concurrency}, {c.seconds:g} s against {c.target}: "
        f"{c.ok_rps:.1f} OK req/s ({c.ok} OK), P50 {c.p50_ms} ms, P99 {c.p99_ms} ms; "
        f"errors: {errors}"
    )
