"""A small served world for tests that need a real server: the tiny synthetic world, a
small SID tokenizer, an untrained tiny model and a published index, plus the settings to
serve it on free localhost ports (tests/service, tests/ops), and a hold on a server's
stop so a drain's NOT_SERVING can be read before its port closes."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc
import pyarrow.parquet as pq
import torch

from index_builder.build import build_index
from index_builder.catalog import read_catalog
from index_builder.synth import generate_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from service.model.checkpoint import save_checkpoint
from service.model.config import PROFILES
from service.model.retriever import GenerativeRetriever
from service.settings import ServerSettings, load_settings
from tests.helpers.oracle import Ad


def make_serving_data(root: Path, seed: int = 2) -> Path:
    """root/world, root/model and root/index (published), as `grace serve` expects."""
    generate_world("tiny", seed, root / "world", progress=False)
    emb = read_catalog(root / "world" / "catalog.parquet", progress=False).embedding
    tok = SIDTokenizer.train(emb, TokenizerConfig(codebook_size=32, iterations=5), progress=False)
    torch.manual_seed(0)
    save_checkpoint(GenerativeRetriever(PROFILES["tiny"]), tok, root / "model")
    build_index(root / "world" / "catalog.parquet", root / "index",
                tokenizer_path=root / "model" / "tokenizer", progress=False)  # fmt: skip
    return root


def serving_settings(root: Path, **overrides: Any) -> ServerSettings:
    """Settings serving `root` on CPU, free ports on 127.0.0.1, fast index polling."""
    base = {"port": 0, "metrics_port": 0, "host": "127.0.0.1", "data_dir": root,
            "device": "cpu", "index_poll_seconds": 0.1, "drain_seconds": 2.0}  # fmt: skip
    return load_settings(base | overrides)


def catalog_ads(root: Path) -> dict[int, Ad]:
    """The served world's ads as the oracle reads them (targeting only: SIDs unused)."""
    rows = pq.read_table(root / "world" / "catalog.parquet").to_pylist()
    return {
        r["ad_id"]: Ad(
            r["ad_id"],
            (0, 0, 0, 0),
            tuple(r["countries"] or ()),
            tuple(r["age_buckets"] or ()),
            tuple(r["genders"] or ()),
            tuple(r["locations"] or ()),
        )
        for r in rows
    }


def hold_stop(server: grpc.aio.Server, timeout: float = 60.0) -> asyncio.Event:
    """Hold `server.stop` (a drain's closing of the port, after its NOT_SERVING notice)
    until the returned event is set, or `timeout` seconds: a test reads NOT_SERVING on
    a condition, not inside the notice's 0.5 s."""
    release, stop = asyncio.Event(), server.stop

    async def held_stop(grace: float | None) -> None:
        # a test that never releases it: stop anyway after `timeout` (it fails on its own)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), timeout)
        await stop(grace)

    server.stop = held_stop  # type: ignore[method-assign]
    return release
