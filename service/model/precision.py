"""The precision a model serves in (the setting `dtype`): one transform when a model
version loads (`for_serving`, called by `service/rollout/sources.py`), after which the
decode engine runs whatever the model holds (docs/FP8.md).

"auto" is bfloat16 on CUDA (the kernels' dtype) and float32 on a CPU (bfloat16 is slow on
most CPUs); "fp8" is "auto" with the decode step's linear layers as FP8 e4m3 layers,
quantised here once (the cross K/V, LayerNorms, embeddings and head keep the model's
dtype). Refused on a GPU without FP8 (compute capability below 8.9).
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import nn

from kernels.fp8 import Fp8Linear, check_fp8_device
from service.settings import Precision

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
# the decoder layers' linear layers in FP8 with per-channel scales (layer 0's QKV: never)
FP8_LINEARS = ("qkv", "self_out", "cross_q", "cross_out", "ffn_up")


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
