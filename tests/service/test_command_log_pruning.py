"""The maintenance role prunes the command log of every room, the quiet ones included."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import sqlalchemy as sa
from tests.service.test_sample_configs import local_settings

from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.store import tables as t
from roomservice.store.migrate import opened_database

DAY = 86_400_000


async def test_the_old_log_of_a_room_too_quiet_for_a_snapshot_goes(tmp_path: Path) -> None:
    """A room of two commands never reaches snapshot_every_n; its rows older than
    room.idempotency_retention still go, once maintenance has snapshotted it."""
    settings = local_settings(tmp_path)
    async with Process.running(settings) as first:
        await first.service.execute("demo", "quiet", "c1", c.CreateRoom(owner_id="alice", title="quiet"))
        await first.service.execute("demo", "quiet", "c2", c.JoinRoom(user_id="bob"))
        view = await first.service.room("demo", "quiet")
    log = t.room_command_log
    async with opened_database(settings.database.connect_url(), migrate=False) as db, db.write() as conn:
        await conn.execute(sa.update(log).values(created_at_ms=log.c.created_at_ms - 8 * DAY))  # eight days ago

    async with Process.running(settings) as second:
        deadline = time.monotonic() + 30
        while True:
            async with second.core.db.read() as conn:
                left = (await conn.execute(sa.select(sa.func.count()).select_from(log))).scalar_one()
            if left == 0:
                break
            assert time.monotonic() < deadline, f"{left} rows of the quiet room's log are still there"
            await asyncio.sleep(0.05)
        assert second.registry.peek("demo", "quiet") is None  # not loaded by a command: read from the store
        assert await second.service.room("demo", "quiet") == view  # from its snapshot
