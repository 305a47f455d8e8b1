"""A batch's rows on a pipelining publisher (issues 8 and 12): one pipeline for the batch, each room's
rows sent in version order without waiting for each acknowledgement; every row's outcome, retry and
dead letter exactly as on the serial path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
from tests.service.conftest import T0, Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event, row

from roomservice.domain import events as e
from roomservice.outbox.model import BROKER, TREASURE_WAKEUP, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PermanentError, PublisherSet, RetryableError
from roomservice.store.database import Database

INITIAL = 1_000


class PipeliningPublisher:
    """A broker target that pipelines: ``send_claimed`` records the send and hands back an
    acknowledgement the test settles (``settle``), or that settles itself (``auto``)."""

    name = BROKER
    pipelined = True

    def __init__(self, *, auto: bool = True) -> None:
        self.auto = auto
        self.sent: list[str] = []  # event ids in the order they were sent
        self.serial: list[str] = []  # event ids published the serial way
        self.acks: dict[str, asyncio.Future[None]] = {}
        self.outstanding_at_send: list[int] = []  # acknowledgements not yet settled when each row was sent
        self.fail: dict[str, Exception] = {}  # event id -> the error its acknowledgement fails with
        self.refuse: dict[str, Exception] = {}  # event id -> the error its send raises
        self.never: set[str] = set()  # event ids whose acknowledgement never comes
        self.stall: set[str] = set()  # event ids whose send itself never returns
        self.sends = asyncio.Event()
        self.expected_sends = 0

    def _outstanding(self) -> int:
        return sum(1 for f in self.acks.values() if not f.done())

    async def send_claimed(self, *, event_id: str, **_: Any) -> asyncio.Future[None]:
        if event_id in self.refuse:
            raise self.refuse[event_id]
        if event_id in self.stall:
            await asyncio.Event().wait()
        self.outstanding_at_send.append(self._outstanding())
        self.sent.append(event_id)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.acks[event_id] = ack
        if self.auto and event_id not in self.never:
            asyncio.get_running_loop().call_soon(self.settle, event_id)
        if len(self.sent) >= self.expected_sends:
            self.sends.set()
        return ack

    def failure(self, exc: BaseException) -> BaseException:
        return exc  # the test's acknowledgements fail with the port's errors already

    def settle(self, event_id: str) -> None:
        ack = self.acks[event_id]
        if ack.done():
            return
        if event_id in self.fail:
            ack.set_exception(self.fail[event_id])
        else:
            ack.set_result(None)

    async def publish_claimed(self, *, event_id: str, **_: Any) -> None:
        self.outstanding_at_send.append(self._outstanding())
        self.serial.append(event_id)

    async def publish(self, event: e.Event, **_: Any) -> None:  # a row decoded for another target
        await self.publish_claimed(event_id=event.event_id)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def worker(
    database: Database, clock: Clock, publisher: Any, *, extra: dict[str, Any] | None = None, **options: Any
) -> OutboxWorker:
    return OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({BROKER: publisher, **(extra or {})}),
        policy=RetryPolicy(initial_backoff_ms=INITIAL, max_backoff_ms=8_000, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.MQ, **options),
        clock=clock,
    )


def one_room(n: int) -> list[e.Event]:
    return [make_event(JOINED, room="busy", version=v) for v in range(1, n + 1)]


async def test_a_rooms_rows_are_sent_in_version_order_without_waiting_for_each_acknowledgement(
    database: Database, clock: Clock
) -> None:
    events = one_room(6)
    await insert_rows(database, *reversed(events))  # ids against the version order
    publisher = PipeliningPublisher()
    assert await worker(database, clock, publisher).run_once() == 6
    assert publisher.sent == [ev.event_id for ev in events]
    # a serial lane would have sent each row after the last one was acknowledged (0 outstanding)
    assert publisher.outstanding_at_send == list(range(6))
    for ev in events:
        r = await row(database, ev.event_id)
        assert (r.status, r.targets_done, r.delivered_at_ms, r.retry_count) == ("delivered", BROKER, T0, 0)


async def test_failures_in_a_pipeline_end_their_own_rows_only_as_on_the_serial_path(
    database: Database, clock: Clock
) -> None:
    ok1, retry_ack, dead_ack, retry_send, dead_send, ok2 = one_room(6)
    await insert_rows(database, ok1, retry_ack, dead_ack, retry_send, dead_send, ok2)
    publisher = PipeliningPublisher()
    publisher.fail[retry_ack.event_id] = RetryableError("broker nats unavailable: reconnecting")
    publisher.fail[dead_ack.event_id] = PermanentError("broker nats refused the event: too large")
    publisher.refuse[retry_send.event_id] = RetryableError("broker nats unavailable: not connected")
    publisher.refuse[dead_send.event_id] = PermanentError("broker nats refused the event: bad header")
    await worker(database, clock, publisher).run_once()
    assert publisher.sent == [ok1.event_id, retry_ack.event_id, dead_ack.event_id, ok2.event_id]
    for ev in (ok1, ok2):
        assert (await row(database, ev.event_id)).status == "delivered"
    for ev, error in ((retry_ack, "reconnecting"), (retry_send, "not connected")):
        r = await row(database, ev.event_id)
        assert (r.status, r.retry_count, r.next_retry_at_ms, r.targets_done) == ("retryable", 1, T0 + INITIAL, "")
        assert r.last_error.startswith("broker: ") and error in r.last_error
    for ev, error in ((dead_ack, "too large"), (dead_send, "bad header")):
        r = await row(database, ev.event_id)
        assert (r.status, r.retry_count) == ("failed", 1) and error in r.last_error


async def test_an_acknowledgement_that_never_comes_times_out_alone_and_is_let_go(
    database: Database, clock: Clock
) -> None:
    first, lost, last = one_room(3)
    await insert_rows(database, first, lost, last)
    publisher = PipeliningPublisher()
    publisher.never.add(lost.event_id)
    await worker(database, clock, publisher, publish_timeout_s=0.2).run_once()
    assert publisher.acks[lost.event_id].cancelled()  # given up: the publisher can drop what it kept
    r = await row(database, lost.event_id)
    assert (r.status, r.retry_count) == ("retryable", 1) and "timed out after 0.2s" in r.last_error
    assert [(await row(database, ev.event_id)).status for ev in (first, last)] == ["delivered", "delivered"]


async def test_a_room_with_a_row_that_does_not_pipeline_is_published_row_after_row(
    database: Database, clock: Clock
) -> None:
    """A countdown needs the broker and the treasure wake-up: its room goes the serial way, each
    row after the one before it is done, so nothing of that room overtakes it."""
    countdown = e.RoomTreasureCountdownStarted(box_id="b1", level=1, open_at_ms=T0 + 60_000, open_command_id="open-b1")
    joined, started, later = (
        make_event(JOINED, room="busy", version=1),
        make_event(countdown, room="busy", version=2),
        make_event(JOINED, room="busy", version=3),
    )
    await insert_rows(database, joined, started, later)
    publisher = PipeliningPublisher()
    wakeup = FakePublisher(TREASURE_WAKEUP)
    await worker(database, clock, publisher, extra={TREASURE_WAKEUP: wakeup}).run_once()
    assert (publisher.sent, publisher.serial) == ([], [joined.event_id, started.event_id, later.event_id])
    assert publisher.outstanding_at_send == [0, 0, 0]
    assert wakeup.delivered == [started.event_id]
    for ev in (joined, started, later):
        assert (await row(database, ev.event_id)).status == "delivered"


async def test_shutdown_lets_go_of_outstanding_acknowledgements_and_hands_the_rows_back(
    database: Database, clock: Clock
) -> None:
    events = one_room(4)
    await insert_rows(database, *events)
    publisher = PipeliningPublisher(auto=False)
    publisher.expected_sends = 4
    w = worker(database, clock, publisher)
    w.start()
    await publisher.sends.wait()
    await w.shutdown()
    assert all(ack.cancelled() for ack in publisher.acks.values())
    for ev in events:
        r = await row(database, ev.event_id)
        assert (r.status, r.lock_owner, r.retry_count) == ("pending", None, 0)


async def test_the_batchs_rooms_share_one_pipeline_round_robin(database: Database, clock: Clock) -> None:
    """Every room's first row, then every second row...: a room's only row is sent without waiting
    for another room's acknowledgement, and each room's rows keep their version order."""
    alone = make_event(JOINED, room="quiet")
    busy = one_room(3)
    other = [make_event(JOINED, room="other", version=v) for v in (1, 2)]
    await insert_rows(database, *reversed(busy), alone, *other)
    publisher = PipeliningPublisher()
    assert await worker(database, clock, publisher).run_once() == 6
    assert publisher.serial == []
    depth = {ev.event_id: n for room in ([alone], busy, other) for n, ev in enumerate(room)}
    assert [depth[i] for i in publisher.sent] == [0, 0, 0, 1, 1, 2]
    for room in ([alone], busy, other):
        assert [i for i in publisher.sent if i in {ev.event_id for ev in room}] == [ev.event_id for ev in room]
    assert publisher.outstanding_at_send[-1] > 0  # not one at a time
    for ev in (alone, *busy, *other):
        assert (await row(database, ev.event_id)).status == "delivered"


async def test_the_pipeline_keeps_at_most_publish_concurrency_attempts_open(database: Database, clock: Clock) -> None:
    events = [make_event(JOINED, room=f"r{n}") for n in range(7)]
    await insert_rows(database, *events)
    publisher = PipeliningPublisher()
    assert await worker(database, clock, publisher, publish_concurrency=2).run_once() == 7
    assert len(publisher.sent) == 7 and max(publisher.outstanding_at_send) == 1
    assert [(await row(database, ev.event_id)).status for ev in events] == ["delivered"] * 7


class CountedFuture(asyncio.Future[None]):
    """An acknowledgement that counts the done callbacks put on it."""

    callbacks = 0

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        CountedFuture.callbacks += 1
        super().add_done_callback(fn, context=context)


class CountingPublisher(PipeliningPublisher):
    async def send_claimed(self, *, event_id: str, **kw: Any) -> asyncio.Future[None]:
        await super().send_claimed(event_id=event_id, **kw)
        ack = self.acks[event_id] = CountedFuture()  # settled by the test, or by settle() a turn later
        return ack


async def test_acknowledgements_that_come_in_together_are_taken_in_with_one_callback(
    database: Database, clock: Clock
) -> None:
    """A pipeline takes its acknowledgements in send order as far as they are in, with one callback
    waiting on the first that is not: not one callback (a loop ``Handle``) a row."""
    events = one_room(8)
    await insert_rows(database, *events)
    publisher = CountingPublisher()  # every row sent at once; the acknowledgements all come a turn later
    CountedFuture.callbacks = 0
    assert await worker(database, clock, publisher, publish_concurrency=16).run_once() == 8
    assert [(await row(database, ev.event_id)).status for ev in events] == ["delivered"] * 8
    assert CountedFuture.callbacks == 1


async def test_acknowledgements_that_come_in_reverse_order_each_end_their_own_row(
    database: Database, clock: Clock
) -> None:
    events = [make_event(JOINED, room=f"r{n}") for n in range(5)]
    await insert_rows(database, *events)
    publisher = CountingPublisher(auto=False)
    publisher.fail[events[1].event_id] = RetryableError("broker busy")
    publisher.expected_sends = 5
    batch = asyncio.create_task(worker(database, clock, publisher).run_once())
    async with asyncio.timeout(10):
        await publisher.sends.wait()
    for event_id in reversed(publisher.sent):  # the last sent is the first acknowledged
        publisher.settle(event_id)
        await asyncio.sleep(0)
    assert await batch == 5
    statuses = [(await row(database, ev.event_id)).status for ev in events]
    assert statuses == ["delivered", "retryable", "delivered", "delivered", "delivered"]


async def test_a_send_that_never_returns_times_out_alone_and_the_rest_go_on(database: Database, clock: Clock) -> None:
    first, stuck, last = [make_event(JOINED, room=f"r{n}") for n in range(3)]
    await insert_rows(database, first, stuck, last)
    publisher = PipeliningPublisher()
    publisher.stall.add(stuck.event_id)
    await worker(database, clock, publisher, publish_timeout_s=0.2).run_once()
    r = await row(database, stuck.event_id)
    assert (r.status, r.retry_count) == ("retryable", 1) and "timed out after 0.2s" in r.last_error
    assert [(await row(database, ev.event_id)).status for ev in (first, last)] == ["delivered", "delivered"]
    assert publisher.sent == [first.event_id, last.event_id]


async def test_past_max_room_lane_a_late_batch_leaves_a_rooms_backlog_to_the_next(
    database: Database, clock: Clock
) -> None:
    from roomservice.outbox.worker import MAX_ROOM_LANE

    busy = one_room(MAX_ROOM_LANE + 3)
    quiet = make_event(JOINED, room="quiet")
    await insert_rows(database, *busy, quiet)
    publisher = PipeliningPublisher()
    assert await worker(database, clock, publisher, lane_budget_s=0.0).run_once() == len(busy) + 1
    assert publisher.sent[:2] == [busy[0].event_id, quiet.event_id]
    assert publisher.sent[2:] == [ev.event_id for ev in busy[1:MAX_ROOM_LANE]]
    left = [await row(database, ev.event_id) for ev in busy[MAX_ROOM_LANE:]]
    assert [(r.status, r.retry_count) for r in left] == [("delivering", 0)] * 3  # handed back, claimed again
    assert [(await row(database, ev.event_id)).status for ev in busy[:MAX_ROOM_LANE]] == ["delivered"] * MAX_ROOM_LANE


class SteppingRepository:
    """The real repository; ``finish_and_claim`` (the claim ahead, under a backlog) first takes a few
    turns of the loop, as a transaction's round trips do, noting at each how many rows had been sent
    by then (``sent()``)."""

    def __init__(self, inner: SqlOutboxRepository, sent: Callable[[], int]) -> None:
        self.inner, self.sent = inner, sent
        self.sent_at_steps: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def finish_and_claim(self, **kwargs: Any) -> tuple[int, list[Any]]:
        for _ in range(3):
            self.sent_at_steps.append(self.sent())
            await asyncio.sleep(0)
        return await self.inner.finish_and_claim(**kwargs)


class SlowSends(PipeliningPublisher):
    """Each send takes 1 ms of the loop's own time and never suspends (a target that takes rows at once)."""

    async def send_claimed(self, *, event_id: str, **kwargs: Any) -> asyncio.Future[None]:
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
        return await super().send_claimed(event_id=event_id, **kwargs)


