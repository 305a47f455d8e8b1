"""The FastAPI application: routes of SPEC §8, one error shape for every failure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from roomservice import errors
from roomservice.api import schemas as s
from roomservice.api.body_limit import ClosesConnection
from roomservice.api.edge import Edge, token_ok
from roomservice.api.errors import error_response, from_http_exception
from roomservice.api.fast_path import CommandFastPath, FastRoute
from roomservice.api.routing import BodyPolicy, JsonRoute, command_endpoint, entering_pipeline
from roomservice.domain import commands as c
from roomservice.domain import limits as lim
from roomservice.health import HealthChecks
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import REGISTRY
from roomservice.service import RoomService

if TYPE_CHECKING:
    from roomservice.admin.dead_letters import DeadLetterAdmin
    from roomservice.admin.operations import OutboxAdmin
    from roomservice.console import Console
    from roomservice.forwarding import Forwarder

_log = get_logger("roomservice.api")

AppCode = Annotated[str, Path(pattern=lim.APP_CODE_PATTERN, min_length=1, max_length=32)]
RoomIdPath = Annotated[str, Path(pattern=lim.ROOM_ID_PATTERN, min_length=1, max_length=48)]
UserIdPath = Annotated[str, Path(pattern=lim.ID_PATTERN, min_length=1, max_length=64)]

_ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "`invalid_argument` (a body or parameter breaks the limits or types; the body is not UTF-8 "
    "`application/json`, has a duplicate key, or did not arrive in time), `unknown_gift`",
    401: "`unauthorized`: no valid admin bearer token",
    402: "`insufficient_balance`",
    403: "`not_member`, `not_allowed`, `user_banned`",
    404: "`room_not_found`, `not_found`",
    409: "`room_exists`, `seat_taken`, `room_closed`, `command_id_reused`",
    413: f"`payload_too_large`: the body is over {lim.MAX_BODY_BYTES} bytes",
    503: "`unavailable` (a dependency is down), `retry` (lost a lease or version race): "
    "safe to retry with the same command_id",
}


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route, documented with the one error shape."""
    return {status: {"model": s.ErrorBody, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


# per route: the errors each can answer (SPEC §3 and §8)
_COMMAND = (400, 404, 409, 413, 503)
_CREATE = _responses(400, 409, 413, 503)
_COMMANDS: dict[str, tuple[str, type[s._Body], type[c.Command], dict[int | str, dict[str, Any]]]] = {
    "join_room": ("join", s.JoinBody, c.JoinRoom, _responses(*_COMMAND, 403)),
    "leave_room": ("leave", s.LeaveBody, c.LeaveRoom, _responses(*_COMMAND)),
    "take_mic": ("mic/take", s.TakeMicBody, c.TakeMic, _responses(*_COMMAND, 403)),
    "leave_mic": ("mic/leave", s.LeaveMicBody, c.LeaveMic, _responses(*_COMMAND)),
    "send_gift": ("gifts", s.GiftBody, c.SendGift, _responses(*_COMMAND, 402, 403)),
    "kick_user": ("kick", s.KickBody, c.KickUser, _responses(*_COMMAND, 403)),
    "close_room": ("close", s.CloseBody, c.CloseRoom, _responses(*_COMMAND, 403)),
}
_READ = _responses(400, 404, 503)
_PRESENCE = _responses(400, 503)
ADMIN_RESPONSES = _responses(400, 401, 404, 413, 503)


@dataclass(slots=True)
class ApiContext:
    """What the HTTP layer needs from the running service."""

    service: RoomService
    health: HealthChecks
    admin_token: str
    outbox_admin: OutboxAdmin | None = None  # serves /admin/outbox… when set
    metrics: bool = True  # serves GET /metrics (metrics.enabled); without it /metrics is 404 not_found
    body_read_timeout_s: float = 10.0  # http.body_read_timeout: the whole body must arrive within it
    forwarder: Forwarder | None = None  # commands and the room view go through it (to the room's owner)
    console: Console | None = None  # serves the operators' web console under /console/ when set
    # serve GET /admin/consumers when set: the configuration's groups on the broker, and what this
    # process's own groups did (consumer_counts: ConsumerRuntime.counts; None: it runs no group)
    consumer_groups: DeadLetterAdmin | None = None
    consumer_counts: Callable[[], dict[str, dict[str, Any]]] | None = None
    fast_commands: bool = True  # the command routes through api/fast_path.py (False: FastAPI's routing only)


def _answer(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _error(exc: errors.RoomServiceError, headers: dict[str, str] | None = None) -> JSONResponse:
    if isinstance(exc, ClosesConnection):
        headers = {**(headers or {}), "connection": "close"}
    return error_response(exc, headers=headers)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """Every method some route answers on this path (Starlette names only the first partial match's)."""
    allowed = []
    for method in _METHODS:
        probe = {**request.scope, "method": method}
        if any(route.matches(probe)[0] is Match.FULL for route in app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def _strip_validation_schemas(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents a 422 on every route with inputs; this API answers 400 in the error shape instead."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(
        title="room-service",
        version="1.0.0",
        description="Live voice-chat rooms; every side effect leaves through a transactional outbox.",
        redirect_slashes=False,  # a trailing slash names no route: 404, never a redirect
        # FastAPI's own OpenTelemetry hooks off: our tracing (observability/tracing.py) makes the HTTP
        # spans, and FastAPI's asked os.environ for a global tracer provider on every request (~5 % of
        # the event loop's time under HTTP commands, py-spy; issue 12)
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    policy = BodyPolicy(read_timeout_s=ctx.body_read_timeout_s)
    app.router.route_class = JsonRoute.with_policy(policy)
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _strip_validation_schemas(base_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(errors.RoomServiceError)
    async def _service_error(request: Request, exc: errors.RoomServiceError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(errors.InvalidArgument(_describe_validation(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = {"allow": _allowed_methods(app, request)} if exc.status_code == 405 else None
        return _error(from_http_exception(exc), headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        _log.exception("unhandled_error", path=request.url.path)
        return JSONResponse({"error": {"code": "internal", "message": "internal error"}}, status_code=500)

    service = ctx.service
    execute = ctx.forwarder.execute if ctx.forwarder is not None else service.execute
    room_view = ctx.forwarder.room if ctx.forwarder is not None else service.room

    # A command's answer is the pipeline's body, already in the shape of s.CommandResponse (which
    # documents it): encoded once with orjson, not validated and serialised again by FastAPI.
    @app.post("/v1/apps/{app_code}/rooms", response_model=s.CommandResponse, tags=["commands"], responses=_CREATE)
    @command_endpoint(c.CreateRoom.name)
    async def create_room(app_code: AppCode, body: s.CreateRoomBody) -> Response:
        entering_pipeline()
        return _answer(await execute(app_code, body.room_id, body.command_id, body.to_command()))

    def register(name: str) -> None:
        suffix, body_type, command, responses = _COMMANDS[name]

        @command_endpoint(command.name)
        async def handler(app_code: str, room_id: str, body: s._Body) -> Response:
            entering_pipeline()
            return _answer(await execute(app_code, room_id, body.command_id, body.to_command()))

        # FastAPI reads the annotations: give each route its own body model
        handler.__annotations__ = {
            "app_code": AppCode,
            "room_id": RoomIdPath,
            "body": body_type,
            "return": Response,
        }
        handler.__name__ = name
        app.post(
            f"/v1/apps/{{app_code}}/rooms/{{room_id}}/{suffix}",
            response_model=s.CommandResponse,
            tags=["commands"],
            name=name,
            responses=responses,
        )(handler)

    for name in _COMMANDS:
        register(name)

    @app.get("/v1/apps/{app_code}/rooms/{room_id}", tags=["reads"], responses=_READ)
    async def get_room(app_code: AppCode, room_id: RoomIdPath) -> dict[str, Any]:
        return await room_view(app_code, room_id)

    @app.get("/v1/apps/{app_code}/rooms", tags=["reads"], responses=_READ)
    async def list_rooms(app_code: AppCode) -> dict[str, Any]:
        return {"rooms": await service.rooms(app_code)}

    @app.get("/v1/apps/{app_code}/users/{user_id}/presence", tags=["reads"], responses=_PRESENCE)
    async def get_presence(app_code: AppCode, user_id: UserIdPath) -> dict[str, object]:
        return await service.presence(app_code, user_id)

    @app.get("/v1/gifts", tags=["reads"])
    async def list_gifts() -> list[dict[str, object]]:
        return service.gifts()

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> JSONResponse:
        ok, report = await ctx.health.run()
        return JSONResponse({"ready": ok, "checks": report}, status_code=200 if ok else 503)

    if ctx.metrics:

        @app.get("/metrics", tags=["ops"], include_in_schema=False)
        async def metrics() -> Response:
            return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        if not token_ok(authorization, ctx.admin_token):
            raise errors.Unauthorized()

    @app.get("/admin/status", tags=["admin"], dependencies=[Depends(require_admin)], responses=ADMIN_RESPONSES)
    async def admin_status() -> dict[str, Any]:
        return {"active_cells": len(service.registry)}

    if ctx.outbox_admin is not None:
        from roomservice.admin.http import admin_router

        router = admin_router(
            ctx.outbox_admin, require_admin, route_class=app.router.route_class, responses=ADMIN_RESPONSES
        )
        app.include_router(router)

    if ctx.consumer_groups is not None:
        from roomservice.admin.dead_letters import group_row

        groups_admin, counts = ctx.consumer_groups, ctx.consumer_counts

        @app.get("/admin/consumers", tags=["admin"], dependencies=[Depends(require_admin)], responses=ADMIN_RESPONSES)
        async def admin_consumers() -> dict[str, Any]:
            """Every consumer group of this configuration: what the broker holds for it (lag, in
            flight, dead letters; ``error`` when the broker did not answer) and, for the groups this
            process consumes, what they did since it started (``this_process``: applied, duplicates,
            failures, redelivered; null for a group another process runs)."""
            here = counts() if counts is not None else {}
            groups = []
            for report in await groups_admin.reports():
                row = group_row(report.spec, report.stats)
                row["error"] = report.error
                row["this_process"] = here.get(report.spec.group)
                groups.append(row)
            return {"broker": groups_admin.broker.name, "groups": groups}

    if ctx.console is not None:
        from roomservice.console import mount

        mount(app, ctx.console)

    if ctx.fast_commands:  # innermost: Edge and tracing apply to it as to every route
        named = {getattr(route, "name", None): route for route in app.router.routes}
        fast_routes = [FastRoute("", s.CreateRoomBody, named["create_room"])]
        fast_routes += [FastRoute(suffix, body, named[name]) for name, (suffix, body, _, _) in _COMMANDS.items()]
        app.add_middleware(
            CommandFastPath,
            routes=fast_routes,
            execute=execute,
            max_bytes=policy.max_bytes,
            read_timeout_s=policy.read_timeout_s,
        )
    app.add_middleware(Edge, admin_token=ctx.admin_token)
    if tracing.ENABLED:  # outermost: the request's span covers everything the app does
        app.add_middleware(tracing.HttpServerSpans)
    return app
