"""The overload generator (loadtest/overload.py) against small in-process fake gRPC servers,
and the pieces of bench/bench_overload.py that need no real server: every arrival gets
exactly one outcome, a stalled server still receives the offered arrivals (open loop)
and they end as DEADLINE_EXCEEDED, goodput counts only OKs within the deadline,
refusals are counted with their latency, a stalled event loop shows as generator lag,
closed-loop capacity cannot beat the server, spawned processes merge; the SVG writer
gives well-formed XML with one polyline per series; the re-publisher writes valid
versions. Bounds are ratios and physical limits, never speeds (a busy 2-core CI box)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.bench_overload import markdown_table, republisher
from bench.svg_plot import Series, line_chart, nice_ticks
from contracts.index_format import read_index_dir
from index_builder.publish import current_path, current_version, list_versions, publish
from loadtest.overload import main
from loadtest.overload_results import OK, Samples, summarise
from loadtest.overload_runner import run_open_loop
from loadtest.overload_sender import probe_capacity
from tests.helpers.indexes import small_index, writer
from tests.helpers.server_process import metric_value

Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]
REQUESTS = [b"\x0a\x03abc", b"\x0a\x03def"]  # opaque bytes: the fakes never parse them
SVG = "{http://www.w3.org/2000/svg}"


@contextlib.asynccontextmanager
async def fake_server(handler: Handler) -> AsyncIterator[str]:
    """A grpc.aio server answering /grace.v1.AdRetrieval/Retrieve with `handler` (raw bytes)."""
    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(handler)  # no (de)serialisers: bytes
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("grace.v1.AdRetrieval", {"Retrieve": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def answer_after(delay: float, reply: bytes = b"r" * 32) -> Handler:
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(delay)
        return reply

    return handle


async def never_answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(3600)  # the client's deadline ends it
    return b""


def refuse_above(limit: int, delay: float) -> Handler:
    inflight = 0

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal inflight
        if inflight >= limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        inflight += 1
        try:
            await asyncio.sleep(delay)
            return b"ok"
        finally:
            inflight -= 1

    return handle


def test_every_arrival_has_one_outcome_and_in_deadline_oks_are_goodput() -> None:
    async def main_() -> tuple:
        async with fake_server(answer_after(0.005)) as target:
            return await run_open_loop(target, REQUESTS, rate=200, seconds=0.5, deadline_s=5.0,
                                       channels=3, seed=1)  # fmt: skip

    r = asyncio.run(main_())
    assert r.arrivals == 100  # uniform arrivals: exactly rate x seconds
    assert sum(o.count for o in r.outcomes.values()) == r.arrivals
    assert r.count(OK) == r.arrivals and r.ok_in_deadline == r.arrivals
    assert r.goodput_rps == pytest.approx(r.arrivals / r.seconds)
    assert r.steady_arrivals == pytest.approx(0.8 * r.arrivals, abs=2)
    assert r.ok_p50_ms is not None and r.ok_p50_ms >= 5.0  # the server's sleep is a floor
    assert r.mean_reply_bytes == 32 and r.refusal_p99_ms is None
    assert r.to_dict()["outcomes"]["OK"]["count"] == r.arrivals


@pytest.mark.parametrize("poisson", [False, True])
def test_a_stalled_server_still_gets_the_offered_arrivals_and_deadlines_fire(
    poisson: bool,
) -> None:
    async def main_() -> tuple:
        async with fake_server(never_answer) as target:
            t = time.perf_counter()
            r = await run_open_loop(target, REQUESTS, rate=100, seconds=0.5, deadline_s=1.0,
                                    poisson=poisson, seed=3)  # fmt: skip
            return r, time.perf_counter() - t

    r, wall = asyncio.run(main_())
    if poisson:
        assert 20 <= r.arrivals <= 80  # mean 50, sd 7
    else:
        assert r.arrivals == 50  # open loop: not slowed by calls that never answer
    assert r.count("DEADLINE_EXCEEDED") == r.arrivals
    assert r.goodput_rps == 0 and r.steady_goodput_rps == 0 and r.ok_in_deadline == 0
    assert r.outcomes["DEADLINE_EXCEEDED"].p50_ms >= 950  # ended by the 1 s deadline
    assert wall < 0.5 + 1.0 + 20  # not 50 calls one after another (50 s)


def test_goodput_counts_only_oks_within_the_deadline() -> None:
    """Calls may wait longer (timeout_s) than the deadline that counts as useful: OKs that
    come back late are answered but are not goodput."""

    async def main_() -> tuple:
        async with fake_server(answer_after(0.15)) as target:
            return await run_open_loop(target, REQUESTS, rate=40, seconds=0.5, deadline_s=0.05,
                                       timeout_s=5.0)  # fmt: skip

    r = asyncio.run(main_())
    assert r.arrivals == 20 and r.count(OK) == 20
    assert r.ok_in_deadline == 0 and r.goodput_rps == 0
    assert r.timeout_s == 5.0 and r.deadline_s == 0.05


def test_summarise_goodput_window_refusals_and_lag_flag() -> None:
    s = Samples(offered_seconds=10.0)
    for k in range(20):  # one arrival every 0.5 s
        due = 0.5 * k
        if k % 4 == 0:
            s.add(due, 0.001, 0.002, "RESOURCE_EXHAUSTED")
        elif k % 4 == 1:
            s.add(due, 0.001, 1.5, OK)  # OK but past the 1 s deadline
        else:
            s.add(due, 0.001, 0.1, OK)
    s.lag[-1] = 0.5  # one arrival went out 500 ms late
    s.add(9.9, 0.0, 0.5, OK)  # in the deadline, but completed after the run (10.4 s)
    r = summarise(s, target="t", rate=2.0, deadline_s=1.0, warmup=0.2)
    assert r.arrivals == 21 and r.count(OK) == 16 and r.count("RESOURCE_EXHAUSTED") == 5
    assert r.ok_in_deadline == 11
    assert r.goodput_rps == pytest.approx(11 / 10.0)  # whole run: the late one too
    # steady state: in-deadline OKs completed in [2 s, 10 s]: k % 4 in (2, 3) for k >= 4,
    # less k = 19 (sent 500 ms late, done at 10.1 s); k = 2, 3 were done before 2 s and
    # the extra one after 10 s: 7 of them over 8 s
    assert r.steady_arrivals == 17 and r.steady_goodput_rps == pytest.approx(7 / 8, abs=0.01)
    assert r.refusal_p50_ms == pytest.approx(2.0) and r.refusal_p99_ms == pytest.approx(2.0)
    assert r.lag_max_ms == pytest.approx(500.0)
    assert r.generator_behind  # of 20 lags, the P99 lies between the two largest
    s.lag[-2] = 0.001
    assert not summarise(s, target="t", rate=2.0, deadline_s=1.0).generator_behind


def test_refusals_are_counted_with_their_latency() -> None:
    async def main_() -> tuple:
        async with fake_server(refuse_above(4, 0.1)) as target:
            t = time.perf_counter()
            r = await run_open_loop(target, REQUESTS, rate=300, seconds=0.5, deadline_s=5.0)
            return r, time.perf_counter() - t

    r, wall = asyncio.run(main_())
    ok, refused = r.count(OK), r.count("RESOURCE_EXHAUSTED")
    assert ok + refused == r.arrivals == 150
    # the server's own limit: at most 4 at a time, 100 ms each, over the run's real time
    # (longer than 0.5 s when a busy machine makes the generator late)
    assert ok <= 4 * wall / 0.1 + 4
    assert refused > 0 and ok > 0
    assert r.refusal_p50_ms is not None and r.refusal_p99_ms is not None
    assert r.refusal_p50_ms < r.ok_p50_ms  # a refusal does not wait out the 100 ms


def test_a_stalled_event_loop_shows_as_generator_lag() -> None:
    stalled = False

    async def block_once(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal stalled
        if not stalled:
            stalled = True
            time.sleep(0.3)  # blocks the loop the generator shares
        return b"x"

    async def main_() -> tuple:
        async with fake_server(block_once) as target:
            return await run_open_loop(target, REQUESTS, rate=100, seconds=0.6, deadline_s=5.0)

    r = asyncio.run(main_())
    assert r.arrivals == 60  # late, but every arrival still went out
    assert r.lag_max_ms is not None and r.lag_max_ms >= 250
    assert r.generator_behind


def test_closed_loop_capacity_is_bounded_by_the_server() -> None:
    async def main_() -> tuple:
        async with fake_server(answer_after(0.02)) as target:
            return await probe_capacity(target, REQUESTS, concurrency=4, seconds=0.5,
                                        warmup_s=0.1, channels=2)  # fmt: skip

    c = asyncio.run(main_())
    assert c.errors == {} and c.ok > 0
    assert c.ok_rps <= 4 / 0.02 * 1.05  # 4 callers, each call at least 20 ms
    assert c.p50_ms is not None and c.p50_ms >= 20.0


def test_spawned_processes_share_the_rate_and_merge() -> None:
    async def main_() -> tuple:
        async with fake_server(answer_after(0.002)) as target:
            return await run_open_loop(target, REQUESTS, rate=100, seconds=0.5, deadline_s=5.0,
                                       processes=2, channels=2, seed=7)  # fmt: skip

    r = asyncio.run(main_())
    assert r.processes == 2
    assert r.arrivals == 50  # 25 from each process (uniform, 50/s for 0.5 s)
    assert r.count(OK) == 50


def test_cli_help_explains_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--target", "--world", "--rate", "--deadline-ms", "--processes",
                   "--channels", "--poisson", "--json", "--closed-loop"):  # fmt: skip
        assert option in out


def test_svg_chart_is_well_formed_with_one_polyline_per_series() -> None:
    series = [
        Series("ideal", [(0, 0), (1, 1), (4, 1)], dashed=True, markers=False),
        Series("deadline 250 ms", [(0.5, 0.5), (1, 0.9), (2, 0.95), (4, None)]),
        Series("a <b> & c", [(0.5, 0.5), (4, 0.1)]),
    ]
    text = line_chart(series, title="T & t", x_label="offered", y_label="goodput")
    root = ET.fromstring(text.encode())
    assert root.tag == f"{SVG}svg"
    lines = [e for e in root.iter(f"{SVG}polyline") if e.get("class") == "series"]
    assert [e.get("data-name") for e in lines] == [s.name for s in series]
    assert len(list(root.iter(f"{SVG}polyline"))) == len(series)
    assert [len(e.get("points").split()) for e in lines] == [3, 3, 2]  # None skipped
    texts = {e.text for e in root.iter(f"{SVG}text")}
    assert {"ideal", "deadline 250 ms", "a <b> & c", "T & t", "offered", "goodput"} <= texts
    assert len(list(root.iter(f"{SVG}circle"))) == (3 + 1) + (2 + 1)  # points, legend
    assert nice_ticks(0, 4) == [0, 1, 2, 3, 4]
    assert nice_ticks(0, 1.2) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2])


def test_republisher_writes_valid_new_versions(tmp_path: Path) -> None:
    root = tmp_path / "index"
    publish(root, writer(small_index(40)))
    first = current_version(root)
    write = republisher(root)
    for _ in range(4):
        publish(root, write)
    version = current_version(root)
    assert version != first and len(list_versions(root)) == 3  # pruned to keep=3
    path = current_path(root)
    assert path is not None
    manifest, arrays = read_index_dir(path)  # checksums verified
    assert manifest["index_version"] == version and manifest["tokenizer_fingerprint"] == "test"
    np.testing.assert_array_equal(arrays.ads.ad_ids, small_index(40).ads.ad_ids)


def test_metric_parsing_and_markdown_table() -> None:
    text = (
        "# HELP grace_index_swaps_total Index hot swaps.\n"
        "# TYPE grace_index_swaps_total counter\n"
        "grace_index_swaps_total 7.0\n"
        "grace_index_swaps_created 1.7e9\n"
        'grpc_server_handled_total{grpc_code="OK",grpc_method="Retrieve"} 3.0\n'
        'grpc_server_handled_total{grpc_code="RESOURCE_EXHAUSTED",grpc_method="Retrieve"} 2.0\n'
    )
    assert metric_value(text, "grace_index_swaps_total") == 7.0
    assert metric_value(text, "grpc_server_handled_total") == 5.0
    assert metric_value(text, "grace_queue_depth") is None
    s = Samples(offered_seconds=1.0)
    s.add(0.1, 0.0, 0.01, OK)
    s.add(0.5, 0.0, 0.001, "RESOURCE_EXHAUSTED")
    r = summarise(s, target="t", rate=2, deadline_s=0.25)
    row = {"multiple": 2.0, "deadline_ms": 250.0, "goodput_fraction": 0.5, **r.to_dict()}
    table = markdown_table([row], capacity=1.0).splitlines()
    assert table[2].count("|") == table[3].count("|") == table[4].count("|")
    assert "| 2 | 250 ms |" in table[4]
