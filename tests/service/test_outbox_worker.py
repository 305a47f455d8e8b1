"""The outbox worker on a real database (SQLite and MariaDB) with scriptable publishers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs
from tests.service.conftest import T0, Clock

from roomservice.domain import events as e
from roomservice.observability.logging import get_logger
from roomservice.outbox.model import BROKER, ClaimedRow, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.repository import OutboxRepository
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerNotReady, WorkerOptions
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PublisherSet
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable
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
    def factory(
        mode: PublishMode = PublishMode.DIRECT,
        *,
        max_retry_count: int = 10,
        repository: OutboxRepository | None = None,
        clock_fn: Callable[[], int] | None = None,
        **options: float,
    ) -> OutboxWorker:
        return OutboxWorker(
            repository=repository or SqlOutboxRepository(database),
            publishers=PublisherSet({"im": im, "activity": activity, BROKER: broker}),
            policy=RetryPolicy(
                initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=max_retry_count, jitter=0
            ),
            options=WorkerOptions(mode=mode, **options),  # type: ignore[arg-type]
            clock=clock_fn or clock,
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
    await slow._finish(slow._decide([outcome]))  # its late finish is guarded by the claim
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


async def test_a_row_cancelled_while_its_later_target_publishes_is_cancelled_whatever_that_target_says(
    database: Database, clock: Clock
) -> None:
    """Cancelled once the first target (activity) answered, while IM still waits: the batch ends
    cancelled even though IM's publisher reports the abandoned request as an ordinary failure
    (awaiting IM's task directly, its result would have swallowed the batch's cancellation)."""
    await insert_rows(database, make_event(JOINED))
    worker, im, activity = paired_worker(database, clock, im_only=True)
    batch = asyncio.create_task(worker.run_once())
    deadline = time.monotonic() + 10
    while not (im.tasks and activity.ended) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert im.tasks and activity.ended == 1  # the first answered, the second still in flight
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert im.abandoned == 1


class ClaimCounting(SqlOutboxRepository):
    """The SQL repository, counting the claims begun and ended."""

    begun = ended = 0

    async def claim_due(self, **kwargs: Any) -> list[ClaimedRow]:
        self.begun += 1
        try:
            return await super().claim_due(**kwargs)
        finally:
            self.ended += 1


async def test_a_wake_up_reaches_the_idle_worker_on_the_loops_next_turn(
    database: Database, make_worker: WorkerFactory
) -> None:
    """Commit -> delivered starts with the wake-up: an idle worker claims on the loop's very next turn
    after wake() (waiting under wait_for, the wait's own task and wait_for's waiter took two more)."""
    repository = ClaimCounting(database)
    worker = make_worker(poll_interval_s=60, repository=repository)
    async with worker:
        async with asyncio.timeout(10):
            while not repository.ended:  # its first claim (nothing to claim) is over
                await asyncio.sleep(0.001)
        for _ in range(20):  # into its idle wait
            await asyncio.sleep(0)
        assert repository.begun == 1
        worker.wake()
        await asyncio.sleep(0)  # one turn: the worker's, scheduled by wake(), runs before this task's
        assert repository.begun == 2


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


async def delivered_in(db: Database, room_id: str) -> int:
    async with db.read() as conn:
        return int(
            await conn.scalar(
                sa.select(sa.func.count()).select_from(t.room_outbox)
                .where(t.room_outbox.c.room_id == room_id, t.room_outbox.c.status == "delivered")
            )
            or 0
        )


async def test_a_busy_room_cannot_starve_the_others(
    database: Database, make_worker: WorkerFactory, clock: Clock, im: FakePublisher
) -> None:
    """A batch whose time is up (slow publishes; here a zero lane budget) publishes MAX_ROOM_LANE
    rows of one room and sends the rest to the back of the queue: a quiet room waits for one pass
    over the older rows, not for the busy room's whole backlog to be delivered eight rows at a time."""
    from roomservice.outbox.worker import MAX_ROOM_LANE

    busy = [make_event(JOINED, room="busy", version=n + 1) for n in range(60)]
    quiet = make_event(JOINED, room="quiet")
    await insert_rows(database, *busy)
    clock.advance(1)
    await insert_rows(database, quiet, now=clock.now_ms)
    worker = make_worker(batch_size=20, lane_budget_s=0.0)
    cycles = 0
    while quiet.event_id not in im.delivered:
        cycles += 1
        assert cycles <= 4, "the quiet room is starved"  # 60 older rows / 20 per claim, then its turn
        clock.advance(1)
        await worker.run_once()
    busy_ids = {ev.event_id for ev in busy}
    assert sum(1 for event_id in im.delivered if event_id in busy_ids) == cycles * MAX_ROOM_LANE < len(busy)
    # the finish of a full batch rides on the next claim (claimed while that batch publishes):
    # the quiet row is marked delivered by the cycle after the one that published it
    for _ in range(2):
        if (await row(database, quiet.event_id)).status == "delivered":
            break
        await worker.run_once()
    assert (await row(database, quiet.event_id)).status == "delivered"


