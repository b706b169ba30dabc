"""A failed call's answer beyond its status code (service/server.py raises `Abort`): the
`google.rpc.Status` that grpcio-status puts in the trailer `grpc-status-details-bin` —
`BadRequest` field violations for INVALID_ARGUMENT, `RetryInfo` for RESOURCE_EXHAUSTED
and UNAVAILABLE — next to the plain message simple clients read (docs/SERVICE.md).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.validation import InvalidRequest


class Abort(Exception):
    """A call ends with `code` and `message`; `details` go in its google.rpc.Status."""

    def __init__(
        self, code: grpc.StatusCode, message: str, details: tuple[Message, ...] = ()
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.details = code, message, details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The google.rpc.Status trailer (`grpc-status-details-bin`), when there are details."""
        if not self.details:
            return ()
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in self.details:
            packed = any_pb2.Any()
            packed.Pack(detail)
            status.details.append(packed)
        return tuple(rpc_status.to_status(status).trailing_metadata)


def retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    """When this server may take the call again."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def bad_request(error: InvalidRequest) -> error_details_pb2.BadRequest:
    """Every bad field of an invalid request, one violation each."""
    return error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in error.violations
        ]
    )
