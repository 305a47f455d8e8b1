"""An HTTP client bound in process (ASGI) to the real app over a real Process on SQLite."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from tests.service.conftest import Clock, make_settings

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.store.database import Database

ADMIN_TOKEN = "test-admin-token"


@pytest_asyncio.fixture
async def api_runtime(tmp_path: Path) -> AsyncIterator[Process]:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)
    async with Process.running(settings, clock=Clock(), roles=(API, MAINTENANCE), loops=False) as rt:
        yield rt


@pytest_asyncio.fixture
async def client(api_runtime: Process) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(ApiContext(service=api_runtime.service, health=api_runtime.health, admin_token=ADMIN_TOKEN))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://room.test") as http:
        yield http


@pytest.fixture(params=["sqlite", "mariadb"])
def own_backend_url(request: pytest.FixtureRequest) -> str:
    """A migrated database of this test alone on each backend (the Process's start-up migration: a no-op)."""
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "migrated_mariadb_url")
    return url


@contextlib.asynccontextmanager
async def admin_client(
    url: str, tmp_path: Path, *, seed: Callable[[Database], Awaitable[None]] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the real app with the outbox admin routes, over a Process on ``url``
    (``seed`` fills its database first)."""
    async with Process.running(make_settings(url, tmp_path), roles=(API,), loops=False) as rt:
        assert rt.outbox_admin is not None
        if seed is not None:
            await seed(rt.db)
        app = create_app(
            ApiContext(service=rt.service, health=rt.health, admin_token=ADMIN_TOKEN, outbox_admin=rt.outbox_admin)
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test") as http:
            yield http
