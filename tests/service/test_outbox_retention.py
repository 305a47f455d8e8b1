"""Retention: old delivered rows and fired timers go in bounded batches; dead letters stay."""

from __future__ import annotations

import sqlalchemy as sa
from tests.service.conftest import T0, Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event

from roomservice.leases.maintenance import DatabaseMaintenanceLock
from roomservice.outbox.retention import LOCK_NAME, RetentionSweeper
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.timers.treasure import DatabaseTreasureTimer

DAY = 86_400_000


async def statuses(db: Database) -> list[tuple[str, str]]:
    async with db.read() as conn:
        rows = await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.status))
        return sorted((status, eid) for eid, status in rows.all())


async def test_sweep_deletes_old_delivered_rows_and_fired_timers_only(database: Database) -> None:
    clock = Clock(T0 + 10 * DAY)
    old = [make_event(JOINED) for _ in range(5)]
    await insert_rows(database, *old, status="delivered", now=T0)
    legacy = make_event(JOINED)
    await insert_rows(database, legacy, status="published", now=T0)
    dead = make_event(JOINED)
    await insert_rows(database, dead, status="failed", now=T0)
    fresh = make_event(JOINED)
    await insert_rows(database, fresh, status="delivered", now=clock.now_ms)
    async with database.write() as conn:
        await conn.execute(sa.update(t.room_outbox).values(delivered_at_ms=t.room_outbox.c.created_at_ms))
        await conn.execute(
            sa.insert(t.treasure_timer),
            [
                dict(
                    app_code="demo",
                    room_id="r1",
                    box_id=box,
                    level=1,
                    open_at_ms=at,
                    command_id=f"open:{box}",
                    status=status,
                    fire_at_ms=at,
                    attempts=0,
                    created_at_ms=at,
                    updated_at_ms=at,
                )
                for box, status, at in (("old", "fired", T0), ("new", "fired", clock.now_ms), ("due", "scheduled", T0))
            ],
        )
    repo = SqlOutboxRepository(database)
    timer = DatabaseTreasureTimer(database, clock=clock, owner="w")
    sweeper = RetentionSweeper(
        DatabaseMaintenanceLock(database),
        [repo.delete_delivered, timer.purge_fired],
        retention_ms=7 * DAY,
        batch_size=2,
        clock=clock,
    )

    assert await sweeper.sweep() == 6 + 1  # five delivered and one legacy row, in batches of two; one timer
    assert await statuses(database) == sorted([("delivered", fresh.event_id), ("failed", dead.event_id)])
    async with database.read() as conn:
        boxes = sorted(b for (b,) in (await conn.execute(sa.select(t.treasure_timer.c.box_id))).all())
    assert boxes == ["due", "new"]  # a scheduled timer is never purged, however old
    assert await sweeper.sweep() == 0


async def test_only_the_lock_holder_sweeps(database: Database) -> None:
    clock = Clock(T0 + 10 * DAY)
    await insert_rows(database, make_event(JOINED), status="delivered", now=T0)
    async with database.write() as conn:
        await conn.execute(sa.update(t.room_outbox).values(delivered_at_ms=T0))
    holder = DatabaseMaintenanceLock(database)
    assert await holder.try_acquire(LOCK_NAME)
    other = SqlOutboxRepository(database)
    sweeper = RetentionSweeper(
        DatabaseMaintenanceLock(database), [other.delete_delivered], retention_ms=DAY, batch_size=10, clock=clock
    )
    try:
        assert await sweeper.sweep() == 0
    finally:
        await holder.release(LOCK_NAME)
    assert await sweeper.sweep() == 1


async def test_a_sweep_that_stops_with_work_left_says_so_and_a_failing_purge_stops_only_itself(
    database: Database,
) -> None:
    """A sweep is bounded (max_batches a purge); the runner used to pause its whole interval after one
    that stopped with rows left, capping what it could ever delete, and a purge that raised ended the
    sweep for the purges after it (found by review)."""
    calls: list[str] = []

    async def failing(*, before_ms: int, limit: int) -> int:
        calls.append("failing")
        raise RuntimeError("this table is broken")

    async def endless(*, before_ms: int, limit: int) -> int:
        calls.append("endless")
        return limit  # always a full batch: more is left

    async def done(*, before_ms: int, limit: int) -> int:
        calls.append("done")
        return 0

    sweeper = RetentionSweeper(
        DatabaseMaintenanceLock(database), [failing, endless, done],
        retention_ms=DAY, batch_size=5, clock=Clock(T0), max_batches=3,
    )  # fmt: skip
    assert await sweeper.sweep() == 15
    assert calls == ["failing", "endless", "endless", "endless", "done"]
    assert sweeper.behind
    sweeper.purges = [done]
    assert await sweeper.sweep() == 0 and not sweeper.behind
