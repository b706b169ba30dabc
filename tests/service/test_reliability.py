"""The server under hostile load, over real gRPC against a real `grace serve` process:
open health watches wedge neither health nor shutdown, goodput holds past capacity,
undecodable and oversized requests are refused and counted, rapid stream resets cancel
no other client's call, and health-check loops leave Retrieve its throughput.

Speeds are compared only with each other in the same test (ratios), never with absolute
figures: the machine may be busy."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.overload import probe_capacity, run_open_loop, world_requests
from service.grpc_server import HEALTH_CHECKS_PER_SECOND, TRANSPORT_LIMIT_FACTOR
from service.settings import load_settings
from service.validation import Limits
from tests.helpers.server_process import ServerProcess, serving
from tests.helpers.serving import make_serving_data

RETRIEVE = "/grace.v1.AdRetrieval/Retrieve"
SERVICE_LABELS = {"grpc_service": "grace.v1.AdRetrieval", "grpc_method": "Retrieve"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("reliability"))


@pytest.fixture(scope="module")
def requests(data: Path) -> list[bytes]:
    return world_requests(data / "world", 64)


def handled(server: ServerProcess, code: str) -> float:
    return server.metric("grpc_server_handled_total", {**SERVICE_LABELS, "grpc_code": code})


def test_open_health_watches_wedge_neither_checks_nor_sigterm(data: Path, tmp_path: Path) -> None:
    """Six Watch streams stay open (as some probes and proxies keep them); a Check still
    answers at once, and SIGTERM ends the process within the drain grace, the watchers
    told NOT_SERVING first."""
    drain = 2.0
    server = ServerProcess.start(data, tmp_path / "server.log",
                                 env={"GRACE_DRAIN_SECONDS": str(drain)})  # fmt: skip
    try:
        server.wait_serving()

        async def main() -> list[list[int]]:
            async with grpc.aio.insecure_channel(server.target) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                seen: list[list[int]] = [[] for _ in range(6)]

                async def watch(i: int) -> None:
                    with pytest.raises(grpc.aio.AioRpcError):  # the stream ends with the server
                        async for reply in stub.Watch(health_pb2.HealthCheckRequest()):
                            seen[i].append(reply.status)

                watches = [asyncio.ensure_future(watch(i)) for i in range(6)]
                while not all(seen):  # every stream open and answered once
                    await asyncio.sleep(0.01)
                for _ in range(3):  # a wedged Check would hang: 30 s catches it
                    r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
                t = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(asyncio.gather(*watches), timeout=60)
                code = await asyncio.to_thread(server.proc.wait, 60)
                took = time.monotonic() - t
                # exit 0: the drain ended inside its own limit (drain + 5.5 s, else exit 1);
                # the bound only catches a hang after it
                assert code == 0, server.log_tail()
                assert took < drain + 30, f"SIGTERM took {took:.1f} s"
                return seen

        seen = asyncio.run(main())
    finally:
        server.stop()
    serving_, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                             health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
    assert all(s[0] == serving_ and s[-1] == not_serving for s in seen), seen


def test_goodput_holds_at_twice_capacity_with_a_one_second_deadline(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """Open-loop load at twice what the server can answer, every call with a 1 s deadline
    (several times the unloaded latency): the server keeps answering about as many calls
    in time as it can, refusing the rest at once, instead of computing answers that come
    too late (before admission control it answered none in time)."""
    with serving(data, tmp_path / "server.log") as server:

        async def main() -> tuple[float, float, object]:
            before = await probe_capacity(server.target, requests, concurrency=16,
                                          seconds=6, warmup_s=2)  # fmt: skip
            overload = await run_open_loop(server.target, requests, 2 * before.ok_rps, 12, 1.0)
            await asyncio.to_thread(server.wait_idle)
            after = await probe_capacity(server.target, requests, concurrency=16, seconds=6)
            return before.ok_rps, after.ok_rps, overload

        before, after, overload = asyncio.run(main())
        refused = server.metric("grace_admission_refused_total")
    capacity = (before + after) / 2
    goodput = overload.steady_goodput_rps
    # The behaviour: no collapse (without admission control this read 0 in time). The
    # figure — 0.83x capacity, bench/results/overload_cpu.json — is the bench's: here the
    # open-loop client shares the 2 cores with the server, and single runs on a busy CI box
    # range from 0.70 to 0.95x (docs/RELIABILITY.md), so the test holds a margin below that.
    assert goodput >= 0.6 * capacity, (goodput, before, after, overload.outcomes)
    assert overload.count("RESOURCE_EXHAUSTED") > 0 and refused > 0
    # refused at once, not behind the queue as the OKs are: compared with them, not with
    # a time (the refusals' P99 is the event loop's lag, 218 ms on the bench's quiet box)
    assert overload.refusal_p50_ms is not None and overload.ok_p50_ms is not None
    assert overload.refusal_p50_ms < overload.ok_p50_ms, overload.outcomes


def test_undecodable_and_oversized_requests_are_refused_and_counted(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """Bytes that are no RetrieveRequest get INVALID_ARGUMENT, a request longer than the
    largest valid one RESOURCE_EXHAUSTED before it is parsed; both are counted in
    grpc_server_handled_total and logged as one short line, not a traceback per call."""
    limit = Limits.from_settings(load_settings({"data_dir": data})).max_request_bytes()
    with serving(data, tmp_path / "server.log") as server:

        async def main() -> dict[str, int]:
            codes: dict[str, int] = {}
            async with grpc.aio.insecure_channel(server.target) as ch:
                call = ch.unary_unary(RETRIEVE)
                junk = [b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc"] * 20
                oversized = requests[0] + b"\x00" * limit  # a valid start, then padding
                beyond = b"\x00" * (TRANSPORT_LIMIT_FACTOR * limit + 1)
                for body in [*junk, oversized, beyond]:
                    try:
                        await call(body, timeout=10)
                        codes["OK"] = codes.get("OK", 0) + 1
                    except grpc.aio.AioRpcError as exc:
                        codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
                await call(requests[0], timeout=30)  # a valid call is still served
            return codes

        codes = asyncio.run(main())
        invalid = handled(server, "INVALID_ARGUMENT")
        exhausted = handled(server, "RESOURCE_EXHAUSTED")
        ok = handled(server, "OK")
        log = server.log_text()
    assert codes == {"INVALID_ARGUMENT": 60, "RESOURCE_EXHAUSTED": 2}, codes
    assert invalid == 60 and exhausted == 1 and ok == 1  # beyond the transport: gRPC's own
    lines = [line for line in log.splitlines() if "INVALID_ARGUMENT" in line]
    assert 1 <= len(lines) <= 2 and "Traceback" not in log, log


def _rapid_reset(port: int, seconds: float, counts: dict[str, int], started) -> None:
    """One raw HTTP/2 connection opening Retrieve streams and resetting them at once;
    `started()` once the first of them went out."""
    import h2.config
    import h2.connection

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", RETRIEVE), (":authority", "g"),
               ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    stream, end = 1, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for _ in range(100):
                conn.send_headers(stream, headers)
                conn.send_data(stream, b"\x00\x00\x00\x00\x00")
                conn.reset_stream(stream)
                stream += 2
            try:
                sock.sendall(conn.data_to_send())
                if stream == 201:
                    started()
                received = sock.recv(1 << 16)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:  # the server closed the abusive connection: also fine
                break
            if not received:
                break
            conn.receive_data(received)
    finally:
        sock.close()
    counts["reset"] = stream // 2


def _attack(port: int, seconds: float, out: mp.Queue) -> None:
    counts: dict[str, int] = {}
    _rapid_reset(port, seconds, counts, lambda: out.put("started"))
    out.put(counts)


def test_rapid_stream_resets_cancel_no_other_clients_call(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """An HTTP/2 "rapid reset" client (open a stream, reset it, thousands a second) on its
    own connection: the other clients' calls all succeed — before, gRPC shed them at
    random from the queue the reset streams filled (CANCELLED)."""
    ctx = mp.get_context("spawn")
    with serving(data, tmp_path / "server.log") as server:
        out = ctx.Queue()
        attacker = ctx.Process(target=_attack, args=(server.port, 6.0, out))
        attacker.start()
        assert out.get(timeout=60) == "started"

        async def clients() -> dict[str, int]:
            codes: dict[str, int] = {}
            channels = [grpc.aio.insecure_channel(server.target) for _ in range(16)]
            end = time.monotonic() + 5

            async def client(i: int) -> None:
                call = channels[i].unary_unary(RETRIEVE)
                while time.monotonic() < end:
                    try:
                        await call(requests[i % len(requests)], timeout=30)
                        code = "OK"
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                    codes[code] = codes.get(code, 0) + 1

            await asyncio.gather(*(client(i) for i in range(16)))
            await asyncio.gather(*(ch.close() for ch in channels))
            return codes

        codes = asyncio.run(clients())
        counts = out.get(timeout=60)
        attacker.join(30)
        server.check_alive()
    assert counts["reset"] > 1000, counts  # the attack really ran
    assert set(codes) == {"OK"} and codes["OK"] > 0, codes


def _health_loops(target: str, loops: int, seconds: float, out: mp.Queue) -> None:
    async def main() -> None:
        done = 0
        channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
        end = time.monotonic() + seconds

        async def loop(i: int) -> None:
            nonlocal done
            stub = health_pb2_grpc.HealthStub(channels[i % len(channels)])
            while time.monotonic() < end:
                with contextlib.suppress(grpc.aio.AioRpcError):  # refused: ask again at once
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    done += 1
                    if done == 1:
                        out.put("started")

        await asyncio.gather(*(loop(i) for i in range(loops)))
        out.put(done / seconds)

    asyncio.run(main())


def test_health_check_loops_leave_retrieve_its_throughput(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """64 callers doing nothing but health Checks back to back (before: Retrieve fell to
    a seventh of its throughput): Checks are paced, Retrieve keeps most of its rate."""
    ctx = mp.get_context("spawn")
    with serving(data, tmp_path / "server.log") as server:
        alone = asyncio.run(probe_capacity(server.target, requests, concurrency=16,
                                           seconds=5, warmup_s=2))  # fmt: skip
        out = ctx.Queue()
        hammer = ctx.Process(target=_health_loops, args=(server.target, 64, 9.0, out))
        hammer.start()
        assert out.get(timeout=60) == "started"
        loaded = asyncio.run(probe_capacity(server.target, requests, concurrency=16, seconds=5))
        checks_per_second = out.get(timeout=60)
        hammer.join(30)
    assert loaded.ok_rps >= 0.5 * alone.ok_rps, (loaded.ok_rps, alone.ok_rps)
    assert checks_per_second <= 1.5 * HEALTH_CHECKS_PER_SECOND, checks_per_second
