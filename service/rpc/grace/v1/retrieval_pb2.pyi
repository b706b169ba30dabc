from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    VIEW: _ClassVar[EventType]
    CLICK: _ClassVar[EventType]
    CONVERSION: _ClassVar[EventType]

class FilterMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_MODE_UNSPECIFIED: _ClassVar[FilterMode]
    CD_ONLY: _ClassVar[FilterMode]
    CD_GTM: _ClassVar[FilterMode]
EVENT_TYPE_UNSPECIFIED: EventType
VIEW: EventType
CLICK: EventType
CONVERSION: EventType
FILTER_MODE_UNSPECIFIED: FilterMode
CD_ONLY: FilterMode
CD_GTM: FilterMode

class RetrieveRequest(_message.Message):
    __slots__ = ("request_id", "user", "targeting", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TARGETING_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    user: User
    targeting: Targeting
    options: Options
    def __init__(self, request_id: _Optional[str] = ..., user: _Optional[_Union[User, _Mapping]] = ..., targeting: _Optional[_Union[Targeting, _Mapping]] = ..., options: _Optional[_Union[Options, _Mapping]] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("user_id", "history")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    history: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, user_id: _Optional[int] = ..., history: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("ad_id", "type", "timestamp_ms")
    AD_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    ad_id: int
    type: EventType
    timestamp_ms: int
    def __init__(self, ad_id: _Optional[int] = ..., type: _Optional[_Union[EventType, str]] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class Targeting(_message.Message):
    __slots__ = ("country", "age", "gender", "locations", "attributes", "exclude_ad_ids", "exclude_campaign_ids", "exclude_advertiser_ids")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Values
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Values, _Mapping]] = ...) -> None: ...
    COUNTRY_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    GENDER_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_AD_IDS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_CAMPAIGN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ADVERTISER_IDS_FIELD_NUMBER: _ClassVar[int]
    country: str
    age: int
    gender: str
    locations: _containers.RepeatedScalarFieldContainer[str]
    attributes: _containers.MessageMap[str, Values]
    exclude_ad_ids: _containers.RepeatedScalarFieldContainer[int]
    exclude_campaign_ids: _containers.RepeatedScalarFieldContainer[int]
    exclude_advertiser_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, country: _Optional[str] = ..., age: _Optional[int] = ..., gender: _Optional[str] = ..., locations: _Optional[_Iterable[str]] = ..., attributes: _Optional[_Mapping[str, Values]] = ..., exclude_ad_ids: _Optional[_Iterable[int]] = ..., exclude_campaign_ids: _Optional[_Iterable[int]] = ..., exclude_advertiser_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Values(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Options(_message.Message):
    __slots__ = ("max_ads", "beam_widths", "filter_mode", "include_sids")
    MAX_ADS_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTHS_FIELD_NUMBER: _ClassVar[int]
    FILTER_MODE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SIDS_FIELD_NUMBER: _ClassVar[int]
    max_ads: int
    beam_widths: _containers.RepeatedScalarFieldContainer[int]
    filter_mode: FilterMode
    include_sids: bool
    def __init__(self, max_ads: _Optional[int] = ..., beam_widths: _Optional[_Iterable[int]] = ..., filter_mode: _Optional[_Union[FilterMode, str]] = ..., include_sids: _Optional[bool] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("ads", "index_version", "model_version", "stats", "request_id")
    ADS_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ads: _containers.RepeatedCompositeFieldContainer[Ad]
    index_version: str
    model_version: str
    stats: Stats
    request_id: str
    def __init__(self, ads: _Optional[_Iterable[_Union[Ad, _Mapping]]] = ..., index_version: _Optional[str] = ..., model_version: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Ad(_message.Message):
    __slots__ = ("ad_id", "score", "sid")
    AD_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SID_FIELD_NUMBER: _ClassVar[int]
    ad_id: int
    score: float
    sid: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ad_id: _Optional[int] = ..., score: _Optional[float] = ..., sid: _Optional[_Iterable[int]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("sids_generated", "ads_expanded", "ads_eligible", "stage_ms", "ads_removed", "catalog_seq", "beam_widths", "beam_rung")
    class StageMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AdsRemovedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SIDS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ADS_EXPANDED_FIELD_NUMBER: _ClassVar[int]
    ADS_ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    ADS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    CATALOG_SEQ_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTHS_FIELD_NUMBER: _ClassVar[int]
    BEAM_RUNG_FIELD_NUMBER: _ClassVar[int]
    sids_generated: int
    ads_expanded: int
    ads_eligible: int
    stage_ms: _containers.ScalarMap[str, float]
    ads_removed: _containers.ScalarMap[str, int]
    catalog_seq: int
    beam_widths: _containers.RepeatedScalarFieldContainer[int]
    beam_rung: int
    def __init__(self, sids_generated: _Optional[int] = ..., ads_expanded: _Optional[int] = ..., ads_eligible: _Optional[int] = ..., stage_ms: _Optional[_Mapping[str, float]] = ..., ads_removed: _Optional[_Mapping[str, int]] = ..., catalog_seq: _Optional[int] = ..., beam_widths: _Optional[_Iterable[int]] = ..., beam_rung: _Optional[int] = ...) -> None: ...
