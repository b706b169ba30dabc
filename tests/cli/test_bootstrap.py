"""The embedded default (`grace serve` with no arguments): a fresh data directory gets a
world, a trained model and a published index, the server answers from them, a second
start reuses everything instead of rebuilding, and two bootstraps on one machine train
the same model (the model version `grace query` prints)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc

from cli.bootstrap import ensure_default
from cli.query import request_for_user
from index_builder.publish import current_version
from service.app import start
from service.model.checkpoint import CONFIG_FILE
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from service.settings import load_settings
from training.train import TrainSettings

QUICK = TrainSettings(epochs=0.05, eval_users=16, warmup_steps=2)


def _outputs(data: Path) -> dict[str, float]:
    """Modification times of what the bootstrap makes: a rebuild would change them."""
    files = [data / "world" / "world.json", data / "model" / "config.json"]
    files += sorted((data / "index").rglob("*.npy"))
    return {str(f): f.stat().st_mtime_ns for f in files}


def test_fresh_data_dir_is_bootstrapped_served_and_reused(tmp_path: Path) -> None:
    data = tmp_path / "grace"
    settings = load_settings(
        {"port": 0, "metrics_port": 0, "host": "127.0.0.1", "data_dir": data, "device": "cpu"}
    )
    ensure_default(settings, progress=False, train_settings=QUICK)

    assert (data / "world" / "catalog.parquet").is_file()
    assert (data / "model" / "config.json").is_file()
    assert current_version(data / "index") is not None
    made = _outputs(data)
    assert len(made) > 2  # the index arrays are among them

    async def serve_one() -> retrieval_pb2.RetrieveResponse:
        app = await start(settings)  # refuses a model/index tokenizer mismatch
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                return await stub.Retrieve(
                    request_for_user(data / "world", 0, 50, retrieval_pb2.CD_GTM)
                )
        finally:
            await app.drain()

    reply = asyncio.run(serve_one())
    assert reply.index_version == current_version(data / "index")
    assert len(reply.ads) > 0

    ensure_default(settings, progress=False, train_settings=QUICK)  # second start
    assert _outputs(data) == made  # nothing regenerated, retrained or republished


def test_given_model_and_index_need_no_demo_world(tmp_path: Path) -> None:
    from tests.helpers.serving import make_serving_data

    given = make_serving_data(tmp_path / "given")
    settings = load_settings({"data_dir": tmp_path / "data", "model_dir": given / "model",
                              "index_root": given / "index"})  # fmt: skip
    ensure_default(settings, progress=False)
    assert not (tmp_path / "data" / "world").exists()


def test_two_bootstraps_train_the_same_model(tmp_path: Path) -> None:
    versions = set()
    for data in (tmp_path / "a", tmp_path / "b"):
        ensure_default(load_settings({"data_dir": data}), progress=False, train_settings=QUICK)
        versions.add(json.loads((data / "model" / CONFIG_FILE).read_text())["model_version"])
    assert len(versions) == 1, versions
