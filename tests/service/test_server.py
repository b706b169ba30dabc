"""The gRPC service end to end over localhost: eligible answers, INVALID_ARGUMENT naming
the field, health through start-up and drain, metrics, and hot swaps under load."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import service.app
from cli.query import request_for_user
from contracts.targeting_schema import DEFAULT
from index_builder.build import build_index
from index_builder.publish import current_path
from index_builder.synth import load_world
from service.app import start
from service.pipeline.stages import Stages, graph_buckets
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.rpc_status import Abort
from service.server import SERVICE, RetrievalServicer
from service.validation import Limits
from tests.helpers.oracle import eligible
from tests.helpers.server_process import ServerProcess
from tests.helpers.serving import catalog_ads, hold_stop, make_serving_data, serving_settings
from tests.helpers.waiting import until


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("serve"))


async def retrieve_users(port: int, root: Path, users: range) -> list:
    """One CD_GTM Retrieve (max 200 ads) per user of root's world, concurrently."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
        return await asyncio.gather(
            *(
                stub.Retrieve(request_for_user(root / "world", u, 200, retrieval_pb2.CD_GTM))
                for u in users
            )
        )


def settings(root: Path, **kw):
    return serving_settings(root, **kw)


def test_retrieve_returns_only_eligible_ads_and_reports_stats(data: Path) -> None:
    ads = catalog_ads(data)
    world = load_world(data / "world")

    async def main() -> None:
        app = await start(settings(data))
        replies = await retrieve_users(app.port, data, range(20))
        await app.drain()
        for u, reply in enumerate(replies):
            assert reply.index_version and reply.model_version.startswith("tiny-")
            assert len(reply.ads) > 0 and reply.stats.ads_eligible >= len(reply.ads)
            assert all(eligible(ads[a.ad_id], world.targeting[u]) for a in reply.ads)
            assert list(reply.ads[0].sid) and len(reply.ads[0].sid) == 4
            assert set(reply.stats.stage_ms) == {"input", "features", "compute", "post"}
            scores = [a.score for a in reply.ads]
            assert scores == sorted(scores, reverse=True)

    asyncio.run(main())


