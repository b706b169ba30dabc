"""The client's parts without a server: the backoff schedule, the retry decision, request
building, RetryInfo / BadRequest parsing (against googleapis' own messages where
installed), and that
`import grace_client` pulls in neither the service nor torch."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from fake_grace import status_details

import grace_client
from grace_client import (
    Backoff,
    GraceError,
    InvalidRequestError,
    RequestFields,
    build_request,
    retrieval_pb2,
)
from grace_client._wire import STATUS_DETAILS_KEY, ErrorDetails, error_details
from grace_client.request import _OWNER
from grace_client.retry import Schedule


def test_backoff_caps_grow_and_jitter_stays_below_them() -> None:
    backoff, rng = Backoff(initial=0.1, maximum=0.5, multiplier=2.0), random.Random(0)
    for retry, cap in enumerate((0.1, 0.2, 0.4, 0.5, 0.5)):
        delays = [backoff.delay(retry, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in delays)
        assert max(delays) > 0.8 * cap and min(delays) < 0.2 * cap  # spread: full jitter
    fixed = Backoff(initial=0.1, maximum=0.5, jitter=0.0)
    assert [fixed.delay(n, rng) for n in range(4)] == pytest.approx([0.1, 0.2, 0.4, 0.5])


@pytest.mark.parametrize(
    "kwargs", [{"initial": 0}, {"initial": 2, "maximum": 1}, {"multiplier": 0.5}, {"jitter": 2}]
)
def test_backoff_refuses_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_schedule_gives_up_on_final_codes_spent_retries_and_the_deadline() -> None:
    now = [0.0]
    schedule = Schedule(1, Backoff(jitter=0.0), 1.0, random.Random(0), clock=lambda: now[0])
    assert schedule.attempt() == 1.0
    assert schedule.pause(GraceError(grpc.StatusCode.INVALID_ARGUMENT, "")) is None
    assert schedule.pause(GraceError(grpc.StatusCode.UNAVAILABLE, "")) == 0.025
    assert schedule.pause(GraceError(grpc.StatusCode.UNAVAILABLE, "", retry_delay=0.5)) == 0.5
    assert schedule.pause(GraceError(grpc.StatusCode.UNAVAILABLE, "", retry_delay=1.0)) is None
    now[0] = 0.4
    assert schedule.attempt() == pytest.approx(0.6)  # what is left of the one deadline
    assert schedule.pause(GraceError(grpc.StatusCode.UNAVAILABLE, "")) is None  # retries spent


def test_build_request_fields_and_defaults() -> None:
    r = build_request(user_id=9, history=[(1, "VIEW", 5), (2, 3, 6)], filter_mode="CD_GTM")
    assert r.user.user_id == 9 and r.options.filter_mode == retrieval_pb2.CD_GTM
    assert [(e.ad_id, e.type, e.timestamp_ms) for e in r.user.history] == [(1, 1, 5), (2, 3, 6)]
    assert build_request() == retrieval_pb2.RetrieveRequest(
        user=retrieval_pb2.User(), targeting=retrieval_pb2.Targeting(),
        options=retrieval_pb2.Options(),
    )  # fmt: skip
    blocked = build_request(attributes={"platform": ["ios"]}, exclude_campaign_ids=[4, 5])
    assert list(blocked.targeting.attributes["platform"].values) == ["ios"]
    assert list(blocked.targeting.exclude_campaign_ids) == [4, 5]
    with pytest.raises(InvalidRequestError, match="expected a list"):
        build_request(attributes={"platform": "ios"})
    with pytest.raises(TypeError, match="unknown request fields"):
        build_request(userid=9)  # type: ignore[call-arg]
    assert set(_OWNER) == set(RequestFields.__annotations__)  # every proto field, no other


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"filter_mode": "CD_SOMETIMES"}, "options.filter_mode", "not one of CD_ONLY, CD_GTM"),
        ({"history": [(1, "CLIK", 5)]}, "user.history[0].type", "one of VIEW, CLICK, CONVERSION"),
        ({"history": [(1, 5)]}, "user.history[0]", "(ad_id, type, timestamp_ms)"),
        ({"age": "31"}, "targeting.age", "str"),
        ({"user_id": 2**64}, "user.user_id", "out of range"),
        ({"locations": "US"}, "targeting.locations", "a list"),
    ],
)
def test_a_value_its_field_cannot_hold_is_one_named_error(
    fields: dict, field: str, says: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        build_request(**fields)
    assert isinstance(err.value, GraceError) and isinstance(err.value, ValueError)
    assert err.value.field_violations[0][0] == field and says in err.value.message
    assert err.value.message.startswith(f"{field}: ") and "\n" not in err.value.message


def test_error_details_parsing() -> None:
    details = status_details(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0.125, (("a", "b"),))
    assert error_details(((STATUS_DETAILS_KEY, details),)) == ErrorDetails(0.125, (("a", "b"),))
    assert error_details((("other", "x"),)) == ErrorDetails() == error_details(None)
    assert error_details(((STATUS_DETAILS_KEY, b"\xff\xff"),)) == ErrorDetails()  # malformed


def test_error_details_read_googleapis_status_messages() -> None:
    """The server builds the trailer with googleapis' google.rpc protos (grpcio-status):
    the client's private declaration of them must read it."""
    status_pb2 = pytest.importorskip("google.rpc.status_pb2")
    error_details_pb2 = pytest.importorskip("google.rpc.error_details_pb2")
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromMilliseconds(1500)
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="targeting.age", description="must be in [0, 150]",
                             reason="OUT_OF_RANGE")  # fmt: skip
    status = status_pb2.Status(code=8, message="queue full")
    for detail in (error_details_pb2.DebugInfo(detail="not read"), info, bad):
        status.details.add().Pack(detail)
    got = error_details(((STATUS_DETAILS_KEY, status.SerializeToString()),))
    assert got == ErrorDetails(1.5, (("targeting.age", "must be in [0, 150]"),))


def test_importing_the_client_pulls_in_neither_the_service_nor_torch(tmp_path: Path) -> None:
    root = Path(grace_client.__file__).resolve().parents[1]  # clients/python, or site-packages
    probe = (
        "import sys, grace_client\n"
        # (grpc itself imports the top-level grpc_health when installed: not its stubs)
        "heavy = {'torch', 'service', 'numpy', 'grpc_health.v1.health_pb2', 'grpc_status',\n"
        "         'google.rpc'}\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
