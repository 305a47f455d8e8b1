"""The embedded default's in-process presence comes back after a restart (projections/port.py, restore)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import sqlalchemy as sa
from structlog.testing import capture_logs
from tests.service.test_sample_configs import local_settings, task_names

from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.store import tables as t
from roomservice.store.migrate import opened_database


async def test_a_restarted_process_knows_who_is_in_which_open_room(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)
    async with Process.running(settings) as first:
        service = first.service
        await service.execute("demo", "r1", "c1", c.CreateRoom(owner_id="alice", title="one"))
        await service.execute("demo", "r1", "c2", c.JoinRoom(user_id="bob"))
        await service.execute("demo", "r1", "c3", c.JoinRoom(user_id="carol"))
        await service.execute("demo", "r1", "c4", c.LeaveRoom(user_id="carol"))
        await service.execute("demo", "r2", "c5", c.CreateRoom(owner_id="alice", title="two"))
        await service.execute("demo", "r2", "c6", c.JoinRoom(user_id="dan"))
        await service.execute("demo", "r2", "c7", c.CloseRoom(operator_id="alice"))
        assert (await service.presence("demo", "bob"))["room_id"] == "r1"

    async with Process.running(settings) as second:
        service = second.service
        deadline = time.monotonic() + 30
        while (await service.presence("demo", "bob"))["room_id"] != "r1":
            assert time.monotonic() < deadline, "bob's presence never came back"
            await asyncio.sleep(0.05)
        assert "presence-restore" not in task_names(second)  # done, not retrying
        assert (await service.presence("demo", "carol"))["room_id"] is None  # left before the restart
        assert (await service.presence("demo", "dan"))["room_id"] is None  # his room closed
        assert [r["room_id"] for r in await service.rooms("demo")] == ["r1"]
        await service.execute("demo", "r1", "c8", c.LeaveRoom(user_id="bob"))  # commands project as before
        assert (await service.presence("demo", "bob"))["room_id"] is None


async def test_a_room_that_does_not_load_is_skipped_and_the_others_come_back(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)
    async with Process.running(settings) as first:
        for room, user in (("good", "bob"), ("broken", "carol")):
            await first.service.execute("demo", room, f"{room}-1", c.CreateRoom(owner_id="alice", title=room))
            await first.service.execute("demo", room, f"{room}-2", c.JoinRoom(user_id=user))
    log = t.room_command_log
    async with opened_database(settings.database.connect_url(), migrate=False) as db, db.write() as conn:
        await conn.execute(sa.update(log).where(log.c.command_id == "broken-2").values(events='[{"not": "an event"}]'))

    with capture_logs() as logs:
        async with Process.running(settings) as second:
            deadline = time.monotonic() + 30
            while (await second.service.presence("demo", "bob"))["room_id"] != "good":
                assert time.monotonic() < deadline, "bob's presence never came back"
                await asyncio.sleep(0.05)
            assert (await second.service.presence("demo", "carol"))["room_id"] is None
    skipped = [e for e in logs if e["event"] == "projections_rebuild_skipped_room"]
    assert [e["room_id"] for e in skipped] == ["broken"]
    assert not [e for e in logs if e["event"] == "presence_restore_failed"]
