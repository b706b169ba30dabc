"""Log lines of every `grace` process: text or JSON (setting `log_format`), the request
id on each line about a call, and the access log (docs/SERVICE.md "Logs").

    cli/__init__.py main, cli/serving.py serve, service/workers.py worker
        ─► configure_logging(level, fmt, worker) ─► the root logger's one handler
    service/server.py Retrieve ─► AccessLog.record(...) ─► logger `grace.access`

`text`: `ts LEVEL logger[worker i]: message key=value ...`; `json`: one object per line
with `ts` (UTC, ISO 8601, ms), `level`, `logger`, `message`, `worker` (a worker of
several), `request_id` (a line about one call), `exc` (a traceback), and the line's other
fields (the access log's). The request id comes from the line's `extra` or, for any line
logged while a Retrieve handler runs, from `service.request_id.current_request_id`.
Imports nothing heavy: `grace --help` configures logging too.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from typing import Any, Literal

import orjson

from service.request_id import current_request_id

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
ACCESS_LOGGER = "grace.access"
# what every LogRecord has: the rest of its attributes came as `extra`
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_OURS = frozenset({"worker", "request_id", "where"})


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
    """One JSON object per line (keys in the module docstring)."""

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
    """Route every logger through one stderr handler in `fmt` ("text" or "json"),
    replacing the one an earlier call installed (settings are read after the CLI's first
    set-up). `worker`: this process's index among the workers of one supervisor. Like
    `logging.basicConfig`, it leaves logging alone where someone else has configured
    the root logger (a test runner, an embedding program)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {list(LOG_FORMATS)}, got {fmt!r}")
    root = logging.getLogger()
    if any(not isinstance(h, _Handler) for h in root.handlers):
        return
    handler = _Handler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Context(worker))
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # Python's warnings too: every stderr line in `fmt`


class AccessLog:
    """One line per Retrieve call on logger `grace.access`: every failed call, and each
    OK call with probability `sample` (setting `access_log_sample`; 0: no line at all)."""

    def __init__(self, sample: float, logger: logging.Logger | None = None) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"access log sample must be in 0..1, got {sample}")
        self.sample = sample
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        self._random = random.Random()

    def wants(self, ok: bool) -> bool:
        """Whether a call of this outcome gets a line (decide before gathering fields)."""
        if self.sample <= 0.0:
            return False
        return not ok or self.sample >= 1.0 or self._random.random() < self.sample

    def record(
        self,
        *,
        request_id: str,
        code: str,
        latency_ms: float,
        peer: str,
        batch_size: int | None = None,
        index_version: str | None = None,
        model_version: str | None = None,
        ads: int | None = None,
    ) -> None:
        """The call's line: `Retrieve CODE` with the fields as `extra`."""
        fields: dict[str, Any] = {
            "request_id": request_id,
            "grpc_code": code,
            "latency_ms": round(latency_ms, 3),
            "batch_size": batch_size,
            "index_version": index_version,
            "model_version": model_version,
            "ads": ads,
            "peer": peer,
        }
        level = logging.ERROR if code == "INTERNAL" else logging.INFO
        self.logger.log(level, "Retrieve %s", code, extra=fields)
