"""The four-stage pipeline behind the batcher: same answers as the reference path, only
eligible ads, one (model, index) pair per batch across model and index swaps, and a
failing batch fails alone."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.tensors import RequestTensors
from index_builder.build import build_arrays
from index_builder.catalog import read_catalog
from service.batcher import Batcher
from service.decode.fp8_step import FP8DecoderStep
from service.index.loaded import LoadedIndex
from service.model import precision
from service.model.config import PROFILES
from service.model.features import UserFeatures, prepare_features
from service.model.precision import for_serving
from service.model.retriever import GenerativeRetriever
from service.model.static_encoder import StaticEncoder
from service.model.static_features import StaticFeatures
from service.pipeline.records import decode_groups
from service.pipeline.runner import Pipeline
from service.pipeline.runtime import ModelRuntime, Serving, ServingHolder
from service.pipeline.stages import Stages, graph_buckets
from service.post import PostResult
from tests.helpers.catalogs import catalog_from_ads, encode_default
from tests.helpers.oracle import Ad, eligible
from tests.helpers.reference_post import expand_and_filter
from tests.helpers.reference_search import ReferenceBeamSearch
from training.offline import OfflineRetriever

CONFIG = PROFILES["tiny"]
BEAMS = (1, 8, 16, 16)


@dataclass(frozen=True)
class Req:
    user_id: int
    targeting: Targeting
    history_ad_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    history_types: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    history_ts_ms: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_ads: int = 50
    beams: tuple[int, ...] = BEAMS
    filter_mode: FilterMode = FilterMode.CD_GTM
    request_id: str = ""
    adaptive: bool = False


def world(seed: int) -> tuple[list[Ad], LoadedIndex]:
    rng = np.random.default_rng(seed)
    ads = [
        Ad(
            1000 + i,
            tuple(int(x) for x in rng.integers(0, 6, 4)),  # type: ignore[arg-type]
            countries=("US",) if i % 3 == 0 else (),
            genders=("female",) if i % 5 == 0 else (),
            locations=("US/R1",) if i % 7 == 0 else (),
        )
        for i in range(300)
    ]
    cat = catalog_from_ads(ads)
    arrays = build_arrays(cat, cat.sid.astype(np.int64))
    return ads, LoadedIndex.from_arrays(arrays, version=f"v{seed}")


def requests(n: int, ads: list[Ad]) -> list[Req]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        hist = np.array([ads[j].ad_id for j in rng.integers(0, len(ads), 5)], dtype=np.int64)
        out.append(
            Req(
                user_id=i,
                targeting=Targeting(
                    ("US", "CA")[i % 2],
                    20 + i,
                    ("female", "male", "")[i % 3],
                    ("US/R1",) if i % 4 == 0 else (),
                ),
                history_ad_ids=hist,
                history_types=np.ones(5, np.int64),
                history_ts_ms=np.arange(5, dtype=np.int64) * 1000,
                filter_mode=FilterMode.CD_ONLY if i % 5 == 4 else FilterMode.CD_GTM,
            )
        )
    return out


@pytest.fixture(scope="module")
def model() -> GenerativeRetriever:
    torch.manual_seed(0)
    return GenerativeRetriever(CONFIG).eval()


def pair(model: GenerativeRetriever | ModelRuntime, index: LoadedIndex,
         stages: Stages | None = None, version: str = "m1") -> Serving:  # fmt: skip
    """`index` served with `model` (made into a runtime of `stages` unless it is one)."""
    if isinstance(model, GenerativeRetriever):
        model = (stages or Stages("cpu")).runtime(model, version=version)
    return Serving(model, index)


@pytest.fixture
def without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Stages(..., "cuda")` built on a machine without one: its bookkeeping only (buckets,
    padding, graphed modules), nothing runs on a stream."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)


async def serve(
    holder: ServingHolder,
    reqs,
    *,
    fail_stage: str | None = None,
    swap: Serving | None = None,
    static=False,
    stages: Stages | None = None,
):
    stages = stages or Stages("cpu")
    if static:  # the GPU's fixed-shape stages 2 and 3, run eagerly
        runtime, model = holder.current.model, holder.current.model.model
        runtime.embedder = StaticFeatures(model.embedder, CONFIG, batch_buckets=(2, 4))
        runtime.encoder = StaticEncoder(model.encoder, batch_buckets=(2, 4))
    if fail_stage:
        original = getattr(stages, fail_stage)

        def broken(batch, *rest):
            if any(r.user_id == 0 for r in batch.requests):
                raise RuntimeError("boom")
            return original(batch, *rest)

        setattr(stages, fail_stage, broken)
    batcher: Batcher
    pipeline = Pipeline(stages, holder, lambda *done: batcher.batch_done(*done))
    batcher = Batcher(pipeline.dispatch, max_batch=4, max_wait=0.002)
    batcher.start()
    tasks = []
    for i, r in enumerate(reqs):
        tasks.append(asyncio.ensure_future(batcher.submit(r)))
        if swap is not None and i == len(reqs) // 2:
            # once the first batch is answered by the first pair (a condition, not a
            # time): the swap lands while the later batches are queued or in flight
            await asyncio.wait_for(asyncio.wait(tasks[:1]), 60)
            holder.swap(swap)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await batcher.stop()
    pipeline.stop()
    return results


@torch.no_grad()
def reference(model: GenerativeRetriever, index: LoadedIndex, r: Req) -> PostResult:
    """One request on the reference path: encoder, the reference beam search (whole
    prefixes, no KV cache) and the Python post stage."""
    feats = prepare_features(
        [UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types,
                      r.history_ts_ms)], index.lookup, CONFIG)  # fmt: skip
    ctx = model.encode(feats)
    requests = None
    if r.filter_mode != FilterMode.CD_ONLY:
        requests = RequestTensors.from_encoded(encode_default([r.targeting]))
    search = ReferenceBeamSearch(model.decoder, index.tables, index.level_offsets)
    leaves, scores = (x.numpy() for x in search.run(ctx, requests, r.beams, r.filter_mode).valid(0))
    vocabulary = index.vocabularies["locations"]
    return expand_and_filter(index.arrays.ads, vocabulary, leaves, scores, r.targeting, r.max_ads)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_pipeline_answers_like_the_reference_path_and_only_eligible_ads(model, static) -> None:
    ads, index = world(0)
    reqs = requests(10, ads)
    results = asyncio.run(serve(ServingHolder(pair(model, index)), reqs, static=static))
    by_id = {a.ad_id: a for a in ads}
    offline = OfflineRetriever(model, index)  # the served engine and post stage, one thread
    for r, res in zip(reqs, results, strict=True):
        feats = prepare_features(
            [UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types,
                          r.history_ts_ms)], index.lookup, CONFIG)  # fmt: skip
        [served] = offline.retrieve(feats, [r.targeting], r.beams, r.filter_mode, r.max_ads)
        for want in (served, reference(model, index, r)):
            assert res.post.ad_ids.tolist() == want.ad_ids.tolist()
            torch.testing.assert_close(res.post.scores, want.scores)
        assert all(eligible(by_id[a], r.targeting) for a in res.post.ad_ids.tolist())
        assert res.index_version == "v0" and res.model_version == "m1"
        assert set(res.stage_ms) == {"input", "features", "compute", "post"}
        assert 0 < res.sids_generated <= r.beams[-1]


def test_every_batch_uses_one_index_across_a_swap(model) -> None:
    ads0, index0 = world(0)
    _, index1 = world(1)
    first = pair(model, index0)
    holder = ServingHolder(first)
    results = asyncio.run(serve(holder, requests(24, ads0), swap=Serving(first.model, index1)))
    versions = [r.index_version for r in results]
    assert set(versions) == {"v0", "v1"}
    assert versions == sorted(versions)  # requests after the swap got the new index
    assert holder.current.index is index1  # the one swap


def test_a_request_the_swapped_in_schema_cannot_read_gets_no_ads_not_an_error(
    model, tmp_path: Path
) -> None:
    """A request checked against the index served before a swap to one whose schema no
    longer lists its enum value (`platform: web` dropped) is answered with no ads — not a
    guess, and not an error for its whole batch; the others are answered as always."""
    from contracts.targeting_schema import parse

    def index(values: list[str]) -> LoadedIndex:
        schema = parse({"attributes": [{"name": "platform", "kind": "enum",
                        "catalog_field": "platforms", "values": values}]}, "s")  # fmt: skip
        rows = [{"ad_id": 1 + i, "sid": [i % 3, i % 5, i % 2, 0], "platforms": ["ios"] * (i % 2)}
                for i in range(60)]  # fmt: skip
        (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        catalog = read_catalog(tmp_path / "c.jsonl", progress=False, schema=schema)
        arrays = build_arrays(catalog, catalog.sid.astype(np.int64))
        return LoadedIndex.from_arrays(arrays, version="b", schema=schema)

    served = index(["ios", "android"])  # "web" was listed by the index before
    reqs = [Req(user_id=i, targeting=Targeting(attributes=(("platform", (p,)),)), max_ads=100)
            for i, p in enumerate(["web", "ios", "web", "android"])]  # fmt: skip
    results = asyncio.run(serve(ServingHolder(pair(model, served)), reqs))
    for r, res in zip(reqs, results, strict=True):
        assert not isinstance(res, BaseException), res
        platform = r.targeting.attributes[0][1][0]
        if platform == "web":
            assert len(res.post.ad_ids) == 0
        else:  # eligible ads only: no rule, or an ios rule for an ios request
            assert len(res.post.ad_ids) > 0
            assert all(platform == "ios" or (a - 1) % 2 == 0 for a in res.post.ad_ids.tolist())


def test_every_batch_uses_one_model_across_a_model_swap(model) -> None:
    """Requests after a model swap are answered by the new model, each batch by one
    model from stage 1 to the end: its answers are the new model's own."""
    ads, index = world(0)
    torch.manual_seed(1)
    other = GenerativeRetriever(CONFIG).eval()
    stages = Stages("cpu")
    holder = ServingHolder(pair(model, index, stages, "m1"))
    reqs = requests(24, ads)
    results = asyncio.run(serve(holder, reqs, swap=pair(other, index, stages, "m2"), stages=stages))
    versions = [r.model_version for r in results]
    assert set(versions) == {"m1", "m2"} and versions == sorted(versions)
    offline = {"m1": OfflineRetriever(model, index), "m2": OfflineRetriever(other, index)}
    differs = 0
    for r, res in zip(reqs, results, strict=True):
        feats = prepare_features(
            [UserFeatures(r.user_id, r.targeting, r.history_ad_ids, r.history_types,
                          r.history_ts_ms)], index.lookup, CONFIG)  # fmt: skip
        answers = {v: o.retrieve(feats, [r.targeting], r.beams, r.filter_mode, r.max_ads)[0]
                   for v, o in offline.items()}  # fmt: skip
        assert res.post.ad_ids.tolist() == answers[res.model_version].ad_ids.tolist()
        differs += answers["m1"].ad_ids.tolist() != answers["m2"].ad_ids.tolist()
    assert differs > 0  # the two models answer differently: the check above can fail


