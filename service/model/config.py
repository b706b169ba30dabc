"""Model profiles (docs/ARCHITECTURE.md §6, docs/MODEL.md): one frozen `ModelConfig` per
named size, read by the model, the FLOP counter, training and the decode engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from contracts.index_format import SID_LENGTH, VOCAB_SIZE

FFN_ACTIVATIONS = ("gelu_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    d_model: int  # residual width
    n_heads: int  # attention heads (self and cross)
    d_head: int  # per-head width; attention inner width is n_heads * d_head
    d_ff: int  # decoder FFN hidden width
    decoder_layers: int
    encoder_layers: int
    encoder_d_ff: int
    t_ctx: int = 128  # context tokens the encoder emits
    max_history: int = 256  # behaviour-sequence events the encoder reads
    user_hash_buckets: int = 1 << 16
    time_gap_buckets: int = 16
    beams: tuple[int, ...] = (1, 64, 128, 128)  # default schedule (M_1, ..., M_4)
    vocab_size: int = VOCAB_SIZE
    sid_length: int = SID_LENGTH
    # the decoder FFN's activation: "gelu_tanh" (tanh approximation, what cuBLASLt's GELU
    # epilogue computes, so the GPU fuses it into the up-projection) or "gelu" (erf, exact;
    # checkpoints written before this field existed were trained with it)
    ffn_activation: str = "gelu_tanh"

    def __post_init__(self) -> None:
        if len(self.beams) != self.sid_length or self.beams[0] != 1:
            raise ValueError(f"beams must have {self.sid_length} entries starting with 1")
        if any(m < 1 for m in self.beams):
            raise ValueError("beam widths must be positive")
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise ValueError(
                f"ffn_activation must be one of {FFN_ACTIVATIONS}, got {self.ffn_activation!r}"
            )
        for name in ("d_model", "n_heads", "d_head", "d_ff", "decoder_layers", "t_ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @property
    def d_attn(self) -> int:
        return self.n_heads * self.d_head

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known.setdefault("ffn_activation", "gelu")  # written before the field: erf GELU
        if "beams" in known:
            known["beams"] = tuple(known["beams"])  # type: ignore[arg-type]
        return cls(**known)  # type: ignore[arg-type]


PROFILES: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig(
            name="tiny",
            d_model=128,
            n_heads=4,
            d_head=32,
            d_ff=512,
            decoder_layers=2,
            encoder_layers=2,
            encoder_d_ff=256,
            t_ctx=32,
            max_history=64,
            user_hash_buckets=1 << 12,
            beams=(1, 64, 128, 128),
        ),
        ModelConfig(
            name="demo",
            d_model=256,
            n_heads=8,
            d_head=32,
            d_ff=1024,
            decoder_layers=2,
            encoder_layers=2,
            encoder_d_ff=1024,
            t_ctx=64,
            max_history=128,
            beams=(1, 128, 256, 256),
        ),
        # d_ff set so decoder FLOPs per request at beams (1, 512, 1024, 1024) land on the
        # paper's 446 G (service/model/flops.py; tests/service/model/test_flops.py).
        ModelConfig(
            name="paper",
            d_model=1024,
            n_heads=16,
            d_head=128,
            d_ff=7680,
            decoder_layers=3,
            encoder_layers=2,
            encoder_d_ff=4096,
            t_ctx=128,
            max_history=256,
            user_hash_buckets=1 << 20,
            beams=(1, 512, 1024, 1024),
        ),
    )
}


def profile(name: str) -> ModelConfig:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown model profile {name!r}; known: {sorted(PROFILES)}") from None
