"""TLS and mutual TLS on the serving port (service/tls.py) over real gRPC, with a PKI made
here: TLS callers answered — Retrieve, health and reflection — and plain text refused;
under mutual TLS a caller without a certificate (or with one of another CA) refused; a
rotated certificate served to new connections without a restart, a half-rotated pair
never; `grace health` and `grace query` with their TLS flags; the request front of
`balance = "request"` serving TLS over plain-text unix hops; the metrics listener on its
own address; settings and files that cannot work refused in one line."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from pydantic import ValidationError

from cli import main
from cli.query import request_for_user
from grace_client import AsyncGraceClient, tls_credentials
from service.app import start
from service.balancer import Front
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings
from tests.helpers.certs import Issued, issue
from tests.helpers.serving import make_serving_data, serving_settings
from tests.helpers.waiting import until
from tests.service.test_balancer import Worker
from tests.service.test_reflection import V1, ask

REPO = Path(__file__).resolve().parents[2]
LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own new connection


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def pki(tmp_path: Path) -> SimpleNamespace:
    """Two CAs; a server and a client certificate of the first, a server one of the other."""
    ca, other = issue(tmp_path, "ca"), issue(tmp_path, "other-ca")
    return SimpleNamespace(ca=ca, other=other, server=issue(tmp_path, "server", ca),
                           client=issue(tmp_path, "client", ca),
                           stranger=issue(tmp_path, "stranger", other),
                           server2=issue(tmp_path, "server2", other))  # fmt: skip


def mutual(pki: SimpleNamespace) -> dict[str, Path]:
    """The settings of mutual TLS: pki's server certificate, callers' of its CA."""
    return {"tls_cert": pki.server.cert_path, "tls_key": pki.server.key_path,
            "tls_client_ca": pki.ca.cert_path}  # fmt: skip


def credentials(ca: Issued, client: Issued | None = None) -> grpc.ChannelCredentials:
    """Trusting `ca`; presenting `client`'s certificate when given."""
    pair = (client.key_path.read_bytes(), client.cert_path.read_bytes()) if client else (None,) * 2
    return grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), *pair)


