"""`service/balancer.py`: the request front of `grace serve --workers N --balance request`,
against stand-in workers (gRPC servers on unix sockets that report who answered, the
deadline and metadata they saw); the real workers behind it are in test_workers.py."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.balancer import Front, FrontThread, _client_metadata
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings
from tests.helpers.serving import hold_stop
from tests.helpers.waiting import until

METHOD = "/grace.v1.AdRetrieval/Retrieve"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Worker(grpc.GenericRpcHandler):
    """Answers Retrieve with model_version 'w<i>' and index_version 'remaining|x-trace';
    request_id 'slow' waits for `release`, 'fail' aborts INVALID_ARGUMENT with trailing
    metadata."""

    def __init__(self, i: int, path: Path) -> None:
        self.i, self.address = i, f"unix:{path}"
        self.release = asyncio.Event()
        self.health = health.HealthServicer()
        self.health.set("grace.v1.AdRetrieval", NOT_SERVING)

    def service(self, details):
        if details.method != METHOD:
            return None
        return grpc.unary_unary_rpc_method_handler(
            self.retrieve,
            request_deserializer=retrieval_pb2.RetrieveRequest.FromString,
            response_serializer=retrieval_pb2.RetrieveResponse.SerializeToString,
        )

    async def retrieve(self, request, context):
        if request.request_id == "slow":
            await self.release.wait()
        if request.request_id == "fail":
            context.set_trailing_metadata((("x-why", "because"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request at w{self.i}")
        meta = dict(context.invocation_metadata())
        remaining = context.time_remaining()
        return retrieval_pb2.RetrieveResponse(
            model_version=f"w{self.i}",
            index_version=f"{remaining if remaining is None else round(remaining, 1)}|"
            f"{meta.get('x-trace', '')}",
        )

    async def start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self,))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_insecure_port(self.address)
        await server.start()
        return server

    def ready(self) -> None:
        self.health.set("grace.v1.AdRetrieval", SERVING)


def test_least_in_flight_then_in_turn() -> None:
    front = Front(load_settings({"port": 0}), ["unix:a", "unix:b", "unix:c"])
    front.inflight = [2, 1, 1]
    assert [front.pick() for _ in range(4)] == [1, 2, 1, 2]
    front.inflight = [0, 3, 0]
    assert {front.pick(), front.pick()} == {0, 2}
    front.down.add(0)  # the supervisor saw worker 0 exit: the busier live one is picked
    assert [front.pick() for _ in range(2)] == [2, 2]
    front.down.add(2)
    assert front.pick() == 1
    front.down.add(1)  # none left up: pick among all rather than fail here
    assert front.pick() in (0, 2)
    front.down.discard(0)  # a retry goes to another worker than the one that failed it
    assert front.pick(not_this=0) == 2 and front.pick() == 0


def test_only_the_callers_own_metadata_is_passed_on() -> None:
    got = _client_metadata((("user-agent", "grpc-python"), ("grpc-accept-encoding", "gzip"),
                            ("x-trace", "t1"), ("authorization", "Bearer k")))  # fmt: skip
    assert got == (("x-trace", "t1"), ("authorization", "Bearer k"))
    assert _client_metadata(None) == ()


def test_front_serves_only_once_every_worker_does_and_forwards_faithfully(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        workers = [Worker(i, tmp_path / f"w{i}.sock") for i in range(2)]
        servers = [await w.start() for w in workers]
        front = Front(load_settings({"port": 0, "drain_seconds": 5}), [w.address for w in workers])
        stopping = asyncio.Event()
        task = asyncio.create_task(front.run(stopping))
        await asyncio.sleep(1.2)
        assert front.server is None and front.port == 0  # a worker still loading: no port
        workers[0].ready()
        await asyncio.sleep(1.2)
        assert front.server is None
        workers[1].ready()
        await until(
            lambda: front.port, "the front to listen"
        )  # its next readiness poll (every 0.5 s) sees both
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            check = health_pb2_grpc.HealthStub(ch).Check
            assert (await check(health_pb2.HealthCheckRequest())).status == SERVING

            # one connection, one call at a time: the workers take turns
            who = [(await stub.Retrieve(retrieval_pb2.RetrieveRequest())).model_version
                   for _ in range(6)]  # fmt: skip
            assert sorted(who) == ["w0"] * 3 + ["w1"] * 3

            # a slow call keeps its worker busy: the next calls go to the other one
            slow = asyncio.ensure_future(
                stub.Retrieve(retrieval_pb2.RetrieveRequest(request_id="slow"))
            )
            await until(lambda: sum(front.inflight) == 1, "one call in flight")
            idle = front.inflight.index(0)
            quick = [(await stub.Retrieve(retrieval_pb2.RetrieveRequest())).model_version
                     for _ in range(3)]  # fmt: skip
            assert quick == [f"w{idle}"] * 3
            workers[1 - idle].release.set()
            assert (await slow).model_version == f"w{1 - idle}"

            # no deadline from the caller: none on the hop either
            reply = await stub.Retrieve(retrieval_pb2.RetrieveRequest())
            assert reply.index_version == "None|"

            # deadline and the caller's metadata reach the worker (the hop takes far less
            # than the 30 s margin: a default or a lost deadline would show; gRPC's
            # timeout header may round the 60 s up a little)
            reply = await stub.Retrieve(retrieval_pb2.RetrieveRequest(), timeout=60,
                                        metadata=(("x-trace", "t-42"),))  # fmt: skip
            remaining, trace = reply.index_version.split("|")
            assert 30.0 < float(remaining) <= 61.0 and trace == "t-42"

            # the worker's status, details and trailing metadata come back unchanged
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Retrieve(retrieval_pb2.RetrieveRequest(request_id="fail"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("bad request at w")
            assert ("x-why", "because") in tuple(err.value.trailing_metadata())

            # other services than AdRetrieval and health are not forwarded
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/grace.v1.Other/Call")(b"")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

            # stopping: NOT_SERVING at once, a call in flight still finishes
            for w in workers:
                w.release.clear()
            slow = asyncio.ensure_future(
                stub.Retrieve(retrieval_pb2.RetrieveRequest(request_id="slow"))
            )
            await until(lambda: sum(front.inflight) == 1, "one call in flight")
            # the port closes 0.5 s after NOT_SERVING: held open until the Checks are in
            port_open = hold_stop(front.server)
            stopping.set()
            end = time.monotonic() + 60
            while (await check(health_pb2.HealthCheckRequest())).status != NOT_SERVING:
                assert time.monotonic() < end, "still SERVING after stopping"
                await asyncio.sleep(0.01)  # NOT_SERVING at once, the call still in flight
            assert (await check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
            assert not slow.done()
            port_open.set()  # the drain's grace begins with the call in flight
            for w in workers:
                w.release.set()
            assert (await slow).model_version in ("w0", "w1")
        await task
        assert sum(front.answered) == 14 and front.inflight == [0, 0]
        for s in servers:
            await s.stop(None)

    asyncio.run(main())


def test_stop_before_the_front_thread_starts_is_kept() -> None:
    """A SIGTERM between creating the front and starting it: stop() returns at once and
    the thread, once started, stops without serving."""
    thread = FrontThread(load_settings({"port": 0}), ["unix:/nonexistent/w.sock"], lambda: None)
    thread.stop()
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and not thread.failed and thread.front.server is None


def test_front_that_cannot_bind_reports_and_fails(tmp_path: Path) -> None:
    """The public port taken: the front thread logs, calls on_error (the supervisor's
    stop_all) and counts as failed."""
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    called: list[bool] = []

    async def workers_up() -> list[grpc.aio.Server]:
        ws = [Worker(i, tmp_path / f"w{i}.sock") for i in range(2)]
        for w in ws:
            w.ready()
        return [await w.start() for w in ws]

    loop = asyncio.new_event_loop()
    try:
        servers = loop.run_until_complete(workers_up())
        settings = load_settings({"port": port, "drain_seconds": 1})
        thread = FrontThread(settings, [f"unix:{tmp_path}/w{i}.sock" for i in range(2)],
                             lambda: called.append(True))  # fmt: skip
        thread.start()
        end = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < end:
            loop.run_until_complete(asyncio.sleep(0.1))  # the stand-in workers answer here
        assert not thread.is_alive() and thread.failed and called
        for s in servers:
            loop.run_until_complete(s.stop(None))
    finally:
        loop.close()
        blocker.close()
