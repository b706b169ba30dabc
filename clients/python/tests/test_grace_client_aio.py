"""AsyncGraceClient over real gRPC against the fake server: the sync client's semantics
(retries on RESOURCE_EXHAUSTED only as far as allowed, none on INVALID_ARGUMENT, the
deadline, health) on grpc.aio. Each test runs its own event loop (no pytest plugin)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import Served
from fake_grace import REPLY, Answer

from grace_client import AsyncGraceClient, Backoff, GraceError, ServingStatus

FAST = Backoff(initial=0.01, maximum=0.02)


def test_retries_then_answers(served: Served) -> None:
    served.fake.answer(
        *[Answer(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_delay=0.01)] * 2
    )

    async def run() -> object:
        async with AsyncGraceClient(served.target, retries=2, backoff=FAST) as client:
            return await client.retrieve(user_id=5, country="DE")

    assert asyncio.run(run()) == REPLY
    assert len(served.fake.calls) == 3
    assert served.fake.calls[-1].request.targeting.country == "DE"


def test_invalid_argument_is_not_retried(served: Served) -> None:
    served.fake.answer(Answer(grpc.StatusCode.INVALID_ARGUMENT, "targeting.locations: at most 64"))

    async def run() -> None:
        async with AsyncGraceClient(served.target, retries=3, backoff=FAST) as client:
            await client.retrieve(user_id=5)

    with pytest.raises(GraceError) as err:
        asyncio.run(run())
    assert (err.value.code, err.value.attempts) == (grpc.StatusCode.INVALID_ARGUMENT, 1)
    assert err.value.message == "targeting.locations: at most 64"
    assert len(served.fake.calls) == 1


def test_the_servers_retry_delay_is_honoured(served: Served) -> None:
    served.fake.answer(Answer(grpc.StatusCode.UNAVAILABLE, "draining", retry_delay=0.25))

    async def run() -> object:
        async with AsyncGraceClient(served.target, backoff=FAST, timeout=5.0) as client:
            return await client.retrieve(user_id=5)

    assert asyncio.run(run()) == REPLY
    first, second = served.fake.calls
    assert second.at - first.at >= 0.245


def test_deadline_and_health(served: Served) -> None:
    served.fake.answer(Answer(sleep=2.0))
    served.fake.health[""] = ServingStatus.NOT_SERVING.value

    async def run() -> tuple[ServingStatus, GraceError, float]:
        async with AsyncGraceClient(served.target, timeout=0.2) as client:
            status = await client.health()
            t0 = time.monotonic()
            try:
                await client.retrieve(user_id=5)
            except GraceError as e:
                return status, e, time.monotonic() - t0
        raise AssertionError("no DEADLINE_EXCEEDED")

    status, error, elapsed = asyncio.run(run())
    assert status is ServingStatus.NOT_SERVING
    assert (error.code, error.attempts) == (grpc.StatusCode.DEADLINE_EXCEEDED, 1)
    assert 0.19 <= elapsed < 1.5