async def test_a_busy_rooms_rows_sent_to_the_back_of_the_queue_keep_their_order(
    database: Database, make_worker: WorkerFactory, clock: Clock, im: FakePublisher
) -> None:
    """The rows a busy room's lane never reached go to the back of the queue, and the room's later rows
    (pending, or already claimed ahead) behind them: its rows are still published in version order."""
    busy = [make_event(JOINED, room="busy", version=n + 1) for n in range(60)]
    await insert_rows(database, *busy)
    worker = make_worker(batch_size=20, lane_budget_s=0.0)  # MAX_ROOM_LANE rows a batch, the rest deferred
    for _ in range(40):
        if len(im.delivered) == len(busy):
            break
        clock.advance(1)
        await worker.run_once()
    versions = {ev.event_id: ev.room_version for ev in busy}
    assert [versions[event_id] for event_id in im.delivered] == list(range(1, 61))  # each once, in order


async def test_one_busy_room_drains_without_a_cycle_per_lane(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    """Every row of one room due at once: while publishes are fast (within the lane budget) a
    batch goes on past MAX_ROOM_LANE rows of the room, so the backlog takes a batch per
    ``batch_size`` rows, not a cycle per eight, and the next cycle never waits for the poll
    (60 s here: only the commit's wake-up or the worker's own hand-off can carry it)."""
    from roomservice.outbox.worker import MAX_ROOM_LANE

    rows, batch = 200, 50
    busy = [make_event(JOINED, room="busy", version=n + 1) for n in range(rows)]
    await insert_rows(database, *busy)
    worker = make_worker(batch_size=batch, poll_interval_s=60.0, lane_budget_s=60.0)
    async with worker:
        deadline = time.monotonic() + 10
        while (done := await delivered_in(database, "busy")) < rows:
            assert time.monotonic() < deadline, f"{done}/{rows} delivered"
            await asyncio.sleep(0.01)
    assert im.delivered == [ev.event_id for ev in busy]  # in the room's order, each once
    # a cycle per eight rows would be rows / MAX_ROOM_LANE = 25 batches
    assert worker.batches <= rows // batch + 1 < rows // MAX_ROOM_LANE


class GatedPublisher:
    """Every attempt waits (until its deadline at most) for ``width`` attempts to be in flight at
    once, then all go on; records the most in flight and the order of each room's rows."""

    def __init__(self, name: str, width: int) -> None:
        self.name, self.width = name, width
        self.in_flight = self.most_in_flight = 0
        self.opened = asyncio.Event()
        self.published: list[tuple[str, int]] = []

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.in_flight >= self.width:
                self.opened.set()
            async with asyncio.timeout_at(deadline):
                await self.opened.wait()
            self.published.append((event.room_id, event.room_version))
        finally:
            self.in_flight -= 1


async def test_rooms_are_published_side_by_side_up_to_publish_concurrency(database: Database, clock: Clock) -> None:
    """Rooms in parallel, each room's rows in version order: publishes that wait get up to
    publish_concurrency rooms in flight at once (the runners that take the lanes start one
    another as each waits), never more."""
    rooms, width = 7, 3
    await insert_rows(database, *(make_event(JOINED, room=f"r{r}", version=v) for r in range(rooms) for v in (1, 2)))
    gated = GatedPublisher(BROKER, width)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({BROKER: gated}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.MQ, batch_size=50, publish_concurrency=width, publish_timeout_s=5.0),
        clock=clock,
    )
    assert await worker.run_once() == 2 * rooms
    assert gated.most_in_flight == width  # the gate opened: that many at once, and never more
    assert sorted(gated.published) == [(f"r{r}", v) for r in range(rooms) for v in (1, 2)]  # each once
    for r in range(rooms):
        assert [v for room, v in gated.published if room == f"r{r}"] == [1, 2]
    assert await delivered_in_all(database) == 2 * rooms


