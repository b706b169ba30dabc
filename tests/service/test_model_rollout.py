"""Model rollout without a restart, end to end over real gRPC with real checkpoints in a
real model repository (`grace publish-model`): a new model swaps in under concurrent
load with no failed call, every answer from a valid (model, index) pair; a model of
another SID space is refused while serving goes on, and swaps in together with its index
when that is published (the coordinated rollout); a restart with CURRENT on a refused
model serves the previous valid one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cli import main
from cli.query import request_for_user
from index_builder.build import build_index
from index_builder.publish import current_version
from index_builder.synth import load_world
from index_builder.tokenizer import SIDTokenizer
from service.app import App, start
from service.model.checkpoint import WEIGHTS_FILE, save_checkpoint
from service.model.config import PROFILES
from service.model.repository import list_versions, publish_model
from service.model.retriever import GenerativeRetriever
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.indexes import flip_byte
from tests.helpers.oracle import eligible
from tests.helpers.server_process import ServerProcess
from tests.helpers.serving import catalog_ads, make_serving_data, serving_settings
from tests.helpers.waiting import until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("model-rollout"))


def checkpoint(data: Path, out: Path, seed: int, sid_space: str | None = None) -> str:
    """An untrained tiny model of the world's SID tokenizer (or of a named SID space)."""
    torch.manual_seed(seed)
    model = GenerativeRetriever(PROFILES["tiny"])
    tokenizer = None if sid_space else SIDTokenizer.load(data / "model" / "tokenizer")
    return save_checkpoint(model, tokenizer, out, sid_space=sid_space)