@pytest.mark.parametrize("stage", ["input", "compute", "post"])
def test_a_failing_batch_fails_alone(model, stage: str, caplog) -> None:
    ads, index = world(0)
    reqs = [dataclasses.replace(r, request_id=f"id-{i}") for i, r in enumerate(requests(12, ads))]
    results = asyncio.run(serve(ServingHolder(pair(model, index)), reqs, fail_stage=stage))
    failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    assert 0 in failed and len(failed) < len(results)
    assert all(not isinstance(r, Exception) for r in results[4:])  # later batches served
    [line] = [r.getMessage() for r in caplog.records if "failed for a batch" in r.getMessage()]
    assert all(f"id-{i}" in line for i in failed)  # the line names each call it failed


def test_every_record_of_a_batch_lives_until_the_device_is_done_with_it(model) -> None:
    """Later stages' streams read a record's device buffers after its stage has returned
    (service/pipeline/runner.py): the records of a batch live until it leaves, and it
    leaves only through `settle` — after its last stage, or after the stage that failed."""
    import gc
    import weakref

    ads, index = world(0)
    stages = Stages("cpu")
    records: dict[int, list[weakref.ref]] = {}
    alive_in_post: list[bool] = []
    settled: list[tuple[str, int | None]] = []
    features, compute, post, settle = stages.features, stages.compute, stages.post, stages.settle

    def keep(batch, record):
        records.setdefault(id(batch), []).append(weakref.ref(record))
        return record

    stages.input = lambda batch, original=stages.input: keep(batch, original(batch))
    stages.features = lambda batch, packed: keep(batch, features(batch, packed))

    def failing_compute(batch, embedded, live):
        if any(r.user_id == 0 for r in batch.requests):
            raise RuntimeError("boom")
        return keep(batch, compute(batch, embedded, live))

    def checked_post(batch, decoded, rows, stage_ms):
        gc.collect()
        alive_in_post.append(all(ref() is not None for ref in records[id(batch)]))
        return post(batch, decoded, rows, stage_ms)

    def recorded_settle(record, failed=None):
        settled.append((type(record).__name__, failed))
        settle(record, failed)

    stages.compute, stages.post = failing_compute, checked_post  # type: ignore[method-assign]
    stages.settle = recorded_settle  # type: ignore[method-assign]
    results = asyncio.run(serve(ServingHolder(pair(model, index, stages)), requests(12, ads),
                                stages=stages))  # fmt: skip
    assert isinstance(results[0], RuntimeError)
    assert alive_in_post and all(alive_in_post)  # Packed and Embedded, still there
    assert ("Embedded", 2) in settled  # the failed batch: after what stage 3 queued
    assert settled.count(("Decoded", None)) == len(alive_in_post)


