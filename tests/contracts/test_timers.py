"""Contract suite of the treasure scheduler port (``roomservice.timers.port``), one subclass per adapter.

A scheduler is driven through a :class:`SchedulerDriver`: the port itself only
schedules, and each adapter fires its wake-ups its own way (the database timer
through ``fire_due(opener)`` with a clock, the fake through ``fire_due(now_ms)``,
the broker's delay messages through a fetch of the treasure-open group on the
broker's clock). An adapter's suite
subclasses :class:`TreasureSchedulerContract` (scheduling, firing times,
idempotency) and, if its wake-ups outlive the object, :class:`DurableSchedulerContract`
(a new scheduler object on the same storage — a restarted process — fires them).

The database timer and the delay-message scheduler on the embedded broker run on
SQLite and MariaDB through the ``database`` fixture; the fake passes the
scheduling part.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import ClassVar, Protocol

import pytest
import pytest_asyncio

from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.domain.commands import OpenTreasure, treasure_open_command_id
from roomservice.domain.events import Event, RoomTreasureCountdownStarted, RoomUserJoined
from roomservice.errors import Unavailable
from roomservice.store.database import Database
from roomservice.timers.delay_message import DelayMessageScheduler, TreasureWakeup
from roomservice.timers.fake import FakeTreasureScheduler
from roomservice.timers.port import TreasureScheduler
from roomservice.timers.treasure import DatabaseTreasureTimer

APP, OTHER_APP = "app_1", "app_2"
T0 = 1_780_000_000_000
OPEN_AT = T0 + 60_000

Fired = tuple[str, str, str, int, str]
"""A wake-up as it fired: (app_code, room_id, box_id, level, command_id)."""


def countdown(
    room: str = "room-1",
    box: str = "box-1",
    open_at_ms: int = OPEN_AT,
    *,
    app: str = APP,
    level: int = 1,
    event_id: str | None = None,
) -> Event:
    return Event(
        event_id=event_id or f"ev-{app}-{room}-{box}",
        app_code=app,
        room_id=room,
        room_version=3,
        occurred_at_ms=open_at_ms - 60_000,
        payload=RoomTreasureCountdownStarted(
            box_id=box, level=level, open_at_ms=open_at_ms, open_command_id=treasure_open_command_id(box)
        ),
    )


def fired(event: Event) -> Fired:
    p = event.payload
    assert isinstance(p, RoomTreasureCountdownStarted)
    return (event.app_code, event.room_id, p.box_id, p.level, p.open_command_id)


class SchedulerDriver(Protocol):
    scheduler: TreasureScheduler

    async def fire_due(self, now_ms: int) -> list[Fired]:
        """Fire what is due at ``now_ms``; the wake-ups that fired."""
        ...


class DurableDriver(SchedulerDriver, Protocol):
    async def reopen(self) -> SchedulerDriver:
        """A new scheduler object on the same storage, as a restarted (or another) process has."""
        ...


class TreasureSchedulerContract:
    """What every :class:`TreasureScheduler` promises: idempotent per box, fires at/after open_at_ms, once."""

    __test__: ClassVar[bool] = False

    @pytest.fixture
    def driver(self) -> SchedulerDriver:
        raise NotImplementedError("an adapter's suite provides the driver")

    async def test_a_wakeup_fires_at_open_at_and_not_before(self, driver: SchedulerDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        assert await driver.fire_due(T0) == []
        assert await driver.fire_due(OPEN_AT - 1) == []
        assert await driver.fire_due(OPEN_AT) == [fired(event)]

    async def test_a_late_pass_still_fires_an_overdue_wakeup(self, driver: SchedulerDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        assert await driver.fire_due(OPEN_AT + 3_600_000) == [fired(event)]

    async def test_a_wakeup_fires_once(self, driver: SchedulerDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        assert await driver.fire_due(OPEN_AT) == [fired(event)]
        assert await driver.fire_due(OPEN_AT + 1) == []
        assert await driver.fire_due(OPEN_AT + 600_000) == []

    async def test_schedule_is_idempotent_per_box(self, driver: SchedulerDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        await driver.scheduler.schedule(event)  # the outbox worker retried the row
        await driver.scheduler.schedule(countdown(event_id="a-repair-of-the-countdown"))  # another event, same box
        assert await driver.fire_due(OPEN_AT) == [fired(event)]

    async def test_a_duplicate_after_firing_does_not_fire_again(self, driver: SchedulerDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        assert await driver.fire_due(OPEN_AT) == [fired(event)]
        await driver.scheduler.schedule(event)  # a late retry of the row
        assert await driver.fire_due(OPEN_AT + 1_000) == []

    async def test_the_first_schedule_of_a_box_wins(self, driver: SchedulerDriver) -> None:
        first = countdown(open_at_ms=OPEN_AT)
        await driver.scheduler.schedule(first)
        await driver.scheduler.schedule(countdown(open_at_ms=OPEN_AT + 5_000, event_id="other"))
        assert await driver.fire_due(OPEN_AT) == [fired(first)]
        assert await driver.fire_due(OPEN_AT + 5_000) == []

    async def test_boxes_rooms_and_apps_are_independent(self, driver: SchedulerDriver) -> None:
        events = [
            countdown("room-1", "box-1", OPEN_AT),
            countdown("room-1", "box-2", OPEN_AT + 1_000, level=2),
            countdown("room-2", "box-1", OPEN_AT + 2_000),  # the same box id in another room
            countdown("room-1", "box-1", OPEN_AT + 3_000, app=OTHER_APP),  # the same room id in another app
        ]
        for event in events:
            await driver.scheduler.schedule(event)
        assert await driver.fire_due(OPEN_AT) == [fired(events[0])]
        assert await driver.fire_due(OPEN_AT + 1_999) == [fired(events[1])]
        assert sorted(await driver.fire_due(OPEN_AT + 3_000)) == sorted([fired(events[2]), fired(events[3])])
        assert await driver.fire_due(OPEN_AT + 10_000) == []

    async def test_other_events_are_refused_and_schedule_nothing(self, driver: SchedulerDriver) -> None:
        other = Event("ev-join", APP, "room-1", 2, T0, RoomUserJoined(user_id="bob", role="member"))
        with pytest.raises(TypeError):
            await driver.scheduler.schedule(other)
        assert await driver.fire_due(OPEN_AT + 3_600_000) == []


class DurableSchedulerContract(TreasureSchedulerContract):
    """Once ``schedule`` returns the wake-up is durable: another scheduler object on the same storage fires it."""

    __test__: ClassVar[bool] = False

    @pytest.fixture
    def driver(self) -> DurableDriver:
        raise NotImplementedError("an adapter's suite provides the driver")

    async def test_a_scheduled_wakeup_survives_the_scheduler(self, driver: DurableDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        restarted = await driver.reopen()
        assert await restarted.fire_due(OPEN_AT - 1) == []
        assert await restarted.fire_due(OPEN_AT) == [fired(event)]
        assert await driver.fire_due(OPEN_AT + 1_000) == []  # fired once, whichever process fired it

    async def test_idempotency_holds_across_scheduler_objects(self, driver: DurableDriver) -> None:
        event = countdown()
        other = await driver.reopen()
        await driver.scheduler.schedule(event)
        await other.scheduler.schedule(event)  # two workers delivered the same row
        fired_here = await driver.fire_due(OPEN_AT)
        fired_there = await other.fire_due(OPEN_AT)
        assert fired_here + fired_there == [fired(event)]

    async def test_a_box_fired_elsewhere_is_not_rescheduled_by_a_late_duplicate(self, driver: DurableDriver) -> None:
        event = countdown()
        await driver.scheduler.schedule(event)
        other = await driver.reopen()
        assert await other.fire_due(OPEN_AT) == [fired(event)]
        await driver.scheduler.schedule(event)
        assert await driver.fire_due(OPEN_AT + 1_000) == []
        assert await other.fire_due(OPEN_AT + 1_000) == []


# --------------------------------------------------------------------------- adapters


class FakeDriver:
    def __init__(self) -> None:
        self.scheduler = FakeTreasureScheduler()

    async def fire_due(self, now_ms: int) -> list[Fired]:
        return [(w.app_code, w.room_id, w.box_id, w.level, w.command_id) for w in self.scheduler.fire_due(now_ms)]


class TestFakeTreasureScheduler(TreasureSchedulerContract):
    __test__ = True

    @pytest.fixture
    def driver(self) -> FakeDriver:
        return FakeDriver()


class _Clock:
    def __init__(self) -> None:
        self.now_ms = T0

    def __call__(self) -> int:
        return self.now_ms


class DatabaseDriver:
    """A :class:`DatabaseTreasureTimer` (one "process") whose opener records what fired."""

    def __init__(self, db: Database, url: str, *, owner: str, opened: list[Database]) -> None:
        self.db = db
        self.url = url
        self.clock = _Clock()
        self.scheduler = DatabaseTreasureTimer(db, clock=self.clock, owner=owner)
        self._opened = opened

    async def fire_due(self, now_ms: int) -> list[Fired]:
        self.clock.now_ms = now_ms
        calls: list[Fired] = []

        async def opener(app_code: str, room_id: str, command_id: str, command: OpenTreasure) -> object:
            assert command.open_at_ms <= now_ms  # never woken before its time
            calls.append((app_code, room_id, command.box_id, command.level, command_id))
            return {"events": []}

        report = await self.scheduler.fire_due(opener)
        assert report.fired == len(calls)
        return calls

    async def reopen(self) -> DatabaseDriver:
        db = Database.from_url(self.url, pool_size=2, max_overflow=2)  # its own engine and pool
        self._opened.append(db)
        return DatabaseDriver(db, self.url, owner=f"process-{len(self._opened) + 1}", opened=self._opened)


@pytest_asyncio.fixture
async def extra_databases() -> AsyncIterator[list[Database]]:
    """Engines opened by :meth:`DatabaseDriver.reopen`, disposed after the test."""
    opened: list[Database] = []
    try:
        yield opened
    finally:
        for db in opened:
            await db.dispose()


class TestDatabaseTreasureTimer(DurableSchedulerContract):
    __test__ = True

    @pytest.fixture
    def driver(self, database: Database, backend_url: str, extra_databases: list[Database]) -> DatabaseDriver:
        return DatabaseDriver(database, backend_url, owner="process-1", opened=extra_databases)


TREASURE_TOPIC, TREASURE_GROUP = "hyapp_room_treasure_open", "hyapp-room-treasure-open"


class DelayMessageDriver:
    """A :class:`DelayMessageScheduler` on an :class:`EmbeddedBroker` whose clock the test sets.

    A wake-up fires when the treasure-open group can fetch it (the broker holds a delay message
    until its ``deliver_at_ms``); firing acknowledges it, as the consumer runtime does once the
    room answered. Idempotency per box is the broker's: the message key is the box, and a
    re-publish of a retained key is stored once."""

    def __init__(self, db: Database, *, clock: _Clock | None = None, opened: list[EmbeddedBroker]) -> None:
        self.db = db
        self.clock = clock or _Clock()
        self.broker = EmbeddedBroker(db, clock=self.clock)
        self.opened = opened
        opened.append(self.broker)
        self.scheduler = DelayMessageScheduler(self.broker, topic=TREASURE_TOPIC, publish_timeout_s=5)

    async def declare(self) -> DelayMessageDriver:
        await self.broker.declare_group(TREASURE_TOPIC, TREASURE_GROUP, max_deliveries=3)
        return self

    async def fire_due(self, now_ms: int) -> list[Fired]:
        self.clock.now_ms = now_ms
        calls: list[Fired] = []
        while got := await self.broker.fetch(
            TREASURE_TOPIC, TREASURE_GROUP, max_messages=10, wait_s=0, visibility_s=30
        ):
            for delivery in got:
                wakeup = TreasureWakeup.decode(delivery.body)
                assert wakeup.open_at_ms <= now_ms  # never delivered before its time
                calls.append((wakeup.app_code, wakeup.room_id, wakeup.box_id, wakeup.level, wakeup.command_id))
                await self.broker.ack(delivery)
        return calls

    async def reopen(self) -> DelayMessageDriver:
        """Another broker object on the same database (a restarted process), on the same clock."""
        return await DelayMessageDriver(self.db, clock=self.clock, opened=self.opened).declare()


class TestDelayMessageScheduler(DurableSchedulerContract):
    __test__ = True

    @pytest_asyncio.fixture
    async def driver(self, database: Database) -> AsyncIterator[DelayMessageDriver]:
        opened: list[EmbeddedBroker] = []
        yield await DelayMessageDriver(database, opened=opened).declare()
        for broker in opened:
            await broker.close()


# --------------------------------------------------------------------------- the fake's own controls


async def test_fake_counts_schedules_and_can_be_down() -> None:
    fake = FakeTreasureScheduler()
    event = countdown()
    await fake.schedule(event)
    await fake.schedule(event)
    assert fake.calls == 2
    assert list(fake.scheduled) == [(APP, "room-1", "box-1")]
    assert fake.next_fire_at() == OPEN_AT
    fake.down = True
    with pytest.raises(Unavailable):
        await fake.schedule(countdown(box="box-2"))
    assert list(fake.scheduled) == [(APP, "room-1", "box-1")]
    assert [w.box_id for w in fake.fire_due(OPEN_AT)] == ["box-1"]
    assert [w.box_id for w in fake.fired] == ["box-1"]
    assert fake.next_fire_at() is None