class TaskCountingPublisher:
    """Takes every row at once (never waits); records how many tasks the loop has at each attempt."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: list[int] = []

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.tasks.append(len(asyncio.all_tasks()))


async def test_publishes_that_never_wait_start_no_task_per_runner(database: Database, clock: Clock) -> None:
    """A target that takes each row at once leaves every lane to the first runner, which runs in
    the batch's own task: a batch of many rooms starts no further task (it started one per
    runner, up to publish_concurrency, which then found nothing left to do)."""
    rooms = 40
    await insert_rows(database, *(make_event(JOINED, room=f"r{r}") for r in range(rooms)))
    counting = TaskCountingPublisher(BROKER)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({BROKER: counting}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.MQ, batch_size=100, publish_concurrency=16),
        clock=clock,
    )
    before = len(asyncio.all_tasks())
    assert await worker.run_once() == rooms
    assert counting.tasks == [before] * rooms
    assert await delivered_in_all(database) == rooms


class HangingPublisher:
    """Every attempt waits until its deadline (never answers in time); counts the attempts. With
    ``cancel_at`` set, the attempt of that number also asks for ``batch`` to be cancelled, from the
    loop's next turn (as a shutdown arriving then would)."""

    def __init__(self, name: str, cancel_at: int) -> None:
        self.name, self.cancel_at = name, cancel_at
        self.calls = 0
        self.batch: asyncio.Task[int] | None = None

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.calls += 1
        loop = asyncio.get_running_loop()
        if self.calls == self.cancel_at and self.batch is not None:
            loop.call_soon(self.batch.cancel)
        await asyncio.sleep(max(0.0, deadline - loop.time()))


async def test_a_batch_cancelled_while_its_runners_start_leaves_no_publish_behind(
    database: Database, clock: Clock
) -> None:
    """Cancelled (a shutdown) while its lane runners are still starting one another (each runner
    starts the next on the loop's turn after its own first step): when the batch has ended, no
    runner of it is left and none starts later, so no publish of its rows goes on after the
    worker hands their claims back."""
    await insert_rows(database, *(make_event(JOINED, room=f"r{r}") for r in range(20)))
    hanging = HangingPublisher(BROKER, cancel_at=2)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({BROKER: hanging}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.MQ, batch_size=50, publish_concurrency=8, publish_timeout_s=30.0),
        clock=clock,
    )
    before = asyncio.all_tasks()
    batch = hanging.batch = asyncio.create_task(worker.run_once())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(batch), timeout=10)
    calls = hanging.calls
    assert 2 <= calls < 8  # cancelled while its runners were starting
    for _ in range(50):  # turns of the loop for anything the batch left scheduled
        await asyncio.sleep(0)
    assert hanging.calls == calls
    assert asyncio.all_tasks() == before


class PairedPublisher:
    """Answers only once its partner target has been asked for the same row too (both must be in
    flight at once); records the task each attempt ran in. ``hang``: never answers (a shutdown test)."""

    def __init__(self, name: str, met: dict[str, asyncio.Event], *, hang: bool = False, swallow: bool = False) -> None:
        self.name, self.met, self.hang, self.swallow = name, met, hang, swallow
        self.tasks: list[asyncio.Task[object] | None] = []
        self.ended = self.abandoned = 0

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.tasks.append(asyncio.current_task())
        self.met.setdefault(f"{event.event_id}/{self.name}", asyncio.Event()).set()
        partner = "im" if self.name == "activity" else "activity"
        await self.met.setdefault(f"{event.event_id}/{partner}", asyncio.Event()).wait()
        if self.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # abandoning its request takes it a few turns of the loop
                for _ in range(3):
                    await asyncio.sleep(0)
                self.abandoned += 1
                if self.swallow:  # a publisher that reports its abandoned request as a failure
                    raise RuntimeError("request abandoned") from None
                raise
        self.ended += 1


