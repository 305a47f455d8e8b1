"""The console over HTTP in process (no browser): login, session cookie, CSRF, filters, paging, replay, audit."""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs
from tests.console.conftest import ADMIN_TOKEN, client_for, console_of, csrf_of, logged_in, login
from tests.service.test_outbox_admin import MIN, T0, insert_rows, join_event, outbox_row, sample_rows

from roomservice.bootstrap import Process
from roomservice.brokers.port import GroupStats
from roomservice.console import Console
from roomservice.console.session import COOKIE, Sessions
from roomservice.domain import commands as c
from roomservice.store import tables as t

PAGES = ["/console/", "/console/outbox", "/console/outbox/f-1", "/console/consumers", "/console/rooms", "/console/im"]
ACTIONS = [
    "/console/logout",
    "/console/outbox/confirm",
    "/console/outbox/replay",
    "/console/outbox/f-1/replay",
    "/console/consumers/confirm",
    "/console/consumers/replay",
]


def set_cookie_headers(response: httpx.Response) -> list[str]:
    return response.headers.get_list("set-cookie")


async def audit_of(rt: Process, event_id: str) -> list[tuple[str, str]]:
    async with rt.db.read() as conn:
        rows = await conn.execute(
            sa.select(t.room_outbox_audit.c.action, t.room_outbox_audit.c.actor)
            .where(t.room_outbox_audit.c.event_id == event_id)
            .order_by(t.room_outbox_audit.c.id)
        )
        return [(r.action, r.actor) for r in rows]


async def status_of(rt: Process, event_id: str) -> str:
    async with rt.db.read() as conn:
        return str(await conn.scalar(sa.select(t.room_outbox.c.status).where(t.room_outbox.c.event_id == event_id)))


