"""The IM sandbox's ASGI app: Tencent's REST paths plus a JSON control API.

REST: ``POST /v4/{service}/{command}?sdkappid=&identifier=&usersig=&random=&contenttype=json``,
answered by :meth:`SandboxState.handle` (HTTP 200 with ``ActionStatus``/``ErrorCode``/``ErrorInfo``),
after the injected outage (HTTP 503, or a connection closed mid-answer) and latency.

Control API (JSON bodies and answers; never affected by injected faults):

=======  =================================  ==============================================
POST     /_sandbox/reset                    forget everything (accounts, groups, faults, log; on disk too)
GET      /_sandbox/state                    summary: groups, faults, request counts, persistence
POST     /_sandbox/outage                   ``{"mode": "http_503"|"reset"|null}``
DELETE   /_sandbox/outage                   end the outage
POST     /_sandbox/errors                   ``{"command", "code", "info"?, "count"?, "service"?}``
                                            (``count`` absent/null: until cleared; ``command`` ``*``: any)
DELETE   /_sandbox/errors                   clear injected errors (``?command=`` for one)
POST     /_sandbox/latency                  ``{"seconds", "command"?}`` (0 removes)
DELETE   /_sandbox/latency                  clear latency
POST     /_sandbox/usersig_expiry           ``{"count"}``: the next N calls answer 70001
POST     /_sandbox/rate_limit               ``{"per_second": n|null}``
POST     /_sandbox/features                 ``{"ban_group_member": bool}`` (false: 10059),
                                            ``{"owned_group_answers_10021": bool}`` (true: an existing
                                            group id its owner asks for again answers 10021, not 10025)
POST     /_sandbox/lost_answers             ``{"command", "count"?}``: its next calls are applied, then
                                            answered 503 (the answer lost on the way)
POST     /_sandbox/clock                    ``{"advance_s": s}``: move the sandbox clock
GET      /_sandbox/accounts                 imported accounts
GET      /_sandbox/groups                   live and destroyed groups
GET      /_sandbox/groups/{group_id}        one group (URL-encode ``@``/``#``)
POST     /_sandbox/groups/{group_id}/dismiss        dismiss it as Tencent may (then 10010 everywhere)
GET      /_sandbox/groups/{group_id}/messages       its messages (MsgSeq, Random, sender, Data)
GET      /_sandbox/groups/{group_id}/notifications  its system notifications
GET      /_sandbox/c2c                      one-to-one messages (``?to=`` filters)
GET      /_sandbox/requests                 ``{"counts": {command: n}, "entries": [...]}``
                                            (``?command=`` filters, ``?limit=`` last N entries)
GET      /_sandbox/healthz                  ``{"ok": true}``; 503 while the state cannot be saved
=======  =================================  ==============================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from roomservice.integrations.im_sandbox.state import SandboxState

__all__ = ["OUTAGE_BODY", "SandboxConnectionReset", "create_app", "injected_fault", "render_json"]


class SandboxConnectionReset(Exception):
    """Raised after the response started: the server closes the connection mid-answer."""


class _QuietReset(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SandboxConnectionReset)


_quiet = _QuietReset()


def _install_log_filter() -> None:
    logger = logging.getLogger("uvicorn.error")
    if _quiet not in logger.filters:
        logger.addFilter(_quiet)


OUTAGE_BODY = b"service unavailable (sandbox outage)"  # what an http_503 outage answers


async def injected_fault(state: SandboxState, service: str, command: str, identifier: Callable[[], str]) -> str | None:
    """The injected outage or latency one REST call meets before :meth:`SandboxState.handle`:
    the outage mode (``http_503``, ``reset``: recorded, the caller answers accordingly), or
    ``None`` once any injected latency has passed. Shared by every way into the sandbox."""
    outage = state.outage
    if outage is not None:
        state.record(service, command, identifier(), 503 if outage == "http_503" else 0, 0)
        return outage
    latency = state.latency_for(command)
    if latency > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.stopping.wait(), latency)
    return None


class _Faults:
    """Outage and latency for the REST paths, in front of the Starlette app."""

    def __init__(self, app: ASGIApp, state: SandboxState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v4/"):
            await self.app(scope, receive, send)
            return
        parts = path.split("/")
        service, command = (parts[2], parts[3]) if len(parts) >= 4 else ("", "")
        outage = await injected_fault(self.state, service, command, lambda: _query_value(scope, "identifier"))
        if outage == "http_503":
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(OUTAGE_BODY)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": OUTAGE_BODY})
            return
        if outage is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"ActionStatus":', "more_body": True})
            raise SandboxConnectionReset("sandbox outage: connection reset")
        await self.app(scope, receive, send)


def _query_value(scope: Scope, name: str) -> str:
    raw = scope.get("query_string", b"").decode("latin-1")
    values = parse_qs(raw).get(name)
    return values[0] if values else ""


def render_json(content: Any) -> bytes:
    """A REST answer's body, as Starlette's JSONResponse renders it."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _ok(data: Any = None, status: int = 200) -> JSONResponse:
    return JSONResponse({"ok": True} if data is None else data, status_code=status)


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"ok": False, "error": message}, status_code=400)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("body nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    return data


Handler = Callable[[Request], Awaitable[Response]]


def create_app(state: SandboxState) -> ASGIApp:
    """The sandbox app serving ``state``."""
    _install_log_filter()

    async def rest(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:  # the caller gave up (timeout): nobody to answer
            return Response(status_code=499)
        query = {k: v for k, v in request.query_params.items()}
        command = request.path_params["command"]
        reply = state.handle(request.path_params["service"], command, query, body)
        if state.answer_lost(command):  # applied, and its answer lost on the way
            return Response(OUTAGE_BODY, status_code=503, media_type="text/plain")
        return Response(render_json(reply.body), status_code=reply.status, media_type="application/json")

    def control(fn: Callable[[Request, dict[str, Any]], Any]) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                data = await _json(request) if request.method in ("POST", "PUT") else {}
                result = fn(request, data)
            except (ValueError, TypeError, KeyError) as exc:
                return _bad(f"{type(exc).__name__}: {exc}")
            if isinstance(result, Response):
                return result
            return _ok(result)

        return endpoint

    def reset(_r: Request, _d: dict[str, Any]) -> None:
        state.reset()

    def summary(_r: Request, _d: dict[str, Any]) -> Any:
        return state.summary()

    def outage(request: Request, data: dict[str, Any]) -> Any:
        state.set_outage(None if request.method == "DELETE" else data.get("mode", "http_503"))
        return state.faults()

    def errors(request: Request, data: dict[str, Any]) -> Any:
        if request.method == "DELETE":
            state.clear_errors(request.query_params.get("command"))
        else:
            count = data.get("count")
            state.inject_error(
                str(data["command"]),
                int(data["code"]),
                str(data.get("info", "")),
                count=None if count is None else int(count),
                service=data.get("service"),
            )
        return state.faults()

    def latency(request: Request, data: dict[str, Any]) -> Any:
        if request.method == "DELETE":
            state.clear_latency()
        else:
            state.set_latency(float(data["seconds"]), data.get("command"))
        return state.faults()

    def usersig_expiry(_r: Request, data: dict[str, Any]) -> Any:
        state.force_usersig_expiry(int(data.get("count", 1)))
        return state.faults()

    def rate_limit(_r: Request, data: dict[str, Any]) -> Any:
        value = data.get("per_second")
        state.set_rate_limit(None if value is None else float(value))
        return state.faults()

    def features(_r: Request, data: dict[str, Any]) -> Any:
        if "ban_group_member" in data:
            state.ban_enabled = bool(data["ban_group_member"])
        if "owned_group_answers_10021" in data:
            state.owned_group_answers_10021 = bool(data["owned_group_answers_10021"])
        return state.faults()

    def lost_answers(_r: Request, data: dict[str, Any]) -> Any:
        state.lose_answers(str(data["command"]), int(data.get("count", 1)))
        return state.faults()

    def clock(_r: Request, data: dict[str, Any]) -> Any:
        return {"now": state.advance_clock(float(data.get("advance_s", 0.0))), "offset": state.clock_offset}

    def accounts(_r: Request, _d: dict[str, Any]) -> Any:
        return {"accounts": [a.to_json() for a in state.accounts.values()]}

    def groups(_r: Request, _d: dict[str, Any]) -> Any:
        now = state.now()
        return {
            "groups": [g.to_json(now) for g in state.groups.values()],
            "destroyed": [g.to_json(now) for g in state.destroyed],
        }

    def group(request: Request, _d: dict[str, Any]) -> Any:
        found = state.group(request.path_params["group_id"])
        if found is None:
            return JSONResponse({"ok": False, "error": "no such group"}, status_code=404)
        return found.to_json(state.now())

    def messages(request: Request, _d: dict[str, Any]) -> Any:
        found = state.group(request.path_params["group_id"])
        if found is None:
            return JSONResponse({"ok": False, "error": "no such group"}, status_code=404)
        return {"group_id": found.group_id, "messages": [m.to_json() for m in found.messages]}

    def dismiss(request: Request, _d: dict[str, Any]) -> Any:
        group_id = request.path_params["group_id"]
        if group_id not in state.groups:
            return JSONResponse({"ok": False, "error": "no such live group"}, status_code=404)
        return state.dismiss_group(group_id).to_json(state.now())

    def notifications(request: Request, _d: dict[str, Any]) -> Any:
        found = state.group(request.path_params["group_id"])
        if found is None:
            return JSONResponse({"ok": False, "error": "no such group"}, status_code=404)
        return {"group_id": found.group_id, "notifications": list(found.notifications)}

    def c2c(request: Request, _d: dict[str, Any]) -> Any:
        return {"messages": [m.to_json() for m in state.c2c_messages(request.query_params.get("to"))]}

    def requests(request: Request, _d: dict[str, Any]) -> Any:
        command = request.query_params.get("command")
        entries = [r for r in state.requests if command is None or r.command == command]
        limit = request.query_params.get("limit")
        if limit is not None:
            entries = entries[-int(limit) :] if int(limit) > 0 else []
        return {"counts": state.request_counts(), "entries": [r.to_json() for r in entries]}

    def healthz(_r: Request, _d: dict[str, Any]) -> Any:
        if state.journal_error is not None:
            return JSONResponse({"ok": False, "error": f"state not saved: {state.journal_error}"}, status_code=503)
        return {"ok": True}

    routes = [
        Route("/v4/{service}/{command}", rest, methods=["POST"]),
        Route("/_sandbox/reset", control(reset), methods=["POST"]),
        Route("/_sandbox/state", control(summary), methods=["GET"]),
        Route("/_sandbox/outage", control(outage), methods=["POST", "PUT", "DELETE"]),
        Route("/_sandbox/errors", control(errors), methods=["POST", "DELETE"]),
        Route("/_sandbox/latency", control(latency), methods=["POST", "DELETE"]),
        Route("/_sandbox/usersig_expiry", control(usersig_expiry), methods=["POST"]),
        Route("/_sandbox/rate_limit", control(rate_limit), methods=["POST"]),
        Route("/_sandbox/features", control(features), methods=["POST"]),
        Route("/_sandbox/lost_answers", control(lost_answers), methods=["POST"]),
        Route("/_sandbox/clock", control(clock), methods=["POST"]),
        Route("/_sandbox/accounts", control(accounts), methods=["GET"]),
        Route("/_sandbox/groups", control(groups), methods=["GET"]),
        Route("/_sandbox/groups/{group_id:path}/messages", control(messages), methods=["GET"]),
        Route("/_sandbox/groups/{group_id:path}/notifications", control(notifications), methods=["GET"]),
        Route("/_sandbox/groups/{group_id:path}/dismiss", control(dismiss), methods=["POST"]),
        Route("/_sandbox/groups/{group_id:path}", control(group), methods=["GET"]),
        Route("/_sandbox/c2c", control(c2c), methods=["GET"]),
        Route("/_sandbox/requests", control(requests), methods=["GET"]),
        Route("/_sandbox/healthz", control(healthz), methods=["GET"]),
    ]
    return _Faults(Starlette(routes=routes), state)
