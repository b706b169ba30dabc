"""Fixtures of the client's tests: a real in-process gRPC server answering from
fake_grace.FakeRetrieval, and a target nobody listens on. These tests run wherever
grace-client is installed (`cd clients/python && pytest`) and from a checkout without
installing it (both pyprojects put clients/python on pytest's `pythonpath`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from fake_grace import FakeRetrieval, serve


@dataclass
class Served:
    target: str
    fake: FakeRetrieval


@pytest.fixture
def served() -> Iterator[Served]:
    fake = FakeRetrieval()
    with serve(fake) as target:
        yield Served(target, fake)


@pytest.fixture
def dead_target() -> str:
    """A localhost port nothing listens on (bound by a server that then stopped)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.stop(0).wait()
    return f"127.0.0.1:{port}"