def test_a_swapped_out_index_is_released_once_no_batch_holds_it(model) -> None:
    import gc
    import weakref

    ads0, index0 = world(0)
    _, index1 = world(1)
    stages = Stages("cpu")  # outlives the swap, as the server's does
    first = pair(model, index0, stages)
    runtime = first.model  # outlives the swap: the model did not change
    holder = ServingHolder(first)
    del first
    asyncio.run(serve(holder, requests(12, ads0), swap=Serving(runtime, index1), stages=stages))
    assert runtime.plans(index1) is runtime.plans(index1)  # plans are kept per version
    ref = weakref.ref(index0)
    del index0
    gc.collect()
    # nothing (pipeline, results, holder, the model's decode plans) keeps the old version
    assert ref() is None
    assert holder.current.index is index1


def test_a_swapped_out_model_is_released_once_no_batch_holds_it(model) -> None:
    import gc
    import weakref

    ads, index = world(0)
    torch.manual_seed(1)
    stages = Stages("cpu")
    holder = ServingHolder(pair(GenerativeRetriever(CONFIG).eval(), index, stages, "old"))
    ref = weakref.ref(holder.current.model)
    asyncio.run(serve(holder, requests(12, ads), swap=pair(model, index, stages, "new"),
                      stages=stages))  # fmt: skip
    gc.collect()
    assert ref() is None and holder.current.model.version == "new"


