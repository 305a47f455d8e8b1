"""The room API over gRPC (``roomservice.v1.RoomApi``, ``proto/room_api.proto``): the HTTP contract of SPEC §8.

Every command and read of the HTTP API, answering the same bodies (typed: a
``CommandReply`` is the HTTP command body, a ``RoomView`` the room view; a
``null`` of the JSON body is an unset ``optional`` field) and refusing the same
input with the same error codes. Validation is the HTTP code itself: a request
becomes the body dict the HTTP route would have read and is validated by the
same pydantic model (:mod:`roomservice.api.schemas`); the path parameters of
HTTP (``app_code``, ``room_id``) are checked by the same limits
(:mod:`roomservice.domain.limits`). Bytes that do not decode as the request are
``invalid_argument`` too (:func:`add_room_api`; grpc alone would answer UNKNOWN).

One rpc has no HTTP route: ``OpenTreasure``, the internal treasure wake-up that
a process whose timer or treasure-open consumer fired sends to the room's owner
(:mod:`roomservice.forwarding`). Having no HTTP body model, its request is
checked here (:func:`parse_open_treasure`); the room re-validates the box itself.

Error code → gRPC status (the HTTP status for comparison):

    ====================  ====  ===================  ==============================================
    error code            HTTP  gRPC status          why
    ====================  ====  ===================  ==============================================
    invalid_argument      400   INVALID_ARGUMENT
    unknown_gift          400   INVALID_ARGUMENT     the gift id names nothing in the catalog
    unauthorized          401   UNAUTHENTICATED
    insufficient_balance  402   FAILED_PRECONDITION  the wallet must change first; not a quota or
                                                     rate limit, which RESOURCE_EXHAUSTED means
    not_member            403   PERMISSION_DENIED
    not_allowed           403   PERMISSION_DENIED
    user_banned           403   PERMISSION_DENIED
    room_not_found        404   NOT_FOUND
    not_found             404   NOT_FOUND
    method_not_allowed    405   UNIMPLEMENTED        (HTTP only)
    room_exists           409   ALREADY_EXISTS
    command_id_reused     409   ALREADY_EXISTS       the id is taken by another payload
    seat_taken            409   FAILED_PRECONDITION  the room's state refuses it
    room_closed           409   FAILED_PRECONDITION
    too_early             409   FAILED_PRECONDITION  (internal: OpenTreasure before the box's open_at_ms,
                                                     which the trailing metadata ``open-at-ms`` holds)
    payload_too_large     413   RESOURCE_EXHAUSTED   (gRPC refuses a message over the limit itself)
    unavailable           503   UNAVAILABLE          retry with the same command_id
    retry                 503   UNAVAILABLE          retry with the same command_id
    any other retryable   503   UNAVAILABLE
    anything else         500   INTERNAL             code ``internal``; never for bad input
    ====================  ====  ===================  ==============================================

Every refusal carries the error code twice: in the trailing metadata
``error-code`` (the message is the status message), and as a ``google.rpc.Status``
in ``grpc-status-details-bin`` (what grpcio-status's ``rpc_status.from_call``
reads) whose details hold one ``google.rpc.ErrorInfo`` with ``reason`` = the
error code and ``domain`` = ``roomservice``. A ``too_early`` refusal also
carries the box's ``open_at_ms`` in ``open-at-ms``, so that the wake-up that
crossed a hop is rescheduled to the owner's time. :func:`error_of` turns such a
refusal back into the error of the tree.

Hooks for scale-out: a command reaches the pipeline through
:meth:`RoomApiServicer.execute` and a room view through
:meth:`RoomApiServicer.room` (by default the local :class:`RoomService`;
forwarding replaces them), both given the call's metadata; authentication is an
interceptor passed to :func:`start_room_api`.

A command refused before the pipeline (bad input) logs its one
``room_command_timing`` line here, as the HTTP route does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final, NoReturn, TypeVar

import grpc
import grpc.aio
from fastapi.exceptions import RequestValidationError
from google.protobuf import json_format
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from roomservice import errors
from roomservice.api import schemas as s
from roomservice.api.app import _describe_validation as describe_request_validation
from roomservice.domain import commands as c
from roomservice.domain import limits as lim
from roomservice.grpc_server import RunningGrpcServer, format_target
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger
from roomservice.observability.timing import CommandTiming, Stopwatch
from roomservice.proto import room_api_pb2 as pb
from roomservice.service import RoomService

_log = get_logger("roomservice.api.grpc")

SERVICE_NAME: Final = pb.DESCRIPTOR.services_by_name["RoomApi"].full_name  # roomservice.v1.RoomApi
ERROR_DOMAIN: Final = "roomservice"
ERROR_CODE_KEY: Final = "error-code"
STATUS_DETAILS_KEY: Final = "grpc-status-details-bin"
OPEN_AT_KEY: Final = "open-at-ms"  # TreasureTooEarly.open_at_ms, in decimal

Metadata = tuple[tuple[str, str | bytes], ...]

GRPC_STATUS: Final[dict[str, grpc.StatusCode]] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_gift": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    "insufficient_balance": grpc.StatusCode.FAILED_PRECONDITION,
    "not_member": grpc.StatusCode.PERMISSION_DENIED,
    "not_allowed": grpc.StatusCode.PERMISSION_DENIED,
    "user_banned": grpc.StatusCode.PERMISSION_DENIED,
    "room_not_found": grpc.StatusCode.NOT_FOUND,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "method_not_allowed": grpc.StatusCode.UNIMPLEMENTED,
    "room_exists": grpc.StatusCode.ALREADY_EXISTS,
    "command_id_reused": grpc.StatusCode.ALREADY_EXISTS,
    "seat_taken": grpc.StatusCode.FAILED_PRECONDITION,
    "room_closed": grpc.StatusCode.FAILED_PRECONDITION,
    "too_early": grpc.StatusCode.FAILED_PRECONDITION,
    "payload_too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "retry": grpc.StatusCode.UNAVAILABLE,
}


def grpc_status(exc: errors.RoomServiceError) -> grpc.StatusCode:
    """The status for ``exc``: by its code; anything else retryable is UNAVAILABLE, the rest INTERNAL."""
    status = GRPC_STATUS.get(exc.code)
    if status is not None:
        return status
    return grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.INTERNAL


def error_metadata(exc: errors.RoomServiceError, status: grpc.StatusCode) -> Metadata:
    """The trailing metadata of a refusal: ``error-code`` and the google.rpc.Status with its ErrorInfo.

    A :class:`errors.TreasureTooEarly` adds its ``open_at_ms`` (``open-at-ms``): the caller reschedules to it.
    """
    info = AnyProto()
    info.Pack(error_details_pb2.ErrorInfo(reason=exc.code, domain=ERROR_DOMAIN))
    rpc_status = status_pb2.Status(code=status.value[0], message=exc.message, details=[info])
    metadata: Metadata = ((ERROR_CODE_KEY, exc.code), (STATUS_DETAILS_KEY, rpc_status.SerializeToString()))
    if isinstance(exc, errors.TreasureTooEarly):
        metadata += ((OPEN_AT_KEY, str(exc.open_at_ms)),)
    return metadata


# --------------------------------------------------------------------------- bodies <-> messages


def to_dict(message: Message) -> dict[str, Any]:
    """A reply as the HTTP body: every field by its proto name, an unset ``optional`` as ``None``."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.is_repeated:
            out[field.name] = [to_dict(v) if field.message_type else v for v in value]
        elif field.message_type is not None:
            out[field.name] = to_dict(value) if message.HasField(field.name) else None
        elif field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = value
    return out


