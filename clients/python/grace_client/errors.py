"""The one exception the client raises (`GraceError`) and which status codes it retries.

Every failed call — refused, timed out, unreachable or malformed — surfaces as a
`GraceError` carrying the gRPC status code and the server's message, plus what the retry
loop saw (how many attempts, the server's RetryInfo delay if any), the BadRequest field
violations of an INVALID_ARGUMENT and the server's id of the call (its `x-request-id`
trailer). A request the client will not send (request.py) is an `InvalidRequestError`,
a GraceError too. The codes the service answers and why are in docs/SERVICE.md (and
service/server.py's docstring).
"""

from __future__ import annotations

import grpc

from grace_client import _wire

# The service's "try again" answers: RESOURCE_EXHAUSTED from admission (queue full, or the
# deadline leaves no room for the predicted wait: it carries a RetryInfo) and UNAVAILABLE
# (draining, still loading, or no connection). A RESOURCE_EXHAUSTED without RetryInfo is a
# request too large for the server or the transport: it would be refused again. Nothing
# else is retried: INVALID_ARGUMENT would fail again, DEADLINE_EXCEEDED has spent the
# caller's budget, INTERNAL may not be idempotent to repeat.
RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
# The trailer carrying the server's id of a call, on errors too (service/request_id.py):
# the id as the server's log lines write it (percent-encoded beyond printable ASCII).
REQUEST_ID_KEY = "x-request-id"


class GraceError(Exception):
    """A call that failed: `code` (grpc.StatusCode), `message` (the server's details),
    `attempts` (calls made, retries included), `retry_delay` (seconds the server asked
    for through RetryInfo, or None), `field_violations` ((field, description) pairs of
    a BadRequest: what an INVALID_ARGUMENT found wrong) and `request_id` (the server's id
    of the call, to find it in the server's logs; None when no server named it). `str()`
    ends with `(request_id=…)` when there is one."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        attempts: int = 1,
        retry_delay: float | None = None,
        field_violations: tuple[tuple[str, str], ...] = (),
        request_id: str | None = None,
    ) -> None:
        text = f"{code.name}: {message}" if message else code.name
        super().__init__(f"{text} (request_id={request_id})" if request_id else text)
        self.code, self.message = code, message
        self.attempts, self.retry_delay = attempts, retry_delay
        self.field_violations, self.request_id = field_violations, request_id

    @property
    def retryable(self) -> bool:
        """Whether the client retries this answer (the attempts may be used up):
        UNAVAILABLE, and RESOURCE_EXHAUSTED when the server said when to retry."""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return self.retry_delay is not None
        return self.code in RETRYABLE

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, attempts: int = 1) -> GraceError:
        """The GraceError of a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
        extra = _wire.error_details(trailers)
        return cls(
            code or grpc.StatusCode.UNKNOWN,
            details or "",
            attempts=attempts,
            retry_delay=extra.retry_delay,
            field_violations=extra.field_violations,
            request_id=next((v for k, v in trailers if k == REQUEST_ID_KEY and v), None),
        )


class InvalidRequestError(GraceError, ValueError):
    """A request the client will not send (request.py): a value its field cannot hold — a
    wrong type, an unknown enum name. INVALID_ARGUMENT like the server's answer, with the
    field as the one violation, no attempt made; a ValueError too."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: {description}",
            attempts=0,
            field_violations=((field, description),),
        )
