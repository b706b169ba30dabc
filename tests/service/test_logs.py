"""The JSON log format never loses a line (service/logs.py): values orjson refuses — a
path with undecodable bytes (lone surrogates), integers past 64 bits, non-string keys —
still give one parseable object per line."""

from __future__ import annotations

import json
import logging

from service.logs import JsonFormatter


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
