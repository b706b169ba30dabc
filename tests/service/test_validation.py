"""Request validation: bad fields are named, good requests come through with defaults."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.request import FilterMode
from contracts.targeting import Targeting
from contracts.targeting_codec import codec
from contracts.targeting_schema import DEFAULT
from service.rpc.grace.v1 import retrieval_pb2 as pb
from service.validation import InvalidRequest, Limits, ValidatedRequest, validate_request

LIMITS = Limits(
    default_max_ads=1000,
    max_ads_limit=10_000,
    default_beams=(1, 64, 128, 128),
    beam_max=(1, 64, 128, 128),
    max_history=100,
)
# Paper-sized maxima: wide enough that the M_{t+1} <= 512·M_t rule can bite.
WIDE = Limits(1000, 10_000, (1, 512, 1024, 1024), (1, 512, 1024, 1024))


def _good() -> pb.RetrieveRequest:
    return pb.RetrieveRequest(
        request_id="req-1",
        user=pb.User(
            user_id=42,
            history=[
                pb.Event(ad_id=7, type=pb.VIEW, timestamp_ms=1_000),
                pb.Event(ad_id=-3, type=pb.CLICK, timestamp_ms=0),
                pb.Event(ad_id=9, type=pb.CONVERSION, timestamp_ms=2_000),
            ],
        ),
        targeting=pb.Targeting(country="us", age=30, gender="female", locations=["NYC", "10001"]),
        options=pb.Options(max_ads=50, beam_widths=[1, 8, 16, 32], filter_mode=pb.CD_ONLY),
    )


def test_good_request_round_trips() -> None:
    v = validate_request(_good(), LIMITS)
    assert v.request_id == "req-1" and v.user_id == 42
    assert v.targeting == Targeting("US", 30, "female", ("NYC", "10001"))
    np.testing.assert_array_equal(v.history_ad_ids, [7, -3, 9])
    np.testing.assert_array_equal(v.history_types, [pb.VIEW, pb.CLICK, pb.CONVERSION])
    np.testing.assert_array_equal(v.history_ts_ms, [1_000, 0, 2_000])
    assert v.history_ad_ids.dtype == v.history_ts_ms.dtype == np.int64
    assert not v.history_ad_ids.flags.writeable
    assert (v.max_ads, v.beams, v.filter_mode) == (50, (1, 8, 16, 32), FilterMode.CD_ONLY)
    assert v.include_sids is False


def test_empty_request_gets_every_default() -> None:
    v = validate_request(pb.RetrieveRequest(), LIMITS)
    assert v == ValidatedRequest(
        request_id="",
        user_id=0,
        targeting=Targeting(),
        history_ad_ids=v.history_ad_ids,
        history_types=v.history_types,
        history_ts_ms=v.history_ts_ms,
        max_ads=1000,
        beams=(1, 64, 128, 128),
        filter_mode=FilterMode.CD_GTM,
        include_sids=False,
        adaptive=True,  # no beam_widths: the server's schedule, its ladder under load
    )
    assert len(v.history_ad_ids) == len(v.history_types) == len(v.history_ts_ms) == 0


@pytest.mark.parametrize(
    ("mode", "expected"),
    [(pb.FILTER_MODE_UNSPECIFIED, FilterMode.CD_GTM), (pb.CD_GTM, FilterMode.CD_GTM)],
)
def test_filter_mode_default_is_cd_gtm(mode: int, expected: FilterMode) -> None:
    req = pb.RetrieveRequest(options=pb.Options(filter_mode=mode, include_sids=True))
    v = validate_request(req, LIMITS)
    assert v.filter_mode == expected and v.include_sids


def test_unknown_but_well_formed_country_is_unknown() -> None:
    v = validate_request(pb.RetrieveRequest(targeting=pb.Targeting(country="xq")), LIMITS)
    assert v.targeting.country == "XQ"
    c = codec(DEFAULT)
    assert np.array_equal(
        c.request_bitmask(v.targeting.values()), c.request_bitmask(Targeting().values())
    )


def test_limits_at_the_edges_pass() -> None:
    req = pb.RetrieveRequest(
        request_id="r" * 128,
        targeting=pb.Targeting(age=150, locations=["é" * 128] * 64),
        options=pb.Options(max_ads=10_000, beam_widths=[1, 64, 128, 128]),
    )
    req.user.history.extend(pb.Event(type=pb.VIEW) for _ in range(100))
    v = validate_request(req, LIMITS)
    assert v.max_ads == 10_000 and len(v.targeting.locations) == 64
    assert v.beams == (1, 64, 128, 128)
    # what validation admits, the targeting encoder accepts
    codec(DEFAULT).request_bitmask(v.targeting.values())
    codec(DEFAULT).request_blooms(v.targeting.values())


def _set(path: str, value):
    def edit(req: pb.RetrieveRequest) -> None:
        *parents, leaf = path.split(".")
        msg = req
        for p in parents:
            msg = getattr(msg, p)
        if isinstance(value, list):
            del getattr(msg, leaf)[:]
            getattr(msg, leaf).extend(value)
        else:
            setattr(msg, leaf, value)

    return edit


def _event(i: int, **kw):
    def edit(req: pb.RetrieveRequest) -> None:
        e = req.user.history[i]
        for k, v in kw.items():
            setattr(e, k, v)

    return edit


def _many_events(n: int):
    def edit(req: pb.RetrieveRequest) -> None:
        req.user.history.extend(pb.Event(type=pb.VIEW) for _ in range(n))

    return edit


BAD = [
    ("request_id", _set("request_id", "x" * 129), "request_id"),
    ("request_id_bytes", _set("request_id", "é" * 65), "request_id"),
    ("country_long", _set("targeting.country", "USA"), "targeting.country"),
    ("country_digits", _set("targeting.country", "1A"), "targeting.country"),
    ("country_non_ascii", _set("targeting.country", "ÜS"), "targeting.country"),
    ("country_short", _set("targeting.country", "U"), "targeting.country"),
    ("age_negative", _set("targeting.age", -1), "targeting.age"),
    ("age_absurd", _set("targeting.age", 151), "targeting.age"),
    ("gender_unknown", _set("targeting.gender", "other"), "targeting.gender"),
    ("gender_case", _set("targeting.gender", "Female"), "targeting.gender"),
    ("locations_65", _set("targeting.locations", ["a"] * 65), "targeting.locations"),
    ("location_empty", _set("targeting.locations", ["a", ""]), "targeting.locations[1]"),
    ("location_long", _set("targeting.locations", ["a" * 257]), "targeting.locations[0]"),
    ("history_long", _many_events(98), "user.history"),
    ("event_unspecified", _event(1, type=pb.EVENT_TYPE_UNSPECIFIED), "user.history[1].type"),
    ("event_unknown", _event(2, type=17), "user.history[2].type"),
    ("timestamp_negative", _event(2, timestamp_ms=-5), "user.history[2].timestamp_ms"),
    ("max_ads_negative", _set("options.max_ads", -1), "options.max_ads"),
    ("max_ads_absurd", _set("options.max_ads", 10_001), "options.max_ads"),
    ("beams_short", _set("options.beam_widths", [1, 8, 16]), "options.beam_widths"),
    ("beams_long", _set("options.beam_widths", [1, 8, 16, 16, 16]), "options.beam_widths"),
    ("beams_first", _set("options.beam_widths", [2, 8, 16, 32]), "options.beam_widths[0]"),
    ("beams_zero", _set("options.beam_widths", [1, 8, 0, 32]), "options.beam_widths[2]"),
    ("beams_negative", _set("options.beam_widths", [1, -8, 1, 1]), "options.beam_widths[1]"),
    ("beams_over_max", _set("options.beam_widths", [1, 64, 129, 128]), "options.beam_widths[2]"),
    ("filter_mode", _set("options.filter_mode", 3), "options.filter_mode"),
]


@pytest.mark.parametrize(("edit", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(edit, field: str) -> None:
    req = _good()
    edit(req)
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, LIMITS)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("widths", "field"),
    [([1, 1, 1000, 1000], "options.beam_widths[2]"), ([1, 1, 2, 1025], "options.beam_widths[3]")],
)
def test_beam_growth_rule_names_the_step(widths: list[int], field: str) -> None:
    req = pb.RetrieveRequest(options=pb.Options(beam_widths=widths))
    with pytest.raises(InvalidRequest, match="exceeds") as e:
        validate_request(req, WIDE)
    assert e.value.field == field


def test_limits_from_settings() -> None:
    from service.settings import load_settings

    s = load_settings({"beam_max": [1, 32, 64, 64], "max_ads_limit": 500, "default_max_ads": 10})
    limits = Limits.from_settings(s)
    assert limits == Limits(10, 500, (1, 32, 64, 64), (1, 32, 64, 64), s.max_history_events)
    with pytest.raises(InvalidRequest, match="server maximum 32"):
        validate_request(
            pb.RetrieveRequest(options=pb.Options(beam_widths=[1, 64, 64, 64])), limits
        )


# Each entry breaks one field of `_good()` (the value, then the path it is reported at).
BREAKS = {
    "request_id": ("x" * 129, "request_id"),
    "targeting.country": ("USA", "targeting.country"),
    "targeting.age": (-1, "targeting.age"),
    "targeting.gender": ("other", "targeting.gender"),
    "options.max_ads": (-1, "options.max_ads"),
    "options.beam_widths": ([1, 8, 16], "options.beam_widths"),
    "options.filter_mode": (7, "options.filter_mode"),
}
# the order validation reports them in: the proto's, element by element
ORDER = [
    "request_id",
    "user.history",
    "targeting.country",
    "targeting.age",
    "targeting.gender",
    "targeting.locations",
    "options.max_ads",
    "options.beam_widths",
    "options.filter_mode",
]


@settings(max_examples=200, deadline=None)
@given(
    fields=st.sets(st.sampled_from(sorted(BREAKS))),
    locations=st.sets(st.integers(0, 3)),
    types=st.sets(st.integers(0, 2)),
    stamps=st.sets(st.integers(0, 2)),
)
def test_every_broken_field_is_reported_and_only_those(
    fields: set[str], locations: set[int], types: set[int], stamps: set[int]
) -> None:
    req = _good()
    req.targeting.locations[:] = ["a", "b", "c", "d"]
    expected = []
    for name in fields:
        value, path = BREAKS[name]
        _set(name, value)(req)
        expected.append(path)
    for i in locations:
        req.targeting.locations[i] = ""
    for i in sorted(types | stamps):
        if i in types:
            req.user.history[i].type = pb.EVENT_TYPE_UNSPECIFIED
            expected.append(f"user.history[{i}].type")
        if i in stamps:
            req.user.history[i].timestamp_ms = -1
            expected.append(f"user.history[{i}].timestamp_ms")
    expected += [f"targeting.locations[{i}]" for i in sorted(locations)]
    expected.sort(key=lambda f: ORDER.index(f.split("[")[0]))  # stable: elements stay in order
    if not expected:
        validate_request(req, LIMITS)
        return
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, LIMITS)
    assert [v.field for v in e.value.violations] == expected
    assert (e.value.field, e.value.message) == (expected[0], e.value.violations[0].description)
    assert str(e.value).startswith(f"{expected[0]}: ")
    if len(expected) > 1:
        assert str(e.value).endswith(f"(and {len(expected) - 1} more: {', '.join(expected[1:])})")


def test_a_repeated_field_names_its_first_bad_elements_then_counts_the_rest() -> None:
    req = pb.RetrieveRequest()
    req.user.history.extend(pb.Event(type=pb.VIEW, timestamp_ms=-1) for _ in range(20))
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, LIMITS)
    fields = [v.field for v in e.value.violations]
    assert fields == [f"user.history[{i}].timestamp_ms" for i in range(8)] + ["user.history"]
    assert e.value.violations[-1].description == "12 more events are invalid (not listed)"


def test_the_worst_request_s_details_fit_in_grpc_s_default_metadata_limit() -> None:
    """Every field bad at its longest: the BadRequest and the message (both go in the
    trailers) stay under the 8 KiB a gRPC client accepts by default."""
    from service.rpc_status import Abort, bad_request

    req = pb.RetrieveRequest(
        request_id="x" * 100_000,
        user=pb.User(history=[pb.Event(type=99, timestamp_ms=-(2**63))] * 100),
        targeting=pb.Targeting(
            country="Q" * 100_000, age=-(2**31), gender="g" * 100_000, locations=[""] * 64
        ),
        options=pb.Options(max_ads=-(2**31), beam_widths=[-(2**31)] * 4, filter_mode=-(2**31)),
    )
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, LIMITS)
    # id; 8 events x (type, time) + the rest; country, age, gender; 8 + 1 locations; options
    assert len(e.value.violations) == 1 + (16 + 1) + 3 + (8 + 1) + (1 + 4 + 1)
    abort = Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e.value), (bad_request(e.value),))
    size = sum(len(k) + len(v) for k, v in abort.trailing_metadata()) + len(abort.message)
    assert size < 8 * 1024, size


def test_beam_bounds_are_each_reported_before_the_growth_rule() -> None:
    req = pb.RetrieveRequest(options=pb.Options(beam_widths=[2, 0, 129, 1000]))
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, LIMITS)
    assert [v.field for v in e.value.violations] == [f"options.beam_widths[{t}]" for t in range(4)]


# --------------------------------------------------------------------------- fuzz

# Each field mixes plausible values with garbage, so both outcomes stay frequent.
_int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-3, 200))
_int64 = st.integers(-(2**63), 2**63 - 1)
_text = st.one_of(st.text(max_size=300), st.text("ab-é€", max_size=3))


def _mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    # one_of would pick each side half the time; 3:1 keeps later fields reachable
    return st.integers(0, 3).flatmap(lambda i: bad if i == 0 else good)


_good_event = st.builds(
    pb.Event,
    ad_id=_int64,
    type=st.sampled_from([pb.VIEW, pb.CLICK, pb.CONVERSION]),
    timestamp_ms=st.integers(0, 2**63 - 1),
)
_any_event = st.builds(pb.Event, ad_id=_int64, type=_int32, timestamp_ms=_int64)
_request_st = st.builds(
    pb.RetrieveRequest,
    request_id=_mostly(st.text(max_size=20), _text),
    user=st.builds(
        pb.User,
        user_id=_int64,
        history=_mostly(
            st.lists(_good_event, max_size=110), st.lists(_any_event, min_size=1, max_size=5)
        ),
    ),
    targeting=st.builds(
        pb.Targeting,
        country=_mostly(st.sampled_from(["", "us", "GB", "XX"]), _text),
        age=_mostly(st.integers(0, 150), _int32),
        gender=_mostly(st.sampled_from(["", "female", "male"]), _text),
        locations=st.lists(_mostly(st.text(min_size=1, max_size=20), _text), max_size=66),
    ),
    options=st.builds(
        pb.Options,
        max_ads=_mostly(st.integers(0, 10_000), _int32),
        beam_widths=st.one_of(
            st.just([]),
            st.tuples(st.just(1), *[st.integers(1, 128)] * 3).map(list),
            st.lists(_int32, max_size=6),
        ),
        filter_mode=_mostly(st.sampled_from([0, 1, 2]), _int32),
        include_sids=st.booleans(),
    ),
)


def _check(req: pb.RetrieveRequest) -> None:
    try:
        v = validate_request(req, LIMITS)
    except InvalidRequest as e:
        assert e.field and str(e).startswith(e.field)
        fields = [v.field for v in e.violations]
        assert fields[0] == e.field and len(fields) == len(set(fields))
        return
    # anything admitted is usable downstream
    assert 1 <= v.max_ads <= LIMITS.max_ads_limit
    assert all(1 <= m <= most for m, most in zip(v.beams, LIMITS.beam_max, strict=True))
    codec(DEFAULT).request_bitmask(v.targeting.values())
    codec(DEFAULT).request_blooms(v.targeting.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_request_st)
def test_fuzzed_fields_raise_only_invalid_request(req: pb.RetrieveRequest) -> None:
    _check(req)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzzed_wire_bytes_raise_only_invalid_request(data: bytes) -> None:
    try:
        req = pb.RetrieveRequest.FromString(data)
    except Exception:  # the gRPC layer rejects undecodable bytes before the handler
        return
    _check(req)


# --- the targeting schema (docs/FORMAT.md §1): attributes, blocks ----------------------------


def _rich():
    from contracts.targeting_schema import parse

    return parse({"attributes": [
        {"name": "platform", "kind": "enum", "catalog_field": "platforms",
         "values": ["ios", "android", "web"]},
        {"name": "age", "kind": "bucket", "catalog_field": "age_buckets",
         "buckets": {"18-34": [18, 34], "35+": [35, None]}},
        {"name": "audiences", "kind": "set", "catalog_field": "audiences",
         "max_request_values": 3},
    ]}, "rich")  # fmt: skip


def _fields(req: pb.RetrieveRequest, schema=None, blockable=()) -> dict[str, str]:
    with pytest.raises(InvalidRequest) as caught:
        validate_request(req, LIMITS, schema or DEFAULT, blockable)
    return {v.field: v.description for v in caught.value.violations}


def test_attributes_of_a_schema_are_checked_as_it_declares_them() -> None:
    schema = _rich()
    req = _good()
    req.targeting.Clear()
    req.targeting.attributes["platform"].values.append("ios")
    req.targeting.attributes["audiences"].values.extend(["a1", "a2"])
    req.targeting.age = 40  # a named field fills the schema's attribute of its name
    req.targeting.exclude_campaign_ids.extend([5, 6])
    ok = validate_request(req, LIMITS, schema, ("exclude_campaign_ids",))
    assert ok.targeting.values() == {"platform": ("ios",), "audiences": ("a1", "a2"),
                                     "age": ("40",)}  # fmt: skip
    assert ok.targeting.exclude_campaign_ids == (5, 6)
    bad = _good()
    bad.targeting.Clear()
    bad.targeting.attributes["platform"].values.extend(["ios", "web"])
    bad.targeting.attributes["audiences"].values.extend(["a", "b", "c", "d"])
    bad.targeting.attributes["colour"].values.append("red")
    bad.targeting.attributes["age"].values.append("forty")
    got = _fields(bad, schema)
    assert got["targeting.attributes['platform']"] == "takes one value, got 2"
    assert got["targeting.attributes['audiences']"] == "at most 3 allowed, got 4"
    assert "no such attribute (it has platform, age, audiences)" in got[
        "targeting.attributes['colour']"]  # fmt: skip
    assert "expected a decimal integer" in got["targeting.attributes['age']"]
    bad = _good()
    bad.targeting.attributes["platform"].values.append("blackberry")
    assert "unknown value 'blackberry'" in _fields(bad, schema)["targeting.attributes['platform']"]


def test_an_attribute_given_twice_or_a_block_the_index_cannot_apply_is_refused() -> None:
    req = _good()
    req.targeting.attributes["gender"].values.append("male")  # also targeting.gender
    req.targeting.exclude_ad_ids.extend(range(4097))
    req.targeting.exclude_advertiser_ids.append(3)
    got = _fields(req, blockable=("exclude_ad_ids",))
    assert got["targeting.attributes['gender']"] == "also given as targeting.gender: give it once"
    assert got["targeting.exclude_ad_ids"] == "at most 4096 ids, got 4097"
    assert "cannot apply it" in got["targeting.exclude_advertiser_ids"]


def test_the_named_fields_may_come_in_the_map_as_the_default_schema_names_them() -> None:
    ok = _good()
    ok.targeting.Clear()
    for name, values in (("gender", ["male"]), ("age", ["70"]), ("country", ["de"]),
                         ("locations", ["NYC", "Paris"])):  # fmt: skip
        ok.targeting.attributes[name].values.extend(values)
    t = validate_request(ok, LIMITS).targeting
    assert (t.country, t.age, t.gender, t.locations) == ("DE", 70, "male", ("NYC", "Paris"))
    assert t.attributes == ()  # filled into the named fields: the model reads those
    bad = _good()
    bad.targeting.Clear()
    bad.targeting.attributes["age"].values.append("151")
    bad.targeting.attributes["gender"].values.append("robot")
    got = _fields(bad)
    assert got == {"targeting.attributes['age']": "must be in 0..150 (0 = unknown), got 151",
                   "targeting.attributes['gender']": "expected one of ['', 'female', 'male'], "
                   "got 'robot'"}  # fmt: skip
