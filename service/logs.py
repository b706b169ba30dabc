"""Log lines of every `grace` process: text or JSON (setting `log_format`), the request
id on each line about a call, grpcio's own lines throttled (a client can trigger them),
and the access log (docs/SERVICE.md "Logs" has the keys).

    cli/__init__.py main, cli/serving.py serve, service/workers.py worker
        ─► configure_logging(level, fmt, worker) ─► the root logger's one handler
    service/server.py Retrieve ─► AccessLog.record(...) ─► logger `grace.access`

The request id comes from the line's `extra` or, while a Retrieve handler runs, from
`service.request_id.current_request_id`. Imports nothing heavy: `grace --help` logs too.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import orjson

from service.request_id import current_request_id

if TYPE_CHECKING:
    from service.pipeline.records import RetrievalResult

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
ACCESS_LOGGER = "grace.access"
# what every LogRecord has: the rest of its attributes came as `extra`
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_OURS = frozenset({"worker", "request_id", "where"})
GRPC_LOG_EVERY_SECONDS = 10.0  # grpcio's own lines: one per message this often


class _Context(logging.Filter):
    """Puts `worker` and `request_id` on every record the handler sees."""

    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        return True


class _GrpcThrottle(logging.Filter):
    """grpcio's records (loggers `grpc.*`): one short line per message every `every` s,
    the rest counted. A text metadata value that is not UTF-8 makes grpcio log three
    tracebacks a call, the value repeated (docs/RELIABILITY.md "Hostile clients")."""

    def __init__(
        self, every: float = GRPC_LOG_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.every, self.clock = every, clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "grpc" and not record.name.startswith("grpc."):
            return True
        key = (record.name, str(record.msg)[:60])
        if key not in self._last and len(self._last) >= 64:
            key = (record.name, "")  # messages formatted by the caller: one budget
        now = self.clock()
        if now - self._last.get(key, -self.every) < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key], held = now, self._held.pop(key, 0)
        text, exc = record.getMessage()[:200], record.exc_info and record.exc_info[1]
        if exc:  # its type and message instead of the traceback
            text += f" ({type(exc).__name__}: {str(exc)[:200]})"
        more = f" (and {held} more in the last {self.every:.0f} s)" if held else ""
        record.msg, record.args, record.exc_info, record.exc_text = text + more, None, None, None
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's `extra` fields but ours, in the order given."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k not in _OURS}


class TextFormatter(logging.Formatter):
    """`2026-01-01 12:00:00,000 INFO grace.server[worker 1]: message request_id=… k=v`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(where)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None)
        record.where = "" if worker is None else f"[worker {worker}]"
        line = super().format(record)
        tail = _fields(record)
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            tail = {"request_id": request_id, **tail}
        if not tail:
            return line
        head, sep, rest = line.partition("\n")  # after the message, before a traceback
        pairs = " ".join(f"{k}={v}" for k, v in tail.items())
        return f"{head} {pairs}{sep}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601, ms), level, logger, message, worker,
    request_id, the line's `extra` fields, exc (a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("worker", "request_id"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(out, default=str).decode()
        except TypeError:  # lone surrogates (undecodable paths), huge ints, odd dict keys
            return json.dumps(out, default=repr, ensure_ascii=True)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler `configure_logging` installs (and may replace)."""


def configure_logging(level: int, fmt: str = "text", worker: int | None = None) -> None:
    """Route every logger through one stderr handler in `fmt`, replacing the one an earlier
    call installed; `worker`: this process's index among a supervisor's workers. Like
    `logging.basicConfig`, it leaves a root logger someone else configured alone."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {list(LOG_FORMATS)}, got {fmt!r}")
    root = logging.getLogger()
    if any(not isinstance(h, _Handler) for h in root.handlers):
        return
    handler = _Handler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Context(worker))
    handler.addFilter(_GrpcThrottle())
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # Python's warnings too: every stderr line in `fmt`


class AccessLog:
    """One line per Retrieve call on logger `grace.access`: every failed call, and each
    OK call with probability `sample` (setting `access_log_sample`; 0: no line at all)."""

    def __init__(self, sample: float) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"access log sample must be in 0..1, got {sample}")
        self.sample = sample
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self._random = random.Random()

    def wants(self, ok: bool) -> bool:
        """Whether a call of this outcome gets a line (decide before gathering fields)."""
        if self.sample <= 0.0:
            return False
        return not ok or self.sample >= 1.0 or self._random.random() < self.sample

    def record(
        self, request_id: str, code: str, seconds: float, peer: str, r: RetrievalResult | None
    ) -> None:
        """The call's line, `Retrieve CODE` with its fields as `extra`; `r`: what answered
        it, if anything did."""
        fields: dict[str, Any] = {
            "request_id": request_id,
            "grpc_code": code,
            "latency_ms": round(seconds * 1e3, 3),
            "batch_size": None if r is None else r.batch_size,
            "index_version": None if r is None else r.index_version,
            "model_version": None if r is None else r.model_version,
            "ads": None if r is None or code != "OK" else len(r.post.ad_ids),
            "peer": peer,
        }
        level = logging.ERROR if code == "INTERNAL" else logging.INFO
        self.logger.log(level, "Retrieve %s", code, extra=fields)