def test_a_pair_of_two_sid_spaces_cannot_be_made(model) -> None:
    _, index = world(0)
    runtime = Stages("cpu").runtime(model, version="m", sid_space="sid-space:other")
    with pytest.raises(ValueError, match="cannot serve with index v0"):
        Serving(runtime, index)


def test_a_failed_capture_falls_back_to_the_eager_module(model, caplog) -> None:
    class BrokenEncoder(StaticEncoder):
        def warm(self) -> None:
            raise RuntimeError("capture failed")

    class BrokenEmbedder(StaticFeatures):
        def warm(self) -> None:
            raise RuntimeError("capture failed")

    runtime = Stages("cpu").runtime(model, version="m1")
    runtime.encoder = BrokenEncoder(model.encoder)
    runtime._warm_graphs()
    assert runtime.encoder is model.encoder
    assert "eager encoder" in caplog.text
    runtime.embedder = BrokenEmbedder(model.embedder, CONFIG)
    runtime._warm_graphs()
    assert runtime.embedder is model.embedder
    assert "eager embedder" in caplog.text
    encoder = StaticEncoder(model.encoder, batch_buckets=(2,))
    embedder = StaticFeatures(model.embedder, CONFIG, batch_buckets=(2,))
    runtime.encoder, runtime.embedder = encoder, embedder
    runtime._warm_graphs()
    assert runtime.encoder is encoder and list(encoder._plans) == [2]
    assert runtime.embedder is embedder and list(embedder._plans) == [2]


@pytest.mark.parametrize(
    ("max_batch", "want"),
    [
        (16, (2, 4, 6, 8, 10, 12, 14, 16)),
        (32, (2, 4, 6, 8, 10, 12, 14, 16, 32)),
        (7, (2, 4, 6, 7)),
        (1, (1,)),
    ],
)
def test_graph_buckets_always_hold_the_largest_batch(max_batch: int, want) -> None:
    """Every batch the batcher can form has a bucket (a larger max_batch gets its own
    graphs rather than failing its batches), and part-full batches pad to a smaller one."""
    assert graph_buckets(max_batch) == want
    assert graph_buckets(16, (2, 6)) == (2, 6, 16)  # the setting's own sizes
    with pytest.raises(ValueError, match="max_batch"):
        graph_buckets(0)
    for bad in ((8, 4), (4, 4), (0, 8)):
        with pytest.raises(ValueError, match="buckets"):
            graph_buckets(16, bad)


