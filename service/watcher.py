"""Index hot-swap: follow `<root>/CURRENT`, load and validate new versions in the
background, swap them in between batches (DESIGN.md §3).

A version that fails validation (or was built for another SID tokenizer) is logged,
counted, remembered so it is not retried, and never served: the old index keeps serving.
The loaded tables go to the compute device here, off the request path (on GPU on the
loading thread's own stream), and `prepare` readies them (on GPU: the decode engine's CUDA
graphs are captured) before `IndexHolder.swap` makes them current.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from index_builder.format import IndexFormatError
from index_builder.publish import current_version
from index_builder.validate import IndexValidationError
from service.serving_index import IndexHolder, ServingIndex, load_serving_index

log = logging.getLogger("grace.watcher")


class IndexWatcher:
    def __init__(
        self,
        root: Path,
        holder: IndexHolder,
        *,
        tokenizer_fingerprint: str | None,
        device: str = "cpu",
        poll_seconds: float = 2.0,
        prepare: Callable[[ServingIndex], ServingIndex] = lambda index: index,
        on_swap: Callable[[ServingIndex], None] = lambda index: None,
        on_failure: Callable[[str, Exception], None] = lambda version, exc: None,
    ) -> None:
        self.root, self.holder = Path(root), holder
        self.fingerprint, self.device = tokenizer_fingerprint, device
        self.poll_seconds = poll_seconds
        self._prepare, self._on_swap, self._on_failure = prepare, on_swap, on_failure
        self._rejected: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def check_once(self) -> bool:
        """Load CURRENT if it is new; True when a swap happened."""
        version = current_version(self.root)
        if version is None or version in self._rejected:
            return False
        if self.holder.ready and self.holder.current.version == version:
            return False
        try:
            stream = torch.cuda.Stream() if self.device.startswith("cuda") else None
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                t0 = time.perf_counter()
                index = load_serving_index(
                    self.root / version, tokenizer_fingerprint=self.fingerprint, device=self.device
                )
                log.info("index %s loaded and validated in %.1f s", version,
                         time.perf_counter() - t0)  # fmt: skip
                index = self._prepare(index)  # e.g. capture its CUDA graphs, off the path
            if stream is not None:
                stream.synchronize()  # tables fully on the device before any batch sees them
        except (IndexValidationError, IndexFormatError, OSError, ValueError) as exc:
            self._rejected.add(version)
            self.failures += 1
            log.error("index %s rejected, still serving the old one: %s", version, exc)
            self._on_failure(version, exc)
            return False
        old = self.holder.swap(index)
        log.info("serving index %s (was %s)", version, old.version if old else None)
        self._on_swap(index)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="grace-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check_once()
            except Exception:  # never let the watcher die
                log.exception("index watcher error")
