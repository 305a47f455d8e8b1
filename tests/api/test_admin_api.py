"""``/admin/outbox…`` in process over a real Process on SQLite: auth, happy paths, 400 and 404."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import sqlalchemy as sa
from tests.api.conftest import ADMIN_TOKEN
from tests.service.test_outbox_admin import HOUR, MIN, T0, Clock, gift_event, insert_rows, outbox_row, sample_rows
from tests.service.test_replay_partial_cli import SecondBatchFails

from roomservice.admin.operations import OutboxAdmin
from roomservice.api.app import ApiContext, create_app
from roomservice.api.edge import token_ok
from roomservice.bootstrap import Process
from roomservice.store import tables as t

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/admin/outbox/stats", None),
    ("GET", "/admin/outbox", None),
    ("GET", "/admin/outbox?status=failed", None),
    ("GET", "/admin/outbox/f-1", None),
    ("GET", "/admin/outbox/nope", None),
    ("POST", "/admin/outbox/replay", {"event_ids": ["f-1"]}),
    ("POST", "/admin/outbox/replay", {"filter": {}}),
]


@pytest_asyncio.fixture
async def admin_client(api_runtime: Process) -> AsyncIterator[httpx.AsyncClient]:
    await insert_rows(api_runtime.db, sample_rows())
    admin = OutboxAdmin(api_runtime.db, clock=Clock())
    app = create_app(
        ApiContext(
            service=api_runtime.service,
            health=api_runtime.health,
            admin_token=ADMIN_TOKEN,
            outbox_admin=admin,
        )
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://room.test") as http:
        yield http


async def status_of(rt: Process, event_id: str) -> str:
    async with rt.db.read() as conn:
        value = await conn.scalar(sa.select(t.room_outbox.c.status).where(t.room_outbox.c.event_id == event_id))
    return str(value)


def assert_error(response: httpx.Response, status: int, code: str, *fragments: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    for fragment in fragments:
        assert fragment in body["error"]["message"]


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": ADMIN_TOKEN},  # no scheme
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
async def test_every_admin_route_needs_the_token(
    admin_client: httpx.AsyncClient,
    api_runtime: Process,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> None:
    response = await admin_client.request(method, path, json=body, headers=headers)
    assert_error(response, 401, "unauthorized")
    assert await status_of(api_runtime, "f-1") == "failed"  # nothing happened


NON_ASCII_ROUTES = [*ROUTES, ("GET", "/admin/status", None), ("DELETE", "/admin/nowhere", None)]


@pytest.mark.parametrize(("method", "path", "body"), NON_ASCII_ROUTES)
@pytest.mark.parametrize(
    "token",
    ["\xe9t\xe9".encode("latin-1"), "\xe9t\xe9".encode(), ADMIN_TOKEN.encode() + b"\xe9", b"\xff" * 64],
    ids=["latin-1", "utf-8", "token-plus-one", "ff"],
)
async def test_a_non_ascii_token_is_unauthorized_not_an_error(
    admin_client: httpx.AsyncClient,
    api_runtime: Process,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    token: bytes,
) -> None:
    # the header is decoded as latin-1: hmac.compare_digest(str, str) raised TypeError on it (500 internal)
    response = await admin_client.request(method, path, json=body, headers={b"Authorization": b"Bearer " + token})
    assert_error(response, 401, "unauthorized")
    assert await status_of(api_runtime, "f-1") == "failed"


async def test_a_non_ascii_configured_token_admits_its_utf8_bytes(api_runtime: Process) -> None:
    app = create_app(ApiContext(service=api_runtime.service, health=api_runtime.health, admin_token="\xe9t\xe9"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test") as http:
        admitted = await http.get("/admin/status", headers={b"Authorization": b"Bearer " + "\xe9t\xe9".encode()})
        assert admitted.status_code == 200, admitted.text
        latin_1 = {b"Authorization": b"Bearer " + "\xe9t\xe9".encode("latin-1")}  # the same text, other bytes
        refused = await http.get("/admin/status", headers=latin_1)
        assert_error(refused, 401, "unauthorized")


def test_token_ok_refuses_text_no_header_can_carry() -> None:
    assert token_ok("Bearer " + "\xe9t\xe9".encode().decode("latin-1"), "\xe9t\xe9")
    assert not token_ok("Bearer \u20ac", "\u20ac")  # not latin-1: not a decoded header value
    assert not token_ok(f"Bearer {ADMIN_TOKEN}\xe9", ADMIN_TOKEN)


async def test_outbox_routes_are_absent_without_outbox_admin(client: httpx.AsyncClient) -> None:
    response = await client.get("/admin/outbox/stats", headers=AUTH)
    assert_error(response, 404, "not_found")


# --------------------------------------------------------------------------- stats, list, show


async def test_stats(admin_client: httpx.AsyncClient) -> None:
    response = await admin_client.get("/admin/outbox/stats", headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["counts"] == {
        "pending": 2,
        "delivering": 0,
        "delivered": 1,
        "retryable": 1,
        "failed": 2,
        "published": 1,
    }
    assert body["legacy_statuses"] == ["published"]
    assert body["total"] == 7
    assert body["oldest_pending_age_ms"] == 10 * MIN
    assert body["oldest_retryable_age_ms"] == 30 * MIN
    assert body["now_ms"] == T0


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", ["p-old", "p-new", "r-1", "d-1", "f-1", "f-2", "legacy-1"]),
        ("?status=failed", ["f-1", "f-2"]),
        ("?status=pending&status=retryable", ["p-old", "p-new", "r-1"]),
        ("?status=pending,retryable", ["p-old", "p-new", "r-1"]),
        ("?type=RoomUserJoined", ["p-old", "p-new", "f-2"]),
        ("?app=other", ["f-2"]),
        ("?room=r2", ["p-new", "d-1", "f-2"]),
        ("?older_than=1h", ["d-1", "f-1", "legacy-1"]),
        ("?newer_than=10m", ["p-old", "p-new", "f-2"]),
        ("?error=im:%20HTTP", ["f-1"]),
        ("?status=failed&type=RoomGiftSent&room=r1&older_than=90m", ["f-1"]),
    ],
)
async def test_list_filters(admin_client: httpx.AsyncClient, query: str, expected: list[str]) -> None:
    response = await admin_client.get(f"/admin/outbox{query}", headers=AUTH)
    assert response.status_code == 200, response.text
    assert [r["event_id"] for r in response.json()["rows"]] == expected


async def test_list_pages_with_after_id(admin_client: httpx.AsyncClient) -> None:
    first = (await admin_client.get("/admin/outbox?limit=4", headers=AUTH)).json()
    assert [r["event_id"] for r in first["rows"]] == ["p-old", "p-new", "r-1", "d-1"]
    assert first["next_after_id"] == first["rows"][-1]["id"]
    second = (await admin_client.get(f"/admin/outbox?limit=4&after_id={first['next_after_id']}", headers=AUTH)).json()
    assert [r["event_id"] for r in second["rows"]] == ["f-1", "f-2", "legacy-1"]
    assert second["next_after_id"] is None


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("?status=dead", "unknown status 'dead'"),
        ("?status=failed,nope", "unknown status 'nope'"),
        ("?older_than=10", "missing a unit"),
        ("?newer_than=soon", "newer_than"),
        ("?older_than=-5m", "negative"),
        ("?older_than=2h&newer_than=1h", "no row can match"),
        ("?limit=0", "limit"),
        ("?limit=1001", "limit"),
        ("?limit=many", "limit"),
        ("?after_id=-1", "after_id"),
        ("?type=", "type"),
    ],
)
async def test_list_rejects_bad_values(admin_client: httpx.AsyncClient, query: str, fragment: str) -> None:
    response = await admin_client.get(f"/admin/outbox{query}", headers=AUTH)
    assert_error(response, 400, "invalid_argument", fragment)


async def test_show(admin_client: httpx.AsyncClient) -> None:
    response = await admin_client.get("/admin/outbox/f-1", headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["event_id"] == "f-1"
    assert body["status"] == "failed"
    assert body["retry_count"] == 10
    assert body["last_error"] == "IM: HTTP 500 Internal Server Error"
    assert body["targets_done"] == ["activity"]
    assert body["age_ms"] == 2 * HOUR
    assert body["event"] == gift_event("f-1").to_dict()
    assert body["audit"] == []
    assert body["payload_size"] > 0


async def test_show_unknown_is_404(admin_client: httpx.AsyncClient) -> None:
    response = await admin_client.get("/admin/outbox/nope", headers=AUTH)
    assert_error(response, 404, "not_found", "no outbox row with event_id nope")


# --------------------------------------------------------------------------- replay


async def test_replay_by_ids(admin_client: httpx.AsyncClient, api_runtime: Process) -> None:
    response = await admin_client.post("/admin/outbox/replay", json={"event_ids": ["f-1", "d-1", "nope"]}, headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["replayed"], body["not_failed"], body["not_found"]) == (1, 1, 1)
    assert [(r["event_id"], r["result"], r["status"]) for r in body["results"]] == [
        ("f-1", "replayed", "failed"),
        ("d-1", "not_failed", "delivered"),
        ("nope", "not_found", None),
    ]
    assert await status_of(api_runtime, "f-1") == "pending"

    shown = (await admin_client.get("/admin/outbox/f-1", headers=AUTH)).json()
    assert shown["replay_count"] == 1
    assert shown["retry_count"] == 0
    assert [(a["action"], a["actor"]) for a in shown["audit"]] == [("replay", "admin-api")]


async def test_replay_as_repair(admin_client: httpx.AsyncClient, api_runtime: Process) -> None:
    response = await admin_client.post(
        "/admin/outbox/replay", json={"event_ids": ["f-2"], "as_repair": True}, headers=AUTH
    )
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    new_id = result["new_event_id"]
    assert new_id
    assert await status_of(api_runtime, "f-2") == "failed"
    repaired = (await admin_client.get(f"/admin/outbox/{new_id}", headers=AUTH)).json()
    assert repaired["status"] == "pending"
    assert repaired["event"]["event_id"] == new_id
    assert [a["action"] for a in repaired["audit"]] == ["repair_of"]


async def test_replay_as_repair_to_default_and_named_targets(
    admin_client: httpx.AsyncClient, api_runtime: Process
) -> None:
    # f-1 (a gift) had reached activity: by default its repair goes everywhere else
    default = await admin_client.post(
        "/admin/outbox/replay", json={"event_ids": ["f-1"], "as_repair": True}, headers=AUTH
    )
    assert default.status_code == 200, default.text
    assert default.json()["targets"] is None
    (result,) = default.json()["results"]
    assert result["targets"] == ["broker", "im"]
    repaired = (await admin_client.get(f"/admin/outbox/{result['new_event_id']}", headers=AUTH)).json()
    assert repaired["event"]["repair_of"] == "f-1"
    assert repaired["targets_done"] == ["activity"]

    named = await admin_client.post(
        "/admin/outbox/replay",
        json={"filter": {"type": "RoomUserJoined"}, "as_repair": True, "targets": ["activity"]},
        headers=AUTH,
    )
    assert named.status_code == 200, named.text
    assert named.json()["targets"] == ["activity"]
    (result,) = named.json()["results"]
    assert (result["event_id"], result["result"], result["targets"]) == ("f-2", "replayed", ["activity"])
    repaired = (await admin_client.get(f"/admin/outbox/{result['new_event_id']}", headers=AUTH)).json()
    assert repaired["event"]["repair_of"] == "f-2"
    assert repaired["targets_done"] == ["broker", "im"]


async def test_replay_by_filter(admin_client: httpx.AsyncClient, api_runtime: Process) -> None:
    response = await admin_client.post(
        "/admin/outbox/replay",
        json={"filter": {"status": ["failed"], "type": "RoomUserJoined", "older_than": "1m"}},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text
    assert [r["event_id"] for r in response.json()["results"]] == ["f-2"]
    assert await status_of(api_runtime, "f-2") == "pending"
    assert await status_of(api_runtime, "f-1") == "failed"

    everything = await admin_client.post("/admin/outbox/replay", json={"filter": {}}, headers=AUTH)
    assert [r["event_id"] for r in everything.json()["results"]] == ["f-1"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "exactly one of event_ids or filter"),
        ({"event_ids": ["f-1"], "filter": {}}, "exactly one of event_ids or filter"),
        ({"event_ids": []}, "event_ids"),
        ({"event_ids": [""]}, "event_ids"),
        ({"event_ids": ["x" * 65]}, "event_ids"),
        ({"event_ids": [f"id-{i}" for i in range(1001)]}, "event_ids"),
        ({"event_ids": "f-1"}, "event_ids"),
        ({"event_ids": [1]}, "event_ids"),
        ({"event_ids": ["f-1"], "as_repair": "yes"}, "as_repair"),
        ({"event_ids": ["f-1"], "extra": 1}, "extra"),
        ({"event_ids": ["f-1"], "as_repair": True, "targets": ["im", "sms"]}, "unknown target 'sms'"),
        ({"event_ids": ["f-1"], "as_repair": True, "targets": []}, "at least one"),
        ({"event_ids": ["f-1"], "as_repair": True, "targets": "im"}, "targets"),
        ({"filter": {}, "as_repair": True, "targets": ["notice"]}, "expected one of im, activity, broker"),
        ({"event_ids": ["f-1"], "targets": ["im"]}, "repair only"),
        ({"filter": {"status": ["pending"]}}, "failed"),
        ({"filter": {"status": ["bogus"]}}, "failed"),
        ({"filter": {"older_than": "10"}}, "older_than"),
        ({"filter": {"room_id": "r1"}}, "room_id"),
    ],
)
async def test_replay_rejects_bad_bodies(
    admin_client: httpx.AsyncClient, api_runtime: Process, body: dict[str, Any], fragment: str
) -> None:
    response = await admin_client.post("/admin/outbox/replay", json=body, headers=AUTH)
    assert_error(response, 400, "invalid_argument", fragment)
    assert await status_of(api_runtime, "f-1") == "failed"


async def test_replay_rejects_non_json(admin_client: httpx.AsyncClient) -> None:
    response = await admin_client.post(
        "/admin/outbox/replay", content=b"not json", headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_error(response, 400, "invalid_argument")


@pytest.mark.parametrize("by", ["filter", "ids"])
async def test_a_replay_cut_short_answers_503_with_the_batches_done(api_runtime: Process, by: str) -> None:
    """The batches committed before the failure are reported beside the error (a real outage:
    tests/integration/test_replay_interrupted.py)."""
    ids = [f"bulk-{i:03}" for i in range(150)]
    await insert_rows(api_runtime.db, [outbox_row(gift_event(i, room="r5"), status="failed") for i in ids])
    admin = OutboxAdmin(api_runtime.db, clock=Clock())
    admin.db = SecondBatchFails(api_runtime.db)  # type: ignore[assignment]
    app = create_app(
        ApiContext(service=api_runtime.service, health=api_runtime.health, admin_token=ADMIN_TOKEN, outbox_admin=admin)
    )
    body = {"filter": {"room": "r5"}} if by == "filter" else {"event_ids": ids}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test") as http:
        response = await http.post("/admin/outbox/replay", json=body, headers=AUTH)
    assert response.status_code == 503, response.text
    answer = response.json()
    assert set(answer) == {"error", "report"}
    assert answer["error"]["code"] == "unavailable"
    assert "replay stopped after 100 of 150 row(s)" in answer["error"]["message"]
    assert answer["report"]["replayed"] == 100
    done = [r["event_id"] for r in answer["report"]["results"]]
    assert done == ids[:100]
    assert [await status_of(api_runtime, i) for i in (ids[0], ids[99], ids[100], ids[149])] == [
        "pending", "pending", "failed", "failed",
    ]
