"""The decode path on CPU: decoder FLOPs per profile, the tiny profile's per-batch latency
by stage (the served engine and C++ post stage), and the two layout ablations on CPU —
per-beam vs beam-as-query cross-attention (the served dispatcher against
`bench.baselines.cross_attention`), and dense vs paged KV cache: both the textbook loop
(`bench.baselines.ladder.TextbookSearch`, CD mask), whole searches that differ in the
cache alone. Medians (and P99 for the batch latency) of repeated runs in this one process.

    .venv/bin/python bench/bench_decode_cpu.py     # -> bench/results/decode_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.cross_attention import cross_attention_per_beam
from bench.baselines.ladder import Rung, TextbookSearch
from bench.common import percentiles, timed, write_result
from contracts.targeting_codec import codec
from contracts.tensors import RequestTensors
from index_builder.build import assign_sids, build_arrays
from index_builder.catalog import read_catalog
from index_builder.synth import generate_world, load_world
from index_builder.tokenizer import SIDTokenizer, TokenizerConfig
from kernels.cross_attention import cross_attention
from service.decode.engine import DecodeEngine
from service.index.loaded import LoadedIndex
from service.model.config import PROFILES
from service.model.flops import decoder_flops
from service.model.retriever import GenerativeRetriever
from training.data import Examples


def flops_table() -> dict[str, float]:
    out = {name: decoder_flops(c).total / 1e9 for name, c in PROFILES.items()}
    out["paper_fixed_1024"] = decoder_flops(PROFILES["paper"], (1024,) * 4).total / 1e9
    return {k: round(v, 3) for k, v in out.items()}


def tiny_latency(batches: int) -> dict[str, object]:
    config = PROFILES["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        generate_world("tiny", 0, Path(tmp) / "w", progress=False)
        world = load_world(Path(tmp) / "w")
        catalog = read_catalog(world.catalog_parquet, progress=False)
    tok = SIDTokenizer.train(catalog.embedding, TokenizerConfig(), progress=False)
    index = LoadedIndex.from_arrays(build_arrays(catalog, assign_sids(catalog, tok)[0]))
    examples = Examples(world, index.lookup, config)
    torch.manual_seed(0)
    model = GenerativeRetriever(config).eval()
    engine = DecodeEngine(model.decoder, batch_buckets=(16,))
    plans = engine.plan(index.tables, index.level_offsets)
    rng = np.random.default_rng(0)
    stages: dict[str, list[float]] = {k: [] for k in ("features", "encoder", "decode", "post")}
    total = []
    for _ in range(batches + 2):
        users = rng.choice(world.n_users, 16, replace=False)
        t0 = time.perf_counter()
        batch = examples.heldout(users)
        targeting = [world.targeting[u] for u in users.tolist()]
        t1 = time.perf_counter()
        with torch.no_grad():
            ctx = model.encode(batch.features)
        t2 = time.perf_counter()
        enc = codec(index.schema).encode_requests([t.values() for t in targeting])
        reqs = RequestTensors.from_encoded(enc)
        res = engine.run(plans, ctx, reqs, config.beams)
        t3 = time.perf_counter()
        index.post.run([
            index.post_request(*(x.numpy() for x in res.valid(b)), t, 1000)
            for b, t in enumerate(targeting)
        ])  # fmt: skip
        t4 = time.perf_counter()
        for k, v in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[k].append(v * 1e3)
        total.append((t4 - t0) * 1e3)
    drop = slice(2, None)  # warm-up batches
    return {
        "batch_size": 16,
        "beams": list(config.beams),
        "batches": batches,
        "torch_threads": torch.get_num_threads(),
        "total": percentiles(total[drop]),
        **{k: percentiles(v[drop]) for k, v in stages.items()},
    }


def cross_attention_ablation(repeat: int) -> list[dict[str, object]]:
    rows = []
    for name in ("tiny", "demo"):
        c = PROFILES[name]
        b, m = 16, max(c.beams)
        q = torch.randn(b * m, c.n_heads, c.d_head)
        k = torch.randn(b, c.n_heads, c.t_ctx, c.d_head)
        v = torch.randn_like(k)
        args = (q, k, v)
        naive = statistics.median(timed(lambda a=args: cross_attention_per_beam(*a), repeat))
        baq = statistics.median(timed(lambda a=args: cross_attention(*a), repeat))
        shape = {"B": b, "M": m, "H": c.n_heads, "d_h": c.d_head, "T_ctx": c.t_ctx}
        ms = {"per_beam_ms": round(naive, 3), "beam_as_query_ms": round(baq, 3)}
        rows.append({"profile": name, **shape, **ms, "speedup": round(naive / baq, 1)})
    return rows


def kv_cache_ablation(repeat: int) -> dict[str, object]:
    """The whole tiny textbook loop, dense vs paged cache (same model, index, inputs)."""
    from tests.helpers.catalogs import catalog_from_ads
    from tests.helpers.oracle import Ad

    rng = np.random.default_rng(0)
    ads = [Ad(i, tuple(int(x) for x in rng.integers(0, 8, 4))) for i in range(3000)]  # type: ignore[misc]
    cat = catalog_from_ads(ads)
    index = LoadedIndex.from_arrays(build_arrays(cat, cat.sid.astype(np.int64)))
    config = PROFILES["tiny"]
    torch.manual_seed(0)
    model = GenerativeRetriever(config).eval()
    ctx = torch.randn(16, config.t_ctx, config.d_model)
    out = {}
    for kv in ("dense", "paged"):
        search = TextbookSearch(model.decoder, Rung(kv=kv, mask="cd"), index.tables,
                                index.level_offsets)  # fmt: skip
        run = lambda s=search: s.run(ctx, None, config.beams)  # noqa: E731
        out[f"{kv}_ms"] = round(statistics.median(timed(run, repeat)), 3)
    out["speedup"] = round(out["dense_ms"] / out["paged_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/decode_cpu.json")
    args = ap.parse_args()
    figures = {
        "decoder_gflops_per_request": flops_table(),
        "tiny_batch_latency": tiny_latency(args.batches),
        "cross_attention": cross_attention_ablation(args.repeat),
        "kv_cache": kv_cache_ablation(args.repeat),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(f"wrote {write_result('decode_cpu', figures, args.out)}")


if __name__ == "__main__":
    main()
