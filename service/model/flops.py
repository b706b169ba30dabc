"""FLOP counter for the model: decoder FLOPs per request by step and term, arithmetic on a
`ModelConfig` (the `paper` profile's sizing, the benchmarks' FLOP floor, `grace flops`).
Matmuls only, a multiply-add = 2 FLOPs; step t's rows attend to the t tokens of their
prefix; the cross K/V projection runs once per request per layer (`once`). What is counted
and why: docs/MODEL.md "Profiles".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.model.config import ModelConfig

DECODER_TERMS = (
    "self_attn_proj",  # QKV + output projections of self-attention
    "self_attn_scores",  # Q·K^T and P·V over the <= 4-token prefix
    "cross_proj",  # cross-attention Q + output projections
    "cross_scores",  # Q·K^T and P·V over the T_ctx context tokens
    "ffn",  # d_model -> d_ff -> d_model
    "head",  # d_model -> vocab_size
)
CROSS_KV = "cross_kv"  # context K/V projections, once per request per layer


@dataclass(frozen=True)
class FlopReport:
    """Decoder FLOPs of one request: per step and term, plus the once-per-request K/V."""

    config_name: str
    beams: tuple[int, ...]  # (M_1, ..., M_L): rows per request at each step
    steps: tuple[dict[str, int], ...]  # [L_SID] term -> FLOPs at that step
    once: dict[str, int]  # term -> FLOPs once per request (cross K/V)

    def step_total(self, t: int) -> int:
        """FLOPs of step t (1-based), without the once-per-request terms."""
        return sum(self.steps[t - 1].values())

    def term_total(self, term: str) -> int:
        if term in self.once:
            return self.once[term]
        return sum(s[term] for s in self.steps)

    @property
    def total(self) -> int:
        return sum(sum(s.values()) for s in self.steps) + sum(self.once.values())

    def table(self) -> str:
        """A fixed-width GFLOP table: terms as rows, steps and the total as columns."""
        n = len(self.steps)
        head = ["term"] + [f"t={t} (M={m})" for t, m in enumerate(self.beams, 1)] + ["total"]
        rows = [
            [term] + [_g(s[term]) for s in self.steps] + [_g(self.term_total(term))]
            for term in DECODER_TERMS
        ]
        rows += [[k] + ["-"] * n + [_g(v)] for k, v in self.once.items()]
        rows.append(["total", *(_g(self.step_total(t)) for t in range(1, n + 1)), _g(self.total)])
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

        def line(cells: list[str]) -> str:  # the term column left-aligned, numbers right
            pairs = enumerate(zip(cells, widths, strict=True))
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

        title = f"decoder GFLOPs per request, profile {self.config_name}, beams {self.beams}"
        return "\n".join([title, *(line(r) for r in [head, *rows])])


def _g(flops: int) -> str:
    return f"{flops / 1e9:.3f}"


def decoder_flops(config: ModelConfig, beams: Sequence[int] | None = None) -> FlopReport:
    """Decoder FLOPs per request at `beams` (default `config.beams`); see module docstring."""
    beams = tuple(config.beams if beams is None else beams)
    if len(beams) != config.sid_length or any(m < 1 for m in beams):
        raise ValueError(f"beams must be {config.sid_length} positive widths, got {beams}")
    d, da, layers = config.d_model, config.d_attn, config.decoder_layers
    steps = []
    for t, m in enumerate(beams, start=1):
        per_layer = {
            "self_attn_proj": 2 * d * 3 * da + 2 * da * d,
            "self_attn_scores": 2 * (2 * t * da),
            "cross_proj": 2 * d * da + 2 * da * d,
            "cross_scores": 2 * (2 * config.t_ctx * da),
            "ffn": 2 * d * config.d_ff + 2 * config.d_ff * d,
        }
        step = {k: m * layers * v for k, v in per_layer.items()}
        step["head"] = m * 2 * d * config.vocab_size
        steps.append(step)
    once = {CROSS_KV: layers * 2 * config.t_ctx * d * 2 * da}
    return FlopReport(config.name, beams, tuple(steps), once)


def encoder_flops(config: ModelConfig, history_len: int) -> int:
    """Estimated encoder FLOPs per request for `history_len` real events (matmuls only),
    following `ContextEncoder`: per interaction layer the summary projections, joint
    attention over S = 4 + history_len tokens and the FFN; then the readout."""
    from service.model.embeddings import NUM_NONSEQ_TOKENS

    d, da, dff, t = config.d_model, config.d_attn, config.encoder_d_ff, config.t_ctx
    s = NUM_NONSEQ_TOKENS + min(history_len, config.max_history)

    def attention(q_len: int, kv_len: int) -> int:
        proj = 2 * q_len * d * da + 2 * kv_len * d * 2 * da + 2 * q_len * da * d
        return proj + 2 * (2 * q_len * kv_len * da)

    summaries = 2 * d * d + 2 * d * 2 * d  # seq -> non-seq and FiLM projections
    layer = summaries + attention(s, s) + 4 * s * d * dff
    readout = attention(t, s) + 4 * t * d * dff
    return config.encoder_layers * layer + readout
