"""The outbox worker on a real database (SQLite and MariaDB) with scriptable publishers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs
from tests.service.conftest import T0, Clock

from roomservice.domain import events as e
from roomservice.outbox.model import BROKER, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PublisherSet
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.wire import encode_event

INITIAL, CAP = 1_000, 8_000


def make_event(payload: e.EventPayload, *, room: str = "r1", version: int = 1, at: int = T0) -> e.Event:
    return e.Event(uuid.uuid4().hex, "demo", room, version, at, payload)


JOINED = e.RoomUserJoined(user_id="bob", role="member")


async def insert_rows(db: Database, *events: e.Event, status: str = "pending", now: int = T0) -> None:
    async with db.write() as conn:
        await conn.execute(
            sa.insert(t.room_outbox),
            [
                dict(event_id=ev.event_id, app_code=ev.app_code, room_id=ev.room_id, room_version=ev.room_version,
                     event_type=ev.type, payload=encode_event(ev), status=status, retry_count=0,
                     targets_done="", due_at_ms=now, created_at_ms=now, updated_at_ms=now)
                for ev in events
            ],
        )


async def row(db: Database, event_id: str) -> sa.Row[tuple[object, ...]]:
    async with db.read() as conn:
        return (await conn.execute(sa.select(t.room_outbox).where(t.room_outbox.c.event_id == event_id))).one()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def im() -> FakePublisher:
    return FakePublisher("im")


@pytest.fixture
def activity() -> FakePublisher:
    return FakePublisher("activity")


@pytest.fixture
def broker() -> FakePublisher:
    return FakePublisher(BROKER)


WorkerFactory = Callable[..., OutboxWorker]


@pytest.fixture
def make_worker(
    database: Database, clock: Clock, im: FakePublisher, activity: FakePublisher, broker: FakePublisher
) -> WorkerFactory:
    def factory(mode: PublishMode = PublishMode.DIRECT, *, max_retry_count: int = 10, **options: float) -> OutboxWorker:
        return OutboxWorker(
            repository=SqlOutboxRepository(database),
            publishers=PublisherSet({"im": im, "activity": activity, BROKER: broker}),
            policy=RetryPolicy(
                initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=max_retry_count, jitter=0
            ),
            options=WorkerOptions(mode=mode, **options),  # type: ignore[arg-type]
            clock=clock,
        )

    return factory


async def test_delivered_when_every_target_succeeds(
    database: Database, make_worker: WorkerFactory, im: FakePublisher, activity: FakePublisher, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    clock.advance(25)
    assert await make_worker().run_once() == 1
    r = await row(database, ev.event_id)
    assert (r.status, r.targets_done, r.delivered_at_ms, r.lock_owner, r.retry_count) == (
        "delivered", "activity,im", T0 + 25, None, 0,
    )
    assert im.delivered == activity.delivered == [ev.event_id]


async def test_backoff_schedule_then_dead_letter(
    database: Database, make_worker: WorkerFactory, im: FakePublisher, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    im.down = True
    worker = make_worker(max_retry_count=5)
    waits = []
    with capture_logs() as logs:
        for attempt in range(1, 6):
            assert await worker.run_once() == 1
            r = await row(database, ev.event_id)
            assert r.retry_count == attempt
            if attempt < 5:
                assert r.status == "retryable"
                waits.append(r.next_retry_at_ms - clock.now_ms)
                clock.advance(waits[-1] - 1)
                assert await worker.run_once() == 0  # not due yet
                clock.advance(1)
        r = await row(database, ev.event_id)
        assert r.status == "failed"
        assert "im: im is down" in r.last_error
        clock.advance(10 * CAP)
        assert await worker.run_once() == 0  # a dead letter is never retried automatically
    assert waits == [1_000, 2_000, 4_000, 8_000]
    lines = [entry["event"] for entry in logs if entry["event"].startswith("outbox_")]
    assert lines == ["outbox_publish_failed"] * 4 + ["outbox_dead_letter"]  # one line per attempt


async def test_permanent_error_is_a_dead_letter_at_once(
    database: Database, make_worker: WorkerFactory, activity: FakePublisher
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    activity.permanent = True
    await make_worker().run_once()
    r = await row(database, ev.event_id)
    assert (r.status, r.retry_count, r.targets_done) == ("failed", 1, "im")


async def test_legacy_published_rows_count_as_delivered_and_are_never_written(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev, status="published")
    before = await row(database, ev.event_id)
    assert await make_worker().run_once() == 0
    assert await row(database, ev.event_id) == before
    assert im.calls == []


@pytest.mark.parametrize("mode", [PublishMode.DIRECT, PublishMode.DUAL])
async def test_a_retry_resends_only_the_failed_target(
    database: Database,
    make_worker: WorkerFactory,
    im: FakePublisher,
    activity: FakePublisher,
    broker: FakePublisher,
    clock: Clock,
    mode: PublishMode,
) -> None:
    ev = make_event(e.RoomGiftSent(sender_id="a", receiver_id="b", gift_id="rose", count=1, unit_price=10,
                                   total_value=10))
    await insert_rows(database, ev)
    im.fail_times = 3
    worker = make_worker(mode)
    for _ in range(4):
        assert await worker.run_once() == 1
        clock.advance(CAP)
    r = await row(database, ev.event_id)
    assert r.status == "delivered"
    assert len(im.calls) == 4
    assert activity.calls == [ev.event_id]  # called exactly once
    if mode is PublishMode.DUAL:
        assert broker.calls == [ev.event_id]
        assert r.targets_done == "activity,broker,im"
    else:
        assert broker.calls == []


async def test_mq_mode_needs_only_the_broker(
    database: Database, make_worker: WorkerFactory, im: FakePublisher, broker: FakePublisher
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    await make_worker(PublishMode.MQ).run_once()
    assert (await row(database, ev.event_id)).targets_done == "broker"
    assert broker.delivered == [ev.event_id] and im.calls == []


async def test_a_hanging_publisher_is_bounded_by_publish_timeout(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    im.hang = True
    started = time.monotonic()
    await make_worker(publish_timeout_s=0.05).run_once()
    assert time.monotonic() - started < 5  # far below the hang; bounded by the timeout
    r = await row(database, ev.event_id)
    assert r.status == "retryable" and "timed out" in r.last_error and r.targets_done == "activity"


async def test_missing_publisher_is_retryable_with_a_clear_error(database: Database, clock: Clock) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT),
        clock=clock,
    )
    await worker.run_once()
    r = await row(database, ev.event_id)
    assert r.status == "retryable" and "no publisher for target 'im'" in r.last_error


async def test_expired_claim_is_overtaken_and_the_late_finish_changes_nothing(
    database: Database, make_worker: WorkerFactory, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    slow, fast = make_worker(), make_worker()
    repo = SqlOutboxRepository(database)
    [claimed] = await repo.claim_due(owner=slow.owner, now_ms=clock.now_ms, lock_ms=1_000, limit=10)
    assert await repo.claim_due(owner=fast.owner, now_ms=clock.now_ms + 999, lock_ms=1_000, limit=10) == []
    clock.advance(1_001)  # the slow worker stalls past lock_until_ms
    assert await fast.run_once() == 1
    assert (await row(database, ev.event_id)).status == "delivered"
    outcome = await slow.deliver(claimed)
    await slow._finish([outcome])  # its late finish is guarded by the claim
    r = await row(database, ev.event_id)
    assert (r.status, r.delivered_at_ms) == ("delivered", clock.now_ms)


async def test_wake_delivers_without_waiting_for_the_poll(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    worker = make_worker(poll_interval_s=60)
    async with worker:
        await asyncio.sleep(0)  # let it reach its idle wait
        ev = make_event(JOINED)
        await insert_rows(database, ev)
        worker.wake()
        async with asyncio.timeout(10):
            await im.called.wait()  # delivered at once, not after the 60 s poll
            while (await row(database, ev.event_id)).status != "delivered":
                await asyncio.sleep(0.01)
    assert im.delivered == [ev.event_id]


async def test_shutdown_hands_unfinished_claims_back(
    database: Database, make_worker: WorkerFactory, im: FakePublisher, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    im.hang = True
    worker = make_worker(publish_timeout_s=60)
    async with worker:
        async with asyncio.timeout(10):
            await im.called.wait()
        assert (await row(database, ev.event_id)).status == "delivering"
    r = await row(database, ev.event_id)
    assert (r.status, r.lock_owner) == ("pending", None)
    im.hang = False
    assert await make_worker().run_once() == 1  # claimable at once, no lease to wait out


async def test_undecodable_payload_is_a_dead_letter(database: Database, make_worker: WorkerFactory) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    async with database.write() as conn:
        await conn.execute(sa.update(t.room_outbox).values(payload=b"\xff\x00garbage"))
    await make_worker().run_once()
    r = await row(database, ev.event_id)
    assert r.status == "failed" and "undecodable" in r.last_error


async def test_pending_only_claims_leave_due_retries_for_the_next_full_claim(database: Database, clock: Clock) -> None:
    fresh, retry = make_event(JOINED), make_event(JOINED)
    await insert_rows(database, fresh)
    await insert_rows(database, retry, status="retryable", now=clock.now_ms - 1)
    repo = SqlOutboxRepository(database)
    hinted = await repo.claim_due(owner="w", now_ms=clock.now_ms, lock_ms=1_000, limit=10, pending_only=True)
    if database.dialect_name == "mysql":
        assert [r.event_id for r in hinted] == [fresh.event_id]
        full = await repo.claim_due(owner="w", now_ms=clock.now_ms, lock_ms=1_000, limit=10)
        assert [r.event_id for r in full] == [retry.event_id]
    else:  # one statement claims every kind on SQLite: the hint costs nothing to ignore
        assert {r.event_id for r in hinted} == {fresh.event_id, retry.event_id}


async def test_a_busy_room_cannot_starve_the_others(
    database: Database, make_worker: WorkerFactory, clock: Clock
) -> None:
    """A batch publishes at most MAX_ROOM_LANE rows of one room and sends the rest to the back
    of the queue: a quiet room waits for one pass over the older rows, not for the busy room's
    whole backlog to be delivered eight rows at a time."""
    from roomservice.outbox.worker import MAX_ROOM_LANE

    busy = [make_event(JOINED, room="busy", version=n + 1) for n in range(60)]
    quiet = make_event(JOINED, room="quiet")
    await insert_rows(database, *busy)
    clock.advance(1)
    await insert_rows(database, quiet, now=clock.now_ms)
    worker = make_worker(batch_size=20)
    cycles = 0
    while (await row(database, quiet.event_id)).status != "delivered":
        cycles += 1
        assert cycles <= 4, "the quiet room is starved"  # 60 older rows / 20 per claim, then its turn
        clock.advance(1)
        await worker.run_once()
    async with database.read() as conn:
        delivered_busy = await conn.scalar(
            sa.select(sa.func.count()).select_from(t.room_outbox)
            .where(t.room_outbox.c.room_id == "busy", t.room_outbox.c.status == "delivered")
        )
    assert delivered_busy == cycles * MAX_ROOM_LANE < len(busy)


async def test_shutdown_releases_every_claim_of_the_owner(database: Database, make_worker: WorkerFactory) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    worker = make_worker()
    repo = SqlOutboxRepository(database)
    # a claim the worker never heard of (it committed as a cancel landed)
    await repo.claim_due(owner=worker.owner, now_ms=T0, lock_ms=60_000, limit=10)
    await worker.shutdown()
    r = await row(database, ev.event_id)
    assert (r.status, r.lock_owner) == ("pending", None)