def paired_worker(
    database: Database, clock: Clock, *, hang: bool = False, im_only: bool = False
) -> tuple[OutboxWorker, PairedPublisher, PairedPublisher]:
    """``im_only``: only the IM publisher hangs, and it reports its abandoned request as a failure."""
    met: dict[str, asyncio.Event] = {}
    im = PairedPublisher("im", met, hang=hang or im_only, swallow=im_only)
    activity = PairedPublisher("activity", met, hang=hang and not im_only)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({"im": im, "activity": activity}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT, batch_size=50, publish_concurrency=4, publish_timeout_s=30.0),
        clock=clock,
    )
    return worker, im, activity


async def test_a_rows_targets_are_published_side_by_side_the_first_in_the_batchs_task(
    database: Database, clock: Clock
) -> None:
    """A row for IM and activity is published to both at once (each publisher here answers only
    once the other has the row too: one after the other would wait out publish_timeout); the first
    target (by name: activity) runs in the worker's own task, only the other in a task of its own."""
    await insert_rows(database, make_event(JOINED))
    worker, im, activity = paired_worker(database, clock)
    batch = asyncio.create_task(worker.run_once())
    assert await asyncio.wait_for(batch, timeout=10) == 1
    assert await delivered_in_all(database) == 1
    assert activity.tasks == [batch]  # (one room: its lane runs in the batch's task)
    assert len(im.tasks) == 1 and im.tasks[0] is not batch


class TaskRecordingPublisher:
    """Answers at once, or (``hang``) never; records the task each attempt ran in."""

    def __init__(self, name: str, *, hang: bool = False) -> None:
        self.name, self.hang = name, hang
        self.tasks: list[asyncio.Task[object] | None] = []

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.tasks.append(asyncio.current_task())
        if self.hang:
            await asyncio.Event().wait()


def recording_worker(database: Database, clock: Clock, im: Any, activity: Any, **options: Any) -> OutboxWorker:
    return OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({"im": im, "activity": activity}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT, batch_size=50, publish_concurrency=4, **options),
        clock=clock,
    )


async def test_a_rows_targets_that_answer_at_once_are_published_in_the_batchs_task_without_one_of_their_own(
    database: Database, clock: Clock
) -> None:
    """Each of a row's attempts runs in the batch's task up to its first wait: targets that answer at
    once (in-process ones) cost no task a row."""
    await insert_rows(database, make_event(JOINED))
    im, activity = TaskRecordingPublisher("im"), TaskRecordingPublisher("activity")
    batch = asyncio.create_task(recording_worker(database, clock, im, activity).run_once())
    assert await asyncio.wait_for(batch, timeout=10) == 1
    assert await delivered_in_all(database) == 1
    assert activity.tasks == im.tasks == [batch]


async def test_a_target_that_waits_after_one_that_answered_goes_on_in_the_batchs_task_within_its_timeout(
    database: Database, clock: Clock
) -> None:
    """The attempt that waits was run up to its wait in the batch's task, and goes on there: its
    publish_timeout bounds it there, and the target that answered counts as done."""
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    im, activity = TaskRecordingPublisher("im", hang=True), TaskRecordingPublisher("activity")
    batch = asyncio.create_task(recording_worker(database, clock, im, activity, publish_timeout_s=0.2).run_once())
    assert await asyncio.wait_for(batch, timeout=10) == 1
    r = await row(database, ev.event_id)
    assert (r.status, r.targets_done, r.retry_count) == ("retryable", "activity", 1)
    assert r.last_error == "im: timed out after 0.2s"
    assert activity.tasks == im.tasks == [batch]


