"""Console fixtures: the real app over a real Process, and logging in the way a browser does."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from tests.service.conftest import Clock, make_settings

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import Process
from roomservice.console import Console

ADMIN_TOKEN = "console-test-token-5f1c2e"  # distinctive: the log test looks for it
_NONCE = re.compile(r'name="login_nonce" value="([^"]+)"')
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest_asyncio.fixture
async def console_runtime(tmp_path: Path) -> AsyncIterator[Process]:
    """The local sample (embedded broker and its consumer groups, IM sandbox) on SQLite, loops not started."""
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)
    async with Process.running(settings, clock=Clock(), loops=False) as rt:
        yield rt


def console_of(rt: Process, **overrides: Any) -> Console:
    console = Console.from_process(rt, admin_token=ADMIN_TOKEN)
    for name, value in overrides.items():
        setattr(console, name, value)
    return console


@pytest_asyncio.fixture
async def console(console_runtime: Process) -> Console:
    return console_of(console_runtime)


def client_for(rt: Process, console: Console, base_url: str = "http://room.test") -> httpx.AsyncClient:
    app = create_app(ApiContext(service=rt.service, health=rt.health, admin_token=ADMIN_TOKEN, console=console))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


@pytest_asyncio.fixture
async def http(console_runtime: Process, console: Console) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(console_runtime, console) as client:
        yield client


async def login(http: httpx.AsyncClient, *, operator: str = "alice", token: str = ADMIN_TOKEN) -> httpx.Response:
    page = await http.get("/console/login")
    nonce = _NONCE.search(page.text)
    assert nonce is not None, page.text
    return await http.post("/console/login", data={"login_nonce": nonce.group(1), "operator": operator, "token": token})


async def logged_in(http: httpx.AsyncClient, *, operator: str = "alice") -> str:
    """Log in; returns the session's CSRF token (as a page carries it)."""
    response = await login(http, operator=operator)
    assert response.status_code == 303, response.text
    return csrf_of((await http.get("/console/")).text)


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found is not None, html
    return found.group(1)
