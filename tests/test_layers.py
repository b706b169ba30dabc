"""The layering of the product (docs/ARCHITECTURE.md §1, "Layers"): contracts at the
bottom, then index_builder and kernels, then service (which never imports the builder:
build and search are separate), then training, then the `grace` CLI; no import cycles
anywhere — every `import` counts, at module level or inside a function (a lazy import
hides a cycle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contracts", "index_builder", "kernels", "service", "training", "cli")
# what each package may import of the project (itself always)
ALLOWED = {
    "contracts": set(),
    "kernels": {"contracts"},
    "index_builder": {"contracts"},
    "service": {"contracts", "kernels"},
    "training": {"contracts", "kernels", "index_builder", "service"},
    "cli": {"contracts", "kernels", "index_builder", "service", "training"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Project modules `path` imports: `from a.b import c` is module a.b.c where that is
    a module, else a.b (a package's own `__init__` running first is not an edge)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for name in names:
            if name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {
        _module(p): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "_pb2" not in p.name
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = set()
        for name in _imports(path, module, set(files)):
            while name and name not in files:  # `from a.b import name`: the module a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


GRAPH = _graph()


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_only_point_down(package: str) -> None:
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] == package
        for d in deps
        if d.split(".")[0] not in ALLOWED[package] | {package}
    )
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_the_checker_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
