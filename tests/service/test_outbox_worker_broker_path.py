"""The outbox worker's broker path (issue 12): the row's own fields, no decoded Event, same outcomes."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest
import sqlalchemy as sa
from tests.service.conftest import T0, Clock
from tests.service.test_outbox_worker import JOINED, insert_rows, make_event, row

from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import BrokerError, BrokerUnavailable, OutgoingMessage
from roomservice.outbox.model import BROKER, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.broker import BrokerPublisher
from roomservice.publishers.port import PermanentError, PublisherSet, RetryableError
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.wire import decode_event

TOPIC = "hyapp_room_outbox"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def mq_worker(database: Database, clock: Clock, broker: FakeBroker, **options: float) -> OutboxWorker:
    return OutboxWorker(
        repository=SqlOutboxRepository(database),
        publishers=PublisherSet({BROKER: BrokerPublisher(broker, topic=TOPIC)}),
        policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=8_000, max_retry_count=10, jitter=0),
        options=WorkerOptions(mode=PublishMode.MQ, **options),  # type: ignore[arg-type]
        clock=clock,
    )


async def test_a_broker_only_row_is_published_from_its_claimed_fields_without_decoding(
    database: Database, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    import roomservice.outbox.worker as worker_module

    def no_decode(_: bytes) -> None:
        raise AssertionError("the broker path must not decode the Event")

    monkeypatch.setattr(worker_module, "decode_event", no_decode)
    ev = make_event(JOINED, room="r7")
    await insert_rows(database, ev)
    broker = FakeBroker()
    assert await mq_worker(database, clock, broker).run_once() == 1
    (sent,) = broker.published
    assert (sent.topic, sent.key, sent.tag, sent.sharding_key) == (TOPIC, ev.event_id, ev.type, "demo:r7")
    assert decode_event(sent.body) == ev
    r = await row(database, ev.event_id)
    assert (r.status, r.targets_done, r.delivered_at_ms) == ("delivered", BROKER, T0)


async def test_an_undecodable_broker_only_row_is_still_a_dead_letter_and_is_not_published(
    database: Database, clock: Clock
) -> None:
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    async with database.write() as conn:
        await conn.execute(sa.update(t.room_outbox).values(payload=b"\xff\x00garbage"))
    broker = FakeBroker()
    await mq_worker(database, clock, broker).run_once()
    r = await row(database, ev.event_id)
    assert r.status == "failed" and "undecodable" in r.last_error
    assert broker.published == []


async def test_a_hung_broker_times_out_by_the_workers_deadline(database: Database, clock: Clock) -> None:
    """publish_claimed adds no timer of its own: the attempt still ends by publish_timeout."""
    ev = make_event(JOINED)
    await insert_rows(database, ev)
    broker = FakeBroker()
    broker.hang = True
    await mq_worker(database, clock, broker, publish_timeout_s=0.2).run_once()
    r = await row(database, ev.event_id)
    assert r.status == "retryable" and "timed out after 0.2s" in r.last_error and r.targets_done == ""


class PipeliningFakeBroker(FakeBroker):
    """The fake broker with the pipelined ``send``: the acknowledgement of a message whose key is
    in ``fail`` fails with that broker error, every other one succeeds at once."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[str, Exception] = {}

    async def send(self, message: OutgoingMessage) -> asyncio.Future[str]:
        ack: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if message.key in self.fail:
            ack.set_exception(self.fail[message.key])
        else:
            ack.set_result(await self.publish(message, timeout_s=None))
        return ack


async def test_a_pipelined_acknowledgement_failing_with_a_broker_error_ends_as_the_publisher_says(
    database: Database, clock: Clock
) -> None:
    """The worker turns the broker's own error into the publisher port's (retry or dead letter)."""
    ok, down, refused, odd = (make_event(JOINED, room=f"r{n}") for n in range(4))
    await insert_rows(database, ok, down, refused, odd)
    broker = PipeliningFakeBroker()
    broker.fail[down.event_id] = BrokerUnavailable("reconnecting")
    broker.fail[refused.event_id] = BrokerError("message too large")
    broker.fail[odd.event_id] = RuntimeError("client library hiccup")  # unclassified: retried, not dead
    worker = mq_worker(database, clock, broker)
    assert worker.publishers.get(BROKER).pipelined  # type: ignore[union-attr]
    await worker.run_once()
    assert (await row(database, ok.event_id)).status == "delivered"
    r = await row(database, down.event_id)
    assert (r.status, r.retry_count) == ("retryable", 1)
    assert r.last_error == "broker: broker fake unavailable: reconnecting"
    r = await row(database, refused.event_id)
    assert (r.status, r.last_error) == ("failed", "broker: broker fake refused the event: message too large")
    r = await row(database, odd.event_id)
    assert (r.status, r.retry_count) == ("retryable", 1)
    assert r.last_error == "broker: broker fake: RuntimeError: client library hiccup"


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (BrokerUnavailable("reconnecting"), RetryableError),
        (TimeoutError(), RetryableError),
        (BrokerError("message too large"), PermanentError),
        (PermanentError("already decided"), PermanentError),
        (RuntimeError("a client library's own error"), RetryableError),
        (nats.js.errors.NotFoundError(), RetryableError),  # e.g. the stream deleted under a publish
    ],
    ids=["unavailable", "timeout", "broker-error", "permanent", "runtime", "nats-not-found"],
)
async def test_only_what_the_port_calls_final_is_a_dead_letter(
    raised: Exception, expected: type[Exception]
) -> None:
    """The port names BrokerError alone as what retrying cannot fix; anything unclassified is retried
    like an outage, as the worker retries an unclassified publisher error (found by review: it was a
    dead letter on the first attempt)."""
    broker = FakeBroker()
    publisher = BrokerPublisher(broker, topic=TOPIC)
    assert isinstance(publisher.failure(raised), expected)
