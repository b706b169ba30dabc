"""Waiting in tests for a condition, never for a time: CI machines are shared and busy,
so a test polls what it needs to see and fails only after a deadline far beyond any
stall (tests/service, tests/ops)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def until(condition: Callable[[], object], what: str, timeout: float = 120.0) -> None:
    """Return once `condition()` is true; AssertionError naming `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], object], what: str, timeout: float = 120.0) -> None:
    """`until`, for a test outside an event loop."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def first(
    value: Callable[[], T], what: str, proc: subprocess.Popen | None = None, timeout: float = 120.0
) -> T:
    """The first truthy `value()`, polled; AssertionError naming `what` after `timeout` s,
    or at once with its output if `proc` (a process the value waits on) exits."""
    end = time.monotonic() + timeout
    while not (got := value()):
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process exited ({proc.returncode}) waiting for {what}: {output}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return got
