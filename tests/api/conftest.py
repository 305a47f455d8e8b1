"""An HTTP client bound in process (ASGI) to the real app over a real Process on SQLite."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest_asyncio
from tests.service.conftest import Clock, make_settings

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, MAINTENANCE, Process

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
