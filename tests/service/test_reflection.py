"""Server reflection over real gRPC, as grpc.reflection.v1 and v1alpha: both list the
services and describe AdRetrieval, so grpcurl and other languages' clients can call the
service from the proto alone (docs/CLIENTS.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from service.app import start
from tests.helpers.serving import make_serving_data, serving_settings

V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_serving_data(tmp_path_factory.mktemp("reflection"))


async def ask(channel: grpc.aio.Channel, method: str,
              *requests: reflection_pb2.ServerReflectionRequest) -> list:  # fmt: skip
    """The replies to `requests` on one reflection stream of `method` (v1 and v1alpha
    messages are the same on the wire)."""
    call = channel.stream_stream(
        method,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return [reply async for reply in call(iter(requests))]


@pytest.mark.parametrize("method", [V1, V1ALPHA], ids=["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(data: Path, method: str) -> None:
    async def main() -> tuple[list[str], list[str], str]:
        app = await start(serving_settings(data))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                listed, described, missing = await ask(
                    ch, method,
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="grace.v1.AdRetrieval"),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="grace.v1.NoSuchService"),
                )  # fmt: skip
        finally:
            await app.drain()
        names = [s.name for s in listed.list_services_response.service]
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in described.file_descriptor_response.file_descriptor_proto]  # fmt: skip
        methods = [m.name for f in files for s in f.service if s.name == "AdRetrieval"
                   for m in s.method]  # fmt: skip
        return (
            names,
            methods,
            grpc.StatusCode.NOT_FOUND.value[0] == missing.error_response.error_code,
        )

    names, methods, not_found = asyncio.run(main())
    assert {"grace.v1.AdRetrieval", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(names)  # fmt: skip
    assert "Retrieve" in methods
    assert not_found


def test_reflection_v1_describes_itself(data: Path) -> None:
    """grpcurl describes the reflection service too: v1's file is in the descriptor pool
    under its own package, its messages v1's."""

    async def main() -> list[descriptor_pb2.FileDescriptorProto]:
        app = await start(serving_settings(data))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                [reply] = await ask(ch, V1, reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"))  # fmt: skip
        finally:
            await app.drain()
        return [descriptor_pb2.FileDescriptorProto.FromString(b)
                for b in reply.file_descriptor_response.file_descriptor_proto]  # fmt: skip

    [file] = asyncio.run(main())
    assert file.package == "grpc.reflection.v1"
    [method] = file.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert all(not f.type_name or f.type_name.startswith(".grpc.reflection.v1.")
               for m in file.message_type for f in m.field)  # fmt: skip
