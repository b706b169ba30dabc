"""Request validation: the RPC handler's first step, before a request may enter the queue.

    RetrieveRequest (proto) ──validate_request(req, limits)──► ValidatedRequest ──► batcher

Every field a client can set is checked here, so nothing later in the pipeline sees a
value outside the contract. A bad field raises `InvalidRequest(field, message)` — the
server answers INVALID_ARGUMENT with `str(error)`, which starts with the field's proto
path (`targeting.gender`, `options.beam_widths[2]`, `user.history[3].type`). Nothing a
client sends raises anything else (tests/service/test_validation.py fuzzes this).

Decisions on values the proto allows but the contract leaves open:

- country: empty = unknown; otherwise two ASCII letters, either case, stored upper-case.
  A well-formed code that is not an assigned ISO 3166-1 alpha-2 code (`"XX"`) is accepted
  as *unknown*, like an empty one: upstream country tables drift, and an unknown country
  only makes targeting stricter (docs/ARCHITECTURE.md §3), never wrong.
- age: 0..150; 0 and ages below 13 are unknown (`targeting.age_bucket_index`).
- gender: exactly "", "female" or "male".
- locations: at most 64, each non-empty and at most 256 UTF-8 bytes; order and
  duplicates are kept.
- history: at most `Limits.max_history` events; type VIEW, CLICK or CONVERSION;
  timestamp_ms >= 0; any ad_id (ads unknown to the index are dropped in stage 2).
- user_id: any int64 (it is hashed). request_id: at most 128 UTF-8 bytes, may be empty.

`Limits.max_request_bytes` is the size of the largest valid request, serialised, plus room
for fields this server does not know yet (a newer client): the server refuses longer
messages before parsing them (service/server.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contracts.index_format import SID_LENGTH, VOCAB_SIZE
from contracts.request import FilterMode, check_schedule
from contracts.targeting import GENDERS, MAX_LOCATION_BYTES, MAX_REQUEST_LOCATIONS, Targeting
from service.rpc.grace.v1 import retrieval_pb2 as pb
from service.settings import ServerSettings

MAX_AGE = 150
MAX_REQUEST_ID_BYTES = 128
UNKNOWN_FIELDS_BYTES = 64 * 1024  # room for fields a newer client may add (docs/ARCHITECTURE.md §5)
_EVENT_TYPES = np.array([pb.VIEW, pb.CLICK, pb.CONVERSION])
_FILTER_MODES = {
    pb.FILTER_MODE_UNSPECIFIED: FilterMode.CD_GTM,
    pb.CD_ONLY: FilterMode.CD_ONLY,
    pb.CD_GTM: FilterMode.CD_GTM,
}


class InvalidRequest(ValueError):
    """A client error; `field` is the proto path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Limits:
    """What a request may ask for; derived once from the settings."""

    default_max_ads: int  # used when options.max_ads is 0
    max_ads_limit: int  # largest options.max_ads
    default_beams: tuple[int, ...]  # (M_1..M_4) used when options.beam_widths is empty
    beam_max: tuple[int, ...]  # per-step maxima of options.beam_widths
    max_history: int = 10_000  # most user.history events

    def max_request_bytes(self) -> int:
        """Serialised size of the largest request these limits accept, plus
        `UNKNOWN_FIELDS_BYTES`: every field at its longest encoding."""
        event = pb.Event(ad_id=-1, type=pb.CONVERSION, timestamp_ms=2**63 - 1)
        largest = pb.RetrieveRequest(
            request_id="x" * MAX_REQUEST_ID_BYTES,
            user=pb.User(user_id=-1, history=[event] * self.max_history),
            targeting=pb.Targeting(
                country="US",
                age=MAX_AGE,
                gender=max(GENDERS, key=len),
                locations=["x" * MAX_LOCATION_BYTES] * MAX_REQUEST_LOCATIONS,
            ),
            options=pb.Options(
                max_ads=self.max_ads_limit,
                beam_widths=list(self.beam_max),
                filter_mode=pb.CD_GTM,
                include_sids=True,
            ),
        )
        return largest.ByteSize() + UNKNOWN_FIELDS_BYTES

    @classmethod
    def from_settings(cls, s: ServerSettings) -> Limits:
        assert s.beams is not None and s.beam_max is not None  # resolved by ServerSettings
        return cls(
            default_max_ads=s.default_max_ads,
            max_ads_limit=s.max_ads_limit,
            default_beams=tuple(s.beams),
            beam_max=tuple(s.beam_max),
            max_history=s.max_history_events,
        )


@dataclass(frozen=True)
class ValidatedRequest:
    """One checked request with defaults applied: the batcher's input record."""

    request_id: str
    user_id: int
    targeting: Targeting  # country upper-case ("" or any well-formed code)
    history_ad_ids: np.ndarray  # int64 [n], read-only
    history_types: np.ndarray  # int64 [n], VIEW / CLICK / CONVERSION values, read-only
    history_ts_ms: np.ndarray  # int64 [n], >= 0, in request order, read-only
    max_ads: int  # 1..Limits.max_ads_limit
    beams: tuple[int, ...]  # (M_1..M_4), a valid schedule within Limits.beam_max
    filter_mode: FilterMode  # CD_ONLY or CD_GTM
    include_sids: bool