async def job_finished(http: httpx.AsyncClient, location: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while True:
        body = (await http.get(location + ".json")).json()
        if body["state"] != "running":
            return dict(body)
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- nothing works without a session


@pytest.mark.parametrize("path", PAGES)
async def test_pages_redirect_to_the_login_page_without_a_session(http: httpx.AsyncClient, path: str) -> None:
    response = await http.get(path + "?x=1")
    assert response.status_code == 303
    location = urlsplit(response.headers["location"])
    assert location.path == "/console/login"
    assert parse_qs(location.query)["next"] == [path + "?x=1"]


@pytest.mark.parametrize("path", ACTIONS)
async def test_actions_answer_403_without_a_session(http: httpx.AsyncClient, path: str) -> None:
    response = await http.post(path, data={"event_id": "f-1", "group": "g"})
    assert response.status_code == 403
    assert "log in" in response.text


async def test_job_json_and_unknown_paths_answer_403_without_a_session(http: httpx.AsyncClient) -> None:
    response = await http.get("/console/jobs/abc.json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"
    assert (await http.get("/console/no/such/page")).status_code == 303  # as any page: to the login page
    assert (await http.post("/console/no/such/action")).status_code == 403
    await logged_in(http)
    assert (await http.get("/console/no/such/page")).status_code == 404
    assert (await http.get("/console", follow_redirects=False)).headers["location"] == "/console/"


async def test_a_tampered_or_foreign_cookie_is_no_session(http: httpx.AsyncClient) -> None:
    await logged_in(http)
    value = http.cookies[COOKIE]
    payload, signature = value.split(".")
    http.cookies.set(COOKIE, f"{payload}x.{signature}", path="/console/")
    assert (await http.get("/console/")).status_code == 303
    other, _ = Sessions("another-token", ttl_s=60).issue("mallory")
    http.cookies.set(COOKIE, other, path="/console/")
    assert (await http.get("/console/")).status_code == 303


async def test_a_cookie_or_an_id_with_non_ascii_characters_is_no_500(http: httpx.AsyncClient) -> None:
    """hmac.compare_digest refuses non-ASCII str, and "²".isdigit() is true where int() refuses it."""
    assert Sessions("a-token", ttl_s=60).read("abc.\xe9") is None
    odd = await http.get("/console/", headers={"Cookie": f"{COOKIE}=abc.\xe9".encode("latin-1")})
    assert odd.status_code == 303  # no session: to the login page
    await logged_in(http)
    page = await http.get("/console/outbox", params={"after_id": "²"})
    assert page.status_code == 400 and "after_id must be a number" in page.text


# --------------------------------------------------------------------------- login and the cookie


async def test_login_sets_an_httponly_strict_expiring_cookie(http: httpx.AsyncClient, console: Console) -> None:
    response = await login(http)
    assert response.status_code == 303 and response.headers["location"] == "/console/"
    [session_cookie] = [h for h in set_cookie_headers(response) if h.startswith(f"{COOKIE}=")]
    flags = [part.strip().lower() for part in session_cookie.split(";")]
    assert "httponly" in flags
    assert "samesite=strict" in flags
    assert "path=/console/" in flags
    assert f"max-age={int(console.settings.console.session_ttl.total_seconds())}" in flags
    assert "secure" not in flags  # served over plain http here
    assert ADMIN_TOKEN not in session_cookie
    page = await http.get("/console/")
    assert page.status_code == 200 and "alice" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


async def test_over_https_the_cookie_is_secure(console_runtime: Process, console: Console) -> None:
    async with client_for(console_runtime, console, base_url="https://room.test") as http:
        response = await login(http)
        [session_cookie] = [h for h in set_cookie_headers(response) if h.startswith(f"{COOKIE}=")]
        assert "secure" in [part.strip().lower() for part in session_cookie.split(";")]


async def test_wrong_token_missing_name_or_missing_nonce_log_nobody_in(http: httpx.AsyncClient) -> None:
    wrong = await login(http, token="not-the-token")
    assert wrong.status_code == 403 and "wrong admin token" in wrong.text
    assert COOKIE not in http.cookies
    nameless = await login(http, operator="   ")
    assert nameless.status_code == 400
    no_nonce = await http.post("/console/login", data={"operator": "eve", "token": ADMIN_TOKEN})
    assert no_nonce.status_code == 403
    assert COOKIE not in http.cookies
    assert (await http.get("/console/")).status_code == 303


async def test_an_empty_admin_token_admits_nobody(console_runtime: Process) -> None:
    console = console_of(console_runtime, sessions=Sessions("", ttl_s=60))
    async with client_for(console_runtime, console) as http:
        assert (await login(http, token="")).status_code == 403


async def test_login_goes_back_to_the_page_asked_for_and_never_elsewhere(http: httpx.AsyncClient) -> None:
    page = await http.get("/console/login?next=/console/outbox%3Fstatus%3Dfailed")
    assert 'value="/console/outbox?status=failed"' in page.text
    for target in ("https://evil.example/", "//evil.example/console/", "/console/../x\\y"):
        page = await http.get("/console/login", params={"next": target})
        assert 'name="next" value="/console/"' in page.text


async def test_the_session_expires(console_runtime: Process) -> None:
    now = [1_000_000.0]
    console = console_of(console_runtime, sessions=Sessions(ADMIN_TOKEN, ttl_s=60, clock=lambda: now[0]))
    async with client_for(console_runtime, console) as http:
        await logged_in(http)
        assert (await http.get("/console/")).status_code == 200
        now[0] += 61
        assert (await http.get("/console/")).status_code == 303


async def test_logout_ends_the_session(http: httpx.AsyncClient) -> None:
    csrf = await logged_in(http)
    cookie = http.cookies[COOKIE]
    response = await http.post("/console/logout", data={"csrf_token": csrf})
    assert response.status_code == 303
    http.cookies.set(COOKIE, cookie, path="/console/")  # even a copy of the cookie no longer works
    assert (await http.get("/console/")).status_code == 303


async def test_the_token_never_appears_in_logs_or_urls(http: httpx.AsyncClient) -> None:
    with capture_logs() as logs:
        await login(http, token=ADMIN_TOKEN + "-wrong")
        response = await login(http)
        locations = [response.headers["location"]]
        for path in PAGES:
            page = await http.get(path)
            assert ADMIN_TOKEN not in page.text
        await http.post("/console/outbox/confirm", data={"csrf_token": "bad"})
    assert any(entry["event"] == "console_login" for entry in logs)
    assert any(entry["event"] == "console_login_refused" for entry in logs)
    assert ADMIN_TOKEN not in json.dumps(logs, default=str)
    assert all(ADMIN_TOKEN not in loc for loc in locations)


# --------------------------------------------------------------------------- CSRF


async def test_every_post_needs_the_sessions_csrf_token(console_runtime: Process, http: httpx.AsyncClient) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    csrf = await logged_in(http)
    data = {"selection": "selected", "event_id": "f-1"}
    assert (await http.post("/console/outbox/replay", data=data)).status_code == 403
    assert (await http.post("/console/outbox/replay", data={**data, "csrf_token": csrf[:-1] + "x"})).status_code == 403
    assert (await http.post("/console/logout", data={"csrf_token": "nope"})).status_code == 403
    assert await status_of(console_runtime, "f-1") == "failed"
    # another session's token is no good either
    async with client_for(console_runtime, console_of(console_runtime)) as other:
        other_csrf = await logged_in(other, operator="bob")
    assert other_csrf != csrf
    assert (await http.post("/console/outbox/replay", data={**data, "csrf_token": other_csrf})).status_code == 403
    ok = await http.post("/console/outbox/replay", data={**data, "csrf_token": csrf})
    assert ok.status_code == 303 and ok.headers["location"].startswith("/console/jobs/")
    # a JSON body is not a form: refused before anything happens
    wrong_type = await http.post("/console/outbox/replay", json=data, headers={"x-csrf-token": csrf})
    assert wrong_type.status_code == 400


# --------------------------------------------------------------------------- the outbox browser


async def test_outbox_filters(console_runtime: Process, http: httpx.AsyncClient) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    await logged_in(http)

    async def ids(**params: str | list[str]) -> set[str]:
        page = await http.get("/console/outbox", params=params)
        assert page.status_code == 200, page.text
        return {
            r
            for r in ("p-old", "p-new", "r-1", "d-1", "f-1", "f-2", "legacy-1")
            if f'/console/outbox/{r}"' in page.text
        }

    assert await ids() == {"p-old", "p-new", "r-1", "d-1", "f-1", "f-2", "legacy-1"}
    assert await ids(status="failed") == {"f-1", "f-2"}
    assert await ids(status=["failed", "retryable"]) == {"f-1", "f-2", "r-1"}
    assert await ids(type="RoomGiftSent", status="failed") == {"f-1"}
    assert await ids(app="other") == {"f-2"}
    assert await ids(room="r2") == {"p-new", "d-1", "f-2"}
    assert await ids(error="quota") == {"f-2"}
    assert await ids(older_than="1h") == {"d-1", "f-1", "legacy-1"}
    assert await ids(newer_than="6m") == {"p-new", "f-2"}
    bad = await http.get("/console/outbox", params={"older_than": "soon"})
    assert bad.status_code == 400 and "older_than" in bad.text
    unknown = await http.get("/console/outbox", params={"status": "lost"})
    assert unknown.status_code == 400 and "unknown status" in unknown.text


async def test_outbox_pages_by_id(console_runtime: Process, http: httpx.AsyncClient) -> None:
    rows = [
        outbox_row(join_event(f"e-{i:03d}"), status="failed", created_at_ms=T0 - MIN, last_error="x")
        for i in range(120)
    ]
    await insert_rows(console_runtime.db, rows)
    await logged_in(http)
    seen: list[str] = []
    url: str | None = "/console/outbox?status=failed"
    pages = 0
    while url is not None:
        page = await http.get(url)
        pages += 1
        assert '<strong id="match-count">120</strong>' in page.text
        seen += [f"e-{i:03d}" for i in range(120) if f'/console/outbox/e-{i:03d}"' in page.text]
        marker = 'href="/console/outbox?'
        nexts = [part for part in page.text.split(marker)[1:] if 'rel="next"' in part.split(">")[0]]
        url = "/console/outbox?" + nexts[0].split('"')[0].replace("&amp;", "&") if nexts else None
    assert pages == 3
    assert seen == [f"e-{i:03d}" for i in range(120)]


async def test_bulk_replay_confirms_then_replays_the_filtered_set_audited(
    console_runtime: Process, http: httpx.AsyncClient
) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    csrf = await logged_in(http, operator="Zoë Operator")
    confirm = await http.post(
        "/console/outbox/confirm", data={"csrf_token": csrf, "selection": "matching", "status": "failed", "room": "r2"}
    )
    assert confirm.status_code == 200
    assert '<strong id="confirm-count">1</strong>' in confirm.text  # only f-2 is failed in r2
    assert await status_of(console_runtime, "f-2") == "failed"  # confirming did nothing yet
    csrf = csrf_of(confirm.text)
    started = await http.post(
        "/console/outbox/replay", data={"csrf_token": csrf, "selection": "matching", "room": "r2", "mode": "replay"}
    )
    assert started.status_code == 303
    page = await http.get(started.headers["location"])
    assert page.status_code == 200 and 'id="job-progress"' in page.text
    job = await job_finished(http, started.headers["location"])
    assert job["state"] == "done" and job["done"] == job["total"] == 1
    assert "replayed 1" in (await http.get(started.headers["location"])).text
    assert await status_of(console_runtime, "f-2") == "pending"
    assert await status_of(console_runtime, "f-1") == "failed"
    assert await audit_of(console_runtime, "f-2") == [("replay", "console:Zoë Operator")]
    detail = await http.get("/console/outbox/f-2")
    assert "console:Zoë Operator" in detail.text and "previous_last_error" in detail.text


async def test_confirming_every_dead_letter_of_a_group_counts_them_by_the_brokers_stats(
    console: Console, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a group's dead letters costs a round trip a letter on NATS: the count comes from its stats."""
    admin = console.dead_letters
    assert admin is not None
    spec = admin.groups[0]

    async def stats(topic: str, group: str) -> GroupStats:
        return GroupStats(topic=topic, group=group, lag=0, in_flight=0, dead_letters=4_321)

    async def no_listing(*_: object, **__: object) -> None:
        raise AssertionError("the confirmation page listed the dead letters")

    monkeypatch.setattr(admin.broker, "group_stats", stats)
    monkeypatch.setattr(admin.broker, "dead_letters", no_listing)
    csrf = await logged_in(http)
    confirm = await http.post(
        "/console/consumers/confirm", data={"csrf_token": csrf, "group": spec.group, "selection": "all"}
    )
    assert confirm.status_code == 200, confirm.text
    assert '<strong id="confirm-count">4321</strong>' in confirm.text


async def test_repair_with_chosen_targets_from_the_detail_page(
    console_runtime: Process, http: httpx.AsyncClient
) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    csrf = await logged_in(http)
    detail = await http.get("/console/outbox/f-1")
    assert "RoomGiftSent" in detail.text and "sender_id" in detail.text  # the decoded payload
    assert "targets pending" in detail.text
    started = await http.post(
        "/console/outbox/f-1/replay", data={"csrf_token": csrf, "mode": "repair", "targets": ["im"]}
    )
    job = await job_finished(http, started.headers["location"])
    assert job["state"] == "done" and job["summary"]["replayed"] == 1  # type: ignore[index]
    assert await status_of(console_runtime, "f-1") == "failed"  # a repair leaves the original as it is
    assert await audit_of(console_runtime, "f-1") == [("repair", "console:alice")]
    bad = await http.post("/console/outbox/f-1/replay", data={"csrf_token": csrf, "mode": "repair", "targets": ["x"]})
    assert bad.status_code == 400 and "unknown target" in bad.text
    missing = await http.get("/console/outbox/nope")
    assert missing.status_code == 404


# --------------------------------------------------------------------------- the other pages


async def test_overview_shows_counts_health_groups_and_the_chart(
    console_runtime: Process, http: httpx.AsyncClient
) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    await logged_in(http)
    page = await http.get("/console/")
    assert '<td class="num" data-status="failed">2</td>' in page.text
    assert "hyapp-room-im-bridge" in page.text  # a consumer group of the local sample
    assert "<svg" in page.text and "this process" in page.text
    assert "database" in page.text and "api" in page.text


async def test_room_inspector_shows_state_and_the_stored_timings(
    console_runtime: Process, http: httpx.AsyncClient
) -> None:
    service = console_runtime.service
    await service.execute("demo", "r9", "c-1", c.CreateRoom(owner_id="alice", title="Inspect me"))
    await service.execute("demo", "r9", "c-2", c.JoinRoom(user_id="bob"))
    await service.execute("demo", "r9", "c-3", c.TakeMic(user_id="bob", seat=2))
    async with console_runtime.db.read() as conn:
        stored = await conn.scalar(
            sa.select(t.room_command_log.c.timing).where(t.room_command_log.c.command_id == "c-2")
        )
    timing = json.loads(stored)
    assert timing["lease_ms"] >= 0 and timing["activity_async_outbox"] is True
    await logged_in(http)
    page = await http.get("/console/rooms", params={"app": "demo", "room": "r9"})
    assert page.status_code == 200
    assert '<td id="room-version">3</td>' in page.text
    assert "Inspect me" in page.text and "bob" in page.text
    for command_id in ("c-1", "c-2", "c-3"):
        assert f">{command_id}<" in page.text
    assert f">{timing['lease_ms']}<" in page.text
    assert "RoomMicTaken" in page.text  # the room's outbox rows
    bad = await http.get("/console/rooms", params={"app": "Demo!", "room": "r9"})
    assert bad.status_code == 400


async def test_im_sandbox_view(console_runtime: Process, http: httpx.AsyncClient) -> None:
    sandbox = console_runtime.sandbox
    assert sandbox is not None
    await logged_in(http)
    assert "No group yet" in (await http.get("/console/im")).text
    missing = await http.get("/console/im", params={"group": "nope"})
    assert missing.status_code == 404


async def test_console_disabled_serves_nothing(console_runtime: Process) -> None:
    from roomservice.cli.main import _console

    disabled = console_runtime.settings.with_overrides({"console.enabled": False})
    console_runtime.core.settings = disabled
    assert _console(console_runtime, ADMIN_TOKEN) is None
    async with client_for(console_runtime, None) as http:  # type: ignore[arg-type]
        assert (await http.get("/console/login")).status_code == 404


async def test_a_bug_is_a_500_page_in_the_consoles_layout_and_a_database_outage_a_503(
    http: httpx.AsyncClient, console: Console
) -> None:
    from roomservice import errors

    await logged_in(http)

    async def broken() -> None:
        raise RuntimeError("boom")

    async def down() -> None:
        raise errors.Unavailable("database unavailable")

    console.outbox.stats = broken  # type: ignore[method-assign]
    with capture_logs() as logs:
        page = await http.get("/console/")
    assert page.status_code == 500 and "internal error" in page.text and "Log out" in page.text
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["console_unhandled_error"]
    console.outbox.stats = down  # type: ignore[method-assign]
    page = await http.get("/console/")
    assert page.status_code == 503 and "database unavailable" in page.text


async def test_replaying_ticked_rows_confirms_them_first(console_runtime: Process, http: httpx.AsyncClient) -> None:
    await insert_rows(console_runtime.db, sample_rows())
    csrf = await logged_in(http)
    nothing = await http.post("/console/outbox/confirm", data={"csrf_token": csrf, "selection": "selected"})
    assert nothing.status_code == 400 and "tick at least one row" in nothing.text
    confirm = await http.post(
        "/console/outbox/confirm",
        data={"csrf_token": csrf, "selection": "selected", "event_id": ["f-1", "f-2", "f-1"]},
    )
    assert '<strong id="confirm-count">2</strong>' in confirm.text
    assert await status_of(console_runtime, "f-1") == "failed"
    started = await http.post(
        "/console/outbox/replay",
        data={"csrf_token": csrf_of(confirm.text), "selection": "selected", "event_id": ["f-1", "f-2", "p-old"]},
    )
    job = await job_finished(http, started.headers["location"])
    assert job["summary"]["replayed"] == 2 and job["summary"]["not_failed"] == 1  # type: ignore[index]
    assert {await status_of(console_runtime, i) for i in ("f-1", "f-2")} == {"pending"}
