"""Every @triton.jit function of kernels/ and bench/baselines/ reads only globals a
compiled kernel may read.

Compiled Triton refuses a plain global inside a kernel (`Cannot access global variable
X ...`: it must be `tl.constexpr(...)`, a module, a jit function, a dtype or a
triton.language name), but `TRITON_INTERPRET=1` runs such a kernel happily — so the CPU
tests alone would miss it until the first GPU run. This check applies the compiler's
rule to every name each kernel's code refers to."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import KernelInterface

import bench.baselines
import kernels


def _python_function(value: object) -> types.FunctionType | None:
    """The Python function behind a jit function (compiled or interpreted) or an
    autotuner wrapping one; None for anything else."""
    if not isinstance(value, KernelInterface):
        return None
    while not isinstance(value, types.FunctionType) and hasattr(value, "fn"):
        value = value.fn
    return value if isinstance(value, types.FunctionType) else None


def _jit_functions() -> list[tuple[str, types.FunctionType]]:
    found = []
    for package in (kernels, bench.baselines):  # the served kernels and the measured baselines
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_triton"):
                module = importlib.import_module(f"{package.__name__}.{info.name}")
                for name, value in vars(module).items():
                    fn = _python_function(value)
                    if fn is not None and fn.__module__ == module.__name__:  # not imports
                        found.append((f"{info.name}.{name}", fn))
    return found


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:  # nested code (comprehensions, lambdas)
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _allowed(value: object) -> bool:
    """The compiler's rule (triton/compiler/code_generator.py, `global_lookup`)."""
    return (
        isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype, KernelInterface))
        or getattr(value, "__module__", "").startswith("triton.language")
        or getattr(value, "__triton_builtin__", False)
    )


KERNELS = _jit_functions()


def test_kernels_are_found() -> None:
    names = {n for n, _ in KERNELS}
    assert "_triton_fp8.quantize_rows_fp8" in names and len(names) >= 8


@pytest.mark.parametrize(("name", "fn"), KERNELS, ids=[n for n, _ in KERNELS])
def test_a_kernel_reads_only_globals_the_compiler_accepts(name: str, fn) -> None:
    bad = []
    injected = vars(interpreter)  # an interpreted run copies these into the kernel's module
    for ref in sorted(_names(fn.__code__)):
        if ref not in fn.__globals__:
            continue  # an attribute name (x.to, tl.load) or a builtin
        if injected.get(ref, object()) is fn.__globals__[ref]:
            continue  # the interpreter's (b.T's attribute name, not its TypeVar T)
        if not _allowed(fn.__globals__[ref]):
            bad.append(f"{ref} = {fn.__globals__[ref]!r}")
    assert not bad, f"{name} reads plain globals (wrap them in tl.constexpr): {bad}"
