"""``GET /admin/outbox`` answers out-of-range ``after_id`` and ``limit`` with 400 invalid_argument on both backends.

Issue 7 §1.5: SQLite raised OverflowError (500) past a signed 64-bit integer
while MariaDB answered 200. The bounds are checked before any SQL, so both
backends answer alike; this runs the real app over a Process on each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from tests.api.conftest import ADMIN_TOKEN, admin_client

from roomservice.domain.limits import MAX_ID_VALUE

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest_asyncio.fixture
async def backend_client(own_backend_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with admin_client(own_backend_url, tmp_path) as http:
        yield http


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        (f"after_id={MAX_ID_VALUE + 1}", "after_id"),  # 9223372036854775808: SQLite's OverflowError
        (f"after_id={2**64}", "after_id"),
        ("after_id=-1", "after_id"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        (f"limit={MAX_ID_VALUE + 1}", "limit"),
    ],
)
async def test_out_of_range_numbers_are_invalid_argument(
    backend_client: httpx.AsyncClient, query: str, fragment: str
) -> None:
    response = await backend_client.get(f"/admin/outbox?{query}", headers=AUTH)
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == "invalid_argument"
    assert fragment in body["error"]["message"]


async def test_the_bounds_themselves_are_accepted(backend_client: httpx.AsyncClient) -> None:
    for query in (f"after_id={MAX_ID_VALUE}", "after_id=0", "limit=1", "limit=1000"):
        response = await backend_client.get(f"/admin/outbox?{query}", headers=AUTH)
        assert response.status_code == 200, (query, response.text)
        assert response.json()["rows"] == []
