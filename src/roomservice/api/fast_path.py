"""The write-command routes served without FastAPI's routing and dependency machinery (issue 12, item 4).

A command request through FastAPI costs the server ~4× a ``/healthz`` before
the pipeline starts (the route table walked, dependencies solved, the body
model validated through FastAPI's field machinery, a Response object built):
~300 µs of CPU a join, measured ASGI-direct on this project's machine. This
middleware answers the requests it can answer exactly as FastAPI would, and
hands every other request to the app untouched:

* it takes only ``POST`` on a command route's path whose path parameters pass
  the same limits as the route's own ``Path`` declarations;
* it reads the body (what it consumed is replayed to the app if it hands the
  request over, with the read deadline the request started with, so a body
  that never comes is refused in the same time as without this path);
* it answers only when the body is ``application/json`` in UTF-8, parses
  strictly (:mod:`.json_body`) to an object and validates against the route's
  body model; anything else — too large, late, not JSON, a duplicate key,
  failing validation, a client that went away — is handed to the app, which
  answers it in the error shape and logs the refused command
  (:mod:`.routing`), as it does for every request that does not come here;
* then the command goes to the pipeline (which logs ``room_command_timing``)
  and its body is answered with orjson; an error of the pipeline gets the
  error shape of :func:`.errors.error_response`, anything unexpected
  propagates to the app's server-error handler as from a route.

It sits inside :class:`.edge.Edge` (encoded slashes, admin) and the tracing
middleware, so those apply to it as to every route; ``scope["route"]`` names
the FastAPI route, so a span is named by its template.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roomservice import errors
from roomservice.api import json_body
from roomservice.api import schemas as s
from roomservice.api.body_limit import DEADLINE_SCOPE_KEY, ClientGone, receive_body
from roomservice.api.errors import error_response
from roomservice.domain import commands as c
from roomservice.domain import limits as lim
from roomservice.store.port import Answer

Execute = Callable[[str, str, str, c.Command], Awaitable[dict[str, Any]]]

_APP = r"(?P<app_code>[^/]+)"
_ROOM = r"(?P<room_id>[^/]+)"


@dataclass(frozen=True, slots=True)
class FastRoute:
    """One command route: the path after ``/v1/apps/{app_code}/rooms`` (``""`` for CreateRoom), its body model."""

    suffix: str
    body: type[s._Body]
    route: Any = None  # the FastAPI route of the same path (scope["route"], for the span's name)


def _pattern(routes: Sequence[FastRoute]) -> re.Pattern[str]:
    """``/v1/apps/{app_code}/rooms`` (CreateRoom) or ``/v1/apps/{app_code}/rooms/{room_id}/<suffix>``."""
    suffixes = "|".join(re.escape(r.suffix) for r in routes if r.suffix)
    return re.compile(rf"/v1/apps/{_APP}/rooms(?:/{_ROOM}/(?P<suffix>{suffixes}))?")


class CommandFastPath:
    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[FastRoute],
        execute: Execute,
        max_bytes: int,
        read_timeout_s: float,
    ) -> None:
        self.app = app
        self.execute = execute
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self._by_suffix = {r.suffix: r for r in routes}
        self._path = _pattern(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = self._path.fullmatch(scope["path"])
        route = None if match is None else self._by_suffix.get(match["suffix"] or "")
        if match is None or route is None or not _valid_path(match["app_code"], match["room_id"]):
            await self.app(scope, receive, send)
            return
        content_length = content_type = None
        for name, raw in scope["headers"]:  # the first of each, as Starlette's Headers.get
            if name == b"content-length":
                if content_length is None:
                    content_length = raw.decode("latin-1")
            elif name == b"content-type" and content_type is None:
                content_type = raw.decode("latin-1")
        consumed: list[Message] = []
        body = await self._read(scope, receive, content_length, consumed)
        value = self._value(body, content_type, route)
        if value is None:  # anything unusual: the app answers it, from the same bytes and deadline
            await self.app(scope, _replaying(consumed, receive), send)
            return
        app_code = match["app_code"]
        room_id = value.room_id if isinstance(value, s.CreateRoomBody) else match["room_id"]
        scope["route"] = route.route
        try:
            answer = await self.execute(app_code, room_id, value.command_id, value.to_command())
        except errors.RoomServiceError as exc:
            await error_response(exc)(scope, receive, send)
            return
        # an answer decided here carries its encoding (the bytes its command log row holds)
        payload = answer.encoded if isinstance(answer, Answer) else orjson.dumps(answer)
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(payload)).encode("ascii")), (b"content-type", b"application/json")],
        })
        await send({"type": "http.response.body", "body": payload})

    async def _read(
        self, scope: Scope, receive: Receive, content_length: str | None, consumed: list[Message]
    ) -> bytes | None:
        """The whole body (:func:`.body_limit.receive_body`: size and deadline), or None when it is not
        plainly there; every message received is appended to ``consumed``, to replay."""
        # if the app reads the body again, it has what is left of this deadline
        deadline = scope[DEADLINE_SCOPE_KEY] = asyncio.get_running_loop().time() + self.read_timeout_s
        try:
            return await receive_body(
                receive,
                declared=content_length,
                max_bytes=self.max_bytes,
                deadline=deadline,
                timeout_s=self.read_timeout_s,
                consumed=consumed,
            )
        except (errors.RoomServiceError, ClientGone):  # too large, late, or nobody left: the app answers
            return None

    @staticmethod
    def _value(body: bytes | None, content_type: str | None, route: FastRoute) -> s._Body | None:
        if body is None:
            return None
        try:
            json_body.check_media_type(content_type)
            parsed = json_body.parse(body)
        except errors.InvalidArgument:
            return None
        if not isinstance(parsed, dict):
            return None
        try:
            return route.body.model_validate(parsed)
        except ValidationError:
            return None


def _valid_path(app_code: str, room_id: str | None) -> bool:
    return lim.valid_app_code(app_code) and (room_id is None or lim.valid_room_id(room_id))


def _replaying(consumed: list[Message], receive: Receive) -> Receive:
    """``receive`` as if nothing had been read from it: the consumed messages first, in order."""
    pending = list(consumed)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
