"""The health servicer: Checks paced by a token bucket, Watches capped, refusals slow."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.grpc_server import HEALTH_CHECK_MAX_WAIT_SECONDS, HealthServicer, set_health


async def health_server(servicer: HealthServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await set_health(servicer, serving=True)
    return server, port


def test_checks_in_tight_loops_are_paced() -> None:
    """Twenty callers asking back to back get at most rate x time + burst answers, all
    SERVING (a slow machine only answers fewer)."""

    async def main() -> tuple[int, float]:
        servicer = HealthServicer(checks_per_second=50, burst=5)
        server, port = await health_server(servicer)
        answered = 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            t = time.monotonic()
            end = t + 1.0

            async def caller() -> None:
                nonlocal answered
                while True:  # one call at least, however late this caller starts
                    r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
                    answered += 1
                    if time.monotonic() >= end:
                        return

            await asyncio.gather(*(caller() for _ in range(20)))
            elapsed = time.monotonic() - t
        await server.stop(0)
        return answered, elapsed

    answered, elapsed = asyncio.run(main())
    assert 5 <= answered <= 50 * elapsed + 5 + 1


def test_a_check_flood_is_refused_slowly_and_watches_are_capped() -> None:
    """Checks that would wait longer than the limit are refused after that long (a caller
    in a loop gains nothing by asking again); Watch streams beyond the cap are refused."""

    async def main() -> None:
        servicer = HealthServicer(checks_per_second=2, burst=1, max_watches=2)
        server, port = await health_server(servicer)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            t = time.monotonic()
            replies = await asyncio.gather(
                *(stub.Check(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(8)),
                return_exceptions=True,
            )
            refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
            assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
            assert time.monotonic() - t >= HEALTH_CHECK_MAX_WAIT_SECONDS
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(3)]
            first = [await w.read() for w in watches[:2]]
            assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in first)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watches[2].read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert servicer.watches == 2
            for w in watches[:2]:
                w.cancel()
        await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 30))