async def test_a_pipeline_gives_the_claim_ahead_turns_of_the_loop_while_it_sends(
    database: Database, clock: Clock
) -> None:
    """Sends that never suspend would hold the loop for the whole batch, the claim ahead's database
    replies waiting behind them; the pipeline gives the loop a turn every half millisecond meanwhile."""
    events = [make_event(JOINED, room=f"r{n}") for n in range(25)]
    await insert_rows(database, *events)
    publisher = SlowSends()
    w = worker(database, clock, publisher, batch_size=10)
    stepping = SteppingRepository(cast(SqlOutboxRepository, w.repository), lambda: len(publisher.sent))
    w.repository = stepping
    assert await w.run_once() == 10  # a full batch: the next one is claimed ahead while it sends
    # the claim ahead took its turns while the batch was being sent, not after its last send
    assert stepping.sent_at_steps[:3] != [10, 10, 10]
    assert stepping.sent_at_steps[2] < 10
    while await w.run_once():
        pass
    assert sorted(publisher.sent) == sorted(ev.event_id for ev in events)
    assert [(await row(database, ev.event_id)).status for ev in events] == ["delivered"] * 25


async def test_a_batch_of_lanes_lets_the_claim_ahead_start_before_its_first_publish(
    database: Database, clock: Clock
) -> None:
    """Rooms published row after row, to a target that takes each row at once: the lanes never
    suspend, and the claim ahead (the last finish and the next claim, one transaction) would only
    begin once the batch's last row was published, its round trips overlapping none of it."""
    events = [make_event(JOINED, room=f"r{n}") for n in range(25)]
    await insert_rows(database, *events)
    publisher = FakePublisher(BROKER)  # not pipelining: a lane per room
    w = worker(database, clock, publisher, batch_size=10)
    stepping = SteppingRepository(cast(SqlOutboxRepository, w.repository), lambda: len(publisher.calls))
    w.repository = stepping
    assert await w.run_once() == 10  # a full batch: the next one is claimed ahead
    assert stepping.sent_at_steps[0] == 0  # its first step came before any row was published
    assert len(publisher.calls) == 10
    while await w.run_once():
        pass
    assert sorted(publisher.delivered) == sorted(ev.event_id for ev in events)
    assert [(await row(database, ev.event_id)).status for ev in events] == ["delivered"] * 25
