"""GraceClient over real gRPC against the fake server (fake_grace.py): request building,
retries with backoff on RESOURCE_EXHAUSTED / UNAVAILABLE only, the server's RetryInfo
delay, one deadline across retries, health, and closing."""

from __future__ import annotations

import itertools
import time

import grpc
import pytest
from conftest import Served
from fake_grace import REPLY, Answer

from grace_client import (
    Backoff,
    GraceClient,
    GraceError,
    InvalidRequestError,
    ServingStatus,
    retrieval_pb2,
)

RE, UNAVAILABLE = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE
FAST = Backoff(initial=0.01, maximum=0.02)  # keep retrying tests quick
SKEW = 0.02  # gRPC carries a deadline as a timeout: the server may see it a little later


def test_retrieve_sends_the_typed_fields(served: Served) -> None:
    with GraceClient(served.target) as client:
        reply = client.retrieve(
            request_id="r-1",
            user_id=7,
            history=[(101, "CLICK", 1_700_000_000_000), retrieval_pb2.Event(ad_id=102, type=1)],
            country="US",
            age=31,
            gender="female",
            locations=["US-CA"],
            max_ads=10,
            beam_widths=[1, 8],
            filter_mode="CD_ONLY",
            include_sids=True,
            metadata=[("x-caller", "tests")],
        )
    assert reply == REPLY
    (call,) = served.fake.calls
    r = call.request
    assert (r.request_id, r.user.user_id) == ("r-1", 7)
    assert (r.targeting.country, r.targeting.age) == ("US", 31)
    assert [(e.ad_id, e.type) for e in r.user.history] == [(101, retrieval_pb2.CLICK), (102, 1)]
    assert list(r.targeting.locations) == ["US-CA"] and r.targeting.gender == "female"
    assert (r.options.max_ads, list(r.options.beam_widths)) == (10, [1, 8])
    assert r.options.filter_mode == retrieval_pb2.CD_ONLY and r.options.include_sids
    assert call.metadata["x-caller"] == "tests"


def test_retrieve_takes_a_request_message_but_not_both(served: Served) -> None:
    request = retrieval_pb2.RetrieveRequest(user=retrieval_pb2.User(user_id=3))
    with GraceClient(served.target) as client:
        assert client.retrieve(request) == REPLY
        with pytest.raises(TypeError, match="not both"):
            client.retrieve(request, user_id=4)
    assert served.fake.calls[0].request == request and len(served.fake.calls) == 1


@pytest.mark.parametrize("code", [RE, UNAVAILABLE])
def test_refusals_are_retried_until_an_answer(served: Served, code: grpc.StatusCode) -> None:
    delay = 0.01 if code == RE else None  # admission's refusals say when (RetryInfo)
    served.fake.answer(*[Answer(code, "busy", retry_delay=delay)] * 2)
    with GraceClient(served.target, retries=2, backoff=FAST) as client:
        assert client.retrieve(user_id=1) == REPLY
    assert len(served.fake.calls) == 3


def test_a_resource_exhausted_without_retry_info_is_final(served: Served) -> None:
    """A request too large for the server (no RetryInfo) would be refused again."""
    served.fake.answer(Answer(RE, "request of 9999999 bytes exceeds the largest valid one"))
    client = GraceClient(served.target, retries=3, backoff=FAST)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1)
    assert (err.value.code, err.value.attempts, err.value.retryable) == (RE, 1, False)
    assert len(served.fake.calls) == 1


def test_retries_are_bounded_and_the_last_error_says_so(served: Served) -> None:
    served.fake.answer(*[Answer(RE, "queue full", retry_delay=0.01)] * 5)
    client = GraceClient(served.target, retries=3, backoff=FAST)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1)
    assert (err.value.code, err.value.message, err.value.attempts) == (RE, "queue full", 4)
    assert err.value.retryable and str(err.value) == "RESOURCE_EXHAUSTED: queue full"
    assert err.value.request_id is None  # this server names no call
    assert len(served.fake.calls) == 4


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND,
     grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED],
)  # fmt: skip
def test_other_codes_are_never_retried(served: Served, code: grpc.StatusCode) -> None:
    served.fake.answer(Answer(code, "targeting.age: must be in [0, 150]"))
    client = GraceClient(served.target, retries=5, backoff=FAST)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1)
    assert (err.value.code, err.value.attempts, err.value.retryable) == (code, 1, False)
    assert err.value.message == "targeting.age: must be in [0, 150]"
    assert len(served.fake.calls) == 1


def test_an_invalid_argument_names_the_bad_fields_and_the_call(served: Served) -> None:
    bad = (("targeting.age", "must be in [0, 150]"), ("options.max_ads", "must be >= 0"))
    served.fake.answer(Answer(grpc.StatusCode.INVALID_ARGUMENT, "2 invalid fields",
                              violations=bad, request_id="r-9"))  # fmt: skip
    client = GraceClient(served.target)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1, age=-1, max_ads=-1)
    assert err.value.field_violations == bad and err.value.retry_delay is None
    assert err.value.request_id == "r-9"  # the server's x-request-id trailer
    assert str(err.value) == "INVALID_ARGUMENT: 2 invalid fields (request_id=r-9)"


