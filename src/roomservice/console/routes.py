"""``/console/…``: the operators' web console, server-rendered (docs/console.md).

Every page but the login page needs a session (:mod:`roomservice.console.session`):
without one a page redirects to the login page, and an action (any POST, any
``.json``) answers ``403``. Every POST must carry the session's CSRF token.
Errors are pages in the console's layout with the status the JSON API would
give (400 for a bad filter, 404 for an unknown row); never a 500 for bad input.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import parse_qs, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from roomservice import errors
from roomservice.admin.operations import ALL_STATUSES, REPAIR_TARGETS, OutboxAdmin, OutboxFilter, repair_targets
from roomservice.api.body_limit import ClientGone, read_body
from roomservice.api.errors import http_status
from roomservice.console.context import Console
from roomservice.console.queries import (
    TIMING_FIELDS,
    TIMING_FLAGS,
    decoded,
    recent_commands,
    sandbox_groups,
    targets_split,
)
from roomservice.console.series import chart_svg
from roomservice.console.session import (
    COOKIE,
    COOKIE_PATH,
    CSRF_FIELD,
    CSRF_HEADER,
    LOGIN_COOKIE,
    ConsoleSession,
    valid_operator,
)
from roomservice.domain import limits as lim
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.console")

PREFIX: Final = "/console"
PAGE_SIZE: Final = 50
MAX_FORM_BYTES: Final = 64 * 1024
FORM_READ_TIMEOUT_S: Final = 10.0
_SECURITY_HEADERS: Final = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("roomservice.console", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(ms: int | float | None) -> str:
    if ms is None:
        return "—"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(ms: int | float | None) -> str:
    if ms is None:
        return "—"
    seconds = int(ms // 1000)
    if seconds < 120:
        return f"{seconds}s" if seconds else f"{int(ms)}ms"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


_env.filters["when"] = _when
_env.filters["age"] = _age
_env.filters["pretty"] = lambda value: json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


# --------------------------------------------------------------------------- forms and sessions


class Form:
    """A urlencoded form body, every field possibly repeated."""

    def __init__(self, fields: Mapping[str, list[str]]) -> None:
        self._fields = fields

    def get(self, name: str) -> str | None:
        values = self._fields.get(name)
        return values[0] if values else None

    def text(self, name: str) -> str | None:
        """The field stripped, or None when missing or blank."""
        value = (self.get(name) or "").strip()
        return value or None

    def all(self, name: str) -> list[str]:
        return list(self._fields.get(name, []))


async def _form(request: Request) -> Form:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise errors.InvalidArgument("the console takes forms (application/x-www-form-urlencoded)")
    body = await read_body(request, max_bytes=MAX_FORM_BYTES, timeout_s=FORM_READ_TIMEOUT_S)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.InvalidArgument("the form is not UTF-8") from None
    return Form(parse_qs(text, keep_blank_values=True, max_num_fields=2000))


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _session(console: Console, request: Request) -> ConsoleSession | None:
    return console.sessions.read(request.cookies.get(COOKIE))


def _safe_next(value: str | None) -> str:
    """Where to go after login: a path of this console only (never another site)."""
    if value and value.startswith(PREFIX + "/") and "//" not in value and "\\" not in value:
        return value
    return PREFIX + "/"


Handler = Callable[[Console, Request, ConsoleSession], Awaitable[Response]]


def _render(
    request: Request,
    template: str,
    session: ConsoleSession | None,
    console: Console,
    *,
    status: int = 200,
    **context: Any,
) -> HTMLResponse:
    html = _env.get_template(template).render(
        session=session,
        csrf_field=CSRF_FIELD,
        has_sandbox=console.sandbox is not None,
        has_broker=console.dead_letters is not None,
        path=request.url.path,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=_SECURITY_HEADERS)


def _forbidden(request: Request, console: Console, message: str, *, wants_json: bool) -> Response:
    if wants_json:
        body = {"error": {"code": "forbidden", "message": message}}
        return JSONResponse(body, status_code=403, headers=_SECURITY_HEADERS)
    return _render(request, "error.html", None, console, status=403, title="Forbidden", message=message)


def _to_login(request: Request) -> Response:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    login = f"{PREFIX}/login?" + urlencode({"next": target})
    return RedirectResponse(login, status_code=303, headers=_SECURITY_HEADERS)


def _guarded(console: Console, handler: Handler, *, action: bool) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` behind the session (and, for POSTs, the CSRF token); errors as console pages."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        wants_json = request.url.path.endswith(".json")
        session = _session(console, request)
        if session is None:
            if action or wants_json or request.method != "GET":
                return _forbidden(request, console, "log in to the console first", wants_json=wants_json)
            return _to_login(request)
        try:
            if request.method == "POST":
                form = await _form(request)
                given = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
                if not console.sessions.csrf_ok(session, given):
                    return _forbidden(request, console, "missing or wrong CSRF token", wants_json=wants_json)
                request.state.form = form
            return await handler(console, request, session)
        except ClientGone:
            return Response(status_code=400)
        except errors.RoomServiceError as exc:
            return _error_page(request, console, session, exc, wants_json=wants_json)
        except Exception:  # a bug: logged (path only, never the form), answered in the console's layout
            _log.exception("console_unhandled_error", path=request.url.path)
            return _error_page(
                request, console, session, errors.RoomServiceError("internal error"), wants_json=wants_json
            )

    return endpoint


def _error_page(
    request: Request, console: Console, session: ConsoleSession, exc: errors.RoomServiceError, *, wants_json: bool
) -> Response:
    status = http_status(exc)
    if wants_json:
        return JSONResponse(exc.to_body(), status_code=status, headers=_SECURITY_HEADERS)
    return _render(request, "error.html", session, console, status=status, title=exc.code, message=str(exc))


# --------------------------------------------------------------------------- login


async def login_page(console: Console, request: Request, *, message: str | None = None, status: int = 200) -> Response:
    nonce = console.sessions.login_nonce()
    response = _render(
        request,
        "login.html",
        None,
        console,
        status=status,
        nonce=nonce,
        next=_safe_next(request.query_params.get("next")),
        message=message,
    )
    response.set_cookie(
        LOGIN_COOKIE, nonce, max_age=600, path=COOKIE_PATH, httponly=True, samesite="strict", secure=_secure(request)
    )
    return response


async def login(console: Console, request: Request) -> Response:
    try:
        form = await _form(request)
    except ClientGone:
        return Response(status_code=400)
    except errors.RoomServiceError as exc:
        return await login_page(console, request, message=str(exc), status=http_status(exc))
    if not console.sessions.login_nonce_ok(request.cookies.get(LOGIN_COOKIE), form.get("login_nonce")):
        return await login_page(console, request, message="the login form expired; try again", status=403)
    operator = valid_operator(form.get("operator") or "")
    if operator is None:
        return await login_page(
            console, request, message="give your name (1–48 printable characters): it is audited", status=400
        )
    if not console.sessions.token_ok(form.get("token") or ""):
        _log.warning("console_login_refused", operator=operator)
        return await login_page(console, request, message="wrong admin token", status=403)
    value, _session_made = console.sessions.issue(operator)
    _log.info("console_login", operator=operator)
    response = RedirectResponse(_safe_next(form.get("next")), status_code=303, headers=_SECURITY_HEADERS)
    response.set_cookie(
        COOKIE,
        value,
        max_age=int(console.sessions.ttl_s),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )
    response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
    return response


async def logout(console: Console, request: Request, session: ConsoleSession) -> Response:
    console.sessions.revoke(session)
    _log.info("console_logout", operator=session.operator)
    response = RedirectResponse(f"{PREFIX}/login", status_code=303, headers=_SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict", secure=_secure(request))
    return response


# --------------------------------------------------------------------------- overview


async def overview(console: Console, request: Request, session: ConsoleSession) -> Response:
    stats = await console.outbox.stats()
    ready, checks = await console.health.run()
    groups = await console.dead_letters.reports() if console.dead_letters is not None else []
    now_ms = console.clock()
    points = console.series.points(now_ms)
    chart = chart_svg(points, now_ms=now_ms, window_ms=console.series.window_ms)
    settings = console.settings
    return _render(
        request,
        "overview.html",
        session,
        console,
        stats=stats,
        statuses=ALL_STATUSES,
        ready=ready,
        checks=checks,
        groups=groups,
        chart=chart,
        samples=len(points),
        interval_s=console.series.interval_s,
        latest=points[-1] if points else None,
        roles=sorted(console.roles),
        publish_mode=settings.outbox_worker.publish_mode,
        broker_driver=settings.broker.driver,
        broker_name=console.broker_name,
        database=console.db.dialect_name,
        jobs=console.jobs.recent()[:5],
    )


# --------------------------------------------------------------------------- outbox


def _filter_fields(source: Callable[[str], str | None], statuses: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {"status": statuses}
    for name in ("type", "app", "room", "older_than", "newer_than", "error"):
        value = (source(name) or "").strip()
        fields[name] = value or None
    return fields


def _filter(fields: Mapping[str, Any]) -> OutboxFilter:
    return OutboxFilter.parse(
        statuses=fields["status"],
        event_type=fields["type"],
        app_code=fields["app"],
        room_id=fields["room"],
        older_than=fields["older_than"],
        newer_than=fields["newer_than"],
        error_contains=fields["error"],
    )


def _query(fields: Mapping[str, Any], **extra: Any) -> str:
    pairs: list[tuple[str, str]] = [("status", s) for s in fields["status"]]
    pairs += [(k, v) for k, v in fields.items() if k != "status" and v]
    pairs += [(k, str(v)) for k, v in extra.items() if v is not None]
    return urlencode(pairs)


def _after_id(text: str | None) -> int | None:
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) > lim.MAX_ID_VALUE:  # "²".isdigit() is true
        raise errors.InvalidArgument(f"after_id must be a number 0..{lim.MAX_ID_VALUE}")
    return int(text)


async def outbox_page(console: Console, request: Request, session: ConsoleSession) -> Response:
    q = request.query_params
    fields = _filter_fields(q.get, [s for v in q.getlist("status") for s in v.split(",") if s.strip()])
    flt = _filter(fields)
    after_id = _after_id(q.get("after_id"))
    rows = await console.outbox.list(flt, limit=PAGE_SIZE, after_id=after_id)
    total = await console.outbox.count(flt)
    next_after = rows[-1].id if len(rows) == PAGE_SIZE else None
    return _render(
        request,
        "outbox.html",
        session,
        console,
        rows=rows,
        total=total,
        fields=fields,
        statuses=ALL_STATUSES,
        after_id=after_id,
        next_query=_query(fields, after_id=next_after) if next_after is not None else None,
        first_query=_query(fields),
        failed_in_filter=fields["status"] in ([], ["failed"]),
    )


def _mode(form: Form) -> tuple[bool, list[str] | None]:
    """(as_repair, targets): a plain replay, or a repair to the targets ticked (none ticked: the default)."""
    mode = form.get("mode") or "replay"
    if mode not in ("replay", "repair"):
        raise errors.InvalidArgument("mode must be replay or repair")
    targets = form.all("targets")
    if mode == "replay":
        return False, None
    return True, (targets or None)


async def outbox_confirm(console: Console, request: Request, session: ConsoleSession) -> Response:
    """The confirmation step of a bulk action: what it takes, how many rows, which mode and targets."""
    form: Form = request.state.form
    fields = _filter_fields(form.get, form.all("status"))
    selection = form.get("selection") or "selected"
    event_ids = [i for i in form.all("event_id") if i]
    if selection == "selected":
        if not event_ids:
            raise errors.InvalidArgument("tick at least one row, or choose every failed row matching the filter")
        count = len(set(event_ids))
    else:
        flt = replace(_filter({**fields, "status": []}), statuses=("failed",))
        count = await console.outbox.count(flt)
    return _render(
        request,
        "confirm.html",
        session,
        console,
        selection=selection,
        event_ids=sorted(set(event_ids)),
        fields=fields,
        count=count,
        repair_targets=REPAIR_TARGETS,
    )


async def outbox_replay(console: Console, request: Request, session: ConsoleSession) -> Response:
    form: Form = request.state.form
    as_repair, targets = _mode(form)
    outbox: OutboxAdmin = console.outbox
    verb = "repair" if as_repair else "replay"
    if (form.get("selection") or "selected") == "selected":
        event_ids = [i for i in form.all("event_id") if i][:1000]
        if not event_ids:
            raise errors.InvalidArgument("no rows to replay")
        title = f"{verb} {len(set(event_ids))} selected row(s)"

        async def work(progress: Callable[[int, int], None]) -> Any:
            return await outbox.replay(
                event_ids, actor=session.actor, as_repair=as_repair, targets=targets, progress=progress
            )
    else:
        fields = _filter_fields(form.get, [])
        flt = replace(_filter(fields), statuses=("failed",))
        title = f"{verb} every failed row matching the filter"

        async def work(progress: Callable[[int, int], None]) -> Any:
            return await outbox.replay_matching(
                flt, actor=session.actor, as_repair=as_repair, targets=targets, progress=progress
            )

    # validate before starting, so a bad choice answers 400 here rather than a failed job
    repair_targets(targets, as_repair=as_repair)
    job = console.jobs.start(title, session.operator, work)
    return RedirectResponse(f"{PREFIX}/jobs/{job.id}", status_code=303, headers=_SECURITY_HEADERS)


async def outbox_detail(console: Console, request: Request, session: ConsoleSession) -> Response:
    event_id = request.path_params["event_id"]
    if not 1 <= len(event_id) <= 64:
        raise errors.InvalidArgument("event_id must be 1..64 characters")
    detail = await console.outbox.show(event_id)
    mode = console.settings.outbox_worker.publish_mode
    done, pending = targets_split(detail.row.event_type, mode, detail.row.targets_done)
    audit = []
    for record in detail.audit:
        try:
            parsed = json.loads(record.detail) if record.detail else None
        except ValueError:
            parsed = record.detail
        audit.append((record, parsed))
    return _render(
        request,
        "detail.html",
        session,
        console,
        detail=detail,
        row=detail.row,
        done=done,
        pending=pending,
        audit=audit,
        repair_targets=REPAIR_TARGETS,
    )


async def outbox_replay_one(console: Console, request: Request, session: ConsoleSession) -> Response:
    event_id = request.path_params["event_id"]
    form: Form = request.state.form
    as_repair, targets = _mode(form)
    repair_targets(targets, as_repair=as_repair)
    outbox = console.outbox

    async def work(progress: Callable[[int, int], None]) -> Any:
        return await outbox.replay(
            [event_id], actor=session.actor, as_repair=as_repair, targets=targets, progress=progress
        )

    job = console.jobs.start(f"{'repair' if as_repair else 'replay'} {event_id}", session.operator, work)
    return RedirectResponse(f"{PREFIX}/jobs/{job.id}", status_code=303, headers=_SECURITY_HEADERS)


async def job_page(console: Console, request: Request, session: ConsoleSession) -> Response:
    job = console.jobs.get(request.path_params["job_id"])
    return _render(request, "job.html", session, console, job=job)


async def job_json(console: Console, request: Request, session: ConsoleSession) -> Response:
    job = console.jobs.get(request.path_params["job_id"])
    return JSONResponse(job.to_dict(), headers=_SECURITY_HEADERS)


# --------------------------------------------------------------------------- consumer groups


def _dead_letters(console: Console) -> Any:
    if console.dead_letters is None:
        raise errors.NotFound("this process has no broker: no consumer group here (publish_mode direct)")
    return console.dead_letters


async def consumers_page(console: Console, request: Request, session: ConsoleSession) -> Response:
    admin = _dead_letters(console)
    reports = await admin.reports()
    chosen = request.query_params.get("group") or (admin.groups[0].group if admin.groups else None)
    letters: list[Any] = []
    if chosen is not None:
        letters = list(await admin.dead_letters(chosen, limit=200))
    return _render(
        request,
        "consumers.html",
        session,
        console,
        reports=reports,
        chosen=chosen,
        letters=letters,
    )


async def consumers_confirm(console: Console, request: Request, session: ConsoleSession) -> Response:
    admin = _dead_letters(console)
    form: Form = request.state.form
    group = admin.group(form.get("group") or "").group
    everything = form.get("selection") == "all"
    ids = sorted(set(form.all("message_id")))
    if not everything and not ids:
        raise errors.InvalidArgument("tick at least one dead letter, or choose every dead letter of the group")
    if everything:  # the broker's own count: listing them costs a round trip a letter on NATS
        spec = admin.group(group)
        count = (await admin.broker.group_stats(spec.topic, spec.group)).dead_letters
    else:
        count = len(ids)
    return _render(
        request, "consumers_confirm.html", session, console, group=group, everything=everything, ids=ids, count=count
    )


async def consumers_replay(console: Console, request: Request, session: ConsoleSession) -> Response:
    admin = _dead_letters(console)
    form: Form = request.state.form
    group = admin.group(form.get("group") or "").group
    ids = None if form.get("selection") == "all" else sorted(set(form.all("message_id")))
    if ids is not None and not ids:
        raise errors.InvalidArgument("no dead letters to replay")
    title = f"replay every dead letter of {group}" if ids is None else f"replay {len(ids)} dead letter(s) of {group}"

    async def work(progress: Callable[[int, int], None]) -> Any:
        result = await admin.replay(group, ids, actor=session.actor, progress=progress)
        _log.info("console_consumer_replay", group=group, operator=session.operator, replayed=len(result.replayed))
        return result

    # a job, as an outbox replay is: every dead letter of a group can be many broker round trips (on NATS
    # one a letter), longer than a browser or a proxy waits for one answer
    job = console.jobs.start(title, session.operator, work, kind="consumers")
    return RedirectResponse(f"{PREFIX}/jobs/{job.id}", status_code=303, headers=_SECURITY_HEADERS)


# --------------------------------------------------------------------------- rooms


async def rooms_page(console: Console, request: Request, session: ConsoleSession) -> Response:
    app_code = (request.query_params.get("app") or "").strip()
    room_id = (request.query_params.get("room") or "").strip()
    room: dict[str, Any] | None = None
    commands: list[Any] = []
    rows: list[Any] = []
    row_count = 0
    if app_code or room_id:
        if not lim.valid_app_code(app_code):
            raise errors.InvalidArgument("app must match [a-z0-9_]{1,32}")
        if not lim.valid_room_id(room_id):
            raise errors.InvalidArgument("room must match [A-Za-z0-9_-]{1,48}")
        if console.room_view is None:
            raise errors.NotFound("this process runs no command pipeline: no room reader here")
        try:
            room = await console.room_view(app_code, room_id)
        except errors.RoomNotFound:
            room = None
        commands = await recent_commands(console.db, app_code, room_id)
        flt = OutboxFilter(app_code=app_code, room_id=room_id)
        rows = await console.outbox.list(flt, limit=20, newest_first=True)
        row_count = await console.outbox.count(flt)
    return _render(
        request,
        "rooms.html",
        session,
        console,
        app_code=app_code,
        room_id=room_id,
        room=room,
        commands=commands,
        rows=rows,
        row_count=row_count,
        timing_fields=TIMING_FIELDS,
        timing_flags=TIMING_FLAGS,
        searched=bool(app_code or room_id),
        room_query=urlencode({"app": app_code, "room": room_id}),
    )


# --------------------------------------------------------------------------- IM sandbox


async def im_page(console: Console, request: Request, session: ConsoleSession) -> Response:
    state = console.sandbox
    if state is None:
        raise errors.NotFound("this process runs no IM sandbox (only the embedded default does)")
    groups = sandbox_groups(state)
    chosen = request.query_params.get("group")
    messages: list[tuple[Any, dict[str, Any] | None]] = []
    if chosen:
        group = state.group(chosen)
        if group is None:
            raise errors.NotFound(f"the sandbox has no group {chosen[:80]!r}")
        messages = [(m, decoded(m.data)) for m in reversed(group.messages[-200:])]
    c2c = [(m, decoded(m.data)) for m in reversed(state.c2c[-100:])]
    return _render(
        request,
        "im.html",
        session,
        console,
        groups=groups,
        chosen=chosen,
        messages=messages,
        c2c=c2c,
        c2c_total=len(state.c2c),
        faults=state.faults(),
        now=time.time(),
    )


# --------------------------------------------------------------------------- the app


def console_app(console: Console) -> Starlette:
    def page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _guarded(console, handler, action=False)

    def action(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _guarded(console, handler, action=True)

    async def login_get(request: Request) -> Response:
        if _session(console, request) is not None:
            return RedirectResponse(_safe_next(request.query_params.get("next")), status_code=303)
        return await login_page(console, request)

    async def login_post(request: Request) -> Response:
        return await login(console, request)

    async def not_found(request: Request, exc: Exception) -> Response:
        session = _session(console, request)
        if session is None:  # without a session a missing page looks like any other: the login page
            if request.method in ("GET", "HEAD") and not request.url.path.endswith(".json"):
                return _to_login(request)
            return _forbidden(request, console, "log in to the console first", wants_json=False)
        return _render(request, "error.html", session, console, status=404, title="not_found", message="no such page")

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return _render(request, "error.html", None, console, status=405, title="method_not_allowed", message="")

    routes = [
        Route("/", page(overview), methods=["GET"]),
        Route("/login", login_get, methods=["GET"]),
        Route("/login", login_post, methods=["POST"]),
        Route("/logout", action(logout), methods=["POST"]),
        Route("/outbox", page(outbox_page), methods=["GET"]),
        Route("/outbox/confirm", action(outbox_confirm), methods=["POST"]),
        Route("/outbox/replay", action(outbox_replay), methods=["POST"]),
        Route("/outbox/{event_id}", page(outbox_detail), methods=["GET"]),
        Route("/outbox/{event_id}/replay", action(outbox_replay_one), methods=["POST"]),
        Route("/jobs/{job_id}.json", page(job_json), methods=["GET"]),
        Route("/jobs/{job_id}", page(job_page), methods=["GET"]),
        Route("/consumers", page(consumers_page), methods=["GET"]),
        Route("/consumers/confirm", action(consumers_confirm), methods=["POST"]),
        Route("/consumers/replay", action(consumers_replay), methods=["POST"]),
        Route("/rooms", page(rooms_page), methods=["GET"]),
        Route("/im", page(im_page), methods=["GET"]),
        Mount("/static", StaticFiles(packages=[("roomservice.console", "static")]), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})


def mount(app: Starlette, console: Console) -> None:
    """Serve ``console`` under ``/console/`` on ``app`` (``/console`` redirects there)."""

    async def to_console(request: Request) -> Response:
        return RedirectResponse(PREFIX + "/", status_code=308)

    app.router.routes.append(Route(PREFIX, to_console, methods=["GET", "HEAD"], include_in_schema=False))
    app.router.routes.append(Mount(PREFIX, console_app(console), name="console"))
