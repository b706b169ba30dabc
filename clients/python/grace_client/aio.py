"""`AsyncGraceClient`: client.py's GraceClient on `grpc.aio` for asyncio callers — the
same deadlines, retries (retry.py), health and `GraceError`s; it waits with
`asyncio.sleep` and closes with `await close()` or `async with`."""

from __future__ import annotations

import asyncio
from typing import Unpack

import grpc

from grace_client import _wire
from grace_client.client import (
    ClientCore,
    Metadata,
    ServingStatus,
    request_of,
)
from grace_client.errors import GraceError
from grace_client.request import RequestFields
from grace_client.retry import Schedule
from grace_client.rpc.grace.v1 import retrieval_pb2


class AsyncGraceClient(ClientCore):
    """GraceClient for asyncio: make it inside the event loop that uses it."""

    _AIO = True

    async def retrieve(
        self,
        request: retrieval_pb2.RetrieveRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **fields: Unpack[RequestFields],
    ) -> retrieval_pb2.RetrieveResponse:
        """As GraceClient.retrieve."""
        message = request_of(request, fields)
        schedule = Schedule(self.retries, self.backoff, self._timeout(timeout), self._rng)
        while True:
            try:
                return await self._stub.Retrieve(
                    message, timeout=schedule.attempt(), metadata=metadata
                )
            except grpc.aio.AioRpcError as exc:
                error = GraceError.from_rpc_error(exc, schedule.attempts)
                pause = schedule.pause(error)
                if pause is None:
                    raise error from exc
            await asyncio.sleep(pause)

    async def health(self, service: str = "", *, timeout: float | None = None) -> ServingStatus:
        """As GraceClient.health."""
        try:
            reply = await self._check(
                _wire.HealthCheckRequest(service=service), timeout=self._timeout(timeout)
            )
        except grpc.aio.AioRpcError as exc:
            raise GraceError.from_rpc_error(exc) from exc
        return ServingStatus(reply.status)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncGraceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
