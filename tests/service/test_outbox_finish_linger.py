"""A short batch's finish can wait briefly for the next commit and claim it in the same transaction
(issue 12: one write a batch at moderate rates on the writer the commands share); by default it
does not wait, since every row's "delivered" would wait with it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.service.conftest import Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event, row

from roomservice.outbox.model import BROKER, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PublisherSet
from roomservice.store.database import Database


class CountingRepository(SqlOutboxRepository):
    """Counts the worker's write transactions by kind."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.calls: dict[str, int] = {"claim_due": 0, "finish_and_claim": 0, "finish": 0}

    async def claim_due(self, **kw: Any) -> Any:
        self.calls["claim_due"] += 1
        return await super().claim_due(**kw)

    async def finish_and_claim(self, **kw: Any) -> Any:
        self.calls["finish_and_claim"] += 1
        return await super().finish_and_claim(**kw)

    async def finish(self, **kw: Any) -> Any:
        self.calls["finish"] += 1
        return await super().finish(**kw)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lingering_worker(
    database: Database, clock: Clock, publisher: FakePublisher, linger_s: float | None
) -> tuple[OutboxWorker, CountingRepository, asyncio.Event]:
    """A worker counting its transactions; ``lingering`` is set once a batch's finish could linger
    (``linger_s`` None: the default linger)."""
    repository = CountingRepository(database)
    options = WorkerOptions(mode=PublishMode.MQ)
    if linger_s is not None:
        options = WorkerOptions(mode=PublishMode.MQ, finish_linger_s=linger_s)
    worker = OutboxWorker(
        repository=repository,
        publishers=PublisherSet({BROKER: publisher}),
        policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=8_000, max_retry_count=3, jitter=0),
        options=options,
        clock=clock,
    )
    lingering = asyncio.Event()
    linger = worker._linger

    async def spied() -> None:
        lingering.set()
        await linger()

    worker._linger = spied  # type: ignore[method-assign]
    return worker, repository, lingering


async def test_a_commit_during_the_linger_is_claimed_by_the_finish_of_the_batch_before(
    database: Database, clock: Clock
) -> None:
    first, second = make_event(JOINED, room="a"), make_event(JOINED, room="b")
    await insert_rows(database, first)
    publisher = FakePublisher(BROKER)
    worker, repository, lingering = lingering_worker(database, clock, publisher, linger_s=3600)
    cycle = asyncio.create_task(worker.run_once())
    await lingering.wait()
    assert (await row(database, first.event_id)).status == "delivering"  # published, not written yet
    await insert_rows(database, second)
    worker.wake()  # as a commit does: ends the linger (an hour long) at once
    assert await cycle == 1
    assert (await row(database, first.event_id)).status == "delivered"
    assert await worker.run_once() == 1  # the second row, claimed by that finish: no claim of its own
    assert (await row(database, second.event_id)).status == "delivered"
    assert publisher.delivered == [first.event_id, second.event_id]
    assert repository.calls["claim_due"] == 1


async def test_without_a_commit_the_finish_is_written_when_the_linger_ends(database: Database, clock: Clock) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    worker, repository, lingering = lingering_worker(database, clock, FakePublisher(BROKER), linger_s=0.05)
    assert await worker.run_once() == 1
    assert lingering.is_set()
    assert (await row(database, ev.event_id)).status == "delivered"
    assert repository.calls == {"claim_due": 1, "finish_and_claim": 1, "finish": 0}


class NeverWoken(asyncio.Event):
    """A wake-up that never comes, and says whether anyone waited for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0

    async def wait(self) -> Any:
        self.waited += 1
        return await super().wait()


async def test_by_default_a_short_batch_is_finished_without_waiting_for_a_commit(
    database: Database, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    # the defaults: batch_size 100, so one row is a short batch
    worker, repository, _ = lingering_worker(database, clock, FakePublisher(BROKER), linger_s=None)
    wakeup = worker._wakeup = NeverWoken()
    assert await worker.run_once() == 1
    assert wakeup.waited == 0  # a linger waits for the next wake-up (until its timeout)
    assert (await row(database, ev.event_id)).status == "delivered"
    assert repository.calls == {"claim_due": 1, "finish_and_claim": 1, "finish": 0}


async def test_a_full_batch_does_not_linger(database: Database, clock: Clock) -> None:
    events = [make_event(JOINED, room=f"r{i}") for i in range(3)]
    await insert_rows(database, *events)
    worker, _, lingering = lingering_worker(database, clock, FakePublisher(BROKER), linger_s=3600)
    worker.options = WorkerOptions(mode=PublishMode.MQ, batch_size=3, finish_linger_s=3600)
    assert await worker.run_once() == 3  # returns: an hour-long linger would hold it
    assert not lingering.is_set()


async def test_shutdown_during_the_linger_writes_the_finish_and_publishes_nothing_again(
    database: Database, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    publisher = FakePublisher(BROKER)
    worker, _, lingering = lingering_worker(database, clock, publisher, linger_s=3600)
    worker.start()
    await lingering.wait()
    await worker.shutdown()
    r = await row(database, ev.event_id)
    assert (r.status, r.lock_owner) == ("delivered", None)
    assert publisher.calls == [ev.event_id]
