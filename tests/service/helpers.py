"""Small helpers shared by the service tests: commands by name, table counts."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.store import tables as t

APP = "demo"


async def run(rt: Process, room: str, command_id: str, command: c.Command) -> dict[str, Any]:
    return await rt.service.execute(APP, room, command_id, command)


async def count(rt: Process, table: sa.Table, *where: Any) -> int:
    async with rt.db.read() as conn:
        value = await conn.scalar(sa.select(sa.func.count()).select_from(table).where(*where))
    return int(value or 0)


async def outbox_rows(rt: Process, room: str) -> list[Any]:
    async with rt.db.read() as conn:
        result = await conn.execute(
            sa.select(t.room_outbox)
            .where(t.room_outbox.c.app_code == APP, t.room_outbox.c.room_id == room)
            .order_by(t.room_outbox.c.id)
        )
        return list(result.all())


async def logged_versions(rt: Process, room: str) -> list[int]:
    async with rt.db.read() as conn:
        result = await conn.execute(
            sa.select(t.room_command_log.c.version)
            .where(t.room_command_log.c.app_code == APP, t.room_command_log.c.room_id == room)
            .order_by(t.room_command_log.c.id)
        )
        return [int(v) for (v,) in result.all()]
