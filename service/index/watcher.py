"""Index hot-swap: follow `<root>/CURRENT`, load and validate new versions in the
background, swap them in between batches (docs/ARCHITECTURE.md §3).

Sits between the publisher (`index_builder/publish.py`) and the request path: the app
calls `check_once` once at start-up for the first load, then `start` polls CURRENT every
`poll_seconds` on a thread of its own.

* Any exception while a version is loaded, validated or prepared (corrupt or truncated
  files, a malformed manifest, a manifest naming another version, another SID tokenizer,
  an error while preparing) is a failure: reported once through
  `on_failure(version, exc)`, logged on one line, and that version is retried only after
  an exponential backoff (`backoff_seconds`, doubling per failure, capped at
  `max_backoff_seconds`). The old index keeps serving. When CURRENT moves to another
  version, that one is tried at once.
* A version CURRENT names before its directory (or its manifest) exists is pending, not a
  failure: logged once, loaded as soon as it appears.
* The first load falls back: if CURRENT's version is pending or rejected, the other
  versions are tried newest first and the newest that loads serves (one warning line says
  why and which). `behind` is True while the served version is not CURRENT's.

The loaded tables go to the compute device here, off the request path (on GPU on the
loading thread's own stream), and `prepare` readies them (the compute stage builds its decode
plans for them; on GPU it captures their CUDA graphs) before `IndexHolder.swap` makes them
current (`grace_index_swap_failures_total` counts the failures, through `on_failure`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from contracts.index_format import MANIFEST
from index_builder.publish import CURRENT, current_version, list_versions
from index_builder.validate import IndexValidationError
from service.index.loaded import IndexHolder, LoadedIndex, load_index

log = logging.getLogger("grace.watcher")

# faults an index on disk can have: logged without a traceback
_EXPECTED = (OSError, ValueError, MemoryError)
_MAX_DOUBLINGS = 30  # keeps 2**n finite; the cap is reached long before


@dataclass(frozen=True)
class _Retry:
    failures: int  # consecutive failures of this version
    next_at: float  # clock time before which it is not tried again
    reason: str  # the last failure, one line


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, IndexValidationError):
        return exc.summary
    text = " ".join(str(exc).split())
    return text if isinstance(exc, _EXPECTED) else f"{type(exc).__name__}: {text}"


class IndexWatcher:
    """Follows CURRENT for one `IndexHolder`: `check_once` (start-up, and each poll of the
    `start`ed thread), `behind` for metrics, `stop` on shutdown."""

    def __init__(
        self,
        root: Path,
        holder: IndexHolder,
        *,
        tokenizer_fingerprint: str | None,
        device: str = "cpu",
        poll_seconds: float = 2.0,
        prepare: Callable[[LoadedIndex], None] = lambda index: None,
        on_swap: Callable[[LoadedIndex], None] = lambda index: None,
        on_failure: Callable[[str, Exception], None] = lambda version, exc: None,
        backoff_seconds: float | None = None,
        max_backoff_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`backoff_seconds`: the wait before a failed version's first retry (default: the
        poll interval, at least 1 s), doubled per further failure up to
        `max_backoff_seconds`; `clock`: monotonic seconds (injectable for tests)."""
        self.root, self.holder = Path(root), holder
        self.fingerprint, self.device = tokenizer_fingerprint, device
        self.poll_seconds = poll_seconds
        if backoff_seconds is None:
            backoff_seconds = max(poll_seconds, 1.0)
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self._prepare, self._on_swap, self._on_failure = prepare, on_swap, on_failure
        self._clock = clock
        self._retry: dict[str, _Retry] = {}
        self._pending_logged: set[str] = set()
        self._target: str | None = None  # the version CURRENT named at the last check
        self._current_fault: str | None = None  # CURRENT unreadable: logged once per message
        self._loop_fault: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def behind(self) -> bool:
        """True while the served version is not the one CURRENT names (CURRENT's was
        rejected, or its directory has not appeared yet)."""
        target = self._target
        if target is None:
            return False
        return not self.holder.ready or self.holder.current.version != target

    def why_none(self) -> str:
        """Why nothing serves after `check_once`: each version tried and why it was
        refused, newest first (for the one-line start-up error)."""
        if self._current_fault is not None:
            return self._current_fault
        if self._target is None:
            return f"no {CURRENT} (nothing published yet)"
        reasons = [f"{v}: {r.reason}" for v, r in sorted(self._retry.items(), reverse=True)]
        if self._target not in self._retry:
            reasons.insert(0, f"{self._target} (named by {CURRENT}): {self._why_not(self._target)}")
        return "; ".join(reasons)

    def check_once(self) -> bool:
        """Load CURRENT's version if it is new and due; True when a swap happened.

        With nothing served yet (start-up), a CURRENT version that is pending or rejected
        falls back to the newest other version that loads.
        """
        version = self._read_current()
        if version is None:
            return False
        if version != self._target:  # CURRENT moved: its version is tried at once
            self._target = version
            self._retry = {v: r for v, r in self._retry.items()
                           if v != version and (self.root / v).is_dir()}  # fmt: skip
        if not self.holder.ready:
            return self._first_load(version)
        if self.holder.current.version == version:
            return False
        return self._try(version)

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
            except Exception as exc:  # never let the watcher die; say so once per fault
                if repr(exc) != self._loop_fault:
                    self._loop_fault = repr(exc)
                    log.exception("index watcher error")

    def _read_current(self) -> str | None:
        try:
            version = current_version(self.root)
        except (OSError, ValueError) as exc:
            self._current_unusable(f"{self.root / CURRENT} is unreadable: {exc}")
            return None
        if version is not None and (version.startswith(".") or "/" in version
                                    or any(c.isspace() or c == "\0" for c in version)):  # fmt: skip
            self._current_unusable(f"{self.root / CURRENT} names {version!r}, not a version")
            return None
        self._current_fault = None
        return version

    def _current_unusable(self, message: str) -> None:
        if message != self._current_fault:
            self._current_fault = message
            log.error("%s; still serving %s", message, self._served())

    def _first_load(self, version: str) -> bool:
        if self._try(version):
            return True
        for candidate in self._fallbacks(version):
            if self._try(candidate):
                log.warning(
                    "CURRENT names %s, which %s; serving %s, the newest version that loads",
                    version, self._why_not(version), candidate,
                )  # fmt: skip
                return True
        return False

    def _fallbacks(self, version: str) -> list[str]:
        try:
            return [v for v in reversed(list_versions(self.root)) if v != version]
        except OSError as exc:
            self._current_unusable(f"{self.root} cannot be listed: {exc}")
            return []

    def _why_not(self, version: str) -> str:
        retry = self._retry.get(version)
        if retry is not None:
            return f"was rejected ({retry.reason})"
        return "has not appeared yet"

    def _try(self, version: str) -> bool:
        """Load, validate, prepare and swap in `version` if it exists and is due."""
        if not (self.root / version / MANIFEST).is_file():
            if version not in self._pending_logged:
                self._pending_logged.add(version)
                log.info("index %s named by CURRENT has not appeared yet; waiting for it "
                         "(still serving %s)", version, self._served())  # fmt: skip
            return False
        retry = self._retry.get(version)
        if retry is not None and self._clock() < retry.next_at:
            return False
        try:
            index = self._load(version)
        except Exception as exc:
            self._failed(version, exc)
            return False
        self._retry.pop(version, None)
        old = self.holder.swap(index)
        log.info("serving index %s (was %s)", version, old.version if old else None)
        self._on_swap(index)
        return True

    def _load(self, version: str) -> LoadedIndex:
        stream = torch.cuda.Stream() if self.device.startswith("cuda") else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            t0 = time.perf_counter()
            index = load_index(
                self.root / version,
                tokenizer_fingerprint=self.fingerprint,
                device=self.device,
                expect_version=version,
            )
            log.info("index %s loaded and validated in %.1f s", version,
                     time.perf_counter() - t0)  # fmt: skip
            self._prepare(index)  # the compute stage's decode plans (CUDA graphs), off the path
        if stream is not None:
            stream.synchronize()  # tables fully on the device before any batch sees them
        return index

    def _failed(self, version: str, exc: Exception) -> None:
        """Count one failed attempt, log it on one line, schedule the next try."""
        previous = self._retry.get(version)
        failures = 1 if previous is None else previous.failures + 1
        delay = min(self.max_backoff_seconds,
                    self.backoff_seconds * 2 ** min(failures - 1, _MAX_DOUBLINGS))  # fmt: skip
        reason = _one_line(exc)
        self._retry[version] = _Retry(failures, self._clock() + delay, reason)
        log.error(
            "index %s rejected (failure %d), still serving %s; next try in %.0f s: %s",
            version, failures, self._served(), delay, reason,
            exc_info=None if isinstance(exc, _EXPECTED) else exc,
        )  # fmt: skip
        self._on_failure(version, exc)

    def _served(self) -> str | None:
        return self.holder.current.version if self.holder.ready else None
