"""Build a `grace.v1.RetrieveRequest` from typed keyword arguments (`build_request`), the
fields of proto/grace/v1/retrieval.proto flattened: what the client's `retrieve(...)` takes
when it is not handed a request message. Limits (at most 64 locations, beam widths, max
ads …) are the server's to check: it answers INVALID_ARGUMENT naming the field
(docs/SERVICE.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypedDict, Unpack

from grace_client.rpc.grace.v1 import retrieval_pb2

EventTypeName = Literal["VIEW", "CLICK", "CONVERSION"]
FilterModeName = Literal["CD_ONLY", "CD_GTM"]
# (ad_id, type, timestamp_ms): a history event without building the message
EventTuple = tuple[int, EventTypeName | int, int]


class RequestFields(TypedDict, total=False):
    """The keyword arguments of `build_request` (and of the clients' `retrieve`)."""

    request_id: str  # the caller's id of the call, on the server's log lines; empty = none
    user_id: int
    history: Iterable[retrieval_pb2.Event | EventTuple]  # recent events, any order
    country: str  # ISO 3166-1 alpha-2; empty = unknown
    age: int  # years; 0 = unknown
    gender: str  # "female" | "male" | "" (unknown)
    locations: Iterable[str]  # at most 64
    max_ads: int  # 0 = the server's default
    beam_widths: Iterable[int]  # per-step beam widths; empty = the server's schedule
    filter_mode: FilterModeName | int  # unspecified (0) = CD_GTM
    include_sids: bool  # return each ad's Semantic ID


def _event(event: retrieval_pb2.Event | EventTuple) -> retrieval_pb2.Event:
    if isinstance(event, retrieval_pb2.Event):
        return event
    ad_id, kind, timestamp_ms = event
    if isinstance(kind, str):
        kind = retrieval_pb2.EventType.Value(kind)
    return retrieval_pb2.Event(ad_id=ad_id, type=kind, timestamp_ms=timestamp_ms)


def build_request(**fields: Unpack[RequestFields]) -> retrieval_pb2.RetrieveRequest:
    """A RetrieveRequest of `RequestFields`; unknown names are a TypeError.

    >>> build_request(user_id=7, country="US", age=31, max_ads=10).targeting.country
    'US'
    """
    unknown = sorted(set(fields) - set(RequestFields.__annotations__))
    if unknown:
        raise TypeError(f"unknown request fields {unknown}")
    f = fields  # (short: used on every line below)
    mode = f.get("filter_mode", 0)
    if isinstance(mode, str):
        mode = retrieval_pb2.FilterMode.Value(mode)
    return retrieval_pb2.RetrieveRequest(
        request_id=f.get("request_id", ""),
        user=retrieval_pb2.User(
            user_id=f.get("user_id", 0), history=[_event(e) for e in f.get("history", ())]
        ),
        targeting=retrieval_pb2.Targeting(
            country=f.get("country", ""),
            age=f.get("age", 0),
            gender=f.get("gender", ""),
            locations=list(f.get("locations", ())),
        ),
        options=retrieval_pb2.Options(
            max_ads=f.get("max_ads", 0),
            beam_widths=list(f.get("beam_widths", ())),
            filter_mode=mode,
            include_sids=f.get("include_sids", False),
        ),
    )
