"""Regenerate the gRPC stubs from `proto/` (`make proto`, or `python -m tools.proto_stubs`): a
developer tool, not installed with the service (it needs the `dev` extras' grpcio-tools).

    proto/grace/v1/retrieval.proto ──protoc──► service/rpc/grace/v1/retrieval_pb2{.py,.pyi,_grpc.py}
                                   └─protoc──► clients/python/grace_client/rpc/grace/v1/…

protoc writes imports relative to the proto root (`from grace.v1 import retrieval_pb2`);
each copy of the stubs lives inside a package of its own (`TARGETS`: the service's
`service.rpc`, the light client's `grace_client.rpc`), so that one import is rewritten
per target and the output is importable as `service.rpc.grace.v1` or
`grace_client.rpc.grace.v1`. The protoc bundled with grpcio-tools decides the exact bytes,
so generation refuses any grpcio-tools but the version pinned in pyproject's `dev` extras;
`tests/service/rpc/test_stubs.py` regenerates every target into a temporary directory and
fails when the committed stubs differ.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTOS = ("grace/v1/retrieval.proto",)


@dataclass(frozen=True)
class StubTarget:
    """One copy of the stubs: they land in `root/grace/v1/`, importable as `package`."""

    root: Path
    package: str


TARGETS = (
    StubTarget(ROOT / "service" / "rpc", "service.rpc"),
    # the light client (clients/python): its own copy, so it never imports the service
    StubTarget(ROOT / "clients" / "python" / "grace_client" / "rpc", "grace_client.rpc"),
)
STUB_ROOT, PACKAGE = TARGETS[0].root, TARGETS[0].package  # the service's
# Package markers written next to the stubs so `service.rpc.grace.v1` imports.
_INIT = '"""Generated gRPC stubs of `proto/grace/v1` (regenerate with `make proto`)."""\n'


class GenerationError(RuntimeError):
    pass


def pinned_tools_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The `grpcio-tools==X` pin of pyproject's `dev` extras."""
    data = tomllib.loads(pyproject.read_text())
    for req in data["project"]["optional-dependencies"]["dev"]:
        m = re.fullmatch(r"grpcio-tools==([0-9][\w.]*)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise GenerationError(f"{pyproject}: no exact grpcio-tools==X pin in the dev extras")


def installed_tools_version() -> str | None:
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return None


def expected_files() -> list[Path]:
    """Paths (relative to a stub root) that generation writes."""
    out = []
    for proto in PROTOS:
        stem = Path(proto).with_suffix("")
        out += [stem.with_name(stem.name + s) for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    packages = {p.parent for p in out}
    packages |= {q for p in packages for q in p.parents if q != Path(".")}
    return sorted(out + [p / "__init__.py" for p in packages])


def _fix_imports(text: str, package: str) -> str:
    # `from grace.v1 import retrieval_pb2 as ...` -> `from service.rpc.grace.v1 import ...`
    roots = sorted({Path(p).parts[0] for p in PROTOS})
    pattern = rf"^from ((?:{'|'.join(map(re.escape, roots))})(?:\.\w+)*) import "
    return re.sub(pattern, rf"from {package}.\1 import ", text, flags=re.M)


def generate(out_root: Path, package: str = PACKAGE) -> list[Path]:
    """Write the stubs (and package `__init__.py` files) under `out_root`, their imports
    rooted at `package`; return the paths."""
    pinned, installed = pinned_tools_version(), installed_tools_version()
    if installed != pinned:
        raise GenerationError(
            f"grpcio-tools {installed or 'is not installed'}; stubs are generated with the "
            f"pinned grpcio-tools=={pinned} (pip install -e '.[dev]')"
        )
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise GenerationError(f"protoc failed: {' '.join(args)}")
        written = []
        for rel in expected_files():
            src, dst = Path(tmp) / rel, out_root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = _INIT if rel.name == "__init__.py" else _fix_imports(src.read_text(), package)
            dst.write_text(text)
            written.append(dst)
    return written


def main() -> int:
    try:
        # all or nothing: every target is generated before any committed stub is replaced
        with tempfile.TemporaryDirectory() as tmp:
            staged = []
            for i, target in enumerate(TARGETS):
                out = Path(tmp) / str(i)
                staged += [(p, target.root / p.relative_to(out))
                           for p in generate(out, target.package)]  # fmt: skip
            for src, dst in staged:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                print(f"wrote {dst.relative_to(ROOT)}")
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
