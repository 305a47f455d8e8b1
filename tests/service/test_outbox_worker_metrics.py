"""The worker's attempt metrics (``room_outbox_deliveries_total``, ``room_outbox_publish_seconds``):
held back and applied once per turn of the loop (and before every collect), they must still say exactly
what each attempt did, on the row-after-row path and on the pipeline."""

from __future__ import annotations

import asyncio

import pytest
from tests.service.conftest import Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event, row
from tests.service.test_outbox_worker_broker_path import PipeliningFakeBroker, mq_worker

from roomservice.brokers.port import BrokerUnavailable, OutgoingMessage
from roomservice.observability.metrics import REGISTRY
from roomservice.outbox.model import BROKER, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PublisherSet
from roomservice.store.database import Database

OUTCOMES = ("ok", "retryable", "permanent", "timeout")


def attempts(target: str) -> dict[str, float]:
    """Attempts counted so far for ``target``, by outcome, and the publish-seconds histogram's count."""
    seen = {
        outcome: REGISTRY.get_sample_value("room_outbox_deliveries_total", {"target": target, "outcome": outcome})
        or 0.0
        for outcome in OUTCOMES
    }
    seen["timed"] = REGISTRY.get_sample_value("room_outbox_publish_seconds_count", {"target": target}) or 0.0
    return seen


def direct_worker(database: Database, clock: Clock, *publishers: FakePublisher, **options: float) -> OutboxWorker:
    return OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({p.name: p for p in publishers}),
        policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=8_000, max_retry_count=10, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT, **options),  # type: ignore[arg-type]
        clock=clock,
    )


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before if after[key] != before[key]}


async def test_every_attempt_of_a_row_after_row_batch_is_counted_and_timed_once(
    database: Database, clock: Clock
) -> None:
    im, activity = FakePublisher("im"), FakePublisher("activity")
    events = [make_event(JOINED, room=f"r{n}") for n in range(5)]
    await insert_rows(database, *events)
    im.fail_times = 2  # the first two IM attempts fail (retryable), the other three succeed
    im_before, activity_before = attempts("im"), attempts("activity")
    assert await direct_worker(database, clock, im, activity).run_once() == 5
    assert grown(im_before, attempts("im")) == {"ok": 3, "retryable": 2, "timed": 5}
    assert grown(activity_before, attempts("activity")) == {"ok": 5, "timed": 5}


async def test_a_timed_out_and_a_permanent_attempt_are_counted_as_such(database: Database, clock: Clock) -> None:
    im, activity = FakePublisher("im"), FakePublisher("activity")
    await insert_rows(database, make_event(JOINED))
    im.hang, activity.permanent = True, True
    im_before, activity_before = attempts("im"), attempts("activity")
    await direct_worker(database, clock, im, activity, publish_timeout_s=0.1).run_once()
    assert grown(im_before, attempts("im")) == {"timeout": 1, "timed": 1}
    assert grown(activity_before, attempts("activity")) == {"permanent": 1, "timed": 1}


async def test_the_pipelines_attempts_are_counted_and_timed_once(database: Database, clock: Clock) -> None:
    events = [make_event(JOINED, room=f"r{n}") for n in range(4)]
    await insert_rows(database, *events)
    pipelining = PipeliningFakeBroker()
    pipelining.fail[events[0].event_id] = BrokerUnavailable("reconnecting")
    before = attempts(BROKER)
    await mq_worker(database, clock, pipelining).run_once()
    assert grown(before, attempts(BROKER)) == {"ok": 3, "retryable": 1, "timed": 4}
    assert (await row(database, events[0].event_id)).status == "retryable"


class HeldAckBroker(PipeliningFakeBroker):
    """Holds every acknowledgement until the test resolves it."""

    def __init__(self) -> None:
        super().__init__()
        self.acks: list[asyncio.Future[str]] = []
        self.sent = asyncio.Event()

    async def send(self, message: OutgoingMessage) -> asyncio.Future[str]:
        ack: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        self.sent.set()
        return ack


async def test_an_acknowledgement_that_comes_in_as_the_pipeline_is_cancelled_is_still_counted(
    database: Database, clock: Clock
) -> None:
    """The pipeline counts its successes once, when it ends; an acknowledgement that succeeded as the
    batch was cancelled, before the callback waiting on it ran, is taken in and counted as it ends."""
    await insert_rows(database, make_event(JOINED, room="r1"))
    broker = HeldAckBroker()
    before = attempts(BROKER)
    batch = asyncio.create_task(mq_worker(database, clock, broker).run_once())
    async with asyncio.timeout(10):
        await broker.sent.wait()
    await asyncio.sleep(0)  # the pipeline waits for the acknowledgement now
    batch.cancel()  # the batch's task wakes first (its wait is cancelled)...
    broker.acks[0].set_result("m-1")  # ...then the acknowledgement, whose callback would run after the count
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0)
    assert grown(before, attempts(BROKER)) == {"ok": 1, "timed": 1}


def commit_to_delivered() -> tuple[float, float]:
    """(count, sum) of ``room_outbox_commit_to_delivered_seconds`` so far."""
    name = "room_outbox_commit_to_delivered_seconds"
    return (
        REGISTRY.get_sample_value(f"{name}_count") or 0.0,
        REGISTRY.get_sample_value(f"{name}_sum") or 0.0,
    )


async def test_each_delivered_row_observes_its_age_once_and_a_row_from_the_future_observes_zero(
    database: Database, clock: Clock
) -> None:
    failing, old, skewed = (make_event(JOINED, room=room) for room in ("failing", "old", "skewed"))
    await insert_rows(database, failing, now=clock() - 10_000)  # the batch's first row: its attempt fails
    await insert_rows(database, old, now=clock() - 30_000)  # committed 30 s before the worker's clock
    await insert_rows(database, skewed, now=clock() + 5_000)  # a writer whose clock runs ahead
    im, activity = FakePublisher("im"), FakePublisher("activity")
    activity.fail_times = 1  # the first attempt fails: that row is not delivered, and observes nothing
    count, total = commit_to_delivered()
    assert await direct_worker(database, clock, im, activity).run_once() == 3
    assert activity.delivered == [old.event_id, skewed.event_id]
    grown_count, grown_sum = (now - then for now, then in zip(commit_to_delivered(), (count, total), strict=True))
    assert grown_count == 2
    assert grown_sum == pytest.approx(30.0)
