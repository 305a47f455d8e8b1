"""Dedup records forgotten after consumers.dedup_retention: old applied ids go, what must stay stays."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import sqlalchemy as sa
from tests.service.conftest import T0, Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event
from tests.service.test_sample_configs import local_settings, task_names

from roomservice.bootstrap import Process
from roomservice.clock import wall_clock_ms
from roomservice.consumers.dedup_retention import LOCK_NAME, dedup_purges
from roomservice.leases.maintenance import DatabaseMaintenanceLock
from roomservice.outbox.retention import RetentionSweeper
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import opened_database

DAY = 86_400_000


def im_row(event_id: str, operation: str, at: int) -> dict[str, object]:
    return {"event_id": event_id, "group_id": "g-" + event_id, "operation": operation, "sent_at_ms": at}


def notice_row(event_id: str, status: str, at: int) -> dict[str, object]:
    return {
        "event_id": event_id,
        "app_code": "demo",
        "room_id": "r1",
        "user_id": "bob",
        "im_account": "bob",
        "kind": "kicked",
        "status": status,
        "attempts": 1,
        "payload": "{}",
        "created_at_ms": at,
        "updated_at_ms": at,
    }


async def seed(db: Database, old: int, new: int) -> None:
    async with db.write() as conn:
        await conn.execute(
            sa.insert(t.im_sent_event),
            [
                im_row("old-msg", "message", old),
                im_row("old-msg", "group", old),
                im_row("old-close", "destroy", old),
                im_row("new-msg", "message", new),
            ],
        )
        await conn.execute(
            sa.insert(t.activity_processed_event),
            [
                {"event_id": f"old-{i}", "event_type": "RoomGiftSent", "processed_at_ms": old + i}
                for i in range(3)
            ]
            + [{"event_id": "new", "event_type": "RoomGiftSent", "processed_at_ms": new}],
        )
        await conn.execute(
            sa.insert(t.notice_delivery_events),
            [
                notice_row("old-sent", "sent", old),
                notice_row("old-failed", "failed", old),
                notice_row("old-pending", "pending", old),
                notice_row("new-sent", "sent", new),
            ],
        )


async def kept(db: Database) -> dict[str, list[str]]:
    async with db.read() as conn:
        im = await conn.execute(sa.select(t.im_sent_event.c.event_id, t.im_sent_event.c.operation))
        activity = await conn.execute(sa.select(t.activity_processed_event.c.event_id))
        notice = await conn.execute(sa.select(t.notice_delivery_events.c.event_id))
        return {
            "im": sorted(f"{e}/{o}" for e, o in im.all()),
            "activity": sorted(e for (e,) in activity.all()),
            "notice": sorted(e for (e,) in notice.all()),
        }


KEPT = {
    "im": ["new-msg/message"],  # a group's destroy goes too: room_meta says the room closed
    "activity": ["new"],
    "notice": ["new-sent", "old-pending"],  # a pending notice may be being delivered
}


async def test_old_dedup_records_go_in_batches_and_pending_notices_and_new_ones_stay(
    database: Database,
) -> None:
    clock = Clock(T0 + 40 * DAY)
    await seed(database, old=T0, new=clock.now_ms - DAY)
    sweeper = RetentionSweeper(
        DatabaseMaintenanceLock(database),
        dedup_purges(database),
        retention_ms=30 * DAY,
        batch_size=2,
        clock=clock,
        lock_name=LOCK_NAME,
    )

    assert await sweeper.sweep() == 3 + 3 + 2  # three IM steps, three activity ids, two notices (in batches of two)
    assert await kept(database) == KEPT
    assert await sweeper.sweep() == 0


async def test_the_records_of_an_event_whose_outbox_row_is_kept_stay(database: Database) -> None:
    """A dead letter stays in the outbox until an operator replays it, however old: the replay must still
    find what was applied of it, and the IM bridge closing its room must find it sent."""
    clock = Clock(T0 + 40 * DAY)
    dead = make_event(JOINED)
    await insert_rows(database, dead, status="failed", now=T0)
    async with database.write() as conn:
        await conn.execute(sa.insert(t.im_sent_event), [im_row(dead.event_id, "message", T0)])
        await conn.execute(
            sa.insert(t.activity_processed_event),
            [{"event_id": dead.event_id, "event_type": "RoomUserJoined", "processed_at_ms": T0}],
        )
        await conn.execute(sa.insert(t.notice_delivery_events), [notice_row(dead.event_id, "sent", T0)])
    sweeper = RetentionSweeper(
        DatabaseMaintenanceLock(database), dedup_purges(database), retention_ms=30 * DAY, batch_size=10, clock=clock
    )
    assert await sweeper.sweep() == 0
    assert await kept(database) == {
        "im": [f"{dead.event_id}/message"], "activity": [dead.event_id], "notice": [dead.event_id]
    }
    async with database.write() as conn:  # replayed and delivered, then gone with the delivered rows
        await conn.execute(sa.delete(t.room_outbox))
    assert await sweeper.sweep() == 3


async def test_a_row_that_changed_after_it_was_picked_stays(database: Database) -> None:
    """The delete repeats the pick's conditions: a notice that went back to pending between them is kept."""
    await seed(database, old=T0, new=T0 + 40 * DAY)
    purge = dedup_purges(database)[2]
    original = purge._purge  # type: ignore[attr-defined]

    def changed_between(conn: sa.Connection, params: dict[str, object]) -> int:
        rows = conn.execute(purge._pick, params).all()  # type: ignore[attr-defined]
        assert sorted(r[0] for r in rows) == ["old-failed", "old-sent"]
        conn.execute(sa.update(t.notice_delivery_events).values(status="pending").where(
            t.notice_delivery_events.c.event_id == "old-failed"
        ))
        return int(original(conn, params))

    purge._purge = changed_between  # type: ignore[attr-defined]
    await purge(before_ms=T0 + DAY, limit=10)
    assert (await kept(database))["notice"] == ["new-sent", "old-failed", "old-pending"]


async def test_the_maintenance_role_forgets_old_dedup_records(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)  # the embedded default: its maintenance role sweeps at start
    now = wall_clock_ms()
    async with opened_database(settings.database.connect_url(), migrate=True) as db:
        await seed(db, old=now - 31 * DAY, new=now - 29 * DAY)
    async with Process.running(settings) as process:
        assert "dedup-retention" in task_names(process)
        deadline = time.monotonic() + 30
        while (left := await kept(process.core.db)) != KEPT:
            assert time.monotonic() < deadline, left
            await asyncio.sleep(0.05)

