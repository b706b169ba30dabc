"""The JSON log format never loses a line (service/logs.py): values orjson refuses — a
path with undecodable bytes (lone surrogates), integers past 64 bits, non-string keys —
still give one parseable object per line; grpcio's own records, which a client can
trigger on every call, are one short line per message and interval."""

from __future__ import annotations

import io
import json
import logging
import sys

from service.logs import JsonFormatter, _GrpcThrottle


def record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("grace.test", logging.WARNING, __file__, 1, msg, args, None)
    r.__dict__.update(extra)
    return r


def test_values_orjson_refuses_still_make_one_json_line() -> None:
    fmt = JsonFormatter()
    for r in (
        record("model loaded from %s", "/data/\udcff"),
        record("big %d", 2**70),
        record("fields", where={1: "non-string key"}),
    ):
        line = fmt.format(r)
        assert "\n" not in line
        parsed = json.loads(line)
        assert parsed["level"] == "WARNING" and parsed["logger"] == "grace.test"
    assert "\\udcff" in fmt.format(record("model loaded from %s", "/data/\udcff"))


def test_grpcio_records_become_one_short_line_per_message_and_interval() -> None:
    """grpcio's `Invalid encoding on b'…'` with its traceback, as a client can trigger it
    on every call: one line per interval, no traceback, the value cut short and the
    records held back counted; other records pass untouched."""
    now = [0.0]
    throttle = _GrpcThrottle(every=10.0, clock=lambda: now[0])
    handler = logging.StreamHandler(io.StringIO())
    handler.addFilter(throttle)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    value = b"\xfe\xff" * 2048
    try:
        value.decode()
    except UnicodeDecodeError:
        exc_info = sys.exc_info()

    def grpc_record() -> logging.LogRecord:
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1,
                                 "Invalid encoding on %s", (value,), exc_info)  # fmt: skip

    passed = [throttle.filter(grpc_record()) for _ in range(50)]
    assert passed == [True] + [False] * 49
    ours = record("not grpcio's %s", "x")
    assert throttle.filter(ours) and ours.getMessage() == "not grpcio's x"
    now[0] = 10.0
    handler.handle(grpc_record())
    out = handler.stream.getvalue()
    assert out.count("\n") == 1 and "Traceback" not in out and len(out) < 500, out
    assert "UnicodeDecodeError" in out and "(and 49 more in the last 10 s)" in out, out
