"""The reference activity service: the ``roomservice.activity.v1.ActivityService`` gRPC servicer (grpc.aio).

``HandleRoomEvent`` receives the ``room_outbox_event`` envelope. Its handler is
registered WITHOUT a request deserializer: the servicer gets the raw bytes and
decodes them itself, so an undecodable payload answers ``INVALID_ARGUMENT``
(a failing deserializer would answer ``INTERNAL``, which a publisher retries).

Status codes:

* ``INVALID_ARGUMENT`` — undecodable envelope, unknown event type, an id or
  value outside SPEC §3's limits (a publisher dead-letters it: retrying cannot help);
* ``UNAVAILABLE`` — the database did not answer (retry);
* ``INTERNAL`` — anything unexpected (retry).

The servicer is thin: persistence and idempotency live in :mod:`roomservice.activity.store`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final, NoReturn

import grpc
import grpc.aio

from roomservice import wire
from roomservice.activity.store import BOARDS, ActivityStore, Board
from roomservice.clock import wall_clock_ms
from roomservice.domain.events import Event, RoomGiftSent, RoomTreasureOpened
from roomservice.domain.limits import MAX_TREASURE_RECIPIENTS, valid_app_code, valid_id, valid_room_id
from roomservice.grpc_server import RunningGrpcServer, format_target
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger
from roomservice.proto import activity_pb2 as apb
from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable

SERVICE_NAME: Final = "roomservice.activity.v1.ActivityService"
HANDLE_ROOM_EVENT_METHOD: Final = f"/{SERVICE_NAME}/HandleRoomEvent"

DEFAULT_LEADERBOARD_LIMIT: Final = 100
MAX_LEADERBOARD_LIMIT: Final = 1000
# The last millisecond of 9999-12-31 UTC: keeps utc_day() far inside the INT day column.
MAX_OCCURRED_AT_MS: Final = 253_402_300_799_999

_log = get_logger("roomservice.activity")


class InvalidEvent(ValueError):
    """The request breaks the contract; answered with INVALID_ARGUMENT."""


# --------------------------------------------------------------------------- validation


def event_from_wire(data: bytes) -> Event:
    """Decode and validate a ``room_outbox_event`` envelope; raises :class:`InvalidEvent`."""
    try:
        event = wire.decode_event(data)
    except KeyError as exc:
        raise InvalidEvent(f"unknown event type {exc.args[0]!r}") from exc
    except Exception as exc:  # DecodeError and friends: nothing in these bytes can be trusted
        raise InvalidEvent(f"undecodable room_outbox_event: {exc.__class__.__name__}") from exc
    _check(valid_id(event.event_id), "event_id", event.event_id)
    if event.repair_of is not None:
        _check(valid_id(event.repair_of) and event.repair_of != event.event_id, "repair_of", event.repair_of)
    _check(valid_app_code(event.app_code), "app_code", event.app_code)
    _check(valid_room_id(event.room_id), "room_id", event.room_id)
    _check(0 <= event.occurred_at_ms <= MAX_OCCURRED_AT_MS, "occurred_at_ms", event.occurred_at_ms)
    payload = event.payload
    if isinstance(payload, RoomGiftSent):
        _check(valid_id(payload.sender_id), "sender_id", payload.sender_id)
        _check(valid_id(payload.receiver_id), "receiver_id", payload.receiver_id)
        _check(payload.total_value >= 0, "total_value", payload.total_value)
    elif isinstance(payload, RoomTreasureOpened):
        _check(valid_id(payload.box_id), "box_id", payload.box_id)
        _check(payload.level >= 1, "level", payload.level)
        _check(len(payload.recipients) <= MAX_TREASURE_RECIPIENTS, "recipients", f"{len(payload.recipients)} users")
        for user_id in payload.recipients:
            _check(valid_id(user_id), "recipients", user_id)
    return event


def _check(ok: bool, name: str, value: object) -> None:
    if not ok:
        raise InvalidEvent(f"invalid {name}: {value!r}"[:200])


def _room(app_code: str, room_id: str) -> None:
    _check(valid_app_code(app_code), "app_code", app_code)
    _check(valid_room_id(room_id), "room_id", room_id)


# --------------------------------------------------------------------------- servicer


class ActivityServicer:
    """The three RPCs of ActivityService over an :class:`ActivityStore`."""

    def __init__(self, store: ActivityStore) -> None:
        self.store = store

    async def HandleRoomEvent(self, request: bytes, context: grpc.aio.ServicerContext) -> apb.HandleRoomEventReply:
        if tracing.ENABLED:  # continues the outbox delivery's trace (direct mode)
            with tracing.grpc_server_span(SERVICE_NAME, "HandleRoomEvent", context.invocation_metadata()):
                return await self._handle_room_event(request, context)
        return await self._handle_room_event(request, context)

    async def _handle_room_event(self, request: bytes, context: grpc.aio.ServicerContext) -> apb.HandleRoomEventReply:
        try:
            event = event_from_wire(request)
            with tracing.effect_span("activity.apply", **{"activity.event_type": event.type}):
                applied = await self.store.handle(event)  # the same effect as the activity consumer group's
        except Exception as exc:
            await _abort(context, exc, "HandleRoomEvent")
        if applied:
            _log.debug("activity_event_applied", event_id=event.event_id, repair_of=event.repair_of, type=event.type)
        return apb.HandleRoomEventReply(duplicate=not applied)

    async def GetGiftLeaderboard(
        self, request: apb.GiftLeaderboardRequest, context: grpc.aio.ServicerContext
    ) -> apb.GiftLeaderboardReply:
        try:
            _room(request.app_code, request.room_id)
            _check(request.day >= 0, "day", request.day)
            _check(request.board in BOARDS, "board", request.board)
            _check(request.limit >= 0, "limit", request.limit)
            board: Board = "sent" if request.board == "sent" else "received"
            limit = min(request.limit or DEFAULT_LEADERBOARD_LIMIT, MAX_LEADERBOARD_LIMIT)
            entries = await self.store.gift_leaderboard(
                request.app_code, request.room_id, day=request.day, board=board, limit=limit
            )
        except Exception as exc:
            await _abort(context, exc, "GetGiftLeaderboard")
        return apb.GiftLeaderboardReply(
            entries=[apb.LeaderboardEntry(user_id=e.user_id, value=e.value) for e in entries]
        )

    async def GetTreasureRewards(
        self, request: apb.TreasureRewardsRequest, context: grpc.aio.ServicerContext
    ) -> apb.TreasureRewardsReply:
        try:
            _room(request.app_code, request.room_id)
            if request.box_id:
                _check(valid_id(request.box_id), "box_id", request.box_id)
            rewards = await self.store.treasure_rewards(request.app_code, request.room_id, box_id=request.box_id)
        except Exception as exc:
            await _abort(context, exc, "GetTreasureRewards")
        return apb.TreasureRewardsReply(
            rewards=[
                apb.TreasureReward(box_id=r.box_id, level=r.level, user_id=r.user_id, event_id=r.event_id)
                for r in rewards
            ]
        )


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> NoReturn:
    """End the call with the status ``exc`` stands for (context.abort raises; it never returns)."""
    if isinstance(exc, InvalidEvent):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    elif isinstance(exc, StoreUnavailable):
        _log.warning("activity_store_unavailable", method=method, error=str(exc))
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    else:
        _log.error("activity_internal_error", method=method, error=repr(exc)[:500])
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc.__class__.__name__}")
    raise AssertionError("context.abort returned")  # pragma: no cover


def add_activity_servicer(server: grpc.aio.Server, servicer: ActivityServicer) -> None:
    """Register ``servicer``; HandleRoomEvent takes raw bytes (see the module docstring)."""
    handlers: dict[str, Any] = {
        "HandleRoomEvent": grpc.unary_unary_rpc_method_handler(
            servicer.HandleRoomEvent,
            request_deserializer=None,
            response_serializer=apb.HandleRoomEventReply.SerializeToString,
        ),
        "GetGiftLeaderboard": grpc.unary_unary_rpc_method_handler(
            servicer.GetGiftLeaderboard,
            request_deserializer=apb.GiftLeaderboardRequest.FromString,
            response_serializer=apb.GiftLeaderboardReply.SerializeToString,
        ),
        "GetTreasureRewards": grpc.unary_unary_rpc_method_handler(
            servicer.GetTreasureRewards,
            request_deserializer=apb.TreasureRewardsRequest.FromString,
            response_serializer=apb.TreasureRewardsReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# --------------------------------------------------------------------------- running server


class RunningActivityService(RunningGrpcServer):
    """A started grpc.aio server; ``target`` is what a publisher connects to."""

    name = "activity_service"

    def __init__(self, server: grpc.aio.Server, servicer: ActivityServicer, host: str, port: int) -> None:
        super().__init__(server, host, port)
        self.servicer = servicer


async def start_activity_service(
    db: Database,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: Callable[[], int] = wall_clock_ms,
    servicer: ActivityServicer | None = None,
) -> RunningActivityService:
    """Start the service on ``host:port`` (port 0: any free port). ``servicer`` replaces the default one (tests)."""
    servicer = servicer or ActivityServicer(ActivityStore(db, clock=clock))
    # No SO_REUSEPORT: a second server on a taken port must fail, not silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_activity_servicer(server, servicer)
    address = format_target(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # newer grpcio raises instead of returning 0
        raise OSError(f"activity service cannot bind {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"activity service cannot bind {address}")
    await server.start()
    running = RunningActivityService(server, servicer, host, bound)
    _log.info("activity_service_started", target=running.target)
    return running


@asynccontextmanager
async def running_activity_service(
    db: Database,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: Callable[[], int] = wall_clock_ms,
    servicer: ActivityServicer | None = None,
    grace: float = 5.0,
) -> AsyncIterator[RunningActivityService]:
    """``async with running_activity_service(db) as svc:`` — serve on ``svc.target``; stopped on exit."""
    running = await start_activity_service(db, host=host, port=port, clock=clock, servicer=servicer)
    try:
        yield running
    finally:
        await running.stop(grace)


__all__ = [
    "HANDLE_ROOM_EVENT_METHOD",
    "SERVICE_NAME",
    "ActivityServicer",
    "InvalidEvent",
    "RunningActivityService",
    "add_activity_servicer",
    "event_from_wire",
    "format_target",
    "running_activity_service",
    "start_activity_service",
]