async def test_a_row_cancelled_while_its_targets_publish_leaves_no_publish_behind(
    database: Database, clock: Clock
) -> None:
    """Cancelled (a shutdown) while both of a row's targets are in flight: the target published in
    a task of its own is cancelled with the batch, and has ended (abandoned its request) by the
    time the batch's cancellation has: no publish of the row outlives it, no task of it is left."""
    await insert_rows(database, make_event(JOINED))
    worker, im, activity = paired_worker(database, clock, hang=True)
    before = asyncio.all_tasks()
    batch = asyncio.create_task(worker.run_once())
    deadline = time.monotonic() + 10
    while not (im.tasks and activity.tasks) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert im.tasks and activity.tasks  # both in flight
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert im.abandoned == activity.abandoned == 1  # both ended before the batch did
    for _ in range(50):  # turns of the loop for anything the batch left scheduled
        await asyncio.sleep(0)
    assert asyncio.all_tasks() == before
    assert im.ended == activity.ended == 0


async def delivered_in_all(db: Database) -> int:
    async with db.read() as conn:
        n = await conn.scalar(
            sa.select(sa.func.count()).select_from(t.room_outbox).where(t.room_outbox.c.status == "delivered")
        )
    return int(n or 0)


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


# --------------------------------------------------------------------------- the lease and a failing database


def test_the_configured_lock_timeout_is_the_lease_whatever_the_batch() -> None:
    """Not raised to cover a worst-case batch (it was ~50 s for the seed's 30 s): a long batch
    extends its claims instead."""
    options = WorkerOptions(mode=PublishMode.DIRECT, batch_size=100, publish_timeout_s=3, lock_timeout_s=30)
    assert options.lock_ms == 30_000
    assert options.extend_every_s == 10