M = TypeVar("M", bound=Message)


def from_dict(body: dict[str, Any], message: M) -> M:
    """Fill ``message`` from an HTTP body (``None`` leaves a field unset). A key it has no field for is an error."""
    json_format.ParseDict(body, message)
    return message


def body_of(reply: pb.CommandReply) -> dict[str, Any]:
    """The HTTP command body of a reply."""
    return to_dict(reply)


def reply_of(body: dict[str, Any]) -> pb.CommandReply:
    return from_dict(body, pb.CommandReply())


def request_of(app_code: str, room_id: str, command_id: str, command: c.Command) -> tuple[str, Message]:
    """The rpc name and request of a command (what a forwarder sends), the internal OpenTreasure included."""
    if command.name not in _COMMAND_RPCS:
        raise ValueError(f"{command.name} is not served over the room API")
    fields = {k: v for k, v in command.to_dict().items() if k != "type" and v is not None}
    request = getattr(pb, f"{command.name}Request")(app_code=app_code, room_id=room_id, command_id=command_id, **fields)
    return command.name, request


def _error_classes() -> dict[str, type[errors.RoomServiceError]]:
    """Each error code's most general class of the tree (``unavailable`` -> Unavailable, not StoreUnavailable)."""
    found: dict[str, type[errors.RoomServiceError]] = {}
    queue: list[type[errors.RoomServiceError]] = [errors.RoomServiceError]
    while queue:
        cls = queue.pop(0)
        if cls is not errors.TreasureTooEarly:  # takes open_at_ms: error_of rebuilds it from the metadata
            found.setdefault(cls.code, cls)
        queue.extend(cls.__subclasses__())
    return found


