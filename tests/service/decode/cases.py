"""Shared cases of the decode tests: small catalogs, a small decoder, both searches over one
index — the served `DecodeEngine` and the oracle `ReferenceBeamSearch` — behind one
`run(ctx, requests, beams, mode)` call, and the comparison of two `DecodeResult`s."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from contracts.index_arrays import IndexArrays
from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.tensors import GtmTables, RequestTensors
from index_builder.build import build_arrays
from index_builder.kway import KwaySpec
from service.decode.engine import DecodeEngine
from service.decode.kv_cache import PagedKVCache
from service.decode.plans import DecodeResult, IndexPlans
from service.model.config import PROFILES, ModelConfig
from service.model.decoder import SIDDecoder
from service.model.precision import quantize_decoder
from tests.helpers.catalogs import catalog_from_ads, encode_default
from tests.helpers.oracle import Ad
from tests.helpers.reference_search import ReferenceBeamSearch

CONFIG = dataclasses.replace(PROFILES["tiny"], d_model=32, n_heads=2, d_head=16, d_ff=64, t_ctx=6)
WIDE = (1, 512, 512, 512)  # wider than any level of the test catalogs
TARGETING = [
    Targeting("US", 30, "female", ("US/R1",)),
    Targeting("CA", 0, "", ()),
    Targeting("GB", 50, "male", ("GB/R3", "elsewhere", "US/R1", "x", "y")),
    Targeting("FR", 16, "", ("US/R1", "CA/R2")),
    Targeting(),
]


def make_ads(n: int = 40, seed: int = 0) -> list[Ad]:
    rng = np.random.default_rng(seed)
    countries, locs = ("US", "CA", "GB"), ("US/R1", "CA/R2", "GB/R3")
    ads = []
    for i in range(n):
        sid = tuple(int(x) for x in rng.integers(0, 3, 4))
        ads.append(
            Ad(
                500 + i,
                sid,  # type: ignore[arg-type]
                countries=tuple(rng.choice(countries, rng.integers(0, 2), replace=False)),
                age_buckets=("25-34",) if rng.random() < 0.3 else (),
                genders=("female",) if rng.random() < 0.2 else (),
                locations=tuple(rng.choice(locs, rng.integers(0, 2), replace=False)),
            )
        )
    return ads


def decoder_with_biases(config: ModelConfig, device: str = "cpu", seed: int = 0) -> SIDDecoder:
    """Random weights and non-zero biases/LayerNorm affines: a pending bias that is lost
    or added twice must show."""
    torch.manual_seed(seed)
    decoder = SIDDecoder(config).to(device).eval()
    with torch.no_grad():
        for p in decoder.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.2)
    return decoder


def run_steps(
    decoder: SIDDecoder,
    step,  # a DecoderStep: (tokens, t, cross, cache) -> logits
    batch: int,
    beams: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of every step of a 4-step search with random (seeded) parents and tokens,
    and each step's teacher-forced logits: `forward_train` of `decoder` over every row's
    prefix."""
    c = decoder.config
    rows = [batch * m for m in beams]
    cache = PagedKVCache(c.decoder_layers, c.n_heads, c.d_head, rows, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(batch, c.t_ctx, c.d_model, generator=g).to(device, dtype)
    cross = decoder.cross_kv(ctx)
    tokens = torch.full((rows[0],), c.vocab_size, device=device)
    prefix = torch.zeros(rows[0], 0, dtype=torch.int64, device=device)
    got, want = [], []
    with torch.no_grad():
        for t in range(len(beams)):
            got.append(step(tokens, t, cross, cache))
            request = torch.arange(rows[t], device=device) // beams[t]
            pad = torch.zeros(rows[t], c.sid_length - t, dtype=torch.int64, device=device)
            sid = torch.cat([prefix, pad], dim=1)  # position t reads tokens < t only
            want.append(decoder.forward_train(ctx[request], sid)[:, t])
            if t + 1 < len(beams):
                m, n = beams[t], beams[t + 1]
                j = torch.randint(0, m, (batch * n,), generator=g)
                parent = (torch.arange(batch * n) // n * m + j).to(device)  # within request
                cache.reorder(t, parent)
                tokens = torch.randint(0, c.vocab_size, (batch * n,), generator=g).to(device)
                prefix = torch.cat([prefix[parent], tokens[:, None]], dim=1)
    return got, want


class Served:
    """A `DecodeEngine` and its plans for one index, called like `ReferenceBeamSearch`."""

    def __init__(self, engine: DecodeEngine, tables: GtmTables, level_offsets: torch.Tensor):
        self.engine = engine
        self.plans: IndexPlans = engine.plan(tables, level_offsets)

    def run(
        self,
        ctx: torch.Tensor,
        requests: RequestTensors | None,
        beams: tuple[int, ...],
        mode: FilterMode = FilterMode.CD_GTM,
    ) -> DecodeResult:
        return self.engine.run(self.plans, ctx, requests, beams, mode)


@dataclass
class Case:
    """One index, one decoder, and the searches over them."""

    index: IndexArrays
    decoder: SIDDecoder
    tables: GtmTables
    level_offsets: torch.Tensor
    reference: ReferenceBeamSearch

    def served(self, *, fp8: bool = False, **kwargs) -> Served:
        """The served engine on this case's index (`kwargs`: DecodeEngine's); `fp8`: on a
        copy of the decoder made FP8 as a load makes it (service/model/precision.py)."""
        decoder = quantize_decoder(copy.deepcopy(self.decoder)) if fp8 else self.decoder
        return Served(DecodeEngine(decoder, **kwargs), self.tables, self.level_offsets)


def setup(ads: list[Ad], seed: int = 0, kway: KwaySpec | None = None) -> Case:
    """The index of `ads` (with k-way matchers per `kway`) and a seeded decoder."""
    cat = catalog_from_ads(ads)
    index = build_arrays(cat, cat.sid.astype(np.int64), kway)
    torch.manual_seed(seed)
    decoder = SIDDecoder(CONFIG).eval()
    tables = GtmTables.from_arrays(index.trie, index.kway)
    level_offsets = torch.from_numpy(index.trie.level_offsets)
    reference = ReferenceBeamSearch(decoder, tables, level_offsets)
    return Case(index, decoder, tables, level_offsets, reference)


def ctx_for(b: int, seed: int = 1, d_model: int = CONFIG.d_model) -> torch.Tensor:
    return torch.randn(b, CONFIG.t_ctx, d_model, generator=torch.Generator().manual_seed(seed))


def requests(ts: list[Targeting], device: str = "cpu") -> RequestTensors:
    return RequestTensors.from_encoded(encode_default(ts), device)


def assert_same(got: DecodeResult, want: DecodeResult) -> None:
    """Same live SIDs (in order) and dead slots; scores equal up to float rounding."""
    assert torch.equal(got.leaves.cpu(), want.leaves.cpu())
    torch.testing.assert_close(got.scores.cpu(), want.scores.cpu(), rtol=1e-4, atol=1e-4)
    live = want.leaves.cpu() >= 0
    assert torch.equal(got.sids.cpu()[live], want.sids.cpu()[live])
    assert got.rows_per_step == want.rows_per_step


def shuffling_topk(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Patch `Tensor.topk`: an unsorted top-k (what the engine asks for before the last
    step) comes back in a random order within each row; returns one entry per shuffle."""
    gen = torch.Generator().manual_seed(0)
    shuffled: list[bool] = []
    real = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        top, flat = real(self, k, dim=dim, largest=largest, sorted=sorted)
        if sorted:
            return top, flat
        assert dim in (1, -1) and top.dim() == 2
        perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(top.shape[0])])
        perm = perm.to(top.device)
        shuffled.append(True)
        return top.gather(1, perm), flat.gather(1, perm)

    monkeypatch.setattr(torch.Tensor, "topk", topk)
    return shuffled


def check_teacher_forcing(step_of, cache) -> None:
    """`step_of(decoder)`'s logits over `cache` (2 rows, 4 steps, rows never reordered)
    equal `forward_train`'s for two fixed SIDs."""
    torch.manual_seed(0)
    decoder = SIDDecoder(CONFIG).eval()
    ctx = ctx_for(2)
    sid = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    with torch.no_grad():
        want = decoder.forward_train(ctx, sid)
        cross = decoder.cross_kv(ctx)
        step = step_of(decoder)
        tokens = torch.full((2,), decoder.bos)
        for t in range(4):
            got = step(tokens, t, cross, cache)
            torch.testing.assert_close(got, want[:, t], rtol=1e-4, atol=1e-5)
            tokens = sid[:, t]
            if t < 3:
                cache.reorder(t, torch.arange(2))


def check_served_buckets_on_gpu(make_engine) -> None:
    """`make_engine(decoder)` against the reference search on CUDA over the served graph
    buckets (one part and two), both filter modes; 8 graphs captured."""
    case = setup(make_ads(200, seed=3))
    decoder = case.decoder.cuda()
    tables = GtmTables.from_arrays(case.index.trie, device="cuda")
    search = ReferenceBeamSearch(decoder, tables, case.level_offsets)
    engine = make_engine(decoder)
    plans = engine.plan(tables, case.level_offsets)
    for b in (1, 5, 10, 13):  # the served buckets 2, 6 (one part), 10 and 14 (two parts)
        ctx = ctx_for(b).cuda()
        reqs = requests((TARGETING * 4)[:b], "cuda")
        for mode in (FilterMode.CD_ONLY, FilterMode.CD_GTM):
            got = engine.run(plans, ctx, reqs, (1, 8, 16, 12), mode)
            assert_same(got, search.run(ctx, reqs, (1, 8, 16, 12), mode))
    assert plans.graphs == 8
