"""`grace serve --workers 2`: two full servers on one port (SO_REUSEPORT), each opening it
only once SERVING, each with its own metrics port; SIGTERM drains both and exits 0."""

from __future__ import annotations

import asyncio
import http.client
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.query import request_for_user
from service.mps import CONTROL
from service.placement import Slot
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings
from service.workers import worker_settings
from tests.helpers.server_process import free_port, free_ports
from tests.helpers.serving import make_serving_data
from tests.helpers.signals import signal_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("workers"))


def scrape(port: int) -> str | None:
    """The metrics text on `port`, None while nothing answers it as HTTP (not up yet, or
    a start-up race: a CI run once read its own request line back as the status line)."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    except (OSError, http.client.HTTPException):
        return None


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def counter(text: str, name: str, must: str = "") -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and must in line
    )


def test_worker_settings_are_single_servers_with_their_own_metrics_port() -> None:
    s = load_settings({"workers": 3, "port": 50051, "metrics_port": 9464})
    cpu = [Slot(i, None, None) for i in range(3)]
    assert [worker_settings(s, w).metrics_port for w in cpu] == [9464, 9465, 9466]
    assert {worker_settings(s, w).workers for w in cpu} == {1}
    free = load_settings({"workers": 2, "metrics_port": 0})
    assert worker_settings(free, cpu[1]).metrics_port == 0
    with pytest.raises(ValueError, match="fixed port"):
        load_settings({"workers": 2, "port": 0})
    with pytest.raises(ValueError, match="workers"):
        load_settings({"workers": 0})


GPU_MPS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs {CONTROL}"),
]


@pytest.mark.parametrize(
    ("device", "balance", "mps"),
    [
        pytest.param("cpu", "connection", False, id="cpu-connection"),
        pytest.param("cpu", "request", False, id="cpu-request"),
        pytest.param("cuda", "connection", True, id="cuda-connection-mps", marks=GPU_MPS),
        pytest.param("cuda", "request", True, id="cuda-request-mps", marks=GPU_MPS),
    ],
)
def test_two_workers_share_the_port_and_drain_on_sigterm(
    data: Path, tmp_path: Path, device: str, balance: str, mps: bool
) -> None:
    """'connection': 24 connections land on both workers (SO_REUSEPORT). 'request': 24
    calls on ONE connection, one after another, are split evenly by the front
    (service/balancer.py: least in flight, then in turn; concurrent calls would split by
    which worker answers first, a busy machine's doing). On a GPU with `--mps` the
    workers run through a private MPS daemon, quit at the end."""
    port, metrics = free_ports(1, 2)
    # stderr to a file (appended to: the processes share it), read while it runs: the
    # stack dumps are waited for, and a pipe nobody drains could fill
    log_path = tmp_path / "serve.log"
    err = log_path.open("a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--data-dir", str(data), "--port",
         str(port), "--metrics-port", str(metrics), "--device", device, "--no-progress",
         "--workers", "2", "--balance", balance, *(["--mps"] if mps else [])],
        cwd=ROOT, stderr=err, text=True,
    )  # fmt: skip
    try:
        # each worker warms up (its first batch; on a GPU after capturing its CUDA graphs),
        # says SERVING and opens the port — both must have, or one worker could take every
        # connection (a busy machine showed it: [24.0, 0])
        deadline = time.monotonic() + (180 if device == "cpu" else 600)
        while time.monotonic() < deadline:
            texts = [scrape(metrics + i) for i in range(2)]
            if all(t and counter(t, "grace_serving ") == 1 for t in texts):
                break
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        while not serving(port):  # behind the front: its own port opens after the workers'
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

        async def many_connections() -> list:
            req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)

            async def one(shared: grpc.aio.Channel | None) -> retrieval_pb2.RetrieveResponse:
                if shared is not None:
                    return await retrieval_pb2_grpc.AdRetrievalStub(shared).Retrieve(
                        req, timeout=30
                    )
                # its own TCP connection: channels to one target share one by default
                local = [("grpc.use_local_subchannel_pool", 1)]
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=local) as ch:
                    return await retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(req, timeout=30)

            if balance == "connection":
                return await asyncio.gather(*(one(None) for _ in range(24)))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return [await one(ch) for _ in range(24)]

        for i, text in enumerate(scrape(metrics + n) or "" for n in range(2)):
            info = re.search(r"^grace_worker_info\{(.*)\} 1\.0$", text, re.M)
            assert info is not None, text[-500:]
            gpu = "cpu" if device == "cpu" else "0"  # one GPU: both workers on GPU 0
            assert sorted(info.group(1).split(",")) == [f'gpu="{gpu}"', f'worker="{i}"']

        replies = asyncio.run(many_connections())
        assert all(len(r.ads) > 0 for r in replies)
        handled = [
            counter(scrape(metrics + i) or "", "grpc_server_handled_total", "Retrieve")
            for i in range(2)
        ]
        assert sum(handled) == 24 and min(handled) > 0, handled  # both workers answered
        if balance == "request":
            assert abs(handled[0] - handled[1]) <= 2, handled  # one connection, split evenly
        pids = [int(n) for n in re.findall(r"\d+", re.search(
            r"started 2 workers.*pids \[(.*)\]", log_path.read_text()).group(1))]  # fmt: skip
        before = "; ".join(signal_state(pid) for pid in pids)
        print("before SIGUSR1:", before)  # shown by `pytest -rA` when it passes
        proc.send_signal(signal.SIGUSR1)  # to the supervisor: every worker dumps its stacks
        assert all(len(r.ads) > 0 for r in asyncio.run(many_connections()))  # and serves on
        # both dumps are in before SIGTERM, waited for rather than assumed: a missing one
        # fails here, with the log, not after the stop — and well inside pytest's own
        # timeout, which would fail it without the log (a dump takes milliseconds: the
        # bound only catches a worker that never writes one)
        dumps_by = time.monotonic() + 60
        forwarded = re.compile(r"SIGUSR1: stack dumps asked of workers \[\d+, \d+\]")
        while (text := log_path.read_text()).count("<module>") < 2 or not forwarded.search(text):
            assert time.monotonic() < dumps_by and proc.poll() is None, (
                f"{text.count('<module>')} of 2 stack dumps after SIGUSR1, the supervisor's "
                f"forward {'logged' if forwarded.search(text) else 'not logged'}; before it: "
                f"{before}; now: {'; '.join(signal_state(pid) for pid in pids)}: " + text[-6000:]
            )
            time.sleep(0.2)
        print("after SIGUSR1:", "; ".join(signal_state(pid) for pid in pids))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    log = log_path.read_text()
    assert "started 2 workers" in log and log.count("stopped") >= 2
    # one dump per worker (SIGUSR1 forwarded): each dump holds one main thread, whose stack
    # ends in the spawned interpreter's <module>. Not "Current thread": the kernel hands the
    # signal to any thread, and a CUDA driver thread has no Python frame to call current.
    # The two dumps share one file and interleave write by write (a busy machine showed
    # it); faulthandler writes each frame's name in one write, so "<module>" stays whole.
    assert log.count("<module>") == 2, log[-3000:]
    assert log.count('File "') > 10  # the stacks of both workers' threads
    assert all(scrape(metrics + i) is None for i in range(2))  # both processes are gone
    if balance == "request":
        sockets = re.findall(r"on unix:(\S+)/worker-0\.sock", log)
        assert sockets and not Path(sockets[0]).exists()  # the private sockets are removed
        assert "front stopped" in log
    if mps:
        assert "MPS control daemon started" in log and "MPS control daemon stopped" in log


def test_a_worker_that_exits_stops_the_others_and_the_supervisor_fails(tmp_path: Path) -> None:
    """Workers that cannot start (no model here) exit non-zero: supervise returns 1."""
    from service.workers import supervise

    s = load_settings(
        {"workers": 2, "port": free_port(), "metrics_port": 0, "data_dir": tmp_path,
         "device": "cpu"}
    )  # fmt: skip
    t = time.monotonic()
    assert supervise(s) == 1
    assert time.monotonic() - t < 240  # only a hang (seconds here, ~15 s on a busy box)


def test_the_grpc_port_may_not_be_a_workers_metrics_port() -> None:
    with pytest.raises(ValueError, match="metrics ports"):
        load_settings({"workers": 2, "port": 9465, "metrics_port": 9464})


def test_a_front_that_cannot_take_the_port_stops_the_workers(data: Path) -> None:
    """`balance = "request"` with the public port already taken (no SO_REUSEPORT sharing
    for the front): the workers come up, the front fails to bind, everything stops, exit 1."""
    from service.workers import supervise

    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        s = load_settings(
            {"workers": 2, "port": blocker.getsockname()[1], "metrics_port": 0,
             "data_dir": data, "device": "cpu", "balance": "request", "drain_seconds": 1}
        )  # fmt: skip
        t = time.monotonic()
        assert supervise(s) == 1
        # only a hang: two workers' start-up took ~30 s on a busy 2-core box
        assert time.monotonic() - t < 240


def test_a_warm_worker_opens_the_port_only_past_the_gate(data: Path) -> None:
    """`gate` (the supervisor's barrier): a worker that is warm waits there, not yet
    listening, until every worker of the host is; then it opens the port, SERVING."""
    from service.app import start
    from tests.helpers.serving import serving_settings

    entered, release = threading.Event(), threading.Event()

    def gate() -> None:
        entered.set()
        assert release.wait(120)

    port = free_port()

    async def run() -> None:
        starting = asyncio.ensure_future(
            start(serving_settings(data, port=port), bind_when_ready=True, gate=gate)
        )
        assert await asyncio.to_thread(entered.wait, 300)  # warm: at the gate
        assert not await asyncio.to_thread(serving, port)  # nothing listens on the port yet
        assert not starting.done()
        release.set()
        app = await starting
        assert app.port == port and await asyncio.to_thread(serving, port)
        await app.drain()

    asyncio.run(run())


def test_a_broken_gate_stops_the_start_in_one_line(data: Path) -> None:
    """Another worker failed (the supervisor aborts the barrier): this one never serves,
    stops its threads and says why."""
    from service.app import start
    from service.errors import StartupError
    from tests.helpers.serving import serving_settings

    def ours() -> set[threading.Thread]:  # pipeline stages, rollout, watchdog, ...
        return {t for t in threading.enumerate() if t.name.startswith("grace-") and t.is_alive()}

    before = ours()  # other tests' servers may still be about
    broken = threading.Barrier(2)
    broken.abort()
    with pytest.raises(
        StartupError, match="another worker of this host failed to start, or took too long"
    ):
        asyncio.run(start(serving_settings(data), bind_when_ready=True, gate=broken.wait))
    assert ours() <= before  # its threads are stopped