async def test_a_dead_workers_rows_come_back_after_lock_timeout(
    database: Database, make_worker: WorkerFactory, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    dead, alive = make_worker(), make_worker()
    repo = SqlOutboxRepository(database)
    # the dead worker claimed with its configured lease and was never heard of again
    [claimed] = await repo.claim_due(owner=dead.owner, now_ms=clock.now_ms, lock_ms=dead.options.lock_ms, limit=10)
    assert claimed.lock_until_ms == clock.now_ms + 30_000
    clock.advance(30_000 - 1)
    assert await alive.run_once() == 0
    clock.advance(2)
    assert await alive.run_once() == 1
    assert (await row(database, ev.event_id)).status == "delivered"


async def test_a_live_worker_extends_its_claims_while_a_long_batch_runs(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    """The publish outlasts the lease many times over; the rows stay the worker's (nobody else
    can claim them) and its finish changes every one of them."""

    def wall_clock() -> int:
        return int(time.time() * 1000)

    ev = make_event(JOINED, at=wall_clock())
    await insert_rows(database, ev, now=wall_clock())
    lease_s = 0.3
    slow = make_worker(clock_fn=wall_clock, lock_timeout_s=lease_s, publish_timeout_s=60)
    rival = make_worker(clock_fn=wall_clock, lock_timeout_s=lease_s)
    publishing, release = asyncio.Event(), asyncio.Event()
    original = im.publish

    async def held(event: e.Event, *, payload: bytes, deadline: float) -> None:
        publishing.set()
        await release.wait()
        await original(event, payload=payload, deadline=deadline)

    im.publish = held  # type: ignore[method-assign]
    with capture_logs() as logs:
        batch = asyncio.create_task(slow.run_once())
        async with asyncio.timeout(10):
            await publishing.wait()
            while slow.claims_extended < 4:  # more than a lease has passed since the claim
                assert await rival.run_once() == 0
                await asyncio.sleep(lease_s / 6)
        release.set()
        assert await batch == 1
    assert [entry for entry in logs if entry["event"] == "outbox_claims_lost"] == []
    assert im.delivered == [ev.event_id]
    assert (await row(database, ev.event_id)).status == "delivered"


class FlakyRepository:
    """The real repository, with the database failing chosen calls."""

    def __init__(self, inner: SqlOutboxRepository) -> None:
        self.inner = inner
        self.fail_finish = 0
        self.claim_then_fail = 0  # the claim commits, its answer is lost (a deadline on COMMIT's reply)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def claim_due(self, **kwargs: object) -> list[object]:
        rows = await self.inner.claim_due(**kwargs)  # type: ignore[arg-type]
        if self.claim_then_fail:
            self.claim_then_fail -= 1
            raise StoreUnavailable("database call exceeded its deadline")
        return rows  # type: ignore[return-value]

    async def finish(self, **kwargs: object) -> int:
        if self.fail_finish:
            self.fail_finish -= 1
            raise StoreUnavailable("database call exceeded its deadline")
        return await self.inner.finish(**kwargs)  # type: ignore[arg-type]

    async def finish_and_claim(self, **kwargs: object) -> tuple[int, list[object]]:
        if self.fail_finish:  # the finish's transaction fails, so does the claim that rides on it
            self.fail_finish -= 1
            raise StoreUnavailable("database call exceeded its deadline")
        changed, rows = await self.inner.finish_and_claim(**kwargs)  # type: ignore[arg-type]
        if self.claim_then_fail:
            self.claim_then_fail -= 1
            raise StoreUnavailable("database call exceeded its deadline")
        return changed, rows  # type: ignore[return-value]


async def test_a_finish_that_failed_is_written_next_cycle_without_publishing_again(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    flaky = FlakyRepository(SqlOutboxRepository(database))
    flaky.fail_finish = 1
    worker = make_worker(repository=flaky)
    with pytest.raises(StoreUnavailable):
        await worker.run_once()
    assert (await row(database, ev.event_id)).status == "delivering"
    assert await worker.run_once() == 0  # the kept decision is written first; nothing left to claim
    r = await row(database, ev.event_id)
    assert (r.status, r.lock_owner) == ("delivered", None)
    assert im.calls == [ev.event_id]  # published once


async def test_claims_of_a_cycle_that_failed_are_handed_back_not_left_for_the_lease(
    database: Database, make_worker: WorkerFactory, im: FakePublisher
) -> None:
    """The claim committed but its answer was lost: the rows are this live worker's without it
    knowing. Its next cycle hands them back and takes them again, instead of their waiting out
    the 30 s lease (the test clock never moves)."""
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    flaky = FlakyRepository(SqlOutboxRepository(database))
    flaky.claim_then_fail = 1
    worker = make_worker(repository=flaky)
    with pytest.raises(StoreUnavailable):
        await worker.run_once()
    assert (await row(database, ev.event_id)).lock_owner == worker.owner
    assert await worker.run_once() == 1
    assert (await row(database, ev.event_id)).status == "delivered"
    assert im.delivered == [ev.event_id]


async def test_readiness_fails_while_cycles_fail_or_the_loop_is_stuck_and_recovers(
    database: Database, make_worker: WorkerFactory
) -> None:
    flaky = FlakyRepository(SqlOutboxRepository(database))
    worker = make_worker(repository=flaky, poll_interval_s=0.01)
    with pytest.raises(WorkerNotReady, match="not running"):
        await worker.check()
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    flaky.fail_finish = 10**6  # the database keeps failing
    async with worker:
        async with asyncio.timeout(10):
            while worker._failing is None:
                await asyncio.sleep(0.01)
        with pytest.raises(WorkerNotReady, match="cycles failing"):
            await worker.check()
        flaky.fail_finish = 0  # it answers again
        async with asyncio.timeout(10):
            while (await row(database, ev.event_id)).status != "delivered":
                await asyncio.sleep(0.01)
            while worker._failing is not None:
                await asyncio.sleep(0.01)
        await worker.check()
        worker._last_beat -= worker.options.stale_after_s + 1  # as if a step had hung
        with pytest.raises(WorkerNotReady, match="stuck"):
            await worker.check()


async def test_lines_logged_while_a_row_is_delivered_name_its_event(database: Database, clock: Clock) -> None:
    class Talkative:
        name = "im"

        async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
            get_logger("test").info("publishing")  # says nothing of the event itself

    ev = make_event(JOINED)
    await insert_rows(database, ev)
    worker = OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({"im": Talkative(), "activity": FakePublisher("activity")}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=CAP, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT),
        clock=clock,
    )
    with capture_logs(processors=[merge_contextvars]) as logs:
        assert await worker.run_once() == 1
    line = next(entry for entry in logs if entry["event"] == "publishing")
    assert line["event_id"] == ev.event_id
