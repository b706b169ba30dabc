"""The committed gRPC stubs — the service's (service/rpc) and the light client's
(clients/python/grace_client/rpc) — are exactly what `make proto` generates from proto/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import proto_stubs as generate


@pytest.mark.parametrize("target", generate.TARGETS, ids=lambda t: t.package)
def test_committed_stubs_are_current(tmp_path: Path, target: generate.StubTarget) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools not installed (pip install -e '.[dev]')")
    pinned, installed = generate.pinned_tools_version(), generate.installed_tools_version()
    assert installed == pinned, (
        f"grpcio-tools {installed} is installed but pyproject pins {pinned}; the stub bytes "
        f"depend on its protoc, so install the pin (pip install -e '.[dev]')"
    )
    generate.generate(tmp_path, target.package)
    stale = [
        str(target.root.relative_to(generate.ROOT) / rel)
        for rel in generate.expected_files()
        if not (target.root / rel).is_file()
        or (target.root / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale or missing stubs {stale}: run `make proto` and commit the result"


def test_stubs_import_as_a_package() -> None:
    from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

    grpc_source = Path(retrieval_pb2_grpc.__file__).read_text()
    assert "from grace.v1 import" not in grpc_source
    assert retrieval_pb2_grpc.AdRetrievalStub is not None
    # the names clients are written against (docs/ARCHITECTURE.md §5)
    service = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"]
    assert service.full_name == "grace.v1.AdRetrieval"
    assert service.methods_by_name["Retrieve"].input_type.name == "RetrieveRequest"
    assert retrieval_pb2.FilterMode.Name(0) == "FILTER_MODE_UNSPECIFIED"


def test_client_stubs_import_inside_grace_client() -> None:
    from grace_client.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc

    grpc_source = Path(retrieval_pb2_grpc.__file__).read_text()
    assert "from grace_client.rpc.grace.v1 import retrieval_pb2" in grpc_source
    assert "from grace.v1 import" not in grpc_source and "service.rpc" not in grpc_source
    service = retrieval_pb2.DESCRIPTOR.services_by_name["AdRetrieval"]
    assert service.full_name == "grace.v1.AdRetrieval"


def test_generation_detects_an_edited_proto(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools not installed (pip install -e '.[dev]')")
    proto_root = tmp_path / "proto"
    src = generate.PROTO_ROOT / generate.PROTOS[0]
    edited = proto_root / generate.PROTOS[0]
    edited.parent.mkdir(parents=True)
    edited.write_text(
        src.read_text().replace(
            "bool include_sids = 4;", "bool include_sids = 4;\n  int32 extra = 5;"
        )
    )
    monkeypatch.setattr(generate, "PROTO_ROOT", proto_root)
    generate.generate(tmp_path / "out")
    rel = generate.expected_files()
    changed = [
        r
        for r in rel
        if (generate.STUB_ROOT / r).read_bytes() != (tmp_path / "out" / r).read_bytes()
    ]
    assert any(str(r).endswith("retrieval_pb2.py") for r in changed)


def test_generation_refuses_another_grpcio_tools(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(generate, "installed_tools_version", lambda: "0.0.1")
    with pytest.raises(generate.GenerationError, match="pinned grpcio-tools=="):
        generate.generate(tmp_path)
    assert not any(tmp_path.iterdir())