def test_a_value_the_request_cannot_hold_is_refused_before_any_call(served: Served) -> None:
    client = GraceClient(served.target)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1, filter_mode="GTM")  # type: ignore[typeddict-item]
    assert isinstance(err.value, InvalidRequestError) and isinstance(err.value, ValueError)
    assert (err.value.code, err.value.attempts) == (grpc.StatusCode.INVALID_ARGUMENT, 0)
    assert err.value.message == "options.filter_mode: 'GTM' is not one of CD_ONLY, CD_GTM"
    assert served.fake.calls == []


def test_backoff_grows_exponentially(served: Served) -> None:
    served.fake.answer(*[Answer(UNAVAILABLE)] * 3)
    backoff = Backoff(initial=0.05, maximum=0.15, multiplier=2.0, jitter=0.0)
    with GraceClient(served.target, retries=3, backoff=backoff, timeout=5.0) as client:
        client.retrieve(user_id=1)
    at = [c.at for c in served.fake.calls]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    # 0.05, 0.1, then capped at 0.15 (lower bounds: a busy machine only adds time)
    assert len(gaps) == 3
    assert all(g >= want - 0.005 for g, want in zip(gaps, (0.05, 0.1, 0.15), strict=True)), gaps


def test_the_servers_retry_delay_is_honoured(served: Served) -> None:
    served.fake.answer(Answer(RE, "overloaded", retry_delay=0.3))
    with GraceClient(served.target, backoff=FAST, timeout=5.0) as client:
        assert client.retrieve(user_id=1) == REPLY
    first, second = served.fake.calls
    assert second.at - first.at >= 0.295  # not FAST's 0.01


def test_a_retry_delay_past_the_deadline_fails_at_once(served: Served) -> None:
    served.fake.answer(Answer(RE, "overloaded", retry_delay=10.0))
    with GraceClient(served.target, timeout=2.0) as client:
        t0 = time.monotonic()
        with pytest.raises(GraceError) as err:
            client.retrieve(user_id=1)
    assert time.monotonic() - t0 < 1.0  # no 10 s wait, no waiting out the deadline
    assert (err.value.code, err.value.attempts, err.value.retry_delay) == (RE, 1, 10.0)


def test_the_deadline_is_honoured(served: Served) -> None:
    served.fake.answer(Answer(sleep=2.0))
    with GraceClient(served.target, timeout=5.0) as client:
        t0 = time.monotonic()
        with pytest.raises(GraceError) as err:
            client.retrieve(user_id=1, timeout=0.2)  # the call's own timeout wins
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.attempts == 1
    assert 0.19 <= time.monotonic() - t0 < 1.5
    assert served.fake.calls[0].time_remaining <= 0.2 + SKEW


def test_one_deadline_spans_every_attempt(served: Served) -> None:
    served.fake.answer(*[Answer(UNAVAILABLE, sleep=0.2)] * 5)
    with GraceClient(served.target, retries=5, backoff=FAST, timeout=0.6) as client:
        t0 = time.monotonic()
        with pytest.raises(GraceError) as err:
            client.retrieve(user_id=1)
    assert time.monotonic() - t0 < 0.6 + 0.5
    calls = served.fake.calls
    assert len(calls) >= 2 and err.value.attempts == len(calls)
    # every attempt runs until the call's one deadline: what is left of it, not 0.6 each
    deadlines = [c.at + c.time_remaining for c in calls]
    assert max(deadlines) - min(deadlines) < SKEW and max(deadlines) <= t0 + 0.6 + SKEW
    assert err.value.code in {grpc.StatusCode.DEADLINE_EXCEEDED, UNAVAILABLE}


def test_an_unreachable_server_is_retried_then_unavailable(dead_target: str) -> None:
    client = GraceClient(dead_target, retries=2, backoff=FAST, timeout=5.0)
    with client, pytest.raises(GraceError) as err:
        client.retrieve(user_id=1)
    assert (err.value.code, err.value.attempts) == (UNAVAILABLE, 3)


def test_health(served: Served) -> None:
    with GraceClient(served.target) as client:
        assert client.health() is ServingStatus.SERVING
        served.fake.health["grace.v1.AdRetrieval"] = ServingStatus.NOT_SERVING.value
        assert client.health("grace.v1.AdRetrieval") is ServingStatus.NOT_SERVING
        with pytest.raises(GraceError) as err:
            client.health("no.such.Service")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_health_of_an_unreachable_server_is_an_error(dead_target: str) -> None:
    client = GraceClient(dead_target)
    with client, pytest.raises(GraceError) as err:
        client.health(timeout=2.0)
    assert err.value.code == UNAVAILABLE and err.value.attempts == 1


def test_leaving_the_context_closes_the_channel(served: Served) -> None:
    with GraceClient(served.target) as client:
        client.retrieve(user_id=1)
    with pytest.raises(ValueError, match="closed channel"):
        client.retrieve(user_id=1)
