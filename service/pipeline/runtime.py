"""What one batch runs on: a model version as the pipeline runs it (`ModelRuntime`), the
(model, index) pair it is served with (`Serving`) and the holder of the current pair. A
batch takes `ServingHolder.current` once, at dispatch, and keeps it to the end; an old
model or index is freed with the last batch holding it (an index's decode plans live in a
weak map of the runtime, so they go with either). docs/ARCHITECTURE.md §2, §3.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from contracts.request import Scoring
from service.decode.engine import DecodeEngine
from service.decode.plans import IndexPlans
from service.index.loaded import LoadedIndex
from service.model import gate
from service.model.config import ModelConfig
from service.model.embeddings import FeatureEmbedder
from service.model.encoder import ContextEncoder
from service.model.precision import serves_in
from service.model.retriever import GenerativeRetriever
from service.model.static_encoder import StaticEncoder
from service.model.static_features import StaticFeatures

log = logging.getLogger("grace.pipeline")


class ModelRuntime:
    """A model version with its decode engine, embedder, encoder and plans per index."""

    def __init__(
        self,
        model: GenerativeRetriever,
        *,
        version: str,  # the repository version (directory name), or the checkpoint's name
        model_version: str,  # the checkpoint's own name (what responses carry)
        sid_space: str,  # contracts/sid_space.py: an index must carry the same key
        device: torch.device,
        buckets: tuple[int, ...],
        locations: tuple[int, ...],
        meta: dict[str, Any] | None = None,  # the checkpoint's config.json
        scoring: Scoring = "masked",  # the decode steps' log-softmax (settings `scoring`)
    ) -> None:
        self.model = model.eval()
        self.version, self.model_version, self.sid_space = version, model_version, sid_space
        self.meta = meta or {}
        self.device, self.buckets = device, buckets
        self.cuda = device.type == "cuda"
        self.loaded_at = time.time()
        self.engine = DecodeEngine(
            model.decoder, batch_buckets=buckets, location_buckets=locations, scoring=scoring
        )
        self._plans: weakref.WeakKeyDictionary[LoadedIndex, IndexPlans] = (
            weakref.WeakKeyDictionary()
        )  # an index version's plans go with the version
        self._plans_lock = threading.Lock()
        self._graphs_warm = False
        self._gated = False  # passed the model gate (`prepare`)
        # GPU: the embedder and the encoder as CUDA graphs over padded buckets (a replay
        # instead of ~20 and ~150 launches from their threads); CPU: eager, as they are
        self.embedder: StaticFeatures | FeatureEmbedder = model.embedder
        self.encoder: StaticEncoder | ContextEncoder = model.encoder
        if self.cuda:
            self.embedder = StaticFeatures(model.embedder, model.config, buckets)
            self.encoder = StaticEncoder(model.encoder, buckets)

    @property
    def dtype(self) -> str:
        """What the model serves in (`service/model/precision.py`): fp8, bfloat16 or float32."""
        return serves_in(self.model)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def plans(self, index: LoadedIndex) -> IndexPlans:
        """The decode plans of `index` for this model (made on first use)."""
        with self._plans_lock:
            plans = self._plans.get(index)
            if plans is None:
                plans = self._plans[index] = self.engine.plan(index.tables, index.level_offsets)
            return plans

    def prepare(
        self,
        index: LoadedIndex,
        beams: tuple[int, ...],
        pace: Callable[[], None] | None = None,
        rungs: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        """Before a pair serves: make the index's decode plans; on GPU capture the graphs
        of the default schedule `beams`, of the narrower `rungs` load may bring
        (service/beam_ladder.py) and, once per model, the embedder's and the encoder's.
        Before the model first serves, the model gate (`gate.py`, ModelRefused): its
        weights first, a canary through what was made last. `pace` is called after each
        capture (`service/pace.py`)."""
        if not self._gated:
            gate.check_finite(self.model.state_dict(), f"model {self.model_version}")
        plans = self.plans(index)
        if self.cuda:
            if not self._graphs_warm:
                self._warm_graphs(pace)
                self._graphs_warm = True
            t0 = time.perf_counter()
            # both filter modes; every Bloom row count up to the schema's most values
            most = max((a.max_request_values for a in index.schema.families), default=1)
            rows = tuple(sorted({*self.engine.location_buckets, most}))
            schedules = tuple(dict.fromkeys((beams, *rungs)))
            n, each = 0, []
            for schedule in schedules:  # `warm` counts every plan made so far
                t1, held = time.perf_counter(), torch.cuda.memory_reserved(self.device)
                before, n = n, self.engine.warm(plans, schedule, locations=rows, pace=pace)
                grew = (torch.cuda.memory_reserved(self.device) - held) / 2**20
                each.append(f"{schedule}: {n - before} in {time.perf_counter() - t1:.1f} s, "
                            f"+{grew:.0f} MiB")  # fmt: skip
            log.info("model %s, index %s: %d decode plans captured as CUDA graphs in %.1f s "
                     "(per beam schedule: %s)", self.model_version, index.version, n,
                     time.perf_counter() - t0, "; ".join(each))  # fmt: skip
        if not self._gated:  # not later: those prepares run beside its graphs serving
            gate.check_answers(self, index, beams)
            self._gated = True

    def _warm_graphs(self, pace: Callable[[], None] | None = None) -> None:
        """Capture the embedder's and the encoder's graphs; where that fails, serve with
        the eager module rather than not at all."""
        for name in ("embedder", "encoder"):
            static = getattr(self, name)
            if not isinstance(static, StaticFeatures | StaticEncoder):
                continue
            t0 = time.perf_counter()
            try:
                static.warm(pace)
            except Exception:
                log.exception("capturing the %s's CUDA graphs failed: eager %s", name, name)
                setattr(self, name, getattr(self.model, name))
            else:
                log.info("%s: CUDA graphs for buckets %s captured in %.1f s", name,
                         static.buckets, time.perf_counter() - t0)  # fmt: skip


@dataclass(frozen=True, eq=False)  # identity equality: one pair is one object
class Serving:
    """The (model, index) pair a batch uses from stage 1 to the end: they share a SID
    space (the rollout checks it before the pair serves)."""

    model: ModelRuntime
    index: LoadedIndex

    def __post_init__(self) -> None:
        if self.model.sid_space != self.index.sid_space:
            raise ValueError(
                f"model {self.model.model_version} (SID space {self.model.sid_space}) cannot serve "
                f"with index {self.index.version} (SID space {self.index.sid_space})"
            )


class ServingHolder:
    """The current pair; swaps are atomic with respect to `current`."""

    def __init__(self, serving: Serving | None = None) -> None:
        self._lock = threading.Lock()
        self._serving = serving

    @property
    def current(self) -> Serving:
        with self._lock:
            if self._serving is None:
                raise RuntimeError("no model and index loaded yet")
            return self._serving

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._serving is not None

    def swap(self, serving: Serving) -> Serving | None:
        with self._lock:
            old, self._serving = self._serving, serving
        return old
