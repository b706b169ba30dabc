"""Waiting in tests for a condition, never for a time: CI machines are shared and busy,
so a test polls what it needs to see and fails only after a deadline far beyond any
stall (tests/service, tests/ops)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


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