def test_graph_buckets_and_busy_batches_reach_the_server(
    data: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server builds its stages over the configured graph buckets (plus max_batch: the
    GPU's graphed stages; the CPU runs every batch at its own size), and its batcher counts
    busy from the device's default (CPU: 2) unless set. Its log says where start-up time
    went (model, index, then ready)."""
    caplog.set_level(logging.INFO)
    built: list[tuple[int, Sequence[int] | None]] = []

    class Recorded(Stages):
        def __init__(self, device, max_batch=16, buckets=None, **kwargs) -> None:
            built.append((max_batch, buckets))
            super().__init__(device, max_batch, buckets, **kwargs)

    monkeypatch.setattr(service.app, "Stages", Recorded)

    async def main() -> None:
        app = await start(settings(data, graph_buckets=[2, 8]))
        try:
            [(max_batch, buckets)] = built
            assert graph_buckets(max_batch, buckets) == (2, 8, 16)  # what a GPU captures
            assert app.pipeline.stages.buckets == tuple(range(1, 17))  # the CPU: no padding
            assert app.batcher.policy.busy_batches == 2
        finally:
            await app.drain()
        for step in (
            r"model \S+ \(\S+\) loaded and verified on cpu in [\d.]+ s \(verify [\d.]+ s, "
            r"weights [\d.]+ s, buffers [\d.]+ s, precision [\d.]+ s\)",  # the load's phases
            r"index \S+ loaded and validated in [\d.]+ s",
            r"ready in [\d.]+ s",
        ):
            assert re.search(step, caplog.text), step  # fmt: skip
        app = await start(settings(data, busy_batches=1))
        try:
            assert app.batcher.policy.busy_batches == 1
        finally:
            await app.drain()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r.targeting, "gender", "robot"), "targeting.gender"),
        (lambda r: setattr(r.targeting, "age", -3), "targeting.age"),
        (lambda r: r.targeting.locations.extend(f"l{i}" for i in range(65)), "targeting.locations"),
        (lambda r: setattr(r.options, "max_ads", 10**7), "options.max_ads"),
        (lambda r: r.options.beam_widths.extend([1, 2]), "options.beam_widths"),
        (lambda r: r.options.beam_widths.extend([1, 10**6, 4, 4]), "options.beam_widths"),
    ],
)
def test_bad_input_gets_invalid_argument_naming_the_field(data: Path, mutate, field) -> None:
    async def main() -> None:
        app = await start(settings(data))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        mutate(req)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(req)
        await app.drain()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()

    asyncio.run(main())


def test_health_metrics_and_drain(data: Path) -> None:
    async def main() -> None:
        app = await start(settings(data))
        target = f"127.0.0.1:{app.port}"
        async with grpc.aio.insecure_channel(target) as ch:
            hc = health_pb2_grpc.HealthStub(ch)
            ok = await hc.Check(health_pb2.HealthCheckRequest(service="grace.v1.AdRetrieval"))
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
            await retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(
                request_for_user(data / "world", 1, 5, retrieval_pb2.CD_ONLY)
            )
            url = f"http://127.0.0.1:{app.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            for name in ("grpc_server_started_total", "grpc_server_handled_total",
                         "grpc_server_handling_seconds_bucket", "grace_stage_duration_seconds",
                         "grace_batch_size", "grace_queue_depth", "grace_inflight_requests",
                         "grace_index_info", "grace_index_age_seconds", "grace_index_swaps_total",
                         "grace_index_swap_failures_total", "grace_sids_generated_total",
                         "grace_ads_expanded_total", "grace_ads_eligible_total",
                         "grace_model_info", "process_resident_memory_bytes", "python_info",
                         "python_gc_collections_total"):  # fmt: skip
                assert name in text, name
            assert "grace_index_swaps_total 0.0" in text  # the first load is not a swap
            assert 'grpc_code="OK"' in text and 'le="0.1"' in text
            port_open = hold_stop(app.server)  # the Check below never races the notice
            drain = asyncio.ensure_future(app.drain())
            get = app.metrics.registry.get_sample_value
            await until(lambda: get("grace_serving") == 0, "the drain to begin")
            status = await hc.Check(health_pb2.HealthCheckRequest(service=""))
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            port_open.set()
            await drain

    asyncio.run(main())


def test_hot_swaps_under_load_lose_no_request(data: Path, tmp_path: Path) -> None:
    """Two index versions published while six clients call back to back: each is swapped
    in under that load (waited for, not timed) and no call fails."""
    import shutil

    root = tmp_path / "index"
    shutil.copytree(data / "index", root, symlinks=True)
    first = current_path(root).name

    async def main() -> tuple[list, set[str]]:
        app = await start(settings(data, index_root=root))
        versions: set[str] = set()
        failures: list[Exception] = []
        answered = [0]
        swapped = asyncio.Event()

        async def client(stub, u: int) -> None:
            while True:  # until both swaps are in, then one call more: the newest answers
                last = swapped.is_set()
                try:
                    r = await stub.Retrieve(
                        request_for_user(data / "world", u, 20, retrieval_pb2.CD_GTM)
                    )
                    versions.add(r.index_version)
                    answered[0] += 1
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc)
                if last:
                    return

        async def swapper() -> None:
            cat = data / "world" / "catalog.parquet"
            swaps = app.metrics.registry.get_sample_value
            await until(lambda: answered[0] >= 6, "the load to start")
            for n in (1, 2):
                await asyncio.to_thread(build_index, cat, root,
                                        tokenizer_path=data / "model" / "tokenizer",
                                        progress=False)  # fmt: skip
                await until(lambda n=n: (swaps("grace_index_swaps_total") or 0) >= n, f"swap {n}")
            swapped.set()

        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            await asyncio.gather(swapper(), *(client(stub, u) for u in range(6)))
        swaps = app.metrics.registry.get_sample_value("grace_index_swaps_total")
        await app.drain()
        assert swaps is not None and swaps >= 2  # two hot swaps (the first load is none)
        return failures, versions

    failures, versions = asyncio.run(main())
    assert failures == []
    valid = {p.name for p in root.iterdir() if (p / "manifest.json").exists()} | {first}
    assert versions <= valid and len(versions) >= 2


def test_overload_is_refused_at_once_while_accepted_requests_succeed(data: Path) -> None:
    async def main() -> tuple[list, list]:
        app = await start(settings(data, queue_capacity=2, max_batch=1))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            replies = await asyncio.gather(
                *(stub.Retrieve(req) for _ in range(40)), return_exceptions=True
            )
        await app.drain()
        ok = [r for r in replies if isinstance(r, retrieval_pb2.RetrieveResponse)]
        refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
        return ok, refused

    ok, refused = asyncio.run(main())
    assert ok and refused and len(ok) + len(refused) == 40
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(len(r.ads) > 0 for r in ok)


def test_reflection_lists_the_services(data: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main() -> list[str]:
        app = await start(settings(data))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            names = []
            async for reply in stub.ServerReflectionInfo(iter([request])):
                names += [s.name for s in reply.list_services_response.service]
        await app.drain()
        return names

    names = asyncio.run(main())
    assert "grace.v1.AdRetrieval" in names and "grpc.health.v1.Health" in names


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(data: Path, tmp_path: Path) -> None:
    """SIGTERM once the server has all eight calls: each is answered, the process exits 0."""
    import signal

    server = ServerProcess.start(data, tmp_path / "serve.log")
    started = {"grpc_service": SERVICE, "grpc_method": "Retrieve"}

    def received(n: int) -> None:
        end = time.monotonic() + 60
        while server.metric("grpc_server_started_total", started) < n:
            assert time.monotonic() < end, "the calls never reached the server"
            time.sleep(0.01)

    async def main() -> list:
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
            calls = [asyncio.ensure_future(stub.Retrieve(req)) for _ in range(8)]
            await asyncio.to_thread(received, 8)
            server.proc.send_signal(signal.SIGTERM)  # while those are in flight
            return await asyncio.gather(*calls, return_exceptions=True)

    try:
        server.wait_serving()  # start-up: model, index, threads (minutes on a busy box)
        replies = asyncio.run(main())
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    assert all(isinstance(r, retrieval_pb2.RetrieveResponse) for r in replies), replies
    log = server.log_text()
    assert "draining" in log and "stopped" in log


def test_expired_deadlines_are_not_processed(data: Path) -> None:
    async def main() -> tuple[list, float | None]:
        app = await start(settings(data, max_batch=1))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            await stub.Retrieve(req)  # warm-up: one batch
            busy = [asyncio.ensure_future(stub.Retrieve(req)) for _ in range(12)]
            await asyncio.sleep(0.01)
            late = asyncio.ensure_future(stub.Retrieve(req, timeout=0.05))
            replies = await asyncio.gather(*busy, late, return_exceptions=True)
        batches = app.metrics.registry.get_sample_value("grace_batch_size_count")
        await app.drain()
        return replies, batches

    replies, batches = asyncio.run(main())
    assert all(isinstance(r, retrieval_pb2.RetrieveResponse) for r in replies[:-1])
    assert isinstance(replies[-1], grpc.aio.AioRpcError)
    # refused at the door (it cannot finish behind 12 others), or dropped once expired
    late = replies[-1].code()
    assert late in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert batches == 14  # server warm-up, client warm-up, the 12 others: never the late one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_server_captures_decode_graphs_before_serving(data: Path) -> None:
    """On GPU the index is served through decode plans whose CUDA graphs were captured
    before health said SERVING; its answers are eligible as on CPU."""
    ads = catalog_ads(data)
    world = load_world(data / "world")

    async def main() -> None:
        app = await start(settings(data, device="cuda"))
        serving = app.servicer.serving.current
        plans = serving.model.plans(serving.index)
        assert plans.graphs > 0  # captured before SERVING
        captured = plans.graphs
        replies = await retrieve_users(app.port, data, range(20))
        await app.drain()
        assert plans.graphs == captured  # the default schedule needed no new capture
        for u, reply in enumerate(replies):
            assert len(reply.ads) > 0
            assert all(eligible(ads[a.ad_id], world.targeting[u]) for a in reply.ads)

    asyncio.run(main())


def test_deadline_misses_and_cancellations_are_not_counted_as_ok(data: Path) -> None:
    """A call the client gave up on (deadline or cancel) while the pipeline held it is
    counted with the code the client saw — the availability SLO reads these counters — and
    the stalled batch is dropped at the next hand-off instead of being finished for nobody."""
    labels = {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "Retrieve"}

    def handled(app, code: str) -> float:
        got = app.metrics.registry.get_sample_value(
            "grpc_server_handled_total", {**labels, "grpc_code": code}
        )
        return got or 0.0

    def dropped(app) -> float:
        get = app.metrics.registry.get_sample_value
        return sum(
            get("grace_stage_dropped_total", {"stage": stage, "reason": reason}) or 0.0
            for stage in ("features", "compute", "post")
            for reason in ("deadline", "cancelled")
        )

    async def main() -> None:
        app = await start(settings(data, max_batch=8, max_wait_ms=200.0))
        gate = threading.Event()
        model = app.servicer.serving.current.model
        encoder = model.encoder
        model.encoder = lambda embedded: (gate.wait(30), encoder(embedded))[1]  # stall
        request = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            call = stub.Retrieve(request)
            # 5 s: time enough to be batched and stalled in stage 3 before expiring
            late = [asyncio.ensure_future(stub.Retrieve(request, timeout=5.0)) for _ in range(7)]
            await until(lambda: app.batcher.inflight_requests == 8,
                        "all eight in one batch, stalled in stage 3")  # fmt: skip
            call.cancel()
            for err in await asyncio.gather(*late, return_exceptions=True):
                assert isinstance(err, grpc.aio.AioRpcError)
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: handled(app, "DEADLINE_EXCEEDED") == 7
                        and handled(app, "CANCELLED") == 1,
                        "the server-side handlers to finish")  # fmt: skip
            gate.set()
            await until(lambda: app.batcher.inflight_requests == 0,
                        "the batch to leave the pipeline at its next hand-off")  # fmt: skip
        ok = handled(app, "OK")
        gone = dropped(app)
        await app.drain()
        assert handled(app, "DEADLINE_EXCEEDED") == 7  # every one the client saw expire
        assert handled(app, "CANCELLED") == 1
        assert ok == 0  # none was answered (the warm-up bypasses gRPC)
        assert gone == 8  # dropped before post: no C++ work for them

    asyncio.run(main())


def test_bfloat16_model_serves_eligible_ads(data: Path) -> None:
    """`dtype` bfloat16 (the GPU default) through the whole pipeline, here on the CPU."""
    ads = catalog_ads(data)
    world = load_world(data / "world")

    async def main() -> None:
        app = await start(settings(data, dtype="bfloat16"))
        replies = await retrieve_users(app.port, data, range(6))
        await app.drain()
        for u, reply in enumerate(replies):
            assert len(reply.ads) > 0
            assert all(eligible(ads[a.ad_id], world.targeting[u]) for a in reply.ads)

    asyncio.run(main())


def test_an_overloaded_server_sheds_before_parsing_the_request() -> None:
    """Under overload a refusal costs no parsing or validation: even bytes that are no
    request are answered RESOURCE_EXHAUSTED while admission refuses (and INVALID_ARGUMENT
    once it admits)."""
    from service.admission import Admission
    from service.batcher import Overloaded
    from service.metrics import Metrics
    from service.server import _Call

    overloaded = [True]

    def admit(timeout: float | None) -> None:
        if overloaded[0]:
            raise Overloaded("overloaded: predicted 900 ms to answer, deadline 100 ms")

    batcher = SimpleNamespace(admit=admit, admission=Admission(), depth=0, inflight_requests=0)
    limits = Limits(1000, 10_000, (1, 4, 8, 8), (1, 8, 16, 16))
    serving = SimpleNamespace(
        ready=True, current=SimpleNamespace(index=SimpleNamespace(schema=DEFAULT, blockable=()))
    )
    servicer = RetrievalServicer(batcher, limits, serving, Metrics())  # type: ignore[arg-type]
    bad = retrieval_pb2.RetrieveRequest(targeting=retrieval_pb2.Targeting(gender="robot"))
    for raw in (bad.SerializeToString(), b"\xff\xff\xff garbage"):
        overloaded[0] = True
        with pytest.raises(Abort) as shed:
            asyncio.run(servicer._retrieve(raw, None, _Call("r")))
        assert shed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        overloaded[0] = False
        with pytest.raises(Abort) as invalid:
            asyncio.run(servicer._retrieve(raw, None, _Call("r")))
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_deadline_shorter_than_the_service_is_refused_without_computing(data: Path) -> None:
    """At low load a 5 ms deadline cannot be met by a server whose batches take longer:
    each is answered DEADLINE_EXCEEDED at the door and none is computed (before, most
    were computed anyway)."""

    async def main() -> tuple[list, float | None, float | None]:
        app = await start(settings(data))
        req = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            await stub.Retrieve(req)  # one batch more teaches the estimate
            batches = app.metrics.registry.get_sample_value("grace_batch_size_count")
            replies = []
            for _ in range(20):
                try:
                    replies.append(await stub.Retrieve(req, timeout=0.005))
                except grpc.aio.AioRpcError as exc:
                    replies.append(exc)
        after = app.metrics.registry.get_sample_value("grace_batch_size_count")
        await app.drain()
        return replies, batches, after

    replies, batches, after = asyncio.run(main())
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in replies)
    assert {r.code() for r in replies} == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert after == batches  # nothing reached the pipeline


def test_a_second_server_on_a_taken_port_is_refused_with_one_line(data: Path) -> None:
    """Only a supervisor's own workers share a port (SO_REUSEPORT): a second `grace serve`
    on the port, or on the metrics port, of a running one fails to start, saying which."""
    from service.errors import StartupError
    from tests.helpers.server_process import free_port

    async def main() -> None:
        app = await start(settings(data))
        try:
            with pytest.raises(StartupError, match=rf"cannot listen on 127.0.0.1:{app.port}: "
                               "the port is taken"):  # fmt: skip
                await start(settings(data, port=app.port))
            with pytest.raises(StartupError, match=rf"metrics port 127.0.0.1:{app.metrics_port}:"
                               " Address already in use"):  # fmt: skip
                await start(settings(data, port=free_port(), metrics_port=app.metrics_port))
            replies = await retrieve_users(app.port, data, range(2))  # the first serves on
            assert all(len(r.ads) > 0 for r in replies)
        finally:
            await app.drain()

    asyncio.run(main())
