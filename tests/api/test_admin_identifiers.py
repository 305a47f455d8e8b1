"""``/admin/outbox…`` answers an id or filter outside the domain's identifier patterns with 400, on both backends.

Event ids, app codes, room ids and event types are ``ascii_bin`` columns.
MariaDB refuses to compare one with a non-ASCII literal (errors 1267/1270),
which surfaced as ``StoreUnavailable``: ``503 database unavailable`` for
``GET /admin/outbox/é`` (an outage alarm for a typo) while SQLite answered 404.
Such values are checked against the patterns of ``domain/limits.py`` before
any SQL, so both backends answer ``400 invalid_argument`` naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from tests.api.conftest import ADMIN_TOKEN, admin_client
from tests.service.test_outbox_admin import insert_rows, sample_rows

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest_asyncio.fixture
async def backend_client(own_backend_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with admin_client(own_backend_url, tmp_path, seed=lambda db: insert_rows(db, sample_rows())) as http:
        yield http


def assert_invalid(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == "invalid_argument", body
    assert field in body["error"]["message"], body


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("type=%C3%A9", "type"),
        ("app=%C3%A9", "app"),
        ("room=%C3%A9", "room"),
        ("app=Demo", "app"),  # ASCII, but not an app code: [a-z0-9_]
        ("room=r%201", "room"),
        ("status=failed&room=r1%C3%A9", "room"),
    ],
)
async def test_list_filters_outside_the_patterns(backend_client: httpx.AsyncClient, query: str, field: str) -> None:
    assert_invalid(await backend_client.get(f"/admin/outbox?{query}", headers=AUTH), field)


@pytest.mark.parametrize("event_id", ["%C3%A9", "f-1%C3%A9", "a%20b", "%E2%82%AC"])
async def test_show_of_an_id_outside_the_pattern(backend_client: httpx.AsyncClient, event_id: str) -> None:
    assert_invalid(await backend_client.get(f"/admin/outbox/{event_id}", headers=AUTH), "event_id")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"event_ids": ["é"]}, "event_ids"),
        ({"event_ids": ["f-1", "é"]}, "event_ids"),
        ({"event_ids": ["f-1"], "as_repair": True, "targets": ["im"]}, None),  # the control: valid
        ({"filter": {"type": "é"}}, "filter.type"),
        ({"filter": {"app": "é"}}, "filter.app"),
        ({"filter": {"room": "é"}}, "filter.room"),
        ({"filter": {"status": ["failed"], "room": "r1", "app": "dé"}}, "filter.app"),
    ],
)
async def test_replay_ids_and_filters_outside_the_patterns(
    backend_client: httpx.AsyncClient, body: dict[str, Any], field: str | None
) -> None:
    response = await backend_client.post("/admin/outbox/replay", json=body, headers=AUTH)
    if field is None:
        assert response.status_code == 200, response.text
        return
    assert_invalid(response, field)
    shown = await backend_client.get("/admin/outbox/f-1", headers=AUTH)
    assert shown.json()["status"] == "failed"  # a bad id anywhere in the list: nothing replayed


async def test_valid_ids_and_filters_still_answer_as_before(backend_client: httpx.AsyncClient) -> None:
    assert (await backend_client.get("/admin/outbox/f-1", headers=AUTH)).status_code == 200
    missing = await backend_client.get("/admin/outbox/no-such.id:1", headers=AUTH)
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"]["code"] == "not_found"
    listed = await backend_client.get("/admin/outbox?type=RoomGiftSent&app=demo&room=r1&status=failed", headers=AUTH)
    assert listed.status_code == 200, listed.text
    assert [r["event_id"] for r in listed.json()["rows"]] == ["f-1"]
    # last_error is text, not an id: any text filters it (MariaDB's collation folds accents, so which rows differs)
    assert (await backend_client.get("/admin/outbox?error=%C3%A9", headers=AUTH)).status_code == 200
