"""The pipeline's CUDA streams never let one batch read another's buffers (GPU only).

Each stage allocates its record on its own stream and the next stages' streams read it.
The caching allocator hands a freed block to the next allocation on the stream that made
it without waiting for the other streams, so a record freed while a later stream still
has to read it is refilled with the next batch's data (on the H200, under a model swap,
an out-of-range embedding index that killed a worker: service/pipeline/runner.py). Here
the stage 2 and stage 3 streams are held back with a GPU sleep queued before they read
their inputs, while the host runs ahead packing the next batches: what each stream reads
must still be its own batch's data.
"""

from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest
import torch

from service.index.loaded import LoadedIndex
from service.model.features import FeatureBatch, UserFeatures, prepare_features
from service.model.retriever import GenerativeRetriever
from service.pipeline.runtime import Serving, ServingHolder
from service.pipeline.stages import Stages
from tests.service.pipeline.test_pipeline import BEAMS, CONFIG, requests, serve, world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time before each held-back read


def tensors(record: object, kind: type | None = None) -> dict[str, torch.Tensor]:
    """The tensor fields of a record (those of the dataclass `kind`, default its own)."""
    return {f.name: getattr(record, f.name) for f in fields(kind or record)}  # type: ignore[arg-type]


def late_copy(stream: torch.cuda.Stream, event: torch.cuda.Event,
              inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """`inputs` as `stream` reads them after a GPU sleep queued behind `event`."""
    with torch.cuda.stream(stream):
        stream.wait_event(event)
        torch.cuda._sleep(SLEEP_CYCLES)
        return {k: t.clone() for k, t in inputs.items()}


def test_every_stage_reads_its_own_batch_however_far_the_device_lags() -> None:
    torch.manual_seed(0)
    model = GenerativeRetriever(CONFIG).eval().to("cuda")
    ads, cpu_index = world(0)
    index = LoadedIndex.from_arrays(cpu_index.arrays, version="v0", device="cuda")
    stages = Stages("cuda", max_batch=4)
    runtime = stages.runtime(model, version="m1")
    runtime.prepare(index, BEAMS)
    features, compute = stages.features, stages.compute
    read_by_stage2: list[tuple[list[int], dict[str, torch.Tensor]]] = []  # (users, inputs)
    made: dict[int, dict[str, torch.Tensor]] = {}  # stage 2's outputs, per batch
    read_by_stage3: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def held_features(batch, packed):
        late = late_copy(stages.streams[1], packed.event, tensors(packed.features, FeatureBatch))
        read_by_stage2.append(([r.user_id for r in batch.requests], late))
        out = features(batch, packed)
        with torch.cuda.stream(stages.streams[1]):  # read on the stream that made them
            made[id(batch)] = {k: t.clone() for k, t in tensors(out.embedded).items()}
        return out

    def held_compute(batch, embedded, live):
        late = late_copy(stages.streams[2], embedded.event, tensors(embedded.embedded))
        read_by_stage3.append((made[id(batch)], late))
        return compute(batch, embedded, live)

    stages.features = held_features  # type: ignore[method-assign]
    stages.compute = held_compute  # type: ignore[method-assign]
    reqs = requests(32, ads)
    results = asyncio.run(serve(ServingHolder(Serving(runtime, index)), reqs, stages=stages))
    assert not [r for r in results if isinstance(r, Exception)]
    torch.cuda.synchronize()
    by_user = {r.user_id: r for r in reqs}
    assert len(read_by_stage2) >= 4  # several batches, packed while the device lagged
    for users, got in read_by_stage2:
        want = prepare_features(
            [UserFeatures(u, by_user[u].targeting, by_user[u].history_ad_ids,
                          by_user[u].history_types, by_user[u].history_ts_ms) for u in users],
            index.lookup, CONFIG,
        )  # fmt: skip
        for name, tensor in got.items():
            assert torch.equal(tensor.cpu(), getattr(want, name)), f"stage 2 read another {name}"
    for want, got in read_by_stage3:
        for name in want:
            assert torch.equal(want[name], got[name]), f"stage 3 read another batch's {name}"
