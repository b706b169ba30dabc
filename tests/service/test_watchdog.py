"""The stall watchdog (service/watchdog.py): a pipeline with batches in flight that stops
finishing stages is a wedged process — it writes every thread's stack and exits 3 (a
real process); a wedge that also stops the watchdog's own thread is caught by the timer
in C; a server whose pipeline stalls past `stall_seconds` calls it, one that keeps
working never does."""

from __future__ import annotations

import asyncio
import faulthandler
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

import service.app
from cli.query import request_for_user
from service.app import start
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.watchdog import EXIT_WEDGED, Watchdog
from tests.helpers.serving import make_serving_data, serving_settings

REPO = Path(__file__).resolve().parents[2]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_the_watchdog_fires_once_at_the_limit_and_rearms_the_backstop_until_then() -> None:
    readings = iter([0.0, 0.0, 0.5, 1.0, 1.6, 2.1, 9.0])
    fired, armed = [], []
    dog = Watchdog(lambda: next(readings), 2.0, tick_s=0.001, on_stall=fired.append,
                   arm=armed.append, disarm=lambda: armed.append("off"))  # fmt: skip
    dog.start()
    wait_for(lambda: dog.fired, "the watchdog to fire")
    dog.stop()
    assert fired == [2.1]  # once, at the first reading past the limit
    # each tick re-arms the C timer for the time left plus four ticks; then it is disarmed
    want = [2.004, 2.004, 1.504, 1.004, 0.404]
    assert [round(a, 3) for a in armed[:5]] == want and armed[5:] == ["off", "off"]


def test_a_working_pipeline_never_fires() -> None:
    fired = []
    dog = Watchdog(lambda: 0.0, 0.05, tick_s=0.001, on_stall=fired.append,
                   arm=lambda s: None, disarm=lambda: None)  # fmt: skip
    dog.start()
    ticks = 0
    while ticks < 200:  # many ticks, counted, not timed
        time.sleep(0.001)
        ticks += 1
    dog.stop()
    assert fired == [] and not dog.fired
    with pytest.raises(ValueError, match="limit_s"):
        Watchdog(lambda: 0.0, 0)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, check=False)  # fmt: skip


def test_a_wedged_process_writes_every_threads_stack_and_exits_3() -> None:
    done = _run("""
        import logging, threading
        from service.watchdog import Watchdog
        logging.basicConfig()
        gate = threading.Event()
        threading.Thread(target=gate.wait, name="grace-compute", daemon=True).start()
        dog = Watchdog(lambda: 99.0, 1.0, tick_s=0.01)
        dog.start()
        gate.wait(60)
    """)
    assert done.returncode == EXIT_WEDGED, done.stderr
    assert "pipeline wedged: no stage finished for 99 s" in done.stderr
    assert done.stderr.count("hread 0x") >= 3  # main, the stuck one, the watchdog (current)
    assert "in wait" in done.stderr  # where the stuck thread waits


def test_a_wedge_that_stops_the_watchdog_thread_is_caught_by_the_timer_in_c() -> None:
    """The first reading arms the timer; the second never returns (as a thread that
    cannot get the GIL back would not): the timer writes the stacks and exits 1."""
    done = _run("""
        import threading
        from service.watchdog import Watchdog
        forever, calls = threading.Event(), []
        def stalled_for():
            calls.append(1)
            if len(calls) > 1:
                forever.wait()  # never returns
            return 0.0
        dog = Watchdog(stalled_for, 0.5, tick_s=0.05)
        dog.start()
        forever.wait(60)
    """)
    assert done.returncode == 1, done.stderr
    assert "Timeout (0:00:00" in done.stderr and "Thread 0x" in done.stderr


@pytest.mark.slow
def test_a_server_whose_pipeline_stalls_past_stall_seconds_is_declared_wedged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_serving_data(tmp_path)
    stall = 5.0  # far beyond any stage of a working pipeline, even on a busy machine
    declared: list[float] = []
    monkeypatch.setattr(service.app, "wedged", declared.append)  # instead of exiting pytest
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *a, **k: None)

    async def main() -> None:
        app = await start(serving_settings(data, stall_seconds=stall))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                request = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
                for _ in range(5):  # a working pipeline: answered, never declared
                    await stub.Retrieve(request, timeout=30)
                assert declared == []
                model = app.servicer.serving.current.model
                gate, encoder = threading.Event(), model.encoder
                model.encoder = lambda embedded: (gate.wait(60), encoder(embedded))[1]
                call = stub.Retrieve(request, timeout=60)
                await asyncio.to_thread(wait_for, lambda: declared, "the stall declared")
                assert declared[0] >= stall and app.pipeline.stalled_for() >= stall
                gate.set()  # (a real wedge would have exited here)
                await call
        finally:
            await app.drain()

    asyncio.run(main())
    assert len(declared) == 1
