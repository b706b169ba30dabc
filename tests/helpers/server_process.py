"""A real `grace serve` process for tests and benchmarks: started on free localhost
ports, waited for until health says SERVING, its Prometheus text read, stopped with
SIGTERM (SIGKILL only if it will not stop). Its output goes to a log file."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0  # a cold start on a busy box: torch import, model, index
_RANDOM = random.SystemRandom()  # not the seeded global one: parallel test runs draw apart


def free_port() -> int:
    """One free localhost port."""
    return free_ports(1)[0]


def free_ports(*runs: int) -> list[int]:
    """The first port of each of `runs` runs of free localhost ports (run i spans
    `runs[i]` ports: workers take metrics_port + i), no two overlapping. Every port stays
    bound until all are chosen, so the kernel cannot hand the same one out twice (two
    `free_port()` calls in a row once gave a server the same port for gRPC and metrics).
    They are drawn below the kernel's ephemeral range: a port from it can be taken by any
    outgoing connection before the server binds it (a worker's metrics port once was, by
    the test's own scrapes, and the worker failed to start)."""
    held: list[socket.socket] = []

    def bind(port: int) -> bool:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            return False
        held.append(s)
        return True

    lo, hi = _below_ephemeral()
    try:
        bases: list[int] = []
        for n in runs:
            for _ in range(100):
                base = _RANDOM.randrange(lo, hi - n)
                if all(bind(base + i) for i in range(n)):
                    bases.append(base)
                    break
            else:
                raise RuntimeError(f"no run of {n} free ports")
        return bases
    finally:
        for s in held:
            s.close()


def _below_ephemeral() -> tuple[int, int]:
    """[lo, hi): the ports under the kernel's ephemeral range (Linux: from
    /proc/sys/net/ipv4/ip_local_port_range, 32768 by default), from 10000."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    return (10000, first) if first - 10000 >= 1000 else (first, 65536)


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of the samples of metric `name` in Prometheus text format whose labels include
    `labels` (any labels when None); None when there is no such sample."""
    total: float | None = None
    want = [f'{k}="{v}"' for k, v in (labels or {}).items()]
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            metric = line[: line.index("{")]
            have = line[line.index("{") + 1 : line.rindex("}")]
            rest = line[line.rindex("}") + 1 :].split()
        else:
            (metric, *rest), have = line.split(), ""
        if metric == name and rest and all(w in have for w in want):
            total = (total or 0.0) + float(rest[0])
    return total


@dataclass
class ServerProcess:
    """`python -m cli serve` in a subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path

    @classmethod
    def start(
        cls,
        data: Path,
        log: Path,
        *,
        device: str = "cpu",
        index_root: Path | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        preexec_fn: Callable[[], object] | None = None,
    ) -> ServerProcess:
        """Serve `data` (world, model, index as `make_serving_data` lays them out);
        `env`: extra GRACE_* settings; `args`: extra `grace serve` flags; `preexec_fn`:
        run in the child before it starts (e.g. its resource limits)."""
        port, metrics_port = free_ports(1, 1)
        cmd = [sys.executable, "-m", "cli", "serve", "--data-dir", str(data),
               "--port", str(port), "--metrics-port", str(metrics_port), "--device", device,
               "--no-progress", *args]  # fmt: skip
        if index_root is not None:
            cmd += ["--index-root", str(index_root)]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=os.environ | dict(env or {}), stdout=fh,
                stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
            )  # fmt: skip
        return cls(proc, port, metrics_port, log)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")
        return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")

    def wait_serving(self, timeout_s: float = START_TIMEOUT) -> None:
        end = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < end:
                self.check_alive()
                with contextlib.suppress(grpc.RpcError):
                    r = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        return metric_value(self.metrics_text(), name, labels) or 0.0

    def rss_mb(self) -> float:
        return round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1)

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Until nothing is queued or in flight; False if it is still busy at the end."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.check_alive()
            text = self.metrics_text()
            busy = (metric_value(text, "grace_inflight_requests") or 0) + (
                metric_value(text, "grace_queue_depth") or 0
            )
            if busy == 0:
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout_s`); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def serving(data: Path, log: Path, **kw: object) -> Iterator[ServerProcess]:
    """A SERVING `ServerProcess` (arguments as `ServerProcess.start`), stopped on exit."""
    server = ServerProcess.start(data, log, **kw)  # type: ignore[arg-type]
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()
