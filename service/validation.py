"""Request validation: the RPC handler's first step, before a request may enter the queue.
It is the request contract's one home (one check per client-settable field), hence longer
than the house's ~300 lines.

    RetrieveRequest (proto) ──validate_request(req, limits)──► ValidatedRequest ──► batcher

A bad request raises `InvalidRequest` listing every bad field, which the server answers
INVALID_ARGUMENT with a `google.rpc.BadRequest`; nothing a client sends raises anything
else (tests/service/test_validation.py fuzzes this). The beam growth rule is asked only of
widths each within bounds.

Values the proto allows but the contract leaves open: country "" is unknown, else two ASCII
letters, either case, stored upper-case; a well-formed code that is not an assigned ISO
3166-1 alpha-2 code (`"XX"`) is accepted as unknown (upstream tables drift, and an unknown
country only makes targeting stricter, never wrong: docs/ARCHITECTURE.md §3). Age 0..150,
0 and below 13 unknown. Gender exactly "", "female" or "male". At most 64 locations, each
non-empty and at most 256 UTF-8 bytes, order and duplicates kept. Each of those fields is
also checked as the served index's schema (docs/FORMAT.md §1) reads the attribute of its
name; `attributes` names only the schema's attributes, none also given as a field above,
with values as `targeting_codec.Codec` takes them (one per enum or bucket, a bucket's an
integer); each `exclude_*_ids` list at most `MAX_EXCLUDE_IDS` ids. History: at most
`Limits.max_history` events, type VIEW, CLICK or CONVERSION, timestamp_ms >= 0, any ad_id
(ads unknown to the index are dropped in stage 2). user_id: any int64 (it is hashed).
request_id: at most 128 UTF-8 bytes, may be empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from contracts.index_format import SID_LENGTH, VOCAB_SIZE
from contracts.request import FilterMode, check_schedule
from contracts.targeting import GENDERS, MAX_LOCATION_BYTES, MAX_REQUEST_LOCATIONS, Targeting
from contracts.targeting_codec import Codec, TargetingError, codec
from contracts.targeting_schema import (
    DEFAULT,
    LEGACY_FIELDS,
    MAX_VALUE_BYTES,
    Attribute,
    TargetingSchema,
)
from service.request_id import MAX_REQUEST_ID_BYTES
from service.rpc.grace.v1 import retrieval_pb2 as pb
from service.settings import ServerSettings

MAX_AGE = 150
MAX_EXCLUDE_IDS = 4096  # per block list of a request (exclude_ad_ids, ...)
MAX_ELEMENT_VIOLATIONS = 8  # bad elements of one repeated field named one by one
MAX_SHOWN_CHARS = 32  # of a bad string value quoted in its violation
UNKNOWN_FIELDS_BYTES = 64 * 1024  # room for fields a newer client may add (docs/ARCHITECTURE.md §5)
_EVENT_TYPES = np.array([pb.VIEW, pb.CLICK, pb.CONVERSION])
_FILTER_MODES = {
    pb.FILTER_MODE_UNSPECIFIED: FilterMode.CD_GTM,
    pb.CD_ONLY: FilterMode.CD_ONLY,
    pb.CD_GTM: FilterMode.CD_GTM,
}


@dataclass(frozen=True)
class Violation:
    """One bad field: its proto path and what is wrong with it."""

    field: str  # e.g. "targeting.gender", "options.beam_widths[2]", "user.history[3].type"
    description: str


class InvalidRequest(ValueError):
    """A client error naming every bad field (`violations`, in field order); `field` and
    `message` are the first's. `str()` is `"field: message"`, plus the other fields'
    paths when there are more."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        assert violations, "an invalid request has at least one bad field"
        self.violations = tuple(violations)
        first, others = self.violations[0], self.violations[1:]
        self.field, self.message = first.field, first.description
        text = f"{first.field}: {first.description}"
        if others:
            text += f" (and {len(others)} more: {', '.join(v.field for v in others)})"
        super().__init__(text)


class _Violations(list[Violation]):
    """What one validation pass has found so far."""

    def add(self, field: str, description: str) -> None:
        self.append(Violation(field, description))


