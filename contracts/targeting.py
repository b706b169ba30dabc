"""The request's targeting (RPC `Targeting`): the record the server, the model's user
features, the data readers and the synthetic world pass around, and the few names of the
default schema's named fields that the user features and request validation read.
Targeting is declared by `contracts/targeting_schema.py` (`DEFAULT`: country, age, gender,
locations) and encoded by `contracts/targeting_codec.py` (`codec(schema)`); this module
encodes nothing, and its constants and lookups are `DEFAULT`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.targeting_codec import TargetingError, codec
from contracts.targeting_schema import DEFAULT, LEGACY_FIELDS, MAX_VALUE_BYTES

_CODEC = codec(DEFAULT)
_COUNTRY, _AGE, _GENDER = (DEFAULT.attribute(n) for n in ("country", "age", "gender"))

AGE_BUCKETS: tuple[str, ...] = _AGE.labels  # ("13-17", ..., "65+")
GENDERS: tuple[str, ...] = _GENDER.labels  # ("female", "male")
MAX_REQUEST_LOCATIONS: int = DEFAULT.attribute("locations").max_request_values
# A request's location strings are non-empty and at most this many UTF-8 bytes
# (service/validation.py); the catalog refuses a location rule no request could match.
MAX_LOCATION_BYTES: int = MAX_VALUE_BYTES


@dataclass(frozen=True)
class Targeting:
    """The request's side of targeting (RPC `Targeting`). The four named fields are also
    the model's user features; each fills the schema's attribute of its name, beside
    `attributes` (every other attribute, by name). Blocks: ads, campaigns, advertisers
    that must not come back."""

    country: str = ""  # ISO alpha-2, "" = unknown
    age: int = 0  # years, 0 = unknown
    gender: str = ""  # "female" | "male" | "" (unknown)
    locations: tuple[str, ...] = ()  # at most MAX_REQUEST_LOCATIONS
    attributes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, values), by name
    exclude_ad_ids: tuple[int, ...] = ()
    exclude_campaign_ids: tuple[int, ...] = ()
    exclude_advertiser_ids: tuple[int, ...] = ()

    def values(self) -> dict[str, tuple[str, ...]]:
        """Every attribute's values by name, as `targeting_codec.Codec` reads a request:
        the named fields under their own names (when set), then `attributes`."""
        out = dict(self.attributes)
        for name in LEGACY_FIELDS:
            given = getattr(self, name)
            if given:
                out[name] = tuple(given) if isinstance(given, tuple | list) else (str(given),)
        return out


def country_index(code: str) -> int | None:
    """Index of an ISO alpha-2 code in `DEFAULT`'s countries (case-insensitive), None if
    the schema does not list it."""
    return _CODEC.value_index(_COUNTRY, code)


def age_bucket_index(age: int) -> int | None:
    """Index in AGE_BUCKETS of an age in years; None for unknown (0) or below 13;
    TargetingError for a negative age."""
    if age < 0:
        raise TargetingError("age", f"must be >= 0 (0 = unknown), got {age}")
    bit = _CODEC.request_bit(_AGE, (str(int(age)),), "age") - DEFAULT.bit_offsets["age"]
    return None if bit == len(AGE_BUCKETS) else bit


def gender_value_index(name: str) -> int | None:
    """Index of a gender in GENDERS, None if the schema does not list it."""
    return _CODEC.value_index(_GENDER, name)
