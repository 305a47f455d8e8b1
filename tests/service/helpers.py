"""Small helpers shared by the service tests: commands by name, table counts, the consumer groups' state."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from roomservice.bootstrap import Process
from roomservice.config import DIRECT_TOPOLOGY
from roomservice.domain import commands as c
from roomservice.integrations.tencent_im.client import group_id_for
from roomservice.store import tables as t

APP = "demo"

# the seed's production topology: mq mode with the activity, notice, IM-bridge and treasure-open groups
# (every switch the code's direct defaults turn off, on), with a short treasure countdown
TOPOLOGY: dict[str, Any] = {
    **{key: True for key in DIRECT_TOPOLOGY},
    "outbox_worker.publish_mode": "mq",
    "treasure.countdown_seconds": 1,
}
ACTIVITY, NOTICE, IM_BRIDGE, TREASURE_OPEN = (
    "hyapp-activity-room-outbox",
    "hyapp-notice-room-outbox",
    "hyapp-room-im-bridge",
    "hyapp-room-treasure-open",
)
GROUPS = (ACTIVITY, NOTICE, IM_BRIDGE, TREASURE_OPEN)
OUTBOX_TOPIC, TREASURE_TOPIC = "hyapp_room_outbox", "hyapp_room_treasure_open"


def topic_of(group: str) -> str:
    return TREASURE_TOPIC if group == TREASURE_OPEN else OUTBOX_TOPIC


async def lag(rt: Process, group: str) -> int:
    assert rt.broker is not None
    return (await rt.broker.group_stats(topic_of(group), group)).lag


async def lag_is_zero(rt: Process, groups: tuple[str, ...] = GROUPS) -> bool:
    for group in groups:
        if await lag(rt, group):
            return False
    return True


def im_types(rt: Process, room: str) -> list[str]:
    """The ``type`` of every message the IM sandbox holds in the room's group, in the order IM got them."""
    assert rt.sandbox is not None
    group = group_id_for(APP, room, group_type=rt.settings.tencent_im.group_type)
    return [json.loads(m.data or "{}")["type"] for m in rt.sandbox.state.messages(group)]


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


async def notices(rt: Process) -> list[tuple[str, str]]:
    """``(user_id, status)`` of every ``notice_delivery_events`` row (the notice group's record of a kick)."""
    async with rt.db.read() as conn:
        rows = (
            await conn.execute(sa.select(t.notice_delivery_events).order_by(t.notice_delivery_events.c.event_id))
        ).all()
    return [(n.user_id, n.status) for n in rows]