def sid_catalog(data: Path, out: Path) -> Path:
    """The world's catalog with SIDs of its own (a named SID space) and no embeddings."""
    table = pq.read_table(data / "world" / "catalog.parquet").drop_columns(["embedding"])
    i = np.arange(table.num_rows)
    sids = np.stack([i % 8, (i // 8) % 8, (i // 64) % 8, i % 512], axis=1).tolist()
    pq.write_table(table.append_column("sid", pa.array(sids, pa.list_(pa.int64()))), out)
    return out


def sample(app: App, name: str, labels: dict[str, str] | None = None) -> float:
    return app.metrics.registry.get_sample_value(name, labels or {}) or 0.0


class Load:
    """Clients retrieving for the world's users until stopped; every answer recorded."""

    def __init__(self, port: int, data: Path, clients: int = 6) -> None:
        self.port, self.data, self.clients = port, data, clients
        self.answers: list[tuple[int, retrieval_pb2.RetrieveResponse]] = []
        self.times: list[tuple[float, float]] = []  # (sent, answered) of each answer
        self.failures: list[grpc.aio.AioRpcError] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Load:
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        stub = retrieval_pb2_grpc.AdRetrievalStub(self._channel)
        self._tasks = [asyncio.ensure_future(self._client(stub, c)) for c in range(self.clients)]
        return self

    async def _client(self, stub, c: int) -> None:
        u = c
        while not self._stop.is_set():
            try:
                request = request_for_user(self.data / "world", u % 40, 50, retrieval_pb2.CD_GTM)
                sent = time.monotonic()
                reply = await stub.Retrieve(request, timeout=30)
                self.answers.append((u % 40, reply))
                self.times.append((sent, time.monotonic()))
            except grpc.aio.AioRpcError as exc:
                self.failures.append(exc)
            u += self.clients

    def served(self, model_version: str) -> int:
        return sum(a.model_version == model_version for _, a in self.answers)

    def first_answer(self, model_version: str) -> float:
        return min(t for (_, a), (_, t) in zip(self.answers, self.times, strict=True)
                   if a.model_version == model_version)  # fmt: skip

    def sent_after(self, t: float) -> set[str]:
        """The models that answered calls sent after `t`."""
        return {a.model_version for (_, a), (sent, _) in zip(self.answers, self.times, strict=True)
                if sent > t}  # fmt: skip

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._channel.close()


def test_a_model_hot_swaps_under_load_and_an_incompatible_one_is_refused(
    data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "models"
    first = publish_model(data / "model", repo)
    index = current_version(data / "index")
    m1 = checkpoint(data, data / "model-copy", seed=0)  # the world's model: same weights
    m2 = checkpoint(data, tmp_path / "m2", seed=7)
    other = checkpoint(data, tmp_path / "other", seed=8, sid_space="other-v1")
    world, ads = load_world(data / "world"), catalog_ads(data)

    async def run() -> Load:
        app = await start(serving_settings(data, model_dir=repo))
        try:
            space = app.servicer.serving.current.model.sid_space
            info = {"version": first, "model_version": m1, "sid_space": space, "dtype": "float32"}
            assert sample(app, "grace_model_info", info) == 1
            async with Load(app.port, data) as load:
                await until(lambda: load.served(m1) >= 30, "answers from the first model")
                second = publish_model(tmp_path / "m2", repo)
                await until(lambda: load.served(m2) >= 30, "answers from the new model")
                assert app.servicer.serving.current.model.version == second
                assert sample(app, "grace_model_swaps_total") == 1  # one swap (not the first load)
                assert sample(app, "grace_model_behind_current") == 0
                publish_model(tmp_path / "other", repo)  # another SID space: no index fits
                failures = {"reason": "incompatible"}
                await until(lambda: sample(app, "grace_model_swap_failures_total", failures) == 1,
                            "the incompatible model refused")  # fmt: skip
                after = load.served(m2)
                await until(lambda: load.served(m2) >= after + 30, "serving on after the refusal")
                assert sample(app, "grace_model_behind_current") == 1
                assert sample(app, "grace_model_swap_failures_total", {"reason": "invalid"}) == 0
                assert app.servicer.serving.current.model.version == second
        finally:
            await app.drain()
        return load

    caplog.set_level("INFO", logger="grace.rollout")
    load = asyncio.run(run())
    assert load.failures == []
    pairs = {(a.model_version, a.index_version) for _, a in load.answers}
    assert pairs == {(m1, index), (m2, index)}  # never the refused model
    loads = {m: line for line in caplog.messages for m in (m1, m2)
             if line.startswith(f"model {m} (")}  # fmt: skip
    assert "paced" not in loads[m1]  # start-up: nothing served beside it
    assert re.search(r"paced [\d.]+ s\)$", loads[m2])  # the swap rested beside serving
    assert other not in {a.model_version for _, a in load.answers}
    assert load.sent_after(load.first_answer(m2)) == {m2}  # once swapped, never back
    for u, a in load.answers:
        assert all(eligible(ads[x.ad_id], world.targeting[u]) for x in a.ads)


def test_a_model_of_a_new_sid_space_rolls_out_with_its_index(data: Path, tmp_path: Path) -> None:
    """The coordinated rollout: publish the new model (refused: no index of its SID space
    yet, the old pair keeps serving), then build and publish its index; the two swap in
    together, and no answer ever comes from a mixed pair."""
    repo, root = tmp_path / "models", tmp_path / "index"
    publish_model(data / "model", repo)
    tokenizer = data / "model" / "tokenizer"
    old_index, _ = build_index(data / "world" / "catalog.parquet", root,
                               tokenizer_path=tokenizer, progress=False)  # fmt: skip
    m1 = checkpoint(data, tmp_path / "m1", seed=0)
    m2 = checkpoint(data, tmp_path / "m2", seed=3, sid_space="rollout-v2")
    catalog = sid_catalog(data, tmp_path / "catalog-v2.parquet")
    world, ads = load_world(data / "world"), catalog_ads(data)
    new_index: list[str] = []

    async def run() -> Load:
        app = await start(serving_settings(data, model_dir=repo, index_root=root))
        try:
            async with Load(app.port, data) as load:
                await until(lambda: load.served(m1) >= 20, "answers from the first pair")
                publish_model(tmp_path / "m2", repo)
                refused = {"reason": "incompatible"}
                await until(lambda: sample(app, "grace_model_swap_failures_total", refused) == 1,
                            "the new model waiting for its index")  # fmt: skip
                assert sample(app, "grace_model_behind_current") == 1
                version, _ = await asyncio.to_thread(
                    build_index, catalog, root, sid_space="rollout-v2", progress=False
                )
                new_index.append(version)
                await until(lambda: load.served(m2) >= 20, "answers from the new pair")
                assert sample(app, "grace_model_behind_current") == 0
                assert sample(app, "grace_index_behind_current") == 0
                assert sample(app, "grace_index_swap_failures_total", refused) == 0
        finally:
            await app.drain()
        return load

    load = asyncio.run(run())
    assert load.failures == []
    pairs = {(a.model_version, a.index_version) for _, a in load.answers}
    assert pairs == {(m1, old_index), (m2, new_index[0])}
    assert load.sent_after(load.first_answer(m2)) == {m2}
    for u, a in load.answers:
        assert all(eligible(ads[x.ad_id], world.targeting[u]) for x in a.ads)


def test_publish_model_refuses_a_bad_checkpoint_and_publishes_nothing(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    repo = tmp_path / "models"
    assert main(["publish-model", str(data / "model"), "--root", str(repo)]) == 0
    [good] = list_versions(repo)
    assert f"as version {good}" in capsys.readouterr().out
    broken = tmp_path / "broken"
    checkpoint(data, broken, seed=1)
    flip_byte(broken / WEIGHTS_FILE)
    assert main(["publish-model", str(broken), "--root", str(repo)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt or truncated" in err[0] and "nothing published" in err[0]
    assert list_versions(repo) == [good] and current_version(repo) == good
    assert main(["publish-model", str(tmp_path / "nowhere"), "--root", str(repo)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    for _ in range(4):  # --keep: the newest valid versions stay, CURRENT's always
        assert main(["publish-model", str(data / "model"), "--root", str(repo), "--keep", "2"]) == 0
    assert len(list_versions(repo)) == 2 and current_version(repo) == list_versions(repo)[-1]


def test_a_restart_with_current_on_a_refused_model_serves_the_previous_one(
    data: Path, tmp_path: Path
) -> None:
    """A real `grace serve` process started while CURRENT names a corrupt model: it serves
    the previous valid model, says why, and reports itself behind (instead of a crash
    loop on Kubernetes)."""
    repo = tmp_path / "models"
    good = publish_model(data / "model", repo)
    checkpoint(data, tmp_path / "m2", seed=5)
    bad = publish_model(tmp_path / "m2", repo)
    flip_byte(repo / bad / WEIGHTS_FILE)  # damaged after publishing (disk, a bad copy)
    server = ServerProcess.start(data, tmp_path / "server.log", env={"GRACE_MODEL_DIR": str(repo)})
    try:
        server.wait_serving()
        with grpc.insecure_channel(server.target) as ch:
            stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
            reply = stub.Retrieve(request_for_user(data / "world", 0, 20, retrieval_pb2.CD_GTM))
        assert len(reply.ads) > 0
        assert server.metric("grace_model_behind_current") == 1
        info = server.metrics_text()
        assert f'grace_model_info{{dtype="float32",model_version="{reply.model_version}",' in info
        assert f'version="{good}"' in info
        log = server.log_text()
        assert f"model CURRENT names {bad}, which was rejected" in log
        assert "corrupt or truncated" in log and f"serving {good}" in log
    finally:
        server.stop()


def test_a_worker_swaps_models_under_the_host_lock(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers of `grace serve --workers N` (each a server with workers = 1) sharing a
    GPU swap one after the other: every server loads a newcomer holding the host-wide
    lock of its roots, so a worker's swap is not another's slowdown."""
    from service.rollout import assembly
    from service.rollout.host_lock import host_lock, swap_lock_path

    repo = tmp_path / "models"
    publish_model(data / "model", repo)
    checkpoint(data, tmp_path / "m2", seed=5)
    held: list[Path] = []
    loads_under_lock: list[bool] = []

    @contextlib.contextmanager
    def recording_lock(path: Path):
        with host_lock(path):
            held.append(path)
            try:
                yield
            finally:
                held.pop()

    real_load = assembly.model_follower

    def follower(*args, **kwargs):
        f = real_load(*args, **kwargs)
        load = f._load
        f._load = lambda p, v: (loads_under_lock.append(bool(held)), load(p, v))[1]
        return f

    monkeypatch.setattr(assembly, "host_lock", recording_lock)
    monkeypatch.setattr(assembly, "model_follower", follower)
    settings = serving_settings(data, model_dir=repo)  # workers = 1, as each worker's are

    async def run() -> None:
        app = await start(settings)
        try:
            second = publish_model(tmp_path / "m2", repo)
            await until(lambda: app.servicer.serving.current.model.version == second, "the swap")
        finally:
            await app.drain()

    asyncio.run(run())
    lock = swap_lock_path(repo, data / "index")
    assert loads_under_lock == [False, True]  # start-up loads alone; the newcomer under the lock
    assert not held and lock.exists()


def diverged(data: Path, out: Path, seed: int = 11) -> str:
    """What a diverged training run saves: every weight NaN, with a matching sha256."""
    torch.manual_seed(seed)
    model = GenerativeRetriever(PROFILES["tiny"])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return save_checkpoint(model, SIDTokenizer.load(data / "model" / "tokenizer"), out)


def overflowing(data: Path, out: Path, seed: int = 12) -> str:
    """Finite weights that answer nothing: head weights so large that every logit
    overflows to inf (and its log-softmax to NaN)."""
    torch.manual_seed(seed)
    model = GenerativeRetriever(PROFILES["tiny"])
    with torch.no_grad():
        model.decoder.head.weight.fill_(3e38)
    return save_checkpoint(model, SIDTokenizer.load(data / "model" / "tokenizer"), out)


def by_hand(checkpoint_dir: Path, repo: Path, version: str) -> None:
    """Put a checkpoint into a repository without `grace publish-model` and point CURRENT
    at it (a copy, a sync or a script that bypasses the gate)."""
    shutil.copytree(checkpoint_dir, repo / version)
    (repo / "CURRENT.tmp").write_text(version + "\n")
    (repo / "CURRENT.tmp").replace(repo / "CURRENT")


def test_publish_model_refuses_a_diverged_checkpoint(data: Path, tmp_path: Path) -> None:
    """A real `grace publish-model` process: a NaN checkpoint (a matching sha256) is
    refused on one line, exit non-zero, nothing published — with or without a canary."""
    repo, nan = tmp_path / "models", tmp_path / "nan"
    diverged(data, nan)
    canary = ["--index", str(data / "index"), "--world", str(data / "world")]
    for extra in ([], canary):
        run = subprocess.run(
            [sys.executable, "-m", "cli", "publish-model", str(nan), "--root", str(repo), *extra],
            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        said = [line for line in run.stderr.splitlines() if "grace publish-model:" in line]
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert len(said) == 1 and "not finite" in said[0] and "nothing published" in said[0]
        assert list_versions(repo) == [] and current_version(repo) is None


def test_publish_model_runs_a_canary_on_the_index_and_records_it(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """With --index and requests (--world or --requests), a checkpoint whose weights are
    finite but which brings no ads is refused; one that does is published with the
    canary's figures in its version."""
    repo, silent = tmp_path / "models", tmp_path / "silent"
    overflowing(data, silent)
    canary = ["--index", str(data / "index"), "--world", str(data / "world")]
    assert main(["publish-model", str(silent), "--root", str(repo), *canary]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no ads" in err[0] and "nothing published" in err[0], err
    assert list_versions(repo) == []
    replay = tmp_path / "replay.jsonl"
    assert main(["record", "--world", str(data / "world"), "--users", "40", "--out",
                 str(replay)]) == 0  # fmt: skip
    for requests in (canary, ["--index", str(data / "index"), "--requests", str(replay)]):
        assert main(["publish-model", str(data / "model"), "--root", str(repo), *requests]) == 0
        out = capsys.readouterr().out
        assert "canary" in out and "ads per request" in out, out
        gate = json.loads((repo / current_version(repo) / "gate.json").read_text())
        assert gate["finite"] is True
        assert gate["canary"]["requests"] >= 32 and gate["canary"]["ads_per_request"] > 0
        assert gate["canary"]["index_version"] == current_version(data / "index")
    assert main(["publish-model", str(silent), "--root", str(repo)]) == 0  # no index: finite only
    gate = json.loads((repo / current_version(repo) / "gate.json").read_text())
    assert gate["finite"] is True and gate["canary"] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])  # fmt: skip
def test_a_diverged_model_put_in_by_hand_is_refused_and_the_old_one_serves(
    data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, device: str
) -> None:
    """A NaN model, then a finite one that answers nothing, copied into the repository
    by hand: the server's warm-up refuses each (counted as invalid, one line each, no
    traceback) and answers on with ads from the model it had; health stays SERVING. On a
    GPU the canary runs through the captured graphs, in bf16."""
    repo = tmp_path / "models"
    publish_model(data / "model", repo)
    m1 = json.loads((data / "model" / "config.json").read_text())["model_version"]
    diverged(data, tmp_path / "nan")
    overflowing(data, tmp_path / "silent")

    async def run() -> Load:
        app = await start(serving_settings(data, model_dir=repo, device=device))
        failures = functools.partial(sample, app, "grace_model_swap_failures_total",
                                     {"reason": "invalid"})  # fmt: skip
        try:
            async with Load(app.port, data) as load:
                await until(lambda: load.served(m1) >= 20, "answers from the first model")
                for name, version in (("nan", "20990101T000000000000Z"),
                                      ("silent", "20990101T000000000001Z")):  # fmt: skip
                    before = failures()
                    by_hand(tmp_path / name, repo, version)
                    refused = functools.partial(app.rollout.models.why_not, version)
                    await until(lambda r=refused: r().startswith("was rejected"), f"{name} refused")
                    assert failures() > before
                    after = load.served(m1)
                    await until(lambda a=after: load.served(m1) >= a + 20, "serving on")
                    assert app.servicer.serving.current.model.model_version == m1
                    assert sample(app, "grace_model_behind_current") == 1
                    assert sample(app, "grace_serving") == 1
                assert sample(app, "grace_empty_answers_total") == 0
        finally:
            await app.drain()
        return load

    caplog.set_level("INFO", logger="grace.rollout")
    load = asyncio.run(run())
    assert load.failures == []
    assert {a.model_version for _, a in load.answers} == {m1}
    assert all(len(a.ads) > 0 for _, a in load.answers)
    rejected = [r for r in caplog.records if " rejected (failure " in r.getMessage()]
    nan = [r.getMessage() for r in rejected if "20990101T000000000000Z" in r.getMessage()]
    silent = [r.getMessage() for r in rejected if "20990101T000000000001Z" in r.getMessage()]
    assert nan and all("not finite" in m for m in nan), nan
    assert silent and all("no SIDs" in m for m in silent), silent
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in rejected)


def test_empty_answers_are_counted(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's state, reached by switching the gate off: a diverged model serving,
    every Retrieve OK with 0 ads and health SERVING. `grace_empty_answers_total` counts
    each such answer (GraceEmptyAnswers alerts on their share)."""
    from service.model import gate

    for check in ("check_finite", "check_answers"):
        monkeypatch.setattr(gate, check, lambda *args, **kwargs: None)
    diverged(data, tmp_path / "nan")

    async def run() -> None:
        app = await start(serving_settings(data, model_dir=tmp_path / "nan"))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                stub = retrieval_pb2_grpc.AdRetrievalStub(channel)
                for u in range(8):
                    request = request_for_user(data / "world", u, 50, retrieval_pb2.CD_GTM)
                    reply = await stub.Retrieve(request, timeout=30)
                    assert len(reply.ads) == 0 and reply.stats.sids_generated == 0
            ok = {"grpc_type": "unary", "grpc_service": "grace.v1.AdRetrieval",
                  "grpc_method": "Retrieve", "grpc_code": "OK"}  # fmt: skip
            assert sample(app, "grpc_server_handled_total", ok) == 8
            assert sample(app, "grace_empty_answers_total") == 8
        finally:
            await app.drain()

    asyncio.run(run())
