"""The few messages of other public protos the client speaks, without their packages:
`grpc.health.v1` Check (for `health()`) and `google.rpc.Status` with the `RetryInfo` and
`BadRequest` details the server puts in an error's `grpc-status-details-bin` trailer
(when to retry; which fields were invalid).

protobuf's runtime bundles only `google.protobuf.*`; the health messages come with
grpcio-health-checking and the `google.rpc` ones with googleapis-common-protos. Rather
than depend on either, the handful of fields used here are declared in a private
descriptor pool: the wire format is identical (same full names, numbers and types), and a
process that also imports those packages sees no clash in the default pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, duration_pb2, message_factory
from google.protobuf.message import DecodeError

_F = descriptor_pb2.FieldDescriptorProto
_pool = descriptor_pool.DescriptorPool()
for _dep in (any_pb2, duration_pb2):
    _pool.AddSerializedFile(_dep.DESCRIPTOR.serialized_pb)


def _field(
    message: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    kind: int,
    type_name: str = "",
    repeated: bool = False,
) -> None:
    label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    added = message.field.add(name=name, number=number, type=kind, label=label)
    if type_name:  # set only for messages and enums (descriptor.proto is proto2: presence)
        added.type_name = type_name


def _health_file() -> descriptor_pb2.FileDescriptorProto:
    # grpc/health/v1/health.proto, the two messages of Check
    f = descriptor_pb2.FileDescriptorProto(
        name="grace_client/health.proto", package="grpc.health.v1", syntax="proto3"
    )
    _field(f.message_type.add(name="HealthCheckRequest"), "service", 1, _F.TYPE_STRING)
    response = f.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    _field(response, "status", 1, _F.TYPE_ENUM, ".grpc.health.v1.HealthCheckResponse.ServingStatus")
    return f


def _rpc_file() -> descriptor_pb2.FileDescriptorProto:
    # google/rpc/status.proto, and RetryInfo and BadRequest of google/rpc/error_details.proto
    # (only the fields read here: others are skipped as unknown fields)
    f = descriptor_pb2.FileDescriptorProto(
        name="grace_client/google_rpc.proto",
        package="google.rpc",
        syntax="proto3",
        dependency=[any_pb2.DESCRIPTOR.name, duration_pb2.DESCRIPTOR.name],
    )
    status = f.message_type.add(name="Status")
    _field(status, "code", 1, _F.TYPE_INT32)
    _field(status, "message", 2, _F.TYPE_STRING)
    _field(status, "details", 3, _F.TYPE_MESSAGE, ".google.protobuf.Any", repeated=True)
    retry = f.message_type.add(name="RetryInfo")
    _field(retry, "retry_delay", 1, _F.TYPE_MESSAGE, ".google.protobuf.Duration")
    bad = f.message_type.add(name="BadRequest")
    violation = bad.nested_type.add(name="FieldViolation")
    _field(violation, "field", 1, _F.TYPE_STRING)
    _field(violation, "description", 2, _F.TYPE_STRING)
    _field(bad, "field_violations", 1, _F.TYPE_MESSAGE,
           ".google.rpc.BadRequest.FieldViolation", repeated=True)  # fmt: skip
    return f


_pool.Add(_health_file())
_pool.Add(_rpc_file())


def _message(full_name: str) -> type:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(full_name))


HealthCheckRequest = _message("grpc.health.v1.HealthCheckRequest")
HealthCheckResponse = _message("grpc.health.v1.HealthCheckResponse")
Status = _message("google.rpc.Status")
RetryInfo = _message("google.rpc.RetryInfo")
BadRequest = _message("google.rpc.BadRequest")

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class ErrorDetails:
    """What an error's google.rpc.Status says beyond its code and message."""

    retry_delay: float | None = None  # RetryInfo: seconds until the server may take it
    field_violations: tuple[tuple[str, str], ...] = ()  # BadRequest: (field, description)


def error_details(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> ErrorDetails:
    """The RetryInfo and BadRequest in a call's `grpc-status-details-bin` trailer; empty
    when there is none or it does not parse (a retry then uses its own backoff)."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = Status.FromString(value)
        except DecodeError:  # a malformed trailer is the server's bug, not a reason to fail
            return ErrorDetails()
        delay, violations = None, ()
        for detail in status.details:
            name = detail.type_url.rsplit("/", 1)[-1]
            if name == "google.rpc.RetryInfo" and detail.Unpack(info := RetryInfo()):
                delay = max(info.retry_delay.ToTimedelta().total_seconds(), 0.0)
            elif name == "google.rpc.BadRequest" and detail.Unpack(bad := BadRequest()):
                violations = tuple((v.field, v.description) for v in bad.field_violations)
        return ErrorDetails(delay, violations)
    return ErrorDetails()