def error_of(exc: grpc.aio.AioRpcError) -> errors.RoomServiceError:
    """The error of the tree a refusal of this API stands for (its ``error-code`` and message).

    ``too_early`` is :class:`errors.TreasureTooEarly` with the ``open_at_ms`` of ``open-at-ms``
    (without a readable one, :class:`errors.Retry`: the wake-up backs off rather than being dropped).
    A failure without an error code (the call never reached the servicer: deadline, connection
    refused, an interceptor's refusal) is :class:`errors.Unavailable` when the status says so
    (UNAVAILABLE, DEADLINE_EXCEEDED), else an internal error.
    """
    metadata = dict(exc.trailing_metadata() or ())
    code = metadata.get(ERROR_CODE_KEY)
    message = exc.details() or None
    if code == errors.TreasureTooEarly.code:
        open_at_ms = _open_at_ms(metadata.get(OPEN_AT_KEY))
        return errors.Retry(message) if open_at_ms is None else errors.TreasureTooEarly(open_at_ms, message)
    if isinstance(code, str):
        cls = _error_classes().get(code)
        if cls is not None:
            return cls(message)
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.Unavailable(message)
    if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unauthorized(message)
    return errors.RoomServiceError(message)


def _open_at_ms(value: str | bytes | None) -> int | None:
    """The ``open-at-ms`` of a ``too_early`` refusal; None when absent or not a positive number."""
    if not isinstance(value, str):
        return None
    try:
        open_at_ms = int(value)
    except ValueError:
        return None
    return open_at_ms if open_at_ms > 0 else None


# --------------------------------------------------------------------------- the servicer

# rpc -> the HTTP body model that validates it; its request's fields are the body's, plus app_code and room_id
_COMMANDS: Final[dict[str, type[s._Body]]] = {
    c.CreateRoom.name: s.CreateRoomBody,
    c.JoinRoom.name: s.JoinBody,
    c.LeaveRoom.name: s.LeaveBody,
    c.TakeMic.name: s.TakeMicBody,
    c.LeaveMic.name: s.LeaveMicBody,
    c.SendGift.name: s.GiftBody,
    c.KickUser.name: s.KickBody,
    c.CloseRoom.name: s.CloseBody,
}
# rpcs of internal commands: sent by peers only, no HTTP route or body model, so kept out of _COMMANDS
_INTERNAL_COMMANDS: Final = frozenset({c.OpenTreasure.name})
_COMMAND_RPCS: Final = frozenset(_COMMANDS) | _INTERNAL_COMMANDS


def describe_validation(exc: ValidationError) -> str:
    """The message of a body refused by its model, worded by the HTTP API's own code."""
    return describe_request_validation(RequestValidationError(exc.errors()))


def check_app_code(app_code: str) -> None:
    if not lim.valid_app_code(app_code):
        raise errors.InvalidArgument(f"app_code: must match {lim.APP_CODE_PATTERN}")


def check_room_id(room_id: str) -> None:
    if not lim.valid_room_id(room_id):
        raise errors.InvalidArgument(f"room_id: must match {lim.ROOM_ID_PATTERN}")