def channel(port: int, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    target = f"127.0.0.1:{port}"
    if creds is None:
        return grpc.aio.insecure_channel(target, options=LOCAL)
    return grpc.aio.secure_channel(target, creds, options=LOCAL)


async def health(port: int, creds: grpc.ChannelCredentials | None) -> str:
    """SERVING / NOT_SERVING, or the status code of the failed Check, on a new connection."""
    async with channel(port, creds) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=30
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def replace(path: Path, source: Path) -> None:
    """Put `source`'s bytes at `path` atomically, as a Kubernetes Secret volume does."""
    path.with_suffix(".new").write_bytes(source.read_bytes())
    os.replace(path.with_suffix(".new"), path)


def test_tls_port_serves_tls_callers_refuses_plain_text_and_reloads_a_rotated_certificate(
    data: Path, pki: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grace.tls")
    cert, key = tmp_path / "served.crt", tmp_path / "served.key"
    replace(cert, pki.server.cert_path)
    replace(key, pki.server.key_path)
    trusts_ca, trusts_other = credentials(pki.ca), credentials(pki.other)

    async def main() -> None:
        settings = serving_settings(data, tls_cert=cert, tls_key=key, metrics_host="127.0.0.2")
        app = await start(settings)
        try:
            async with channel(app.port, trusts_ca) as ch:
                request = request_for_user(data / "world", 0, 10, retrieval_pb2.CD_GTM)
                reply = await retrieval_pb2_grpc.AdRetrievalStub(ch).Retrieve(request, timeout=30)
                assert len(reply.ads) > 0
                (listed,) = await ask(ch, V1, reflection_pb2.ServerReflectionRequest(
                    list_services=""))  # fmt: skip
                names = {s.name for s in listed.list_services_response.service}
                assert {"grace.v1.AdRetrieval", "grpc.health.v1.Health"} <= names
            assert await health(app.port, trusts_ca) == "SERVING"
            assert await health(app.port, None) == "UNAVAILABLE"  # plain text: refused
            assert await health(app.port, trusts_other) == "UNAVAILABLE"
            # the metrics listener is on metrics_host, not host
            url = f"http://127.0.0.2:{app.metrics_port}/metrics"
            assert b"grace_serving" in urllib.request.urlopen(url, timeout=10).read()
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{app.metrics_port}/metrics", timeout=10)

            # half rotated (the new certificate, the old key): the old pair serves on, and
            # one warning says so however many handshakes meet it
            replace(cert, pki.server2.cert_path)
            for _ in range(3):
                assert await health(app.port, trusts_ca) == "SERVING"
            warned = [r for r in caplog.records if "do not load" in r.getMessage()]
            assert len(warned) == 1 and str(cert) in warned[0].getMessage()
            # rotated (a certificate of another CA): new connections get it, no restart
            replace(key, pki.server2.key_path)
            assert await health(app.port, trusts_other) == "SERVING"
            assert await health(app.port, trusts_ca) == "UNAVAILABLE"
            assert any("reloaded" in r.getMessage() for r in caplog.records)
        finally:
            await app.drain()

    asyncio.run(main())


def test_mutual_tls_refuses_callers_without_a_certificate_of_the_client_ca(
    data: Path, pki: SimpleNamespace, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    """Also `grace health`, `grace query`, grace-client and the locust user with TLS."""
    ca, client = str(pki.ca.cert_path), pki.client
    mine = ["--tls-ca", ca, "--tls-cert", str(client.cert_path), "--tls-key", str(client.key_path)]

    async def main() -> dict[str, object]:
        # no watchdog: it arms faulthandler on stderr, which capsys has replaced
        app = await start(serving_settings(data, stall_seconds=0, **mutual(pki)))
        target = f"127.0.0.1:{app.port}"

        async def grace(*args: str) -> int:
            return await asyncio.to_thread(cli, args[0], "--target", target, *args[1:])

        try:
            got: dict[str, object] = {
                "with a certificate": await health(app.port, credentials(pki.ca, client)),
                "without": await health(app.port, credentials(pki.ca)),
                "of another CA": await health(app.port, credentials(pki.ca, pki.stranger)),
                "grace health": await grace("health", *mine),
                "grace health, no certificate": await grace("health", "--tls-ca", ca),
                "grace health, another name": await grace("health", *mine,
                                                          "--tls-server-name", "other.example"),
                "grace query": await grace("query", "--world", str(data / "world"), *mine),
            }  # fmt: skip
            tls = tls_credentials(ca, client.cert_path, client.key_path)
            async with AsyncGraceClient(target, credentials=tls) as light:
                got["grace-client"] = (await light.health()).name
            # as a probe in the server's container: the server's own pair (GRACE_TLS_CERT
            # and GRACE_TLS_KEY are its settings), then the locust user under the same
            server = pki.server
            env = {"CA": ca, "CERT": server.cert_path, "KEY": server.key_path,
                   "SERVER_NAME": "localhost"}  # fmt: skip
            for name, value in env.items():
                monkeypatch.setenv(f"GRACE_TLS_{name}", str(value))
            got["grace health, GRACE_TLS_*"] = await grace("health")
            got["locust"] = await asyncio.to_thread(locust, target, data / "world")
            return got
        finally:
            await app.drain()

    got = asyncio.run(main())
    out, err = capsys.readouterr()
    assert got == {"with a certificate": "SERVING", "without": "UNAVAILABLE",
                   "of another CA": "UNAVAILABLE", "grace health": 0,
                   "grace health, no certificate": 1, "grace health, another name": 1,
                   "grace query": 0, "grace-client": "SERVING", "grace health, GRACE_TLS_*": 0,
                   "locust": "thresholds met"}, (out, err)  # fmt: skip
    assert "index " in out and "rank" in out  # query printed its ads


def cli(*args: str) -> int:
    return main(list(args))


def locust(target: str, world: Path) -> str:
    """A short headless run of the locust user (a subprocess: locust patches the standard
    library), no failure allowed: its verdict, or its stderr."""
    if importlib.util.find_spec("locust") is None:
        return "thresholds met"  # not installed: tests/ops/test_loadtest.py says so
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
           "--headless", "--only-summary", "-H", target, "-u", "1", "-r", "1", "-t", "3s",
           "--world", str(world), "--world-users", "5", "--grace-fail-ratio", "0"]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    ok = run.returncode == 0 and "thresholds met" in run.stderr
    return "thresholds met" if ok else run.stderr[-3000:]


def test_the_request_front_serves_tls_over_plain_unix_hops(
    tmp_path: Path, pki: SimpleNamespace
) -> None:
    async def run() -> None:
        workers = [Worker(i, tmp_path / f"w{i}.sock") for i in range(2)]
        servers = [await w.start() for w in workers]
        for w in workers:
            w.ready()
        settings = load_settings({"port": 0, "drain_seconds": 1, **mutual(pki)})
        front = Front(settings, [w.address for w in workers])
        stopping = asyncio.Event()
        task = asyncio.create_task(front.run(stopping))
        try:
            await until(lambda: front.port, "the front to listen")
            async with channel(front.port, credentials(pki.ca, pki.client)) as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                who = {(await stub.Retrieve(retrieval_pb2.RetrieveRequest(), timeout=30))
                       .model_version for _ in range(4)}  # fmt: skip
                assert who == {"w0", "w1"}
            assert await health(front.port, credentials(pki.ca, pki.client)) == "SERVING"
            assert await health(front.port, credentials(pki.ca)) == "UNAVAILABLE"
            assert await health(front.port, None) == "UNAVAILABLE"
        finally:
            stopping.set()
            await task
            for s in servers:
                await s.stop(None)

    asyncio.run(run())


def test_settings_and_files_that_cannot_serve_tls_are_refused_in_one_line(
    tmp_path: Path, pki: SimpleNamespace, capsys: pytest.CaptureFixture
) -> None:
    server, client = pki.server, pki.client
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        load_settings({"tls_cert": server.cert_path})
    with pytest.raises(ValidationError, match=r"tls_client_ca .* needs the server's tls_cert"):
        load_settings({"tls_client_ca": pki.ca.cert_path})
    assert load_settings({"host": "0.0.0.0"}).metrics_host == "0.0.0.0"  # default: host
    missing, empty = tmp_path / "missing.crt", tmp_path / "empty.crt"
    empty.write_text("")
    cases = [
        ([missing, server.key_path, None],
         f"tls_cert {missing}: No such file or directory (--tls-cert, GRACE_TLS_CERT)"),
        ([server.cert_path, client.key_path, None], "(--tls-cert, --tls-key)"),  # not its key
        ([server.cert_path, server.key_path, server.key_path], "no PEM CA certificate"),
        ([server.cert_path, server.key_path, empty], "no PEM CA certificate"),  # half written
    ]  # fmt: skip
    for (cert, key, client_ca), says in cases:
        args = ["serve", "--data-dir", str(tmp_path / "nothing"), "--port", "0",
                "--metrics-port", "0", "--tls-cert", str(cert), "--tls-key", str(key)]  # fmt: skip
        if client_ca is not None:
            args += ["--tls-client-ca", str(client_ca)]
        assert main(args) == 2  # before anything is built or loaded
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("grace serve: error: ") and says in err
    assert not (tmp_path / "nothing").exists()
