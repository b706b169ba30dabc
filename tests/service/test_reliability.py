"""The server under hostile load, over real gRPC against a real `grace serve` process:
open health watches wedge neither health nor shutdown, goodput holds past capacity,
undecodable and oversized requests are refused and counted, rapid stream resets cancel
no other client's call, health-check loops leave Retrieve its throughput, metadata that is
not UTF-8 cannot flood the log, and idle connections at a soft open-files limit of 1,024
leave health and the rollout working.

Speeds are compared only with each other in the same test (ratios), never with absolute
figures: the machine may be busy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing as mp
import resource
import selectors
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.query import request_for_user
from index_builder.build import build_index
from loadtest.overload import probe_capacity, run_open_loop, world_requests
from service.grpc_server import FD_RESERVE, HEALTH_CHECKS_PER_SECOND, TRANSPORT_LIMIT_FACTOR
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.server import LOG_EVERY_SECONDS
from service.settings import load_settings
from service.validation import Limits
from tests.helpers.server_process import ServerProcess, serving
from tests.helpers.serving import make_serving_data
from tests.helpers.waiting import until

RETRIEVE = "/grace.v1.AdRetrieval/Retrieve"
SERVICE_LABELS = {"grpc_service": "grace.v1.AdRetrieval", "grpc_method": "Retrieve"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("reliability"))


@pytest.fixture(scope="module")
def requests(data: Path) -> list[bytes]:
    return world_requests(data / "world", 64)


def build(data: Path, root: Path) -> str:
    """`grace build-index` of the served world's catalog into `root`; the new version."""
    catalog, tokenizer = data / "world" / "catalog.parquet", data / "model" / "tokenizer"
    return build_index(catalog, root, tokenizer_path=tokenizer, progress=False)[0]


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