def test_every_graphed_stage_uses_the_buckets_of_max_batch(model, without_gpu) -> None:
    """On GPU the embedder, the encoder and the decode engine share one bucket set that
    holds max_batch: a larger batch setting gets graphs in all three, not eager stages."""
    stages = Stages("cuda", max_batch=32)
    runtime = stages.runtime(model, version="m1")
    assert stages.buckets == graph_buckets(32) == (2, 4, 6, 8, 10, 12, 14, 16, 32)
    assert isinstance(runtime.embedder, StaticFeatures)
    assert isinstance(runtime.encoder, StaticEncoder)
    assert runtime.embedder.buckets == runtime.encoder.buckets == stages.buckets
    assert runtime.engine.batch_buckets == stages.buckets
    coarse = Stages("cuda", max_batch=16, buckets=[8])  # the setting
    runtime = coarse.runtime(model, version="m1")
    assert coarse.buckets == runtime.engine.batch_buckets == (8, 16)
    assert runtime.embedder.buckets == runtime.encoder.buckets == (8, 16)


def test_the_cpu_runs_every_batch_at_its_own_size_on_the_eager_modules(model) -> None:
    stages = Stages("cpu", max_batch=32, buckets=[8])  # the GPU setting: unused
    runtime = stages.runtime(model, version="m1")
    assert stages.buckets == runtime.engine.batch_buckets == tuple(range(1, 33))
    assert runtime.embedder is model.embedder and runtime.encoder is model.encoder


def test_padding_is_what_the_buckets_add_per_decode_group_on_gpu_only(without_gpu) -> None:
    """`grace_batch_padding_total` counts the requests' worth of rows the GPU decodes past
    the batch's requests: each decode group (beam schedule, filter mode) pads to its own
    bucket. The CPU path runs each group at its own size."""

    def groups(*sizes: tuple[int, FilterMode]):
        reqs = [
            SimpleNamespace(beams=(1, 4, 8, 8), filter_mode=mode, adaptive=False)
            for n, mode in sizes
            for _ in range(n)
        ]
        return decode_groups(reqs)

    gtm, cd = FilterMode.CD_GTM, FilterMode.CD_ONLY
    cpu = Stages("cpu", max_batch=16, buckets=[4, 8, 12])
    assert [cpu.padding(groups((n, gtm))) for n in (1, 5, 9, 16)] == [0, 0, 0, 0]
    assert cpu.padding(groups((5, gtm), (5, cd))) == 0
    stages = Stages("cuda", max_batch=16, buckets=[4, 8, 12])
    assert [stages.padding(groups((n, gtm))) for n in (1, 4, 5, 9, 12, 13, 16)] == [
        3, 0, 3, 3, 0, 3, 0
    ]  # fmt: skip
    assert stages.padding(groups((5, gtm), (5, cd))) == 6  # two groups of 5, each in 8
    fine = Stages("cuda", max_batch=16)  # the default: every even size
    assert [fine.padding(groups((n, gtm))) for n in (1, 5, 9, 16)] == [1, 1, 1, 0]
    for too_many in (stages, cpu):
        with pytest.raises(ValueError, match="exceeds the largest bucket"):
            too_many.padding(groups((17, gtm)))


def test_an_fp8_model_serves_only_eligible_ads_through_an_fp8_step(model) -> None:
    """settings `dtype = fp8`: the model's linear layers are made FP8 at load
    (service/model/precision.py) and its engine runs the FP8 step."""
    ads, index = world(0)
    reqs = requests(6, ads)
    stages = Stages("cpu")
    served = pair(for_serving(copy.deepcopy(model), "fp8", "cpu"), index, stages)
    assert isinstance(served.model.engine.step, FP8DecoderStep)
    results = asyncio.run(serve(ServingHolder(served), reqs, stages=stages))
    by_id = {a.ad_id: a for a in ads}
    for r, res in zip(reqs, results, strict=True):
        assert all(eligible(by_id[a], r.targeting) for a in res.post.ad_ids.tolist())
    assert sum(len(res.post.ad_ids) for res in results) > 0


def test_fp8_on_a_gpu_without_fp8_is_refused_in_one_line(
    without_gpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"dtype fp8 needs a GPU with FP8 .*NVIDIA A100 is not"):
        precision.check("fp8", "cuda")
    precision.check("bfloat16", "cuda")  # bf16 there is fine
