"""One versioned root (`contracts/versions.py`) as the server follows it: what CURRENT
names, which versions have appeared, and each failed version's backoff (docs/SERVICE.md,
the rollout paragraphs). A failure is reported through `on_failure`, logged on one line
and retried after an exponential backoff; a version CURRENT names before it is complete is
pending (logged once); an unreadable CURRENT is logged once per fault while whatever
serves keeps serving. `single`: the root is itself one version (a checkpoint directory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from contracts.index_validation import IndexValidationError
from contracts.versions import CURRENT, current_version, is_version_name, list_versions

log = logging.getLogger("grace.rollout")
_T = TypeVar("_T")

# faults a version on disk can have: logged without a traceback
EXPECTED = (OSError, ValueError, MemoryError)
_MAX_DOUBLINGS = 30  # keeps 2**n finite; the cap is reached long before


@dataclass(frozen=True)
class _Retry:
    failures: int  # consecutive failures of this version
    next_at: float  # clock time before which it is not tried again
    reason: str  # the last failure, one line


def one_line(exc: BaseException) -> str:
    """A failure as one log line: the message, with its type when it is unexpected."""
    if isinstance(exc, IndexValidationError):
        return exc.summary
    text = " ".join(str(exc).split())
    return text if isinstance(exc, EXPECTED) else f"{type(exc).__name__}: {text}"


class Follower(Generic[_T]):
    """CURRENT, pending versions and backoffs of one root; `load` makes a `_T` of one of
    its versions (a model runtime, a loaded index) or records why it could not."""

    def __init__(
        self,
        root: Path,
        kind: str,  # "model" or "index": for logs and messages
        *,
        complete: str,  # the file a complete version holds (written last)
        load: Callable[[Path, str], _T],  # (version directory, version) -> loaded, or raises
        space: Callable[[Path], str | None],  # a version's SID space, cheaply (None: unknown)
        served: Callable[[], str | None] = lambda: None,  # the version now served, for logs
        on_failure: Callable[[str, Exception], None] = lambda version, exc: None,
        single: bool = False,
        backoff_seconds: float = 1.0,
        max_backoff_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root, self.kind, self.single = Path(root), kind, single
        self._complete, self._load, self._space = complete, load, space
        self._served, self._on_failure = served, on_failure
        self.backoff_seconds, self.max_backoff_seconds = backoff_seconds, max_backoff_seconds
        self._clock = clock
        self._retry: dict[str, _Retry] = {}
        self._pending_logged: set[str] = set()
        self.target: str | None = None  # the version CURRENT named at the last `read`
        self.fault: str | None = None  # CURRENT unreadable: logged once per message

    def read(self) -> str | None:
        """The version CURRENT names now (None: nothing published, or CURRENT unusable —
        then `fault` says why). When it moved, the new version is tried at once."""
        version = self.root.name if self.single else self._read_current()
        if version is not None and version != self.target:
            self.target = version
            self._retry = {v: r for v, r in self._retry.items()
                           if v != version and self.path(v).is_dir()}  # fmt: skip
        return version

    def path(self, version: str) -> Path:
        return self.root if self.single else self.root / version

    def space(self, version: str) -> str | None:
        return self._space(self.path(version))

    def load(self, version: str) -> _T | None:
        """`version` loaded, or None: it has not appeared yet, its backoff is running, or
        it failed now (counted, logged, retried after the backoff)."""
        if not (self.path(version) / self._complete).is_file():
            if version not in self._pending_logged:
                self._pending_logged.add(version)
                log.info("%s %s named by %s has not appeared yet; waiting for it (still "
                         "serving %s)", self.kind, version, CURRENT, self._served())  # fmt: skip
            return None
        retry = self._retry.get(version)
        if retry is not None and self._clock() < retry.next_at:
            return None
        try:
            loaded = self._load(self.path(version), version)
        except Exception as exc:
            self.failed(version, exc)
            return None
        self._retry.pop(version, None)
        return loaded

    def failed(self, version: str, exc: Exception) -> None:
        """Count one failed attempt, log it on one line, schedule the next try."""
        previous = self._retry.get(version)
        failures = 1 if previous is None else previous.failures + 1
        delay = min(self.max_backoff_seconds,
                    self.backoff_seconds * 2 ** min(failures - 1, _MAX_DOUBLINGS))  # fmt: skip
        reason = one_line(exc)
        self._on_failure(version, exc)  # counted before `why_not` can name it
        self._retry[version] = _Retry(failures, self._clock() + delay, reason)
        log.error(
            "%s %s rejected (failure %d), still serving %s; next try in %.0f s: %s",
            self.kind, version, failures, self._served(), delay, reason,
            exc_info=None if isinstance(exc, EXPECTED) else exc,
        )  # fmt: skip

    def fallbacks(self, version: str) -> list[str]:
        """The other complete versions, newest first (start-up's fallbacks)."""
        if self.single:
            return []
        try:
            return [v for v in reversed(list_versions(self.root, self._complete)) if v != version]
        except OSError as exc:
            self._unusable(f"{self.root} cannot be listed: {exc}")
            return []

    def why_not(self, version: str) -> str:
        retry = self._retry.get(version)
        if retry is not None:
            return f"was rejected ({retry.reason})"
        if not (self.path(version) / self._complete).is_file():
            return "has not appeared yet"
        return "was not tried"

    def reasons(self) -> list[str]:
        """Each version tried and why it was refused, CURRENT's first (for a start-up error)."""
        if self.fault is not None:
            return [self.fault]
        if self.target is None:
            return [f"no {CURRENT} under {self.root} (nothing published yet)"]
        reasons = [f"{v}: {r.reason}" for v, r in sorted(self._retry.items(), reverse=True)
                   if v != self.target]  # fmt: skip
        named = "" if self.single else f" (named by {CURRENT})"
        return [f"{self.target}{named} {self.why_not(self.target)}", *reasons]

    def _read_current(self) -> str | None:
        try:
            version = current_version(self.root)
        except (OSError, ValueError) as exc:
            self._unusable(f"{self.root / CURRENT} is unreadable: {exc}")
            return None
        if version is not None and not is_version_name(version):
            self._unusable(f"{self.root / CURRENT} names {version!r}, not a version")
            return None
        self.fault = None
        return version

    def _unusable(self, message: str) -> None:
        if message != self.fault:
            self.fault = message
            log.error("%s; still serving %s %s", message, self.kind, self._served())