def test_goodput_holds_at_twice_capacity_and_shrinking_beams_answer_more(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """Open-loop load at twice what the server can answer at its full beam schedule, every
    call with a 1 s deadline (several times the unloaded latency). Refusal-only (the beam
    ladder off): the server keeps answering about as many calls in time as it can,
    refusing the rest at once, instead of computing answers that come too late (before
    admission control it answered none in time). With the ladder (the default) the same
    offered load is answered at narrower rungs — the replies say which — and clearly more
    of it in time: the two servers offered it side by side, at the same time."""

    async def run(server: ServerProcess) -> tuple[float, float, object]:
        """Twice the capacity probed before it; (capacity: the mean of probes before and
        after, offered rate, the overload run)."""
        before = await probe_capacity(server.target, requests, concurrency=16,
                                      seconds=6, warmup_s=2)  # fmt: skip
        overload = await run_open_loop(server.target, requests, 2 * before.ok_rps, 12, 1.0)
        await asyncio.to_thread(server.wait_idle)
        after = await probe_capacity(server.target, requests, concurrency=16, seconds=6)
        return (before.ok_rps + after.ok_rps) / 2, 2 * before.ok_rps, overload

    async def side_by_side(a: ServerProcess, b: ServerProcess, rate: float) -> list:
        """The same open-loop load on both servers at once: whatever else runs on the
        machine meanwhile weighs on both alike."""
        return list(await asyncio.gather(*(run_open_loop(s.target, requests, rate, 12, 1.0)
                                           for s in (a, b))))  # fmt: skip

    with serving(data, tmp_path / "refusing.log", env={"GRACE_BEAM_LADDER": "off"}) as off, \
            serving(data, tmp_path / "adaptive.log") as server:  # fmt: skip
        capacity, offered, refusing = asyncio.run(run(off))
        refused = off.metric("grace_admission_refused_total")
        goodput = refusing.steady_goodput_rps
        # The behaviour: no collapse (without admission control this read 0 in time). The
        # figure — 0.83x capacity, bench/results/overload_cpu.json — is the bench's: here
        # the open-loop client shares the 2 cores with the server, and single runs on a busy
        # CI box range from 0.70 to 0.95x (docs/RELIABILITY.md), so the test holds a margin.
        assert goodput >= 0.6 * capacity, (goodput, capacity, refusing.outcomes)
        assert refusing.count("RESOURCE_EXHAUSTED") > 0 and refused > 0
        # refused at once, not behind the queue as the OKs are: compared with them, not
        # with a time (the refusals' P99 is the event loop's lag, 218 ms on a quiet box)
        assert refusing.refusal_p50_ms is not None and refusing.ok_p50_ms is not None
        assert refusing.refusal_p50_ms < refusing.ok_p50_ms, refusing.outcomes
        # the ladder against refusal-only, each offered the same load at the same time
        base, adaptive = asyncio.run(side_by_side(off, server, offered))
        narrower = sum(server.metric("grace_beam_rung_batches_total", {"rung": r}) or 0
                       for r in ("1", "2"))  # fmt: skip
        own = retrieval_pb2.RetrieveRequest.FromString(requests[0])
        own.options.beam_widths.extend([1, 8, 16, 16])
        with grpc.insecure_channel(server.target) as channel:
            stub = retrieval_pb2_grpc.AdRetrievalStub(channel)
            plain = stub.Retrieve(retrieval_pb2.RetrieveRequest.FromString(requests[0]),
                                  timeout=30).stats  # fmt: skip
            mine = stub.Retrieve(own, timeout=30).stats
    assert narrower > 0, adaptive.outcomes  # load brought narrower rungs
    assert adaptive.steady_goodput_rps >= 1.2 * base.steady_goodput_rps, (
        adaptive.steady_goodput_rps, base.steady_goodput_rps, adaptive.outcomes,
        base.outcomes)  # fmt: skip
    # each reply names what answered it: a rung of the tiny profile's ladder, or its own
    ladder = load_settings({"profile": "tiny"}).ladder()
    assert tuple(plain.beam_widths) == ladder[plain.beam_rung]
    assert (mine.beam_rung, tuple(mine.beam_widths)) == (-1, (1, 8, 16, 16))


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
    a seventh of its throughput): Checks are paced, Retrieve keeps well over that."""
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
    # unpaced, Retrieve fell to a seventh (0.14); the hammer's own process takes a share of
    # a 2-core machine's CPU whatever the server does (0.496 seen on a busy CI box), so the
    # bar sits between the two
    assert loaded.ok_rps >= 0.3 * alone.ok_rps, (loaded.ok_rps, alone.ok_rps)
    assert checks_per_second <= 1.5 * HEALTH_CHECKS_PER_SECOND, checks_per_second


def _raw_calls(port: int, n: int, metadata: list[tuple[bytes, bytes]], body: bytes) -> list[str]:
    """`n` Retrieve calls over one raw HTTP/2 connection (`h2`, which sends header bytes
    as they are: grpcio's own client refuses a text value that is not UTF-8), at most 8 in
    flight; the grpc-status of each ('RESET' for a stream the server reset)."""
    import h2.config
    import h2.connection
    import h2.events

    config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                       normalize_outbound_headers=False)  # fmt: skip
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", RETRIEVE.encode()),
               (b":authority", b"g"), (b"content-type", b"application/grpc"),
               (b"te", b"trailers"), *metadata]  # fmt: skip
    frame = b"\x00" + len(body).to_bytes(4, "big") + body
    statuses: dict[int, str] = {}
    next_stream, open_streams = 1, set()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        while len(statuses) < n:
            while len(open_streams) < 8 and next_stream < 2 * n:
                if conn.outbound_flow_control_window < len(frame) and open_streams:
                    break  # wait for the server's WINDOW_UPDATE
                conn.send_headers(next_stream, headers)
                conn.send_data(next_stream, frame, end_stream=True)
                open_streams.add(next_stream)
                next_stream += 2
            sock.sendall(conn.data_to_send())
            received = sock.recv(1 << 16)
            assert received, f"the server closed the connection after {len(statuses)} calls"
            for event in conn.receive_data(received):
                got = getattr(event, "headers", None) or ()  # trailers, or trailers-only
                status = dict(got).get(b"grpc-status")
                if status is not None:
                    statuses[event.stream_id] = status.decode()
                    open_streams.discard(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    statuses[event.stream_id] = "RESET"
                    open_streams.discard(event.stream_id)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            sock.sendall(conn.data_to_send())
    return list(statuses.values())


def test_metadata_that_is_not_utf8_cannot_flood_the_log(
    data: Path, requests: list[bytes], tmp_path: Path
) -> None:
    """Calls carrying a text metadata value that is not UTF-8 (4 KiB of b'\\xfe\\xff'),
    sent by a raw HTTP/2 client: the calls are answered, the server's log grows by a
    bounded number of short lines whatever their number — before, grpcio logged three
    ERROR records with a traceback per call, each repeating the value (~49 KiB a call) —
    and well-formed calls are still served."""
    n, value = 200, b"\xfe\xff" * 2048
    with serving(data, tmp_path / "server.log") as server:
        asyncio.run(until(lambda: "serving grace.v1" in server.log_text(), "the serving line"))
        with grpc.insecure_channel(server.target) as ch:
            ch.unary_unary(RETRIEVE)(requests[0], timeout=30)  # anything lazy logs now
        before = server.log.stat().st_size
        start = time.monotonic()
        statuses = _raw_calls(server.port, n, [(b"x-custom", value)], requests[1])
        took = time.monotonic() - start
        with grpc.insecure_channel(server.target) as ch:
            ch.unary_unary(RETRIEVE)(requests[2], timeout=30)  # a well-formed call: served
        server.check_alive()
        grown = server.log.read_bytes()[before:].decode(errors="replace")
    lines = grown.splitlines()
    per_call = len(grown.encode()) / n
    print(f"\nlog growth: {len(lines)} lines, {per_call:.0f} bytes per hostile call "
          f"({n} calls in {took:.1f} s)")  # fmt: skip
    assert statuses == ["0"] * n, statuses  # answered: the value is read as Latin-1
    intervals = 1 + int(took // LOG_EVERY_SECONDS)
    said = f"{len(lines)} lines, {per_call:.0f} bytes a call: {grown[:400]!r}"
    assert len(lines) <= 2 * intervals and len(grown) <= 600 * intervals, said
    assert "Traceback" not in grown, said


# a client that connects, says the HTTP/2 preface and an empty SETTINGS, and then nothing
IDLE_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _connect_idle(port: int, n: int) -> list[socket.socket]:
    """`n` idle HTTP/2 connections, as a client pool that leaks them would leave."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(IDLE_PREFACE)
        socks.append(sock)
    return socks


def _sort(socks: list[socket.socket], timeout: float = 60.0) -> tuple[int, int]:
    """Wait until the server has either answered each connection (its SETTINGS: held) or
    closed it (refused); (held, refused). AssertionError when some got neither in time:
    connections left waiting, as a server out of descriptors leaves them."""
    held = refused = 0
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while sel.get_map() and time.monotonic() < end:
            for key, _ in sel.select(timeout=1.0):
                sock = key.fileobj
                try:
                    got = sock.recv(1 << 16)  # type: ignore[union-attr]
                except ConnectionResetError:
                    got = b""
                held, refused = held + bool(got), refused + (not got)
                sel.unregister(sock)
        waiting = len(sel.get_map())
    assert not waiting, f"{waiting} connections neither answered nor refused ({held} held)"
    return held, refused


def _health(target: str) -> str:
    """One Check over a new connection: SERVING, NOT_SERVING, or `CODE: details`."""
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.fixture
def many_files() -> Iterator[None]:
    """This test process may open a few thousand sockets (CI often starts at 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit ({hard}) is below 4,096")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_at_a_soft_limit_of_1024_leave_health_and_rollout_working(
    data: Path, tmp_path: Path, many_files: None
) -> None:
    """A server started with the open-files limit containers commonly get (soft 1,024; the
    hard limit 2,048 here), 1,100 idle connections against it (a leaking client pool):
    new connections are answered, health says SERVING and a newly published index swaps
    in — before, from about the 1,000th connection every new one timed out and the rollout
    could not open CURRENT. Past the connection cap new connections are closed at once
    (UNAVAILABLE, not a timeout) while the rollout still swaps, and once the idle ones go
    new connections are answered again."""
    root = tmp_path / "index"
    shutil.copytree(data / "index", root)
    env = {"GRACE_MAX_CONNECTION_AGE_SECONDS": "0"}  # no GOAWAY to the idle ones mid-test
    limits = functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, (1024, 2048))
    server = ServerProcess.start(data, tmp_path / "server.log", index_root=root, env=env,
                                 preexec_fn=limits)  # fmt: skip
    socks: list[socket.socket] = []

    def swapped_to(version: str) -> bool:
        return server.metric("grace_index_info", {"version": version}) == 1

    try:
        server.wait_serving()
        socks += _connect_idle(server.port, 1100)
        assert _health(server.target) == "SERVING"
        assert _sort(socks) == (1100, 0)
        assert server.metric("grace_grpc_connections") >= 1100
        cap = server.metric("grace_grpc_connections_max")
        assert server.metric("process_max_fds") == 2048 and cap == 2048 - FD_RESERVE
        assert "open files: soft limit 1024, now 2048 (hard 2048)" in server.log_text()
        version = build(data, root)  # published while they are held
        asyncio.run(until(lambda: swapped_to(version), f"index {version} swapped in"))

        more = _connect_idle(server.port, int(cap) - 1100 + 64)  # past the cap
        socks += more
        held, refused = _sort(more)
        assert refused >= 64 and 1100 + held <= cap, (held, refused)
        # closed at once — not `connection attempt timed out before receiving SETTINGS`
        refusal = _health(server.target)
        assert refusal.startswith("UNAVAILABLE") and "timed out" not in refusal, refusal
        version = build(data, root)  # the reserve: the rollout still opens its files
        asyncio.run(until(lambda: swapped_to(version), f"index {version} swapped in"))

        for sock in socks:
            sock.close()
        socks.clear()
        asyncio.run(until(lambda: _health(server.target) == "SERVING", "SERVING again"))
        with grpc.insecure_channel(server.target) as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            request = request_for_user(data / "world", 0, 20, retrieval_pb2.CD_GTM)
            assert stub.Retrieve(request, timeout=30).index_version == version
        server.check_alive()
    finally:
        for sock in socks:
            sock.close()
        server.stop()
