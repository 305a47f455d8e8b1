"""The FastAPI application: routes of SPEC §8, one error shape for every failure."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from roomservice import errors
from roomservice.api import schemas as s
from roomservice.api.body_limit import BodyLimit
from roomservice.api.errors import error_response
from roomservice.domain import limits as lim
from roomservice.health import HealthChecks
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import REGISTRY
from roomservice.service import RoomService

if TYPE_CHECKING:
    from roomservice.admin.operations import OutboxAdmin

_log = get_logger("roomservice.api")

AppCode = Annotated[str, Path(pattern=lim.APP_CODE_PATTERN, min_length=1, max_length=32)]
RoomIdPath = Annotated[str, Path(pattern=lim.ROOM_ID_PATTERN, min_length=1, max_length=48)]

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": s.ErrorBody} for status in (400, 401, 402, 403, 404, 405, 409, 413, 503)
}


@dataclass(slots=True)
class ApiContext:
    """What the HTTP layer needs from the running service."""

    service: RoomService
    health: HealthChecks
    admin_token: str
    outbox_admin: OutboxAdmin | None = None  # serves /admin/outbox… when set
    metrics: bool = True  # serves GET /metrics (metrics.enabled); without it /metrics is 404 not_found


def _error(exc: errors.RoomServiceError) -> JSONResponse:
    return error_response(exc)


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
        responses=_ERROR_RESPONSES,
    )

    @app.exception_handler(errors.RoomServiceError)
    async def _service_error(request: Request, exc: errors.RoomServiceError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type:
            got = content_type or "none"
            message = f"the body must be JSON (Content-Type: application/json), got {got!r}"
            return _error(errors.InvalidArgument(message))
        return _error(errors.InvalidArgument(_describe_validation(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        mapped: errors.RoomServiceError
        if exc.status_code == 404:
            mapped = errors.NotFound()
        elif exc.status_code == 405:
            mapped = errors.MethodNotAllowed()
        elif exc.status_code == 413:
            mapped = errors.PayloadTooLarge()
        elif exc.status_code == 401:
            mapped = errors.Unauthorized()
        else:
            mapped = errors.InvalidArgument(str(exc.detail))
        return _error(mapped)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        _log.exception("unhandled_error", path=request.url.path)
        return JSONResponse({"error": {"code": "internal", "message": "internal error"}}, status_code=500)

    service = ctx.service

    @app.post("/v1/apps/{app_code}/rooms", response_model=s.CommandResponse, tags=["commands"])
    async def create_room(app_code: AppCode, body: s.CreateRoomBody) -> dict[str, Any]:
        return await service.execute(app_code, body.room_id, body.command_id, body.to_command())

    def register(suffix: str, body_type: type[s._Body], name: str) -> None:
        async def handler(app_code: str, room_id: str, body: s._Body) -> dict[str, Any]:
            return await service.execute(app_code, room_id, body.command_id, body.to_command())

        # FastAPI reads the annotations: give each route its own body model
        handler.__annotations__ = {
            "app_code": AppCode,
            "room_id": RoomIdPath,
            "body": body_type,
            "return": dict[str, Any],
        }
        handler.__name__ = name
        app.post(
            f"/v1/apps/{{app_code}}/rooms/{{room_id}}/{suffix}",
            response_model=s.CommandResponse,
            tags=["commands"],
            name=name,
        )(handler)

    register("join", s.JoinBody, "join_room")
    register("leave", s.LeaveBody, "leave_room")
    register("mic/take", s.TakeMicBody, "take_mic")
    register("mic/leave", s.LeaveMicBody, "leave_mic")
    register("gifts", s.GiftBody, "send_gift")
    register("kick", s.KickBody, "kick_user")
    register("close", s.CloseBody, "close_room")

    @app.get("/v1/apps/{app_code}/rooms/{room_id}", tags=["reads"])
    async def get_room(app_code: AppCode, room_id: RoomIdPath) -> dict[str, Any]:
        return await service.room(app_code, room_id)

    @app.get("/v1/apps/{app_code}/rooms", tags=["reads"])
    async def list_rooms(app_code: AppCode) -> dict[str, Any]:
        return {"rooms": await service.rooms(app_code)}

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
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not ctx.admin_token or not hmac.compare_digest(token, ctx.admin_token):
            raise errors.Unauthorized()

    @app.get("/admin/status", tags=["admin"], dependencies=[Depends(require_admin)])
    async def admin_status() -> dict[str, Any]:
        return {"active_cells": len(service.registry)}

    if ctx.outbox_admin is not None:
        from roomservice.admin.http import admin_router

        app.include_router(admin_router(ctx.outbox_admin, require_admin))

    app.add_middleware(BodyLimit, max_bytes=lim.MAX_BODY_BYTES)
    return app
