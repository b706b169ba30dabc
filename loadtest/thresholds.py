"""Pass/fail for a headless run: P99, failure ratio and minimum RPS against the totals.

Plain numbers in, messages out, so the rules are testable without running locust; the
locustfile reads locust's aggregated stats into a `RunSummary` when the run quits and
turns any miss into exit code `EXIT_THRESHOLD_MISSED`.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_THRESHOLD_MISSED = 3  # locust itself exits 1 on failures, 2 on unhandled errors
MAX_GENERATOR_LAG_S = 1.0  # open loop: arrivals dispatched later than this void the run


@dataclass(frozen=True)
class Thresholds:
    p99_ms: float | None = None  # P99 response time must be <= this
    fail_ratio: float | None = None  # failed / all requests must be <= this (0.01 = 1 %)
    min_rps: float | None = None  # requests per second over the run must be >= this

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.p99_ms, self.fail_ratio, self.min_rps))


@dataclass(frozen=True)
class RunSummary:
    requests: int  # answered calls, failures included
    failures: int
    rps: float  # requests over the run's duration
    p50_ms: float
    p99_ms: float
    generator_lag_s: float | None = None  # open loop: the latest dispatch behind schedule

    @property
    def fail_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    def describe(self) -> str:
        text = (
            f"{self.requests} requests, {self.failures} failures "
            f"({100 * self.fail_ratio:.2f} %), {self.rps:.1f} req/s, "
            f"P50 {self.p50_ms:.0f} ms, P99 {self.p99_ms:.0f} ms"
        )
        if self.generator_lag_s is not None:
            text += f", open-loop dispatch lag max {1000 * self.generator_lag_s:.0f} ms"
        return text


def check(summary: RunSummary, limits: Thresholds) -> list[str]:
    """Every missed threshold as a message; empty when the run passes."""
    misses = []
    if summary.requests == 0:
        misses.append("no request was answered")
    if limits.p99_ms is not None and summary.p99_ms > limits.p99_ms:
        misses.append(f"P99 {summary.p99_ms:.0f} ms > {limits.p99_ms:g} ms")
    if limits.fail_ratio is not None and summary.fail_ratio > limits.fail_ratio:
        misses.append(f"failure ratio {summary.fail_ratio:.4f} > {limits.fail_ratio:g}")
    if limits.min_rps is not None and summary.rps < limits.min_rps:
        misses.append(f"{summary.rps:.1f} req/s < {limits.min_rps:g} req/s")
    lag = summary.generator_lag_s
    if lag is not None and lag > MAX_GENERATOR_LAG_S:
        misses.append(
            f"the load generator fell {lag:.1f} s behind its arrival schedule "
            f"(> {MAX_GENERATOR_LAG_S:g} s): the offered rate was not applied"
        )
    return misses