def parse_open_treasure(request: pb.OpenTreasureRequest) -> tuple[str, str, str, c.OpenTreasure]:
    """``(app_code, room_id, command_id, command)`` of an OpenTreasure request (no HTTP body validates it).

    Only the shape is checked: the ids as every id, a level and an open_at_ms that a box can have,
    and the command_id the wake-up always carries (``treasure-open:<box_id>``: a wake-up under any
    other id would dodge the replay that keeps a box from opening twice). Whether the box is the
    room's current one is the room's to say (a stale wake-up is a no-op there).
    """
    check_app_code(request.app_code)
    check_room_id(request.room_id)
    expected = c.treasure_open_command_id(request.box_id)
    if not (lim.valid_id(request.box_id) and lim.valid_id(expected)):
        raise errors.InvalidArgument(f"box_id: must match {lim.ID_PATTERN}, and treasure-open:<box_id> too")
    if request.command_id != expected:
        raise errors.InvalidArgument(f"command_id: must be treasure-open:<box_id> ({expected})")
    if request.level < 1:
        raise errors.InvalidArgument(f"level: must be at least 1, got {request.level}")
    if request.open_at_ms <= 0:
        raise errors.InvalidArgument(f"open_at_ms: must be positive, got {request.open_at_ms}")
    command = c.OpenTreasure(box_id=request.box_id, level=request.level, open_at_ms=request.open_at_ms)
    return request.app_code, request.room_id, request.command_id, command


def parse_command(rpc: str, request: Message) -> tuple[str, str, str, c.Command]:
    """``(app_code, room_id, command_id, command)`` of a command request, validated as HTTP validates it."""
    if isinstance(request, pb.OpenTreasureRequest):
        return parse_open_treasure(request)
    model = _COMMANDS[rpc]
    app_code: str = getattr(request, "app_code")  # noqa: B009 - generated messages are untyped here
    check_app_code(app_code)
    body: dict[str, Any] = {}
    for field in request.DESCRIPTOR.fields:
        if field.name == "app_code" or (field.name == "room_id" and "room_id" not in model.model_fields):
            continue
        if field.has_presence and not request.HasField(field.name):
            continue  # absent, as an omitted optional key of the JSON body
        body[field.name] = getattr(request, field.name)
    room_id: str = getattr(request, "room_id")  # noqa: B009
    if "room_id" not in model.model_fields:
        check_room_id(room_id)  # a path parameter over HTTP
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        raise errors.InvalidArgument(describe_validation(exc)) from None
    return app_code, room_id, parsed.command_id, parsed.to_command()


def _log_refused(rpc: str, request: Message, result: str, total_ms: float) -> None:
    """The one ``room_command_timing`` line of a command refused before the pipeline (valid ids only)."""

    def valid(name: str, check: Callable[[str], bool]) -> str:
        value = getattr(request, name, "")
        return value if isinstance(value, str) and check(value) else ""

    CommandTiming(
        command=rpc,
        app_code=valid("app_code", lim.valid_app_code),
        room_id=valid("room_id", lim.valid_room_id),
        command_id=valid("command_id", lim.valid_id),
        result=result,
        total_ms=total_ms,
    ).emit()


