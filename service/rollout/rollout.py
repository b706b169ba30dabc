"""Model and index rollout without a restart (the policy: docs/SERVICE.md, the rollout
paragraphs; docs/ARCHITECTURE.md §3). `Rollout` follows both roots' `CURRENT`, loads and
verifies newcomers off the request path, and swaps in the first pair that shares a SID
space (both targets, else the new model with the served index, else the served model with
the new index) once its decode plans are prepared; a newcomer that fits no partner waits,
loaded, for one. The app calls `check_once` at start-up, where a `CURRENT` pair that
cannot serve falls back to the newest pair that does (models outer, indexes inner, SID
spaces compared before anything loads), then `start` polls on a thread of its own, and
on another applies the live changes published over the served index every `live_seconds`
(`service/index/live.py`); a new index catches up with the served one's live changes
before it swaps in, so no reply goes back in `catalog_seq`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from service.index.live import LiveEligibility, follow
from service.index.loaded import LoadedIndex
from service.pipeline.runtime import ModelRuntime, Serving, ServingHolder
from service.rollout.follower import Follower

log = logging.getLogger("grace.rollout")

# how long a new index may take to catch up with the served one's live changes (the
# builder republishes the feed over a new version within a poll of it) before it swaps in
LIVE_CATCH_UP_SECONDS = 10.0


class Rollout:
    """Follows a model root and an index root for one `ServingHolder`."""

    def __init__(
        self,
        models: Follower[ModelRuntime],
        indexes: Follower[LoadedIndex],
        holder: ServingHolder,
        *,
        device: str = "cpu",
        poll_seconds: float = 2.0,
        prepare: Callable[[ModelRuntime, LoadedIndex], None] = lambda model, index: None,
        on_swap: Callable[[Serving, Serving | None], None] = lambda new, old: None,
        on_incompatible: Callable[[str, str], None] = lambda kind, version: None,
        one_at_a_time: Callable[[], AbstractContextManager[object]] = nullcontext,
        live_seconds: float = 0.1,
        on_live: Callable[[LiveEligibility, dict[str, int]], None] = lambda live, ops: None,
    ) -> None:
        """`one_at_a_time`: held while a newcomer loads, prepares and swaps in (not at
        start-up; the app's is host-wide, `host_lock.py`)."""
        self.models, self.indexes, self.holder = models, indexes, holder
        self.device, self.poll_seconds = device, poll_seconds
        self._prepare, self._on_swap, self._on_incompatible = prepare, on_swap, on_incompatible
        self._one_at_a_time = one_at_a_time
        self.live_seconds, self._on_live = live_seconds, on_live
        self._live_thread: threading.Thread | None = None
        self._staged: dict[str, ModelRuntime | LoadedIndex] = {}  # loaded, waiting for a partner
        self._refused: set[tuple[str, str]] = set()  # (model, index) versions found unfit
        self._unfit: list[str] = []  # start-up: pairs refused for their SID spaces
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_fault: str | None = None
        # one stream for every load and capture, drawn once: torch hands streams out of a
        # small pool in rotation, and a stream drawn per load would in time be one a
        # pipeline stage runs on (its work queued behind a gigabyte copy)
        self._stream = (
            torch.cuda.Stream(torch.device(device)) if device.startswith("cuda") else None
        )

    @property
    def model_behind(self) -> bool:
        """True while the served model is not the version its CURRENT names."""
        return self._behind(self.models.target, "model")

    @property
    def index_behind(self) -> bool:
        """True while the served index is not the version its CURRENT names."""
        return self._behind(self.indexes.target, "index")

    def _behind(self, target: str | None, kind: str) -> bool:
        if target is None:
            return False
        if not self.holder.ready:
            return True
        return getattr(self.holder.current, kind).version != target

    def why_none(self) -> str:
        """Why nothing serves after `check_once`: each version tried and why it was refused."""
        parts = [f"models: {'; '.join(self.models.reasons())}",
                 f"indexes: {'; '.join(self.indexes.reasons())}"]  # fmt: skip
        if self._unfit:
            parts.append(f"SID spaces: {'; '.join(self._unfit)}")
        return " | ".join(parts)

    def check_once(self) -> bool:
        """Load what CURRENT names if it is new and due; True when a swap happened."""
        model_target, index_target = self.models.read(), self.indexes.read()
        if not self.holder.ready:
            if model_target is None or index_target is None:
                return False
            return self._first_load(model_target, index_target)
        cur = self.holder.current
        want_model = model_target or cur.model.version
        want_index = index_target or cur.index.version
        for kind, want in (("model", want_model), ("index", want_index)):
            staged = self._staged.get(kind)
            if staged is not None and staged.version != want:
                del self._staged[kind]  # CURRENT moved on: free what waited
        if (want_model, want_index) == (cur.model.version, cur.index.version):
            return False
        with self._one_at_a_time():
            return self._advance(cur, want_model, want_index)

    def _advance(self, cur: Serving, want_model: str, want_index: str) -> bool:
        """Load what is new of the wanted pair and swap in the best pair that serves."""
        model = cur.model if want_model == cur.model.version else self._get("model", want_model)
        index = cur.index if want_index == cur.index.version else self._get("index", want_index)
        options = []
        if model is not None and index is not None:
            options.append((model, index))
        if model is not None and model is not cur.model:
            options.append((model, cur.index))
        if index is not None and index is not cur.index:
            options.append((cur.model, index))
        for m, i in options:
            if m.sid_space == i.sid_space:
                return self._swap(m, i)
        if model is not None and model is not cur.model:
            self._refuse("model", model, index or cur.index)
        if index is not None and index is not cur.index:
            self._refuse("index", index, model or cur.model)
        return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grace-rollout", daemon=True)
        self._thread.start()
        self._live_thread = threading.Thread(
            target=follow, args=(self._served_live, self._stop, self.live_seconds, self._on_live),
            name="grace-live", daemon=True,
        )  # fmt: skip
        self._live_thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._live_thread):
            if thread is not None:
                thread.join(10)

    def _served_live(self) -> LiveEligibility | None:
        return self.holder.current.index.live if self.holder.ready else None

    def _catch_up(self, new: LiveEligibility, served: LiveEligibility) -> None:
        """`new` applies the live changes at least as far as `served` has (waiting up to
        LIVE_CATCH_UP_SECONDS for the builder to publish them over it)."""
        deadline = time.monotonic() + LIVE_CATCH_UP_SECONDS
        new.catch_up()
        while new.seq < served.seq and time.monotonic() < deadline:
            time.sleep(0.02)
            new.catch_up()
        if new.seq < served.seq:
            log.warning("index %s swaps in at catalog_seq %d, behind the served %d: the "
                        "builder has not published the changes over it yet", new.version,
                        new.seq, served.seq)  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check_once()
            except Exception as exc:  # never let the rollout die; say so once per fault
                if repr(exc) != self._loop_fault:
                    self._loop_fault = repr(exc)
                    log.exception("rollout error")

    def _get(self, kind: str, version: str) -> ModelRuntime | LoadedIndex | None:
        staged = self._staged.get(kind)
        if staged is not None and staged.version == version:
            return staged
        with self._side_stream():
            loaded = self._follower(kind).load(version)
        if loaded is not None:
            self._staged[kind] = loaded
        return loaded

    def _refuse(self, kind: str, newcomer: ModelRuntime | LoadedIndex,
                partner: ModelRuntime | LoadedIndex) -> None:  # fmt: skip
        """Count and log, once per pair, a newcomer whose SID space fits no partner."""
        pair = ((newcomer.version, partner.version) if kind == "model"
                else (partner.version, newcomer.version))  # fmt: skip
        if pair in self._refused:
            return
        self._refused.add(pair)
        other = "index" if kind == "model" else "model"
        cur = self.holder.current
        log.error(
            "%s %s refused: its SID space %s is not that of %s %s (%s); still serving model "
            "%s with index %s — it swaps in once %s's CURRENT names a version of its SID space",
            kind, newcomer.version, newcomer.sid_space, other, partner.version,
            partner.sid_space, cur.model.version, cur.index.version, other,
        )  # fmt: skip
        self._on_incompatible(kind, newcomer.version)

    def _swap(self, model: ModelRuntime, index: LoadedIndex) -> bool:
        old = self.holder.current if self.holder.ready else None
        t0 = time.perf_counter()
        try:
            with self._side_stream():
                self._prepare(model, index)
        except Exception as exc:
            for kind, new in (("model", model), ("index", index)):
                if old is None or new is not getattr(old, kind):
                    self._staged.pop(kind, None)
                    self._follower(kind).failed(new.version, exc)
            return False
        serving = Serving(model, index)
        if old is not None and index is not old.index:
            self._catch_up(index.live, old.index.live)
        self.holder.swap(serving)
        for kind in ("model", "index"):
            if self._staged.get(kind) is getattr(serving, kind):
                del self._staged[kind]
        log.info("serving model %s with index %s (was %s), prepared in %.1f s",
                 model.model_version, index.version, "nothing" if old is None else
                 f"model {old.model.model_version} with index {old.index.version}",
                 time.perf_counter() - t0)  # fmt: skip
        self._on_swap(serving, old)
        return True

    def _first_load(self, model_target: str, index_target: str) -> bool:
        """The CURRENT pair, else the newest pair that loads (module docstring)."""
        index_versions = [index_target, *self.indexes.fallbacks(index_target)]
        index_spaces = {i: self.indexes.space(i) for i in index_versions}
        loaded: dict[str, LoadedIndex | None] = {}
        for m in [model_target, *self.models.fallbacks(model_target)]:
            space = self.models.space(m)
            fits = [i for i in index_versions if None in (space, index_spaces[i])
                    or index_spaces[i] == space]  # fmt: skip
            if not fits:
                self._unfit.append(f"model {m} ({space}) fits no index")
                continue
            with self._side_stream():
                model = self.models.load(m)
            if model is None:
                continue
            for i in fits:
                if i not in loaded:
                    with self._side_stream():
                        loaded[i] = self.indexes.load(i)
                index = loaded[i]
                if index is None or index.sid_space != model.sid_space:
                    continue
                if self._swap(model, index):
                    self._say_fallback(model_target, index_target, model, index)
                    return True
        return False

    def _say_fallback(self, model_target: str, index_target: str, model: ModelRuntime,
                      index: LoadedIndex) -> None:  # fmt: skip
        for kind, target, served in (("model", model_target, model.version),
                                     ("index", index_target, index.version)):  # fmt: skip
            if served != target:
                why = self._follower(kind).why_not(target)
                if why == "was not tried":
                    why = "fits no loadable partner's SID space"
                log.warning("%s CURRENT names %s, which %s; serving %s, the newest that "
                            "serves", kind, target, why, served)  # fmt: skip

    def _follower(self, kind: str) -> Follower:
        return self.models if kind == "model" else self.indexes

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        """Loads and captures on a CUDA stream of their own, finished before anything
        they made can serve (tables fully on the device before any batch sees them)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()
