"""Compile the served Triton kernels for Hopper (sm_90) on a machine without a GPU.

Elsewhere the tests run the kernels under Triton's interpreter, which executes their Python
and never meets the compiler: a kernel that one Triton version's front end refuses (a
`tl.static_range` bound it does not take as a constant, say) passes every CPU test and
fails on the first GPU. Run as a script with TRITON_INTERPRET unset
(`python -m tests.helpers.hopper_compile`), this calls the launchers of the served path
with small CPU tensors while `JITFunction.run` and `Autotuner.run` record each launch (every
config of an autotuned one) instead of running it, then compiles every recorded launch
through Triton's front end, its passes and ptxas for sm_90 — what a GPU's first call does.
It prints one JSON line per launch: the kernel, the launch's compile-time constants, and
the error if it did not compile. `tests/kernels/test_hopper_compile.py` runs it.

The TMA FP8 FFN kernel is not among them: its launcher builds host tensor descriptors,
which need a GPU.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET unset"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

Launch = tuple[JITFunction, tuple, dict]
launches: list[Launch] = []


def _record_jit(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    launches.append((self, args, kwargs))


def _record_autotuned(self: Autotuner, *args, **kwargs) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    for config in self.configs:
        launches.append((self.fn, args, {**kwargs, **config.all_kwargs()}))


def _type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, str | None]:
    """Compile one recorded launch for sm_90: (its constants, None or the error)."""
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    signature, constants, shown = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if i < len(args):
            value = args[i]
        elif name in kwargs:
            value = kwargs[name]
        else:
            value = param.default
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constants[(i,)] = value
            shown[name] = value if isinstance(value, int | float | bool | tuple) else str(value)
        else:
            signature[name] = _type(value)
    try:
        triton.compile(ASTSource(fn, signature, constants), target=HOPPER, options=options)
    except Exception as e:
        return {**shown, **options}, f"{type(e).__name__}: {e}".splitlines()[0][:2000] + (
            " | " + " ".join(str(e).split())[-600:]
        )
    return {**shown, **options}, None


def _gtm_launches() -> None:
    """The CD+GTM mask over the layouts schemas give: no family, one (the default's
    locations), several of unrolled and looped widths; with and without `n_blooms`; CD
    only; both scorings; fp32 and bf16 logits; every autotune config of the richest."""
    from contracts.index_format import VOCAB_SIZE
    from contracts.tensors import GtmTables, RequestTensors
    from kernels._triton_gtm_mask import _configs, gtm_mask_triton

    def run(widths: tuple[int, ...], *, has_n=True, gtm=True, scoring="masked",
            dtype=torch.float32, config=None) -> None:  # fmt: skip
        at, families = 0, []
        for w in widths:
            families.append((at, w))
            at += w
        rows, batch, locations, w_bm = 4, 2, 3, 5
        i32 = torch.zeros(4, dtype=torch.int32)
        tables = GtmTables(
            node_offsets=torch.tensor([0, 2, 2, 2], dtype=torch.int32),
            child_nodes=i32[:2].clone(), tokens=i32[:2].clone(),
            bitmask_index=i32[:2].clone(), bloom_index=i32[:2].clone(),
            bitmask_table=torch.zeros(1, w_bm, dtype=torch.int64),
            bloom_table=torch.zeros(1, at, dtype=torch.int64),
            bloom_families=tuple(families),
        )  # fmt: skip
        n = torch.ones(batch, len(widths), dtype=torch.int32) if has_n else None
        requests = RequestTensors(
            torch.zeros(batch, w_bm, dtype=torch.int64),
            torch.zeros(batch, locations, at, dtype=torch.int64), n,
        )  # fmt: skip
        gtm_mask_triton(
            torch.zeros(rows, VOCAB_SIZE, dtype=dtype), tables,
            torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
            requests, torch.zeros(rows), gtm=gtm, scoring=scoring, config=config,
        )  # fmt: skip

    for widths in [(), (4,), (1,), (8, 2), (2, 8, 1), (16, 2)]:
        run(widths)
    run((4,), has_n=False)
    run((4,), gtm=False)
    run((4,), scoring="unmasked", dtype=torch.bfloat16)
    run((8, 2), dtype=torch.bfloat16)
    for c in _configs():
        run((2, 8, 1), dtype=torch.bfloat16, config={**c.kwargs, "num_warps": c.num_warps})


def _other_launches() -> None:
    """Beam bookkeeping, layer norm (plain, residual + FP8 out), row quantisation and the
    fused self-attention (dense and paged caches, bf16): the rest of the served loop."""
    from kernels._triton_beam_advance import triton_beam_advance
    from kernels._triton_fp8 import triton_quantize_rows
    from kernels._triton_layer_norm import triton_add_layer_norm_fp8, triton_layer_norm
    from kernels._triton_self_attention import fused_self_attention_triton

    b, keep, m, v = 2, 4, 4, 256
    triton_beam_advance(
        torch.zeros(b, keep), torch.zeros(b, keep, dtype=torch.int64),
        torch.zeros(b * m, v, dtype=torch.int32), m, v, 0,
    )  # fmt: skip
    x = torch.zeros(6, 128, dtype=torch.bfloat16)
    w, bias = torch.ones(128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.bfloat16)
    triton_layer_norm(x, w, bias, 1e-5)
    triton_add_layer_norm_fp8(x, x.clone(), w, bias, 1e-5, shift=torch.zeros(128))
    triton_quantize_rows(x)
    rows, heads, d_h, length, t = 4, 2, 64, 8, 3
    qkv = torch.zeros(rows, 3 * heads * d_h, dtype=torch.bfloat16)
    dense = torch.zeros(rows, length, heads, d_h, dtype=torch.bfloat16)
    fused_self_attention_triton(qkv, dense, dense.clone(), t)
    pool = torch.zeros(rows * length, heads, d_h, dtype=torch.bfloat16)
    table = torch.arange(rows * length, dtype=torch.int32).view(rows, length)
    fused_self_attention_triton(qkv, pool, pool.clone(), t, table)


def main() -> int:
    JITFunction.run = _record_jit  # type: ignore[method-assign]
    Autotuner.run = _record_autotuned  # type: ignore[method-assign]
    groups: list[Callable[[], None]] = [_gtm_launches, _other_launches]
    if sys.argv[1:] == ["--gtm"]:
        groups = [_gtm_launches]
    for group in groups:
        group()
    failed = 0
    for fn, args, kwargs in launches:
        constants, error = compile_launch(fn, args, dict(kwargs))
        failed += error is not None
        print(json.dumps({"kernel": fn.__name__, "constants": constants, "error": error},
                         default=str), flush=True)  # fmt: skip
    print(json.dumps({"triton": triton.__version__, "launches": len(launches),
                      "failed": failed}), flush=True)  # fmt: skip
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
