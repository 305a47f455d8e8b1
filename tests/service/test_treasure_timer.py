"""The durable local treasure timer: schedule, restart, fire once, too-early, backoff, leases, runner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from structlog.testing import capture_logs
from tests.service.conftest import Clock, RuntimeFactory
from tests.service.helpers import APP, count, run

from roomservice import errors
from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.domain.events import Event, RoomTreasureCountdownStarted, RoomUserJoined
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.timers.treasure import (
    DatabaseTreasureTimer,
    FireReport,
    Opener,
    TreasureTimerRunner,
    backoff_ms,
    due_select,
)
from roomservice.wire import decode_event

COUNTDOWN = "RoomTreasureCountdownStarted"
OPENED = "RoomTreasureOpened"
tt = t.treasure_timer


# --------------------------------------------------------------------------- helpers


async def start_countdown(rt: Process, room: str = "r1") -> Event:
    """Open a room with bob, send a rocket past the first threshold; the committed countdown event."""
    await run(rt, room, f"{room}-create", c.CreateRoom(owner_id="owner", title="Room"))
    await run(rt, room, f"{room}-join-bob", c.JoinRoom(user_id="bob"))
    price = rt.service.rules.gifts["rocket"].price
    needed = -(-rt.service.rules.treasure_levels[0] // price)
    await run(
        rt, room, f"{room}-gift", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rocket", count=needed)
    )
    async with rt.db.read() as conn:
        payloads = (
            await conn.scalars(
                sa.select(t.room_outbox.c.payload).where(
                    t.room_outbox.c.room_id == room, t.room_outbox.c.event_type == COUNTDOWN
                )
            )
        ).all()
    assert len(payloads) == 1
    return decode_event(payloads[0])


def countdown_event(room: str, box: str, open_at_ms: int, *, level: int = 1) -> Event:
    return Event(
        event_id=f"ev-{room}-{box}",
        app_code=APP,
        room_id=room,
        room_version=3,
        occurred_at_ms=open_at_ms - 60_000,
        payload=RoomTreasureCountdownStarted(
            box_id=box, level=level, open_at_ms=open_at_ms, open_command_id=c.treasure_open_command_id(box)
        ),
    )


async def timer_row(db: Database, room: str, box: str) -> Any:
    async with db.read() as conn:
        return (
            await conn.execute(sa.select(tt).where(tt.c.app_code == APP, tt.c.room_id == room, tt.c.box_id == box))
        ).one()


async def set_fire_at(db: Database, room: str, box: str, fire_at_ms: int) -> None:
    async with db.write() as conn:
        await conn.execute(
            sa.update(tt)
            .where(tt.c.app_code == APP, tt.c.room_id == room, tt.c.box_id == box)
            .values(fire_at_ms=fire_at_ms)
        )


async def opened_rows(rt: Process, room: str = "r1") -> int:
    return await count(rt, t.room_outbox, t.room_outbox.c.room_id == room, t.room_outbox.c.event_type == OPENED)


class Recorder:
    """A fake opener: records calls, answers from a script (exceptions raised), then succeeds."""

    def __init__(self, *script: BaseException | None) -> None:
        self.calls: list[tuple[str, str, str, c.OpenTreasure]] = []
        self.script = list(script)
        self.called = asyncio.Event()
        self.before: Callable[[], Awaitable[None]] | None = None

    async def __call__(self, app_code: str, room_id: str, command_id: str, command: c.OpenTreasure) -> object:
        self.calls.append((app_code, room_id, command_id, command))
        self.called.set()
        await asyncio.sleep(0)  # let concurrent claimers interleave
        if self.before is not None:
            await self.before()
        answer = self.script.pop(0) if self.script else None
        if answer is not None:
            raise answer
        return {"events": []}


# --------------------------------------------------------------------------- end to end on a Process


async def test_countdown_survives_restart_and_opens_once(runtime_factory: RuntimeFactory, clock: Clock) -> None:
    async with runtime_factory() as rt:
        event = await start_countdown(rt)
        payload = event.payload
        assert isinstance(payload, RoomTreasureCountdownStarted)
        timer = DatabaseTreasureTimer(rt.db, clock=clock, owner="before-restart")
        await timer.schedule(event)
        assert await timer.fire_due(rt.service.execute) == FireReport()  # not due yet
        assert await timer.next_fire_at() == payload.open_at_ms

    clock.now_ms = payload.open_at_ms + 1
    async with runtime_factory() as rt:  # a new process on the same database
        timer = DatabaseTreasureTimer(rt.db, clock=clock, owner="after-restart")
        assert await timer.fire_due(rt.service.execute) == FireReport(fired=1)
        treasure = (await rt.service.room(APP, "r1"))["treasure"]
        assert treasure["level"] == 1
        assert treasure["box_id"] is None
        assert treasure["state"] == "idle"
        assert await opened_rows(rt) == 1
        row = await timer_row(rt.db, "r1", payload.box_id)
        assert (row.status, row.lock_owner, row.command_id) == ("fired", None, payload.open_command_id)
        assert await timer.next_fire_at() is None
        assert await timer.fire_due(rt.service.execute) == FireReport()


async def test_too_early_is_rescheduled_at_open_at(runtime: Process, clock: Clock) -> None:
    event = await start_countdown(runtime)
    payload = event.payload
    assert isinstance(payload, RoomTreasureCountdownStarted)
    timer = DatabaseTreasureTimer(runtime.db, clock=clock, owner="w1")
    await timer.schedule(event)
    await set_fire_at(runtime.db, "r1", payload.box_id, clock.now_ms - 5)  # deliberately early

    assert await timer.fire_due(runtime.service.execute) == FireReport(rescheduled=1)
    row = await timer_row(runtime.db, "r1", payload.box_id)
    assert (row.status, row.fire_at_ms, row.attempts, row.lock_owner) == ("scheduled", payload.open_at_ms, 0, None)
    assert await opened_rows(runtime) == 0
    assert await timer.fire_due(runtime.service.execute) == FireReport()

    clock.now_ms = payload.open_at_ms
    assert await timer.fire_due(runtime.service.execute) == FireReport(fired=1)
    assert await opened_rows(runtime) == 1


async def test_duplicate_wakeups_are_noops(runtime: Process, clock: Clock) -> None:
    event = await start_countdown(runtime)
    payload = event.payload
    assert isinstance(payload, RoomTreasureCountdownStarted)
    timer = DatabaseTreasureTimer(runtime.db, clock=clock, owner="w1")
    await timer.schedule(event)
    await timer.schedule(event)  # the outbox worker retried
    assert await count(runtime, tt) == 1

    clock.now_ms = payload.open_at_ms + 10
    assert await timer.fire_due(runtime.service.execute) == FireReport(fired=1)
    await timer.schedule(event)  # a late duplicate schedule changes nothing
    assert await timer.fire_due(runtime.service.execute) == FireReport()

    # a wake-up for a box that already opened (e.g. a second timer row), from another instance
    async with runtime.db.write() as conn:
        await conn.execute(sa.update(tt).values(status="scheduled", fire_at_ms=clock.now_ms))
    other = DatabaseTreasureTimer(runtime.db, clock=clock, owner="w2")
    assert await other.fire_due(runtime.service.execute) == FireReport(fired=1)
    assert await opened_rows(runtime) == 1
    assert (await runtime.service.room(APP, "r1"))["treasure"]["level"] == 1


async def test_closed_room_wakeup_fires_as_noop(runtime: Process, clock: Clock) -> None:
    event = await start_countdown(runtime)
    payload = event.payload
    assert isinstance(payload, RoomTreasureCountdownStarted)
    timer = DatabaseTreasureTimer(runtime.db, clock=clock, owner="w1")
    await timer.schedule(event)
    await run(runtime, "r1", "close", c.CloseRoom(operator_id="owner"))

    clock.now_ms = payload.open_at_ms + 1
    assert await timer.fire_due(runtime.service.execute) == FireReport(fired=1)
    assert (await timer_row(runtime.db, "r1", payload.box_id)).status == "fired"
    assert await opened_rows(runtime) == 0


# --------------------------------------------------------------------------- fake openers, both backends


async def test_retryable_errors_back_off_then_fire(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="w1")
    await timer.schedule(countdown_event("r1", "d-1", clock.now_ms))
    opener = Recorder(errors.Unavailable(), errors.Retry(), RuntimeError("boom"))

    with capture_logs() as logs:
        assert await timer.fire_due(opener) == FireReport(failed=1)
        row = await timer_row(database, "r1", "d-1")
        assert (row.status, row.attempts, row.fire_at_ms, row.lock_owner) == ("scheduled", 1, clock.now_ms + 1000, None)
        assert await timer.fire_due(opener) == FireReport()  # not due yet

        clock.advance(1000)
        assert await timer.fire_due(opener) == FireReport(failed=1)
        row = await timer_row(database, "r1", "d-1")
        assert (row.attempts, row.fire_at_ms) == (2, clock.now_ms + 2000)

        clock.advance(2000)
        assert await timer.fire_due(opener) == FireReport(failed=1)
        assert (await timer_row(database, "r1", "d-1")).fire_at_ms == clock.now_ms + 4000

        clock.advance(4000)
        assert await timer.fire_due(opener) == FireReport(fired=1)
    assert (await timer_row(database, "r1", "d-1")).status == "fired"
    assert len(opener.calls) == 4
    assert {call[2] for call in opener.calls} == {"treasure-open:d-1"}
    assert opener.calls[0][3] == c.OpenTreasure(box_id="d-1", level=1, open_at_ms=clock.now_ms - 7000)
    failures = [entry for entry in logs if entry["event"] == "treasure_wakeup_failed"]
    assert [entry["attempt"] for entry in failures] == [1, 2, 3]  # one line per attempt


def test_backoff_doubles_from_one_second_capped_at_a_minute() -> None:
    assert [backoff_ms(n) for n in range(8)] == [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000]
    assert backoff_ms(10_000) == 60_000


async def test_permanent_error_fires_with_warning(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="w1")
    await timer.schedule(countdown_event("gone", "d-1", clock.now_ms))
    with capture_logs() as logs:
        assert await timer.fire_due(Recorder(errors.RoomNotFound())) == FireReport(fired=1)
    assert (await timer_row(database, "gone", "d-1")).status == "fired"
    assert [e["log_level"] for e in logs if e["event"] == "treasure_wakeup_dropped"] == ["warning"]


@pytest.mark.parametrize(
    "answer",
    [errors.RoomServiceError("internal error"), errors.Unauthorized("wrong peer secret")],
    ids=["internal", "unauthorized"],
)
async def test_a_failure_at_the_rooms_owner_is_retried_not_fired(
    database: Database, clock: Clock, answer: errors.RoomServiceError
) -> None:
    """Over the gRPC hop an owner's unexpected exception comes back as ``internal``: retried like the
    same exception here, never fired (found by review: the box never opened)."""
    timer = DatabaseTreasureTimer(database, clock=clock, owner="w1")
    await timer.schedule(countdown_event("r1", "d-1", clock.now_ms))
    assert await timer.fire_due(Recorder(answer)) == FireReport(failed=1)
    row = await timer_row(database, "r1", "d-1")
    assert (row.status, row.attempts) == ("scheduled", 1)


async def test_two_instances_never_fire_the_same_timer(database: Database, backend_url: str, clock: Clock) -> None:
    second_db = Database.from_url(backend_url, pool_size=5, max_overflow=5)  # a second "process"
    try:
        a = DatabaseTreasureTimer(database, clock=clock, owner="a")
        b = DatabaseTreasureTimer(second_db, clock=clock, owner="b")
        for i in range(40):
            await a.schedule(countdown_event(f"room{i % 7}", f"box-{i}", clock.now_ms - i))
        opener = Recorder()
        reports: list[FireReport] = []
        for _round in range(10):
            reports += await asyncio.gather(*(x.fire_due(opener, limit=7) for x in (a, b, a, b)))
        boxes = [call[3].box_id for call in opener.calls]
        assert sorted(boxes) == sorted(f"box-{i}" for i in range(40))  # each exactly once
        assert sum(r.fired for r in reports) == 40
        assert await a.next_fire_at() is None
    finally:
        await second_db.dispose()


async def test_expired_lease_is_overtaken_and_late_finish_changes_nothing(database: Database, clock: Clock) -> None:
    a = DatabaseTreasureTimer(database, clock=clock, owner="a")
    b = DatabaseTreasureTimer(database, clock=clock, owner="b")
    await a.schedule(countdown_event("r1", "d-1", clock.now_ms))
    b_opener = Recorder()
    a_opener = Recorder(errors.Unavailable())  # a stalls past its lease, then fails

    async def stall() -> None:
        assert await b.fire_due(b_opener) == FireReport()  # a's lease is live: nothing to take
        clock.advance(1_001)
        assert await b.fire_due(b_opener) == FireReport(fired=1)

    a_opener.before = stall
    await a.fire_due(a_opener, lock_ms=1_000)
    row = await timer_row(database, "r1", "d-1")
    assert (row.status, row.attempts, row.lock_owner) == ("fired", 0, None)  # a's retry did not land
    assert len(b_opener.calls) == 1


async def test_cancelled_pass_hands_claims_back(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="a")
    for i in range(3):
        await timer.schedule(countdown_event("r1", f"d-{i}", clock.now_ms))
    opener = Recorder()
    hang = asyncio.Event()

    async def block() -> None:
        await hang.wait()

    opener.before = block
    task = asyncio.create_task(timer.fire_due(opener))
    await asyncio.wait_for(opener.called.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await timer.next_fire_at() == clock.now_ms  # due again now, not after the 30 s lease
    opener.before = None
    assert await timer.fire_due(opener) == FireReport(fired=3)


async def test_purge_fired_is_bounded(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="a")
    for i in range(5):
        await timer.schedule(countdown_event("r1", f"d-{i}", clock.now_ms))
    await timer.schedule(countdown_event("r1", "later", clock.now_ms + 60_000))
    assert await timer.fire_due(Recorder()) == FireReport(fired=5)
    clock.advance(10)
    assert await timer.purge_fired(before_ms=clock.now_ms, limit=3) == 3
    assert await timer.purge_fired(before_ms=clock.now_ms, limit=3) == 2
    assert await timer.purge_fired(before_ms=clock.now_ms, limit=3) == 0
    assert (await timer_row(database, "r1", "later")).status == "scheduled"


async def test_schedule_rejects_other_events(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="a")
    event = countdown_event("r1", "d-1", clock.now_ms)
    other = Event(event.event_id, APP, "r1", 1, clock.now_ms, RoomUserJoined(user_id="x", role="member"))
    with pytest.raises(TypeError):
        await timer.schedule(other)


async def test_claim_sql(database: Database, clock: Clock) -> None:
    compiled = str(due_select(skip_locked=True).compile(dialect=mysql.dialect()))
    assert "FOR UPDATE SKIP LOCKED" in compiled

    timer = DatabaseTreasureTimer(database, clock=clock, owner="a")
    await timer.schedule(countdown_event("r1", "d-1", clock.now_ms))
    statements: list[str] = []
    engine = database.engine.sync_engine if database.dialect_name == "mysql" else database._sync_engine
    assert engine is not None

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        assert await timer.fire_due(Recorder()) == FireReport(fired=1)
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    claim = next(s for s in statements if s.startswith("SELECT") and "treasure_timer" in s)
    if database.dialect_name == "mysql":
        assert claim.endswith("FOR UPDATE SKIP LOCKED")
    else:
        assert statements[statements.index(claim) - 1] == "BEGIN IMMEDIATE"


# --------------------------------------------------------------------------- the runner


class CountingTimer(DatabaseTreasureTimer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.passes = 0
        self.passed = asyncio.Event()

    async def fire_due(self, opener: Opener, *, limit: int = 100, lock_ms: int = 30_000) -> FireReport:
        report = await super().fire_due(opener, limit=limit, lock_ms=lock_ms)
        self.passes += 1
        self.passed.set()
        return report


async def test_runner_wakes_on_schedule_and_stops(database: Database, clock: Clock) -> None:
    timer = CountingTimer(database, clock=clock, owner="runner")
    opener = Recorder()
    runner = TreasureTimerRunner(timer, opener, idle_s=30)  # only wake() can make it prompt
    timer.on_scheduled = runner.wake
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(timer.passed.wait(), 5)  # first (empty) pass done: now idle
        assert opener.calls == []
        await timer.schedule(countdown_event("r1", "d-1", clock.now_ms))
        await asyncio.wait_for(opener.called.wait(), 5)
        assert [call[3].box_id for call in opener.calls] == ["d-1"]
    finally:
        runner.stop()
        await asyncio.wait_for(task, 5)
    assert (await timer_row(database, "r1", "d-1")).status == "fired"


async def test_runner_sleeps_until_next_fire_at(database: Database, clock: Clock) -> None:
    timer = DatabaseTreasureTimer(database, clock=clock, owner="runner")
    await timer.schedule(countdown_event("r1", "d-1", clock.now_ms + 200))  # due in 200 ms
    opener = Recorder()
    runner = TreasureTimerRunner(timer, opener, idle_s=30)  # never woken: the fire_at sets the sleep
    task = asyncio.create_task(runner.run())
    try:
        clock.advance(200)  # fake time passes; the runner's ~0.2 s real sleep ends and it fires
        await asyncio.wait_for(opener.called.wait(), 5)
    finally:
        runner.stop()
        await asyncio.wait_for(task, 5)
    assert len(opener.calls) == 1


class FlakyTimer(CountingTimer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed = asyncio.Event()

    async def fire_due(self, opener: Opener, *, limit: int = 100, lock_ms: int = 30_000) -> FireReport:
        if not self.failed.is_set():
            self.failed.set()
            raise RuntimeError("database hiccup")
        return await super().fire_due(opener, limit=limit, lock_ms=lock_ms)


async def test_runner_survives_a_failing_pass(database: Database, clock: Clock) -> None:
    timer = FlakyTimer(database, clock=clock, owner="runner")
    opener = Recorder()
    runner = TreasureTimerRunner(timer, opener, idle_s=30)
    timer.on_scheduled = runner.wake
    task = asyncio.create_task(runner.run())
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(timer.failed.wait(), 5)
            await timer.schedule(countdown_event("r1", "d-1", clock.now_ms))
            await asyncio.wait_for(opener.called.wait(), 5)
    finally:
        runner.stop()
        await asyncio.wait_for(task, 5)
    assert [e["event"] for e in logs].count("treasure_timer_pass_failed") == 1
