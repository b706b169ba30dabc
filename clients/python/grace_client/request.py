"""Build a `grace.v1.RetrieveRequest` from typed keyword arguments (`build_request`), the
fields of proto/grace/v1/retrieval.proto flattened: what the client's `retrieve(...)` takes
when it is not handed a request message. A value its field cannot hold (a wrong type, an
unknown enum name) is an `InvalidRequestError` naming the field, before any call; limits
(at most 64 locations, beam widths, max ads …) are the server's to check: it answers
INVALID_ARGUMENT naming the field (docs/SERVICE.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, TypedDict, Unpack

from grace_client.errors import InvalidRequestError
from grace_client.rpc.grace.v1 import retrieval_pb2

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

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
    # any attribute of the served index's targeting schema, by name (docs/FORMAT.md §1):
    # {"platform": ["ios"], "audiences": ["a17", "a9"], "age": ["31"]}
    attributes: dict[str, Iterable[str]]
    exclude_ad_ids: Iterable[int]  # blocks: these ads never come back
    exclude_campaign_ids: Iterable[int]  # nor ads of these campaigns
    exclude_advertiser_ids: Iterable[int]  # nor of these advertisers
    max_ads: int  # 0 = the server's default
    beam_widths: Iterable[int]  # per-step beam widths; empty = the server's schedule
    filter_mode: FilterModeName | int  # unspecified (0) = CD_GTM
    include_sids: bool  # return each ad's Semantic ID


# keyword -> the part of the request holding the field of that name ("" = the request)
_OWNER = {
    field.name: part.name if part.message_type else ""
    for part in retrieval_pb2.RetrieveRequest.DESCRIPTOR.fields
    for field in (part.message_type.fields if part.message_type else (part,))
}


def _enum(enum: EnumTypeWrapper, value: str | int, path: str) -> int:
    """An enum's number: of its name, or the number as given."""
    if not isinstance(value, str):
        return value
    try:
        return enum.Value(value)
    except ValueError:
        names = ", ".join(v.name for v in enum.DESCRIPTOR.values if v.number)  # not *_UNSPECIFIED
        raise InvalidRequestError(path, f"{value!r} is not one of {names}") from None


def _event(event: retrieval_pb2.Event | EventTuple, path: str) -> retrieval_pb2.Event:
    if isinstance(event, retrieval_pb2.Event):
        return event
    try:
        ad_id, kind, timestamp_ms = event
    except (TypeError, ValueError):
        raise InvalidRequestError(
            path, f"expected an Event or (ad_id, type, timestamp_ms), got {event!r}"
        ) from None
    kind = _enum(retrieval_pb2.EventType, kind, f"{path}.type")
    return retrieval_pb2.Event(ad_id=ad_id, type=kind, timestamp_ms=timestamp_ms)


def build_request(**fields: Unpack[RequestFields]) -> retrieval_pb2.RetrieveRequest:
    """A RetrieveRequest of `RequestFields`; an unknown name is a TypeError (as for any
    call), a value its field cannot hold an InvalidRequestError.

    >>> build_request(user_id=7, country="US", age=31, max_ads=10).targeting.country
    'US'
    """
    unknown = sorted(set(fields) - set(_OWNER))
    if unknown:
        raise TypeError(f"unknown request fields {unknown}")
    request = retrieval_pb2.RetrieveRequest(user={}, targeting={}, options={})
    for name, value in fields.items():
        owner = _OWNER[name]
        path, message = (f"{owner}.{name}", getattr(request, owner)) if owner else (name, request)
        try:
            if name == "history":
                value = [_event(e, f"{path}[{i}]") for i, e in enumerate(value)]
            elif name == "filter_mode":
                value = _enum(retrieval_pb2.FilterMode, value, path)
            if name == "attributes":
                for key, values in value.items():
                    if isinstance(values, str):
                        raise TypeError(f"{key!r}: expected a list, got the string {values!r}")
                    message.attributes[key].values.extend(values)
            elif message.DESCRIPTOR.fields_by_name[name].is_repeated:
                if isinstance(value, str):  # would be taken letter by letter
                    raise TypeError(f"expected a list, got the string {value!r}")
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except InvalidRequestError:
            raise
        except (TypeError, ValueError) as exc:  # protobuf's: a wrong type, out of range
            raise InvalidRequestError(path, str(exc)) from None
    return request