class RoomApiServicer:
    """``roomservice.v1.RoomApi`` over a :class:`RoomService`.

    Override :meth:`execute` and :meth:`room` (or pass them in) to route a call elsewhere,
    e.g. to the process that holds the room's lease.
    """

    def __init__(
        self,
        service: RoomService,
        *,
        execute: Callable[..., Awaitable[dict[str, Any]]] | None = None,
        room: Callable[..., Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.service = service
        self._execute = execute
        self._room = room
        self._orphans: set[asyncio.Task[dict[str, Any]]] = set()  # commands whose caller went away

    # ------------------------------------------------------------------ hooks

    async def execute(
        self, app_code: str, room_id: str, command_id: str, command: c.Command, *, metadata: Metadata
    ) -> dict[str, Any]:
        """Run a validated command; the HTTP command body, or raises RoomServiceError."""
        if self._execute is not None:
            return await self._execute(app_code, room_id, command_id, command, metadata=metadata)
        return await self.service.execute(app_code, room_id, command_id, command)

    async def room(self, app_code: str, room_id: str, *, metadata: Metadata) -> dict[str, Any]:
        """The room view, or raises RoomServiceError."""
        if self._room is not None:
            return await self._room(app_code, room_id, metadata=metadata)
        return await self.service.room(app_code, room_id)

    # ------------------------------------------------------------------ commands

    async def _command(self, rpc: str, request: Message, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        watch = Stopwatch()
        try:
            app_code, room_id, command_id, command = parse_command(rpc, request)
        except errors.RoomServiceError as exc:
            _log_refused(rpc, request, exc.code, watch.elapsed_ms())
            await _abort(context, exc)
        metadata = tuple(context.invocation_metadata() or ())
        # Its own task, awaited through a shield: a call cancelled by its client or its deadline (or
        # a server stop's grace running out) must not stop a command between its commit and what
        # follows it (the room list, presence, the closing snapshot), as HTTP never stops one.
        pipeline = asyncio.ensure_future(self.execute(app_code, room_id, command_id, command, metadata=metadata))
        try:
            return reply_of(await asyncio.shield(pipeline))
        except asyncio.CancelledError:
            if not pipeline.done():
                self._orphans.add(pipeline)
                pipeline.add_done_callback(self._orphan_done)
            raise
        except errors.RoomServiceError as exc:
            await _abort(context, exc)
        except Exception:
            _log.exception("grpc_unhandled_error", rpc=rpc)
            await _abort(context, errors.RoomServiceError())

    def _orphan_done(self, task: asyncio.Task[dict[str, Any]]) -> None:
        self._orphans.discard(task)
        if not task.cancelled():
            task.exception()  # its outcome is in its room_command_timing line; its caller is gone

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for commands whose callers went away (a server stop)."""
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=timeout_s)

    async def CreateRoom(self, request: pb.CreateRoomRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("CreateRoom", request, context)

    async def JoinRoom(self, request: pb.JoinRoomRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("JoinRoom", request, context)

    async def LeaveRoom(self, request: pb.LeaveRoomRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("LeaveRoom", request, context)

    async def TakeMic(self, request: pb.TakeMicRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("TakeMic", request, context)

    async def LeaveMic(self, request: pb.LeaveMicRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("LeaveMic", request, context)

    async def SendGift(self, request: pb.SendGiftRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("SendGift", request, context)

    async def KickUser(self, request: pb.KickUserRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("KickUser", request, context)

    async def CloseRoom(self, request: pb.CloseRoomRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return await self._command("CloseRoom", request, context)

    async def OpenTreasure(self, request: pb.OpenTreasureRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        """Internal: a peer's treasure wake-up for a room this process holds (through :meth:`execute`)."""
        return await self._command("OpenTreasure", request, context)

    # ------------------------------------------------------------------ reads

    async def GetRoom(self, request: pb.GetRoomRequest, context: grpc.aio.ServicerContext) -> pb.RoomView:
        async def read() -> pb.RoomView:
            check_app_code(request.app_code)
            check_room_id(request.room_id)
            metadata = tuple(context.invocation_metadata() or ())
            view = await self.room(request.app_code, request.room_id, metadata=metadata)
            return from_dict(view, pb.RoomView())

        return await _answer("GetRoom", read, context)

    async def ListRooms(self, request: pb.ListRoomsRequest, context: grpc.aio.ServicerContext) -> pb.ListRoomsReply:
        async def read() -> pb.ListRoomsReply:
            check_app_code(request.app_code)
            return from_dict({"rooms": await self.service.rooms(request.app_code)}, pb.ListRoomsReply())

        return await _answer("ListRooms", read, context)

    async def ListGifts(self, request: pb.ListGiftsRequest, context: grpc.aio.ServicerContext) -> pb.ListGiftsReply:
        async def read() -> pb.ListGiftsReply:
            return from_dict({"gifts": self.service.gifts()}, pb.ListGiftsReply())

        return await _answer("ListGifts", read, context)


R = TypeVar("R")


async def _answer(rpc: str, read: Callable[[], Awaitable[R]], context: grpc.aio.ServicerContext) -> R:
    try:
        return await read()
    except errors.RoomServiceError as exc:
        await _abort(context, exc)
    except Exception:
        _log.exception("grpc_unhandled_error", rpc=rpc)
        await _abort(context, errors.RoomServiceError())


async def _abort(context: grpc.aio.ServicerContext, exc: errors.RoomServiceError) -> NoReturn:
    status = grpc_status(exc)
    await context.abort(status, exc.message, trailing_metadata=error_metadata(exc, status))
    raise AssertionError("context.abort returned")  # it raises


# --------------------------------------------------------------------------- registration


class _Undecodable:
    """A request whose bytes are not its message (invalid UTF-8 in a string, a truncated field...)."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error


def _decoder(message_type: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    def decode(data: bytes) -> Message | _Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:  # grpc would answer UNKNOWN, without an error code
            return _Undecodable(message_type.DESCRIPTOR.full_name, str(exc))

    return decode


def _guarded(
    rpc: str, behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]:
    async def call(request: Message | _Undecodable, context: grpc.aio.ServicerContext) -> Message:
        if isinstance(request, _Undecodable):
            exc = errors.InvalidArgument(f"the request is not a valid {request.type_name}: {request.error}")
            if rpc in _COMMAND_RPCS:  # its one timing line, as for any refused command (no id is readable)
                CommandTiming(command=rpc, app_code="", room_id="", command_id="", result=exc.code).emit()
            await _abort(context, exc)
        if tracing.ENABLED:  # a server span continuing the caller's traceparent
            with tracing.grpc_server_span(SERVICE_NAME, rpc, context.invocation_metadata()):
                return await behaviour(request, context)
        return await behaviour(request, context)

    return call


def add_room_api(server: grpc.aio.Server, servicer: RoomApiServicer) -> None:
    """Register ``servicer`` as ``roomservice.v1.RoomApi`` (what the generated ``add_RoomApiServicer_to_server``
    does, except that a request that does not decode is ``invalid_argument``, not UNKNOWN)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["RoomApi"].methods:
        request_type = getattr(pb, method.input_type.name)
        reply_type = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _guarded(method.name, getattr(servicer, method.name)),
            request_deserializer=_decoder(request_type),
            response_serializer=reply_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


# --------------------------------------------------------------------------- running server


class RunningRoomApi(RunningGrpcServer):
    """A started grpc.aio server serving the room API; ``target`` is what a client connects to."""

    name = "room_api"

    def __init__(self, server: grpc.aio.Server, servicer: RoomApiServicer, host: str, port: int) -> None:
        super().__init__(server, host, port)
        self.servicer = servicer

    async def stop(self, grace: float | None = 5.0) -> None:
        """As a server stops, and then the commands of the calls its grace cut off run to their end
        (within the same grace): none stops between its commit and what follows it."""
        await super().stop(grace)
        await self.servicer.drain(5.0 if grace is None else max(grace, 0.1))


async def start_room_api(
    service: RoomService,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    servicer: RoomApiServicer | None = None,
    credentials: grpc.ServerCredentials | None = None,
    options: Iterable[tuple[str, Any]] = (),
) -> RunningRoomApi:
    """Serve the room API (and reflection) on ``host:port``; port 0 binds a free port (see ``.port``/``.target``).

    ``interceptors`` run before every call (authentication of peers goes there), ``servicer``
    replaces the default one (forwarding), ``credentials`` serve TLS instead of plaintext.
    A request over the HTTP body limit is refused by gRPC itself (RESOURCE_EXHAUSTED).
    """
    servicer = servicer or RoomApiServicer(service)
    server = grpc.aio.server(
        interceptors=tuple(interceptors),
        # no SO_REUSEPORT: a second server on a taken port must fail, not silently share it
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", lim.MAX_BODY_BYTES), *options],
    )
    add_room_api(server, servicer)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = format_target(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # newer grpcio raises instead of returning 0
        raise OSError(f"room API cannot bind {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"room API cannot bind {address}")
    await server.start()
    running = RunningRoomApi(server, servicer, host, bound)
    _log.info("room_api_started", target=running.target)
    return running
