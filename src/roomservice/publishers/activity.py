"""The direct-mode activity publisher: ``HandleRoomEvent`` over grpc.aio with the attempt's deadline.

The payload (the ``room_outbox_event`` envelope the outbox row stores) is sent
as it is: the call uses an identity request serializer, so nothing is decoded
or re-encoded on the way.

grpc.aio objects belong to the event loop they were made on, so the channel is
created lazily, on first use, in the running loop (and made afresh if the
publisher is later used from another loop). The channel reconnects quickly
after an outage (backoff capped at ``max_reconnect_backoff_ms``): calls fail fast
with ``UNAVAILABLE`` while the service is down, and succeed again soon after it
is back.

Status codes: ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``RESOURCE_EXHAUSTED``,
``ABORTED``, ``INTERNAL``, ``UNKNOWN`` (and any other code not listed below) →
:class:`RetryableError`; ``INVALID_ARGUMENT``, ``FAILED_PRECONDITION``,
``NOT_FOUND``, ``UNIMPLEMENTED``, ``PERMISSION_DENIED``, ``UNAUTHENTICATED``,
``OUT_OF_RANGE`` → :class:`PermanentError`. A ``duplicate = true`` reply is a
success: the service had already applied the event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

import grpc
import grpc.aio

from roomservice.domain.events import Event
from roomservice.domain.routing import Target
from roomservice.observability import tracing
from roomservice.proto import activity_pb2 as apb
from roomservice.publishers.port import PermanentError, RetryableError

HANDLE_ROOM_EVENT: Final = "/roomservice.activity.v1.ActivityService/HandleRoomEvent"

PERMANENT_CODES: Final[frozenset[grpc.StatusCode]] = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)

DEFAULT_CHANNEL_OPTIONS: Final[tuple[tuple[str, Any], ...]] = (
    # Reconnect soon after the service comes back (grpc's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead peer between bursts.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


def _identity(payload: bytes) -> bytes:
    return payload


class ActivityPublisher:
    """The ``activity`` target of the outbox worker in direct/dual mode."""

    name = Target.ACTIVITY.value

    def __init__(self, target: str, *, options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS) -> None:
        if not target or not target.strip():
            raise ValueError("activity publisher needs a host:port target")
        self.target = target
        self._options = list(options)
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _handle_room_event(self, loop: asyncio.AbstractEventLoop) -> Any:
        if self._channel is None or self._loop is not loop:
            # A channel of another (finished) loop cannot be used nor closed from here: drop it.
            self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            self._loop = loop
            self._call = self._channel.unary_unary(
                HANDLE_ROOM_EVENT,
                request_serializer=_identity,
                response_deserializer=apb.HandleRoomEventReply.FromString,
            )
        return self._call

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        call = self._handle_room_event(loop)
        timeout = deadline - loop.time()
        if timeout <= 0:  # gRPC may still send a call whose timeout is 0: it must not go out
            raise RetryableError(
                f"activity HandleRoomEvent {event.type} {event.event_id}: DEADLINE_EXCEEDED: passed before sending"
            )
        try:
            await call(payload, timeout=timeout, metadata=tracing.grpc_metadata() or None)
        except grpc.aio.AioRpcError as exc:
            raise classify(exc, event) from exc

    async def close(self) -> None:
        channel, self._channel, self._call = self._channel, None, None
        loop, self._loop = self._loop, None
        if channel is not None and loop is asyncio.get_running_loop():
            await channel.close()


def classify(exc: grpc.aio.AioRpcError, event: Event) -> RetryableError | PermanentError:
    """The publisher error a failed call stands for (message: code and details)."""
    code = exc.code()
    message = f"activity HandleRoomEvent {event.type} {event.event_id}: {code.name}: {exc.details() or ''}"[:1000]
    if code in PERMANENT_CODES:
        return PermanentError(message)
    return RetryableError(message)