def validate_request(req: pb.RetrieveRequest, limits: Limits) -> ValidatedRequest:
    """Check every field of `req`; raise InvalidRequest naming the first bad one."""
    request_id = req.request_id
    if _utf8_len("request_id", request_id) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes")
    ad_ids, types, ts = _history(req.user.history, limits.max_history)
    opts = req.options
    return ValidatedRequest(
        request_id=request_id,
        user_id=req.user.user_id,
        targeting=_targeting(req.targeting),
        history_ad_ids=ad_ids,
        history_types=types,
        history_ts_ms=ts,
        max_ads=_max_ads(opts.max_ads, limits),
        beams=_beams(list(opts.beam_widths), limits),
        filter_mode=_filter_mode(opts.filter_mode),
        include_sids=opts.include_sids,
    )


def _utf8_len(field: str, s: str) -> int:
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates can be set from Python, not sent on the wire
        raise InvalidRequest(field, "not valid UTF-8") from None


def _targeting(t: pb.Targeting) -> Targeting:
    country = t.country
    if country and not (len(country) == 2 and country.isascii() and country.isalpha()):
        raise InvalidRequest(
            "targeting.country", f"expected an ISO 3166-1 alpha-2 code or '', got {country!r}"
        )
    country = country.upper()  # a code outside COUNTRIES is kept: it encodes as unknown
    if not 0 <= t.age <= MAX_AGE:
        raise InvalidRequest("targeting.age", f"must be in 0..{MAX_AGE} (0 = unknown), got {t.age}")
    if t.gender not in ("", *GENDERS):
        raise InvalidRequest(
            "targeting.gender", f"expected one of {['', *GENDERS]}, got {t.gender!r}"
        )
    if len(t.locations) > MAX_REQUEST_LOCATIONS:
        raise InvalidRequest(
            "targeting.locations",
            f"at most {MAX_REQUEST_LOCATIONS} allowed, got {len(t.locations)}",
        )
    for i, loc in enumerate(t.locations):
        field = f"targeting.locations[{i}]"
        if not loc:
            raise InvalidRequest(field, "must not be empty")
        if _utf8_len(field, loc) > MAX_LOCATION_BYTES:
            raise InvalidRequest(field, f"at most {MAX_LOCATION_BYTES} bytes")
    return Targeting(country=country, age=t.age, gender=t.gender, locations=tuple(t.locations))


def _history(
    events: Sequence[pb.Event], max_history: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(events)
    if n > max_history:
        raise InvalidRequest("user.history", f"at most {max_history} events, got {n}")
    ad_ids = np.fromiter((e.ad_id for e in events), dtype=np.int64, count=n)
    types = np.fromiter((e.type for e in events), dtype=np.int64, count=n)
    ts = np.fromiter((e.timestamp_ms for e in events), dtype=np.int64, count=n)
    bad = np.flatnonzero(~np.isin(types, _EVENT_TYPES))
    if len(bad):
        i = int(bad[0])
        raise InvalidRequest(
            f"user.history[{i}].type",
            f"expected VIEW, CLICK or CONVERSION, got {_event_type_name(int(types[i]))}",
        )
    bad = np.flatnonzero(ts < 0)
    if len(bad):
        i = int(bad[0])
        raise InvalidRequest(f"user.history[{i}].timestamp_ms", f"must be >= 0, got {ts[i]}")
    for a in (ad_ids, types, ts):
        a.flags.writeable = False
    return ad_ids, types, ts


def _max_ads(max_ads: int, limits: Limits) -> int:
    if max_ads == 0:
        return limits.default_max_ads
    if not 1 <= max_ads <= limits.max_ads_limit:
        raise InvalidRequest(
            "options.max_ads",
            f"must be in 1..{limits.max_ads_limit} (0 = server default), got {max_ads}",
        )
    return max_ads


def _beams(widths: list[int], limits: Limits) -> tuple[int, ...]:
    if not widths:
        return limits.default_beams
    field = "options.beam_widths"
    if len(widths) != SID_LENGTH:
        raise InvalidRequest(
            field, f"expected {SID_LENGTH} values (M_1..M_{SID_LENGTH}) or none, got {len(widths)}"
        )
    if widths[0] != 1:
        raise InvalidRequest(f"{field}[0]", f"M_1 must be 1, got {widths[0]}")
    for t, (m, most) in enumerate(zip(widths, limits.beam_max, strict=True)):
        if m < 1:
            raise InvalidRequest(f"{field}[{t}]", f"must be >= 1, got {m}")
        if m > most:
            raise InvalidRequest(
                f"{field}[{t}]", f"{m} exceeds the server maximum {most} for M_{t + 1}"
            )
    beams = tuple(widths)
    try:
        check_schedule(beams, SID_LENGTH, VOCAB_SIZE)
    except ValueError as e:
        raise InvalidRequest(f"{field}[{_first_bad_step(beams)}]", str(e)) from None
    return beams


def _first_bad_step(beams: tuple[int, ...]) -> int:
    # The engine's rule, asked step by step: widths after step t are replaced by 1, which
    # never breaks the rule, so the first t whose prefix fails is the offending one.
    for t in range(1, len(beams)):
        try:
            check_schedule(beams[: t + 1] + (1,) * (len(beams) - t - 1), SID_LENGTH, VOCAB_SIZE)
        except ValueError:
            return t
    return 0


def _filter_mode(mode: int) -> FilterMode:
    if mode not in _FILTER_MODES:
        raise InvalidRequest(
            "options.filter_mode",
            f"expected FILTER_MODE_UNSPECIFIED, CD_ONLY or CD_GTM, got {mode}",
        )
    return _FILTER_MODES[mode]


def _event_type_name(value: int) -> str:
    try:
        return pb.EventType.Name(value)
    except ValueError:  # open enum: unknown numbers arrive as plain ints
        return str(value)
