"""Acceptance fixtures: the whole embedded wiring (IM sandbox, activity service, real worker) on MariaDB."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio
import sqlalchemy as sa
from tests.service.conftest import DIRECT, make_settings

from roomservice.bootstrap import Process
from roomservice.store import tables as t

FAST_RETRIES = {
    "outbox_worker.poll_interval": "100ms",
    "outbox_worker.initial_backoff": "100ms",
    "outbox_worker.max_backoff": "400ms",
    "outbox_worker.max_retry_count": 3,
    "outbox_worker.publish_timeout": "1s",
    "outbox_worker.lock_timeout": "10s",
    "tencent_im.request_timeout": "1s",
}


@pytest_asyncio.fixture
async def direct(fresh_mariadb_url: str, tmp_path: Path) -> AsyncIterator[Process]:
    settings = make_settings(fresh_mariadb_url, tmp_path, **FAST_RETRIES, **DIRECT)
    async with Process.running(settings) as rt:
        assert rt.sandbox is not None and rt.activity_service is not None
        yield rt


async def statuses(rt: Process) -> dict[str, int]:
    async with rt.db.read() as conn:
        rows = await conn.execute(sa.select(t.room_outbox.c.status, sa.func.count()).group_by(t.room_outbox.c.status))
        return {status: int(n) for status, n in rows.all()}


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        await asyncio.sleep(0.05)


async def all_delivered(rt: Process) -> bool:
    counts = await statuses(rt)
    return set(counts) == {"delivered"}