@dataclass(frozen=True)
class Limits:
    """What a request may ask for; derived once from the settings."""

    default_max_ads: int  # used when options.max_ads is 0
    max_ads_limit: int  # largest options.max_ads
    default_beams: tuple[int, ...]  # (M_1..M_4) used when options.beam_widths is empty
    beam_max: tuple[int, ...]  # per-step maxima of options.beam_widths
    max_history: int = 10_000  # most user.history events

    def max_request_bytes(self, schema: TargetingSchema = DEFAULT) -> int:
        """Serialised size of the largest request these limits and `schema` accept, plus
        `UNKNOWN_FIELDS_BYTES`: every field at its longest encoding."""
        event = pb.Event(ad_id=-1, type=pb.CONVERSION, timestamp_ms=2**63 - 1)
        longest = {
            a.name: pb.Values(values=["x" * MAX_VALUE_BYTES] * _most_values(a))
            for a in schema.attributes
            if a.name not in LEGACY_FIELDS
        }
        blocks = [-1] * MAX_EXCLUDE_IDS
        largest = pb.RetrieveRequest(
            request_id="x" * MAX_REQUEST_ID_BYTES,
            user=pb.User(user_id=-1, history=[event] * self.max_history),
            targeting=pb.Targeting(
                country="US",
                age=MAX_AGE,
                gender=max(GENDERS, key=len),
                locations=["x" * MAX_LOCATION_BYTES] * MAX_REQUEST_LOCATIONS,
                attributes=longest,
                exclude_ad_ids=blocks,
                exclude_campaign_ids=blocks,
                exclude_advertiser_ids=blocks,
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
    # no beam_widths sent: `beams` is the server's, and its batch may get a narrower rung
    # of the ladder under load (service/beam_ladder.py)
    adaptive: bool = False


def validate_request(
    req: pb.RetrieveRequest,
    limits: Limits,
    schema: TargetingSchema = DEFAULT,
    blockable: Collection[str] = (),
) -> ValidatedRequest:
    """Check every field of `req` (targeting against `schema`, the served index's; the
    block lists it can apply, `blockable`: names of `exclude_*_ids`); raise InvalidRequest
    naming every bad one (at most `MAX_ELEMENT_VIOLATIONS` elements of one repeated field,
    then the field itself)."""
    bad = _Violations()
    request_id = req.request_id
    length = _utf8_len(request_id)
    if length is None:
        bad.add("request_id", "not valid UTF-8")
    elif length > MAX_REQUEST_ID_BYTES:
        bad.add("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes")
    ad_ids, types, ts = _history(bad, req.user.history, limits.max_history)
    targeting = _targeting(bad, req.targeting, schema, blockable)
    opts = req.options
    max_ads = _max_ads(bad, opts.max_ads, limits)
    beams = _beams(bad, list(opts.beam_widths), limits)
    filter_mode = _filter_mode(bad, opts.filter_mode)
    if bad:
        raise InvalidRequest(bad)
    return ValidatedRequest(
        request_id=request_id,
        user_id=req.user.user_id,
        targeting=targeting,
        history_ad_ids=ad_ids,
        history_types=types,
        history_ts_ms=ts,
        max_ads=max_ads,
        beams=beams,
        filter_mode=filter_mode,
        include_sids=opts.include_sids,
        adaptive=not opts.beam_widths,
    )


def _utf8_len(s: str) -> int | None:
    """UTF-8 length of `s`; None when it has none."""
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates can be set from Python, not sent on the wire
        return None


def _targeting(
    bad: _Violations, t: pb.Targeting, schema: TargetingSchema, blockable: Collection[str]
) -> Targeting:
    c, attributes = codec(schema), []
    merged, where = pb.Targeting(), {}  # the named fields, those given in the map filled in
    merged.CopyFrom(t)
    merged.ClearField("attributes")
    for name in sorted(t.attributes):
        field = f"targeting.attributes[{_shown(name)}]"
        values = tuple(t.attributes[name].values)
        if not any(a.name == name for a in schema.attributes):
            known = ", ".join(a.name for a in schema.attributes)
            bad.add(field, f"the served index's schema has no such attribute (it has {known})")
        elif name in LEGACY_FIELDS and getattr(t, name):
            bad.add(field, f"also given as targeting.{name}: give it once")
        elif name in LEGACY_FIELDS:  # a named field (a model feature too): filled from here
            where[name] = field
            _fill(bad, merged, name, values, field)
        else:
            _attribute(bad, c, schema.attribute(name), values, field)
            attributes.append((name, values))
    named = _named_fields(bad, merged, where)
    for name in LEGACY_FIELDS:  # each fills the schema's attribute of its name
        given, field = named.values().get(name), where.get(name, f"targeting.{name}")
        flagged = any(v.field == field or v.field.startswith(f"{field}[") for v in bad)
        if given and not flagged and any(a.name == name for a in schema.attributes):
            _attribute(bad, c, schema.attribute(name), given, field)
    blocks = {}
    for name in ("exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids"):
        ids = tuple(getattr(t, name))
        if ids and name not in blockable:
            bad.add(f"targeting.{name}", "the served index cannot apply it (docs/FORMAT.md §1)")
        elif len(ids) > MAX_EXCLUDE_IDS:
            bad.add(f"targeting.{name}", f"at most {MAX_EXCLUDE_IDS} ids, got {len(ids)}")
        elif name != "exclude_ad_ids" and 0 in ids:  # 0: an ad of no campaign or advertiser
            bad.add(f"targeting.{name}", "0 means none and cannot be blocked")
        blocks[name] = ids
    return dataclasses.replace(named, attributes=tuple(attributes), **blocks)


def _fill(bad: _Violations, t: pb.Targeting, name: str, values: Sequence[str], field: str) -> None:
    """Set the named field `name` of `t` from the map's `values`."""
    if name == "locations":
        t.locations.extend(values)
    elif len(values) > 1:
        bad.add(field, f"takes one value, got {len(values)}")
    elif values and name == "age":
        if not (values[0].isascii() and values[0].isdigit()):
            bad.add(field, f"expected a decimal integer >= 0, got {_shown(values[0])}")
        else:  # past MAX_AGE (int32 or not): out of range, named as such below
            t.age = min(int(values[0]), MAX_AGE + 1)
    elif values:
        setattr(t, name, values[0])


def _most_values(attr: Attribute) -> int:
    return attr.max_request_values if attr.kind == "set" else 1


def _attribute(
    bad: _Violations, c: Codec, attr: Attribute, values: Sequence[str], field: str
) -> None:
    """One attribute's request values as the codec reads them."""
    try:
        if attr.kind == "set":
            c.check_set(attr, values, field)
        else:
            c.request_bit(attr, values, field)
    except TargetingError as exc:
        bad.add(exc.field, str(exc).removeprefix(f"{exc.field}: "))


def _named_fields(bad: _Violations, t: pb.Targeting, where: dict[str, str]) -> Targeting:
    """Fields 1-4, checked as the model's user features (and the default schema) read
    them; `where`: the map entry a field was given in, named in its violations."""
    f = {n: where.get(n, f"targeting.{n}") for n in LEGACY_FIELDS}
    country = t.country
    if country and not (len(country) == 2 and country.isascii() and country.isalpha()):
        bad.add(f["country"], f"expected an ISO 3166-1 alpha-2 code or '', got {_shown(country)}")
    country = country.upper()  # a code outside COUNTRIES is kept: it encodes as unknown
    if not 0 <= t.age <= MAX_AGE:
        bad.add(f["age"], f"must be in 0..{MAX_AGE} (0 = unknown), got {t.age}")
    if t.gender not in ("", *GENDERS):
        bad.add(f["gender"], f"expected one of {['', *GENDERS]}, got {_shown(t.gender)}")
    if len(t.locations) > MAX_REQUEST_LOCATIONS:
        bad.add(f["locations"], f"at most {MAX_REQUEST_LOCATIONS} allowed, got {len(t.locations)}")
    else:
        elements = _Elements(bad, f["locations"], "locations")
        for i, loc in enumerate(t.locations):
            length = _utf8_len(loc)
            if not loc:
                elements.add(i, "", "must not be empty")
            elif length is None:
                elements.add(i, "", "not valid UTF-8")
            elif length > MAX_LOCATION_BYTES:
                elements.add(i, "", f"at most {MAX_LOCATION_BYTES} bytes")
        elements.close()
    return Targeting(country=country, age=t.age, gender=t.gender, locations=tuple(t.locations))


class _Elements:
    """The bad elements of one repeated field: the first `MAX_ELEMENT_VIOLATIONS` are
    named one by one, any beyond are counted on the repeated field itself (a reply
    naming 10,000 events would not fit in gRPC's trailing metadata)."""

    def __init__(self, bad: _Violations, field: str, noun: str) -> None:
        self.bad, self.field, self.noun = bad, field, noun
        self.named: set[int] = set()
        self.more: set[int] = set()

    def add(self, i: int, suffix: str, description: str) -> None:
        if i in self.named or len(self.named) < MAX_ELEMENT_VIOLATIONS:
            self.named.add(i)
            self.bad.add(f"{self.field}[{i}]{suffix}", description)
        else:
            self.more.add(i)

    def close(self) -> None:
        """After the named elements: the count of the others, on the field itself."""
        if self.more:
            self.bad.add(self.field, f"{len(self.more)} more {self.noun} are invalid (not listed)")


def _history(
    bad: _Violations, events: Sequence[pb.Event], max_history: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(events)
    if n > max_history:
        bad.add("user.history", f"at most {max_history} events, got {n}")
        n, events = 0, ()  # not read: the request is refused
    ad_ids = np.fromiter((e.ad_id for e in events), dtype=np.int64, count=n)
    types = np.fromiter((e.type for e in events), dtype=np.int64, count=n)
    ts = np.fromiter((e.timestamp_ms for e in events), dtype=np.int64, count=n)
    bad_type = set(np.flatnonzero(~np.isin(types, _EVENT_TYPES)).tolist())
    bad_ts = set(np.flatnonzero(ts < 0).tolist())
    elements = _Elements(bad, "user.history", "events")
    for i in sorted(bad_type | bad_ts):  # event by event: its type, then its timestamp
        if i in bad_type:
            name = _event_type_name(int(types[i]))
            elements.add(i, ".type", f"expected VIEW, CLICK or CONVERSION, got {name}")
        if i in bad_ts:
            elements.add(i, ".timestamp_ms", f"must be >= 0, got {ts[i]}")
    elements.close()
    for a in (ad_ids, types, ts):
        a.flags.writeable = False
    return ad_ids, types, ts


def _max_ads(bad: _Violations, max_ads: int, limits: Limits) -> int:
    if max_ads == 0:
        return limits.default_max_ads
    if not 1 <= max_ads <= limits.max_ads_limit:
        bad.add(
            "options.max_ads",
            f"must be in 1..{limits.max_ads_limit} (0 = server default), got {max_ads}",
        )
    return max_ads


def _beams(bad: _Violations, widths: list[int], limits: Limits) -> tuple[int, ...]:
    if not widths:
        return limits.default_beams
    field = "options.beam_widths"
    if len(widths) != SID_LENGTH:
        bad.add(
            field, f"expected {SID_LENGTH} values (M_1..M_{SID_LENGTH}) or none, got {len(widths)}"
        )
        return limits.default_beams
    steps = _Violations()
    if widths[0] != 1:
        steps.add(f"{field}[0]", f"M_1 must be 1, got {widths[0]}")
    for t, (m, most) in enumerate(zip(widths, limits.beam_max, strict=True)):
        if t == 0 and m != 1:
            continue
        if m < 1:
            steps.add(f"{field}[{t}]", f"must be >= 1, got {m}")
        elif m > most:
            steps.add(f"{field}[{t}]", f"{m} exceeds the server maximum {most} for M_{t + 1}")
    beams = tuple(widths)
    if steps:  # the growth rule is asked only of values each within bounds
        bad.extend(steps)
        return limits.default_beams
    try:
        check_schedule(beams, SID_LENGTH, VOCAB_SIZE)
    except ValueError as e:
        bad.add(f"{field}[{_first_bad_step(beams)}]", str(e))
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


def _filter_mode(bad: _Violations, mode: int) -> FilterMode:
    if mode not in _FILTER_MODES:
        bad.add(
            "options.filter_mode",
            f"expected FILTER_MODE_UNSPECIFIED, CD_ONLY or CD_GTM, got {mode}",
        )
        return FilterMode.CD_GTM
    return _FILTER_MODES[mode]


def _shown(value: str) -> str:
    """`value` as an error quotes it: at most `MAX_SHOWN_CHARS` (the details travel in
    gRPC's trailers, which a client caps at 8 KiB by default)."""
    if len(value) <= MAX_SHOWN_CHARS:
        return repr(value)
    return f"{value[:MAX_SHOWN_CHARS]!r}… ({len(value)} characters)"


def _event_type_name(value: int) -> str:
    try:
        return pb.EventType.Name(value)
    except ValueError:  # open enum: unknown numbers arrive as plain ints
        return str(value)
