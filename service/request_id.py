"""The id of one Retrieve call: chosen by the servicer's first step, carried by every log
line about the call, echoed in the reply (docs/SERVICE.md "Request ids").

    Retrieve bytes + metadata ─► call_request_id() ─► current_request_id (log lines)
                                                   ─► RetrieveResponse.request_id
                                                   ─► trailing metadata x-request-id

Refusals come before parsing, so the request's field is read straight off the wire: every
protobuf writer puts field 1 first. `current_request_id` set in one call's handler (its
own asyncio task and context) is seen only by that call's log lines (service/logs.py).
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Iterable
from urllib.parse import quote

METADATA_KEY = "x-request-id"
MAX_REQUEST_ID_BYTES = 128  # of the request_id field (service/validation.py) and the metadata
_FIELD_1_TAG = 0x0A  # field 1 (request_id), wire type 2 (length-delimited)
# what may stand in a metadata value as it is: printable ASCII but space and '%'
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "grace_request_id", default=None
)


def call_request_id(raw: bytes, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The id of a call before its bytes are parsed: field 1 of `raw`, else the
    `x-request-id` metadata, else a new one."""
    return usable(peek_request_id(raw)) or from_metadata(metadata) or uuid.uuid4().hex


def peek_request_id(raw: bytes) -> str | None:
    """`request_id` when it is the first field of the wire bytes; None otherwise (absent,
    truncated, not UTF-8, or not first)."""
    if len(raw) < 2 or raw[0] != _FIELD_1_TAG:
        return None
    size, shift, at = 0, 0, 1
    while at < len(raw) and at <= 3:  # a length of at most 3 varint bytes (< 2 MiB)
        byte = raw[at]
        size |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            break
    else:
        return None
    if size > MAX_REQUEST_ID_BYTES or at + size > len(raw):
        return None
    try:
        return raw[at : at + size].decode("utf-8")
    except UnicodeDecodeError:
        return None


def usable(request_id: str | None) -> str | None:
    """`request_id` when it can name the call (non-empty, at most 128 UTF-8 bytes)."""
    if not request_id:
        return None
    try:
        return request_id if len(request_id.encode("utf-8")) <= MAX_REQUEST_ID_BYTES else None
    except UnicodeEncodeError:  # lone surrogates: set from Python, never from the wire
        return None


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The caller's `x-request-id` (the first, when sent more than once)."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str):
            return usable(value.strip())
    return None


def for_metadata(request_id: str) -> str:
    """`request_id` as a metadata value: printable ASCII as it is, any other byte (space,
    '%', control characters, non-ASCII UTF-8) percent-encoded — gRPC refuses the rest, and
    a log line must not be split by a newline in an id."""
    return quote(request_id, safe=_SAFE)
