"""The precision a model serves in (the setting `dtype`): one transform when a model
version loads (`for_serving`, called by `service/rollout/sources.py`), after which the
decode engine runs whatever the model holds (docs/FP8.md).

"auto" (the default) is, per model version, FP8 on a GPU with FP8 when the version carries
a passing FP8 quality record (`fp8_verdict`, made by `grace publish-model` and kept in its
gate.json), else bfloat16 on CUDA (the kernels' dtype) and float32 on a CPU (bfloat16 is
slow on most CPUs): `choose` says which and why. "fp8" forces the decode step's linear
layers as FP8 e4m3 layers, quantised here once (the cross K/V, LayerNorms, embeddings and
head keep bfloat16); it is refused on a GPU without FP8 (compute capability below 8.9).
"bfloat16" and "float32" force those.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

import torch
from torch import nn

from kernels.fp8 import Fp8Linear, check_fp8_device, lacks_fp8
from service.settings import Precision

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
# the decoder layers' linear layers in FP8 with per-channel scales (layer 0's QKV: never)
FP8_LINEARS = ("qkv", "self_out", "cross_q", "cross_out", "ffn_up")
# The pass rule of an FP8 quality record (docs/FP8.md, "FP8 by default"): on at least
# MIN_USERS held-out users, FP8 is not shown to lose more than TOLERANCE of recall@K
# against bfloat16 at any K (the lower end of the paired 95 % bootstrap interval of
# FP8 - bf16 is at least -TOLERANCE) and keeps, on average, at least MIN_SIDS_KEPT of
# bf16's top-K SIDs. Fewer users fail: a handful can read an interval of [0, 0] (one user,
# resampled, always does) and prove nothing.
FP8_TOLERANCE = 0.01
FP8_MIN_SIDS_KEPT = 0.95
FP8_MIN_USERS = 200


def weights_dtype(precision: Precision, device: torch.device | str) -> torch.dtype:
    """The dtype of the weights and activations `precision` serves in on `device`."""
    if precision in ("float32", "bfloat16"):
        return getattr(torch, precision)
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def check(precision: Precision, device: torch.device | str) -> None:
    """Raise, in one line, where `precision` cannot run on `device` (before any load)."""
    if precision not in PRECISIONS:
        raise ValueError(f"dtype must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        check_fp8_device(torch.device(device))


def fp8_verdict(vs_bf16: Mapping[str, Any], users: int, *, tolerance: float = FP8_TOLERANCE,
                min_sids_kept: float = FP8_MIN_SIDS_KEPT) -> dict[str, Any]:  # fmt: skip
    """An FP8 quality record: the figures of `vs_bf16` (a study's `vs_full_precision` over
    `users` users: `recall@K` paired differences FP8 - bf16 and `sid_overlap` per `@K`, each
    with `mean`, `lo`, `hi`), the rule they were judged by, `passed` and `why` (one line)."""
    recalls = {k: dict(v) for k, v in vs_bf16.items() if k.startswith("recall@")}
    kept = {k: dict(v) for k, v in vs_bf16["sid_overlap"].items()}
    if not recalls or not kept:
        raise ValueError("an FP8 quality record needs recall@K differences and SID overlaps")

    def diff(k: str) -> str:
        d = recalls[k]
        return f"{k} {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"

    def share(k: str) -> str:
        return f"top-{k.lstrip('@')} SIDs kept {kept[k]['mean']:.3f}"

    fails = [f"{users} users < {FP8_MIN_USERS}: too few to judge"] if users < FP8_MIN_USERS else []
    fails += [f"{diff(k)} may lose more than {tolerance:g}"
             for k, d in recalls.items() if d["lo"] < -tolerance]  # fmt: skip
    fails += [
        f"{share(k)} < {min_sids_kept:g}" for k, d in kept.items() if d["mean"] < min_sids_kept
    ]
    shown = ", ".join([*map(diff, recalls), *map(share, kept)])
    return {
        "passed": not fails,
        "why": "; ".join(fails) if fails else shown,
        "users": users,
        "rule": {
            "tolerance": tolerance,
            "min_sids_kept": min_sids_kept,
            "min_users": FP8_MIN_USERS,
        },
        "recall_vs_bf16": recalls,
        "sids_kept": kept,
    }


def choose(precision: Precision, device: torch.device | str,
           record: Mapping[str, Any] | None) -> tuple[Precision, str]:  # fmt: skip
    """The precision a model version serves in under the setting `precision` on `device`,
    given its FP8 quality record (None: it has none), and why, in words for a log line."""
    dev = torch.device(device)
    if precision != "auto":
        return precision, "set by dtype"
    if dev.type != "cuda":
        return "auto", "a CPU serves float32"
    if (name := lacks_fp8(dev)) is not None:
        return "auto", f"{name} has no FP8"
    if record is None:
        return "auto", ("it has no FP8 quality record (grace publish-model --index --world "
                        "makes one)")  # fmt: skip
    if record.get("passed"):
        return "fp8", f"its FP8 quality record passes: {record.get('why')}"
    return "auto", f"its FP8 quality record fails: {record.get('why')}"


def serves_in(model: nn.Module) -> str:
    """What a `for_serving` model serves in, in words: fp8, bfloat16 or float32."""
    if is_fp8(model.decoder):
        return "fp8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def for_serving(model: nn.Module, precision: Precision, device: torch.device | str) -> nn.Module:
    """`model` (a `GenerativeRetriever` on `device`) in `precision`, in place."""
    check(precision, device)
    model.to(weights_dtype(precision, device))
    if precision == "fp8":
        quantize_decoder(model.decoder)
    return model


@torch.no_grad()
def quantize_decoder(decoder: nn.Module) -> nn.Module:
    """The decode step's linear layers of `decoder` (a `SIDDecoder`) as `Fp8Linear`s."""
    for i, layer in enumerate(decoder.layers):
        for name in FP8_LINEARS:
            if not (i == 0 and name == "qkv"):
                _replace(layer, name, Fp8Linear.of(getattr(layer, name)))
        _replace(layer, "ffn_down", Fp8Linear.of(layer.ffn_down, block=True))
    return decoder


def is_fp8(decoder: nn.Module) -> bool:
    """Whether `quantize_decoder` made `decoder`'s layers FP8."""
    return isinstance(decoder.layers[-1].self_out, Fp8Linear)


def _replace(layer: nn.Module, name: str, new: nn.Module) -> None:
    if name.startswith("ffn_"):  # the FFN's Sequential: up at 0, down at 2
        layer.ffn[0 if name == "ffn_up" else 2] = new
    else:
        setattr(layer, name, new)
