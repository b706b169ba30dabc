"""The server's optional request log: every valid Retrieve as one line of protobuf JSON,
written off the event loop, dropped (and counted) rather than waited for when full."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from service import request_log
from service.app import start
from service.request_log import RequestLog, read_requests, write_requests
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings
from tests.helpers.serving import make_serving_data, serving_settings
from tests.helpers.tmpfs import PAGE, fill, small_tmpfs
from tests.helpers.waiting import until


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("request_log"), seed=3)


def test_server_logs_each_valid_request_exactly_as_received(data: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "requests.jsonl"  # the directory is created
    sent = [request_for_user(data / "world", u, 20, retrieval_pb2.CD_GTM) for u in range(6)]
    for i, r in enumerate(sent):
        r.request_id = f"r{i}"
    bad = retrieval_pb2.RetrieveRequest()
    bad.CopyFrom(sent[0])
    bad.targeting.gender = "robot"

    async def main() -> None:
        app = await start(serving_settings(data, request_log=log_path))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            for r in sent[:3]:
                await stub.Retrieve(r)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Retrieve(bad)  # INVALID_ARGUMENT: not logged
            for r in sent[3:]:
                await stub.Retrieve(r)
        await app.drain()  # closes the log: everything queued is on disk
        assert app.servicer.request_log.dropped == 0

    asyncio.run(main())
    assert list(read_requests(log_path)) == sent
    assert len(log_path.read_text().splitlines()) == len(sent)


def test_no_log_unless_configured(data: Path) -> None:
    async def main() -> None:
        app = await start(serving_settings(data))
        assert app.servicer.request_log is None
        await app.drain()

    asyncio.run(main())


def test_request_log_setting_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GRACE_REQUEST_LOG", str(tmp_path / "r.jsonl"))
    assert load_settings().request_log == tmp_path / "r.jsonl"


def test_full_queue_drops_and_counts_instead_of_blocking(monkeypatch, tmp_path: Path) -> None:
    taken, release = threading.Event(), threading.Event()
    serialise = request_log.to_json_line

    def slow_writer(request):  # the writer thread stalls on its first request
        taken.set()
        release.wait(60)
        return serialise(request)

    monkeypatch.setattr(request_log, "to_json_line", slow_writer)
    log = RequestLog(tmp_path / "r.jsonl", capacity=4)
    requests = [retrieval_pb2.RetrieveRequest(request_id=f"r{i}") for i in range(11)]
    log.append(requests[0])
    assert taken.wait(60)
    t0 = time.perf_counter()
    for r in requests[1:] + requests[-1:] * 1000:
        log.append(r)  # 4 fit in the queue, 1006 are dropped
    # microseconds each; a wait for the stalled writer (until release, 60 s), even 10 ms
    # per drop, would show; a busy machine's stall would not
    assert time.perf_counter() - t0 < 10.0  # never waited for the stalled writer
    assert (log.overflowed, log.dropped) == (1006, 1006)
    release.set()
    log.close()
    assert [r.request_id for r in read_requests(tmp_path / "r.jsonl")] == [
        f"r{i}" for i in range(5)
    ]
    assert log.written == 5


def test_log_appends_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    for i in range(2):
        log = RequestLog(path)
        log.append(retrieval_pb2.RetrieveRequest(request_id=f"run{i}"))
        log.close()
    assert [r.request_id for r in read_requests(path)] == ["run0", "run1"]


def test_replay_format_round_trip_and_bad_line_named(tmp_path: Path) -> None:
    req = retrieval_pb2.RetrieveRequest(
        request_id="a\nb",  # a newline inside a field stays inside its line
        user=retrieval_pb2.User(user_id=2**62, history=[retrieval_pb2.Event(ad_id=7, type=1)]),
        targeting=retrieval_pb2.Targeting(country="US", age=30, locations=["US/CA", "é"]),
        options=retrieval_pb2.Options(max_ads=5, beam_widths=[1, 4, 8, 8]),
    )
    path = tmp_path / "r.jsonl"
    assert write_requests(path, [req, req]) == 2
    assert path.read_text(encoding="utf-8").count("\n") == 2
    assert list(read_requests(path)) == [req, req]
    path.write_text(path.read_text() + "\n" + '{"user": {"userId": "x"}}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:4: not a RetrieveRequest"):
        list(read_requests(path))


def test_a_full_file_rotates_into_numbered_backups_of_whole_lines(tmp_path: Path) -> None:
    """Past `max_bytes` the file moves to `.1` (older ones up, the oldest dropped) and a new
    one begins: every file holds whole, parseable lines, none over the limit by more than
    one line, and the newest requests are all kept."""
    path = tmp_path / "requests.jsonl"
    requests = []
    for i in range(60):
        r = retrieval_pb2.RetrieveRequest(request_id=f"r{i:03d}")
        r.user.user_id = 1000 + i  # every line the same length
        requests.append(r)
    line = len(request_log.to_json_line(requests[0])) + 1
    rlog = RequestLog(path, max_bytes=10 * line, backups=2, interval=0.001)
    for r in requests:
        rlog.append(r)
    rlog.close()
    files = [path.with_name(f"{path.name}.{i}") for i in (2, 1)] + [path]  # oldest first
    assert all(f.exists() for f in files) and not path.with_name(f"{path.name}.3").exists()
    kept = [r.request_id for f in files for r in read_requests(f)]
    assert kept == [r.request_id for r in requests][-len(kept) :]  # the newest, in order
    assert all(f.stat().st_size < 11 * line for f in files)
    assert rlog.written == 60 and rlog.rotations == 60 // 10 and rlog.dropped == 0
    with pytest.raises(ValueError, match="backups"):
        RequestLog(tmp_path / "x.jsonl", backups=0)


def test_the_server_exports_the_request_logs_counts(data: Path, tmp_path: Path) -> None:
    async def main() -> None:
        app = await start(serving_settings(data, request_log=tmp_path / "requests.jsonl"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            for u in range(3):
                await stub.Retrieve(request_for_user(data / "world", u, 5, retrieval_pb2.CD_GTM))
        get = app.metrics.registry.get_sample_value
        end = time.monotonic() + 60  # the writer wakes every 0.1 s: wait for it, not a time
        while get("grace_request_log_lines_total") != 3 and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert get("grace_request_log_lines_total") == 3
        assert get("grace_request_log_dropped_total") == 0
        assert get("grace_request_log_rotations_total") == 0
        await app.drain()

    asyncio.run(main())


def test_a_full_disk_is_reported_once_counted_and_serving_goes_on(
    data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose request log lies on a full filesystem (a real tmpfs) answers every
    call; the log says "no space left on device" once (per 10 s: here the test's whole
    span), naming the file, and counts each request it lost; with a page free again the
    lines that fit are written and the one cut short is cut back: whole lines only."""
    monkeypatch.setattr(request_log, "_DROP_REPORT_SECONDS", 3600.0)  # a slow machine's span
    caplog.set_level("WARNING", logger="grace.request_log")
    sent = [request_for_user(data / "world", u, 5, retrieval_pb2.CD_GTM) for u in range(40)]
    for i, r in enumerate(sent):
        r.request_id = f"r{i}"

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]

    with small_tmpfs(tmp_path / "fs", 1 << 20) as fs:
        path = fs / "requests.jsonl"

        async def main() -> None:
            app = await start(serving_settings(data, request_log=path))
            rlog = app.servicer.request_log
            filler = fill(fs, 0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                for r in sent[:10]:
                    await stub.Retrieve(r)  # OK, or it raises
                await until(lambda: rlog.write_errors == 10, "10 lost requests counted")
                [line] = errors()
                assert f"{path}: no space left on device" in line, line
                filler.unlink()
                fill(fs, PAGE)  # room for a few lines, then full again
                for r in sent[10:]:
                    await stub.Retrieve(r)
                await until(lambda: rlog.written + rlog.write_errors == 40, "40 requests seen")
            get = app.metrics.registry.get_sample_value
            assert get("grace_request_log_dropped_total") == rlog.write_errors > 10
            assert 0 < rlog.written < 30 and len(errors()) == 1
            await app.drain()
            kept = [int(r.request_id[1:]) for r in read_requests(path)]  # every line parses
            assert len(kept) == rlog.written and kept == sorted(kept) and kept[0] >= 10
            assert path.read_bytes().endswith(b"\n")

        asyncio.run(main())
