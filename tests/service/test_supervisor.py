"""`grace serve --workers 2` keeps serving when a worker dies or freezes: the supervisor
(service/supervisor.py) restarts it while the other answers, health stays honest, the
restart is counted; and it gives up, exit 1, only when restarts keep failing.

Run with `-s` to read the figures docs/RELIABILITY.md quotes ("detected in ..., serving
again ..., calls lost ...")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import free_ports
from tests.helpers.serving import make_serving_data
from tests.service.test_workers import counter, scrape, serving

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 2.0  # worker_heartbeat_seconds here: the default 5 s only makes the test longer
START_SECONDS = 240  # two CPU workers' start on a busy 2-core machine, with room


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("supervised"))


class Server:
    """`grace serve --workers 2` in a process of its own, its log in a file."""

    def __init__(self, data: Path, tmp_path: Path, balance: str, **env_extra: str) -> None:
        self.port, self.metrics = free_ports(1, 2)
        self.log_path = tmp_path / "serve.log"
        self._err = self.log_path.open("a")
        env = os.environ | {"GRACE_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT)} | env_extra
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--data-dir", str(data), "--port",
             str(self.port), "--metrics-port", str(self.metrics), "--device", "cpu",
             "--no-progress", "--workers", "2", "--balance", balance],
            cwd=ROOT, stderr=self._err, env=env,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, holds: Callable[[], object], what: str,
                 seconds: float = START_SECONDS) -> float:  # fmt: skip
        """The monotonic time `holds()` first held; fails with the log if the server exits
        or `seconds` pass first."""
        deadline = time.monotonic() + seconds
        while not holds():
            tail = self.log()[-4000:]
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {what}: {tail}"
            assert time.monotonic() < deadline, f"no {what} in {seconds:.0f} s: {tail}"
            time.sleep(0.05)
        return time.monotonic()

    def both_serving(self) -> bool:
        texts = [scrape(self.metrics + i) for i in range(2)]
        return all(t and counter(t, "grace_serving ") == 1 for t in texts) and serving(self.port)

    def pids(self) -> list[int]:
        found = re.search(r"started 2 workers.*pids \[(\d+), (\d+)\]", self.log())
        assert found is not None, self.log()[-2000:]
        return [int(found.group(1)), int(found.group(2))]

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._err.close()
        return self.proc.returncode


class Calls(threading.Thread):
    """Retrieve calls, one after another, each on a connection of its own (so SO_REUSEPORT
    spreads them over the workers): when each ended and whether it was answered."""

    def __init__(self, port: int, data: Path, timeout: float) -> None:
        super().__init__(daemon=True)
        self.port, self.timeout = port, timeout
        self.request = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        self.done: list[tuple[float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        local = [("grpc.use_local_subchannel_pool", 1)]
        while not self.stop.is_set():
            with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=local) as ch:
                try:
                    reply = retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(
                        self.request, timeout=self.timeout
                    )
                    ok = len(reply.ads) > 0
                except grpc.RpcError:
                    ok = False
            self.done.append((time.monotonic(), ok))

    def between(self, t0: float, t1: float) -> tuple[int, int]:
        """(answered, lost) among the calls that ended in [t0, t1]."""
        window = [ok for t, ok in self.done if t0 <= t <= t1]
        return sum(window), len(window) - sum(window)


@pytest.mark.parametrize(
    ("sig", "balance"),
    [
        pytest.param(signal.SIGKILL, "connection", id="killed"),
        pytest.param(signal.SIGSTOP, "connection", id="frozen"),
        pytest.param(signal.SIGSTOP, "request", id="frozen-behind-the-front"),
    ],
)
def test_a_lost_worker_is_restarted_while_the_other_serves(
    data: Path, tmp_path: Path, sig: signal.Signals, balance: str
) -> None:
    server = Server(data, tmp_path, balance)
    try:
        server.wait_for(server.both_serving, "two workers serving")
        lost_pid = server.pids()[0]
        # behind the front a call the frozen worker held is sent again once it is killed:
        # a deadline longer than the heartbeat lets it be answered by the other
        calls = Calls(server.port, data, timeout=3 * HEARTBEAT)
        calls.start()
        server.wait_for(lambda: sum(ok for _, ok in calls.done) >= 5, "answers before")
        t_signal = time.monotonic()
        os.kill(lost_pid, sig)
        seen = "killed for its silence" if sig == signal.SIGSTOP else "exited with SIGKILL"
        t_seen = server.wait_for(lambda: seen in server.log(), f"'{seen}'", 60)
        # the lost worker is gone and not yet back: every fresh connection is answered
        # (the front's health, or the live worker's)
        assert all(serving(server.port) for _ in range(5)), server.log()[-3000:]
        t_back = server.wait_for(
            lambda: "worker 0 serving again" in server.log(), "the restarted worker serving"
        )
        server.wait_for(lambda: calls.done and calls.done[-1][0] > t_back + 1, "calls after")
        calls.stop.set()
        calls.join(30)
        answered, lost = calls.between(t_signal, t_back)
        print(f"{sig.name} ({balance}): detected in {t_seen - t_signal:.1f} s, serving again "
              f"{t_back - t_seen:.1f} s later, calls lost {lost} of {answered + lost}")  # fmt: skip
        assert answered > 0  # the other worker answered all along
        if balance == "request":
            assert lost == 0  # sent again to the live worker within its deadline
        answered_after, lost_after = calls.between(t_back + 1, time.monotonic())
        assert answered_after > 0 and lost_after == 0
        # the restart is counted, by the restarted worker itself; both serve again
        text = scrape(server.metrics) or ""
        assert counter(text, "grace_worker_restarts_total", 'worker="0"') == 1, text[-2000:]
        server.wait_for(
            lambda: counter(scrape(server.metrics + 1) or "", "grace_workers_serving ") == 2,
            "both workers counted serving",
            30,
        )
        assert not _alive(lost_pid)
    finally:
        code = server.close()
    assert code == 0, server.log()[-3000:]
    assert "restarts [1, 0]" in server.log()


def test_restarts_that_keep_failing_stop_the_server(data: Path, tmp_path: Path) -> None:
    """Once served, a worker whose restarts cannot start (its model is gone) is tried with
    a backoff, then the supervisor stops the other and exits 1."""
    root = tmp_path / "data"
    shutil.copytree(data, root, ignore=shutil.ignore_patterns("world"))
    (root / "world").symlink_to(data / "world")
    server = Server(root, tmp_path, "connection")
    try:
        server.wait_for(server.both_serving, "two workers serving")
        shutil.rmtree(root / "model")  # the serving workers hold theirs; a new one has none
        os.kill(server.pids()[0], signal.SIGKILL)
        server.proc.wait(timeout=START_SECONDS)
    finally:
        code = server.close()
    log = server.log()
    assert code == 1, log[-3000:]
    assert "restarts in a row failed to serve" in log
    assert log.count("restarting it in") == 4, log[-3000:]  # backoffs 1, 2, 4, 8 s


def test_a_worker_frozen_when_the_server_stops_is_killed_after_its_drain(
    data: Path, tmp_path: Path
) -> None:
    """SIGTERM while a worker is stopped: its own drain limit cannot act, so the supervisor
    kills it once drain_seconds + STOP_SLACK_SECONDS have passed, and exits (1: a worker
    did not stop cleanly) instead of waiting for the orchestrator's SIGKILL."""
    from service.supervisor import STOP_SLACK_SECONDS

    server = Server(data, tmp_path, "connection", GRACE_DRAIN_SECONDS="1")
    try:
        server.wait_for(server.both_serving, "two workers serving")
        pids = server.pids()
        os.kill(pids[0], signal.SIGSTOP)
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)  # before the heartbeat could see the freeze
        code = server.proc.wait(timeout=120)
        took = time.monotonic() - t
    finally:
        server.close()
    log = server.log()
    assert code == 1 and "worker 0" in log and "did not stop after its drain" in log, log[-3000:]
    assert took >= 1 + STOP_SLACK_SECONDS - 1  # the drain's own limits came first
    assert not _alive(pids[0]) and not _alive(pids[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
