"""The route class of every API route: the body is read bounded and parsed strictly, and a command is logged once.

``JsonRoute`` reads a route's body itself (:mod:`.body_limit`: size and
deadline), checks it is ``application/json`` in UTF-8 without duplicate keys
(:mod:`.json_body`), and only then lets FastAPI validate it against the model.

A command request (a route registered with :func:`command_endpoint`) logs
exactly one ``room_command_timing`` line and counts once in the command
metrics: the pipeline does that when the request reaches it
(:meth:`RoomService.execute`); when the request is refused before — bad JSON,
missing or extra fields, out-of-range numbers, 413, a body that never came —
the route does, with the error code as ``result``, the command name of the
route, and the app code, room id and command id when the request gave valid
ones (else empty: invalid input is never echoed into the log).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from roomservice import errors
from roomservice.api import json_body
from roomservice.api.body_limit import ClientGone, read_body, replaying
from roomservice.api.errors import from_http_exception
from roomservice.domain import limits as lim
from roomservice.observability.timing import CommandTiming, Stopwatch

F = TypeVar("F", bound=Callable[..., Any])

_COMMAND_OF: weakref.WeakKeyDictionary[Callable[..., Any], str] = weakref.WeakKeyDictionary()  # endpoint -> command


def command_endpoint(command_name: str) -> Callable[[F], F]:
    """Mark ``endpoint`` as serving the write command ``command_name`` (it must call :func:`entering_pipeline`)."""

    def mark(endpoint: F) -> F:
        _COMMAND_OF[endpoint] = command_name
        return endpoint

    return mark


@dataclass(slots=True)
class _Attempt:
    reached_pipeline: bool = False
    body: bytes | None = None  # as read, for the ids of a refused command's log line


_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("roomservice_command_attempt", default=None)


def entering_pipeline() -> None:
    """Called by a command endpoint just before the pipeline: from here on the pipeline logs the command."""
    attempt = _ATTEMPT.get()
    if attempt is not None:
        attempt.reached_pipeline = True


@dataclass(frozen=True, slots=True)
class BodyPolicy:
    max_bytes: int = lim.MAX_BODY_BYTES
    read_timeout_s: float = 10.0


class JsonRoute(APIRoute):
    """Set ``policy`` on the class (``JsonRoute.with_policy``) to change the body limits."""

    policy: BodyPolicy = BodyPolicy()

    @classmethod
    def with_policy(cls, policy: BodyPolicy) -> type[JsonRoute]:
        return type("JsonRoute", (cls,), {"policy": policy})

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        policy = self.policy
        takes_body = self.body_field is not None
        command = _COMMAND_OF.get(self.endpoint)

        async def read_then_handle(request: Request, attempt: _Attempt | None = None) -> Response:
            if not takes_body:
                return await handle(request)
            body = await read_body(request, max_bytes=policy.max_bytes, timeout_s=policy.read_timeout_s)
            if attempt is not None:
                attempt.body = body
            json_body.check_media_type(request.headers.get("content-type"))
            return await handle(replaying(request, body, json_body.parse(body)))

        if command is None:

            async def unlogged(request: Request) -> Response:
                try:
                    return await read_then_handle(request)
                except ClientGone:  # nobody reads the answer
                    return Response(status_code=400)

            return unlogged

        async def logged_once(request: Request) -> Response:
            attempt = _Attempt()
            token = _ATTEMPT.set(attempt)
            watch = Stopwatch()
            try:
                return await read_then_handle(request, attempt)
            except BaseException as exc:
                if not attempt.reached_pipeline:
                    _log_refused(command, request, attempt.body, _result_of(exc), watch.elapsed_ms())
                if isinstance(exc, ClientGone):  # nobody reads the answer
                    return Response(status_code=400)
                raise
            finally:
                _ATTEMPT.reset(token)

        return logged_once


def _result_of(exc: BaseException) -> str:
    if isinstance(exc, errors.RoomServiceError):
        return exc.code
    if isinstance(exc, RequestValidationError):
        return errors.InvalidArgument.code
    if isinstance(exc, StarletteHTTPException):
        return from_http_exception(exc).code
    if isinstance(exc, (ClientGone, asyncio.CancelledError)):
        return "cancelled"
    return "internal"


def _log_refused(command: str, request: Request, raw: bytes | None, result: str, total_ms: float) -> None:
    params = request.path_params
    app_code = params.get("app_code", "")
    room_id = params.get("room_id")
    command_id = ""
    body = _parsed(raw)
    if isinstance(body, dict):
        if room_id is None:  # CreateRoom: the room id is in the body
            room_id = body.get("room_id")
        command_id = body.get("command_id", "")
    timing = CommandTiming(
        command=command,
        app_code=app_code if _valid(app_code, lim.valid_app_code) else "",
        room_id=room_id if isinstance(room_id, str) and lim.valid_room_id(room_id) else "",
        command_id=command_id if _valid(command_id, lim.valid_id) else "",
        result=result,
        total_ms=total_ms,
    )
    timing.emit()


def _valid(value: object, check: Callable[[str], bool]) -> bool:
    return isinstance(value, str) and check(value)


def _parsed(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json_body.parse(raw)
    except errors.InvalidArgument:
        return None
