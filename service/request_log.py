"""Recorded traffic: `RetrieveRequest`s as JSON Lines, and the server's optional request log.

The format (one contract for `grace record`, the server's request log and the locust
replay in `loadtest/`): UTF-8 text, one `RetrieveRequest` per line in protobuf's JSON
mapping (`json_format.MessageToJson`, camelCase names, int64 as strings), no blank lines.

`RequestLog` (setting `request_log`): the event loop only appends to a bounded deque; a
writer thread serialises and writes (unbuffered) every `interval`; requests it cannot keep
up with are dropped and counted, never slowed; so are lines a write fails for (a full disk:
one error line per 10 s). Files rotate like logrotate's numbered ones
(`path` -> `path.1` -> ... -> `path.<backups>`), each holding whole lines only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from google.protobuf import json_format

from contracts.versions import disk_full
from service.rpc.grace.v1 import retrieval_pb2

log = logging.getLogger("grace.request_log")
DEFAULT_CAPACITY = 10_000  # requests waiting for the writer; ~10-30 MB at most
DEFAULT_BACKUPS = 3  # rotated files kept beside the current one
WRITE_INTERVAL_SECONDS = 0.1  # the writer wakes, writes what waits, flushes
_DROP_REPORT_SECONDS = 10.0


def to_json_line(request: retrieval_pb2.RetrieveRequest) -> str:
    """One line of the format, without its newline."""
    return json_format.MessageToJson(request, indent=None)


def write_requests(path: Path | str, requests: Iterable[retrieval_pb2.RetrieveRequest]) -> int:
    """Write requests to a new file (replacing it); returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(to_json_line(request) + "\n")
            n += 1
    return n


def read_requests(path: Path | str) -> Iterator[retrieval_pb2.RetrieveRequest]:
    """Parse a file of the format; a bad line raises ValueError naming its number."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue  # a trailing newline or an editor's blank line
            try:
                yield json_format.Parse(line, retrieval_pb2.RetrieveRequest())
            except json_format.ParseError as exc:
                raise ValueError(f"{path}:{number}: not a RetrieveRequest: {exc}") from None


class RequestLog:
    """Appends requests to a JSON Lines file from its own thread; never blocks `append`."""

    def __init__(
        self,
        path: Path | str,
        capacity: int = DEFAULT_CAPACITY,
        interval: float = WRITE_INTERVAL_SECONDS,
        *,
        max_bytes: int = 0,  # rotate once the file reaches this size; 0: never
        backups: int = DEFAULT_BACKUPS,
    ) -> None:
        if max_bytes < 0 or backups < 1:
            raise ValueError(f"max_bytes must be >= 0 and backups >= 1, got {max_bytes}, {backups}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by the thread)
        self.capacity, self.interval = capacity, interval
        self.max_bytes, self.backups = max_bytes, backups
        self.rotations = 0  # files rotated (writer thread only)
        # One producer (the event loop) and one consumer (the writer): deque's append and
        # popleft are atomic, so neither side takes a lock or wakes the other per request.
        self._pending: deque[retrieval_pb2.RetrieveRequest] = deque()
        self._closing = threading.Event()
        self.written = 0  # lines written (writer thread only)
        self.overflowed = 0  # requests dropped because `capacity` were waiting (append only)
        self.write_errors = 0  # requests lost to a failed write (writer thread only)
        self._thread = threading.Thread(target=self._run, name="grace-request-log", daemon=True)
        self._thread.start()

    def append(self, request: retrieval_pb2.RetrieveRequest) -> None:
        """Queue one request for the writer, or drop it (counted) when `capacity` wait: on
        the event loop, no serialisation, I/O or lock. The message must not change after."""
        if len(self._pending) >= self.capacity:
            self.overflowed += 1
        else:
            self._pending.append(request)

    @property
    def dropped(self) -> int:
        """Requests that were not logged."""
        return self.overflowed + self.write_errors

    def close(self, timeout: float = 5.0) -> None:
        """Write what is waiting (up to `timeout` seconds), then close the file."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("request log %s: writer stuck; closed without flushing", self.path)
        if self.dropped:
            log.warning("request log %s: %d requests dropped", self.path, self.dropped)

    def _rotate(self) -> None:
        """`path` -> `path.1` -> ... -> `path.<backups>`, then a new, empty `path`."""
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by the thread)
        self.rotations += 1

    def _append(self, line: bytes) -> None:
        """Append a whole line or none: unbuffered, so a failed line is the one counted."""
        done = 0
        try:
            while done < len(line):
                done += self._file.write(line[done:])
        except OSError:
            if done:  # the disk is full, so nobody appended since: the last bytes are ours
                os.ftruncate(self._file.fileno(), os.fstat(self._file.fileno()).st_size - done)
            raise

    def _run(self) -> None:
        reported, last_report = 0, time.monotonic()
        said = float("-inf")  # when a failed write was last logged (the count says the rest)
        try:
            while True:
                closing = self._closing.wait(self.interval)  # wake a few times a second
                while self._pending:
                    request = self._pending.popleft()
                    try:
                        self._append((to_json_line(request) + "\n").encode())
                        self.written += 1
                        if self.max_bytes and self._file.tell() >= self.max_bytes:
                            self._rotate()
                    except (OSError, ValueError) as exc:
                        self.write_errors += 1
                        if time.monotonic() - said > _DROP_REPORT_SECONDS:  # not per request
                            said, why = time.monotonic(), disk_full(exc, self.path)
                            log.error("request log %s; requests dropped (counted)",
                                      why or f"{self.path}: {exc}")  # fmt: skip
                now = time.monotonic()
                if self.dropped != reported and now - last_report > _DROP_REPORT_SECONDS:
                    log.warning("request log %s: %d requests dropped so far (writer behind or "
                                "writes failing)", self.path, self.dropped)  # fmt: skip
                    reported, last_report = self.dropped, now
                if closing:
                    return
        finally:
            self._file.close()
