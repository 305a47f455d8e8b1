"""The broker contract on the embedded broker (SQLite and MariaDB), plus what only it has: retention
(``purge``), stale receipts, and two processes sharing one database.

"Restart" disposes the :class:`Database` and opens a new one (and a new adapter)
on the same URL. On MariaDB the session database is shared: names are unique
per test, and the ``migrated_database`` helper empties the tables afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import sqlalchemy as sa
from tests.conftest import count_calls, migrated_database
from tests.contracts.brokers.base import DurableBrokerContract, message, unique
from tests.contracts.test_outbox_repository import second_process

from roomservice.brokers.embedded import BODY_MAX_BYTES, CRASHED_REASON, EmbeddedBroker, open_embedded_broker
from roomservice.brokers.port import Broker, BrokerError, BrokerUnavailable, PipelinedBroker
from roomservice.config import EmbeddedBrokerConfig
from roomservice.store.database import Database
from roomservice.store.tables import broker_delivery, broker_message

FAST = EmbeddedBrokerConfig.model_validate({"poll_interval": "20ms"})
T0 = 1_780_000_000_000
RETENTION_MS = 3_600_000


class TestEmbeddedBroker(DurableBrokerContract):
    @pytest_asyncio.fixture
    async def broker(self, backend_url: str) -> AsyncIterator[EmbeddedBroker]:
        self.url = backend_url
        self.restarted: list[tuple[EmbeddedBroker, Database]] = []
        async with migrated_database(backend_url) as db:
            broker = await open_embedded_broker(db, FAST)
            yield broker
            await broker.close()
            for other, other_db in self.restarted:
                await other.close()
                await other_db.dispose()

    async def restart(self, broker: Broker) -> Broker:
        assert isinstance(broker, EmbeddedBroker)
        await broker.close()
        await broker.db.dispose()  # every connection of the "old process" is gone
        db = Database.from_url(self.url, pool_size=5, max_overflow=5)
        restarted = EmbeddedBroker(db, config=FAST)
        self.restarted.append((restarted, db))
        return restarted


# --------------------------------------------------------------------------- embedded only


class Clock:
    def __init__(self, now_ms: int = T0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def embedded(database: Database, clock: Clock) -> EmbeddedBroker:
    return EmbeddedBroker(database, config=FAST, clock=clock)


async def rows(db: Database, table: sa.Table) -> int:
    async with db.read() as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def drain(broker: EmbeddedBroker, topic: str, group: str, *, ack: bool = True, visibility_s: float = 30) -> int:
    got = await broker.fetch(topic, group, max_messages=100, wait_s=0, visibility_s=visibility_s)
    for d in got:
        if ack:
            await broker.ack(d)
    return len(got)


async def test_a_stale_receipt_changes_nothing(embedded: EmbeddedBroker, clock: Clock) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=5)
    await embedded.publish(message(topic), timeout_s=5)
    (first,) = await embedded.fetch(topic, group, max_messages=1, wait_s=0, visibility_s=1)
    assert await embedded.fetch(topic, group, max_messages=1, wait_s=0, visibility_s=1) == []  # in flight
    clock.now_ms += 1001
    (second,) = await embedded.fetch(topic, group, max_messages=1, wait_s=0, visibility_s=1)
    assert (second.message_id, second.delivery_count) == (first.message_id, 2)
    await embedded.ack(first)  # redelivered since: its receipt is stale
    await embedded.nack(first, delay_s=0, reason="stale")
    stats = await embedded.group_stats(topic, group)
    assert (stats.lag, stats.in_flight, stats.dead_letters) == (1, 1, 0)
    await embedded.ack(second)
    assert (await embedded.group_stats(topic, group)).lag == 0


async def test_groups_are_checked(embedded: EmbeddedBroker) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=2)
    await embedded.declare_group(topic, group, max_deliveries=3)  # idempotent; the new limit applies
    with pytest.raises(BrokerError, match="consumes topic"):
        await embedded.declare_group(unique("topic"), group, max_deliveries=3)
    with pytest.raises(BrokerError, match="unknown consumer group"):
        await embedded.fetch(topic, unique("g"), max_messages=1, wait_s=0, visibility_s=1)
    with pytest.raises(BrokerError, match="ASCII"):
        await embedded.publish(message(topic, "kéy"), timeout_s=5)
    await embedded.publish(message(topic), timeout_s=5)
    for attempt in (1, 2, 3):
        (d,) = await embedded.fetch(topic, group, max_messages=1, wait_s=0, visibility_s=1)
        assert d.delivery_count == attempt
        await embedded.nack(d, delay_s=0)
    assert [dl.delivery_count for dl in await embedded.dead_letters(group)] == [3]


async def test_a_declared_group_gets_what_the_topic_retains_and_redeclaring_resurrects_nothing(
    embedded: EmbeddedBroker,
) -> None:
    topic, early, late = unique("topic"), unique("g"), unique("g")
    await embedded.declare_group(topic, early, max_deliveries=3)
    keys = {unique("ev") for _ in range(3)}
    for key in keys:
        await embedded.publish(message(topic, key), timeout_s=5)
    assert await drain(embedded, topic, early) == 3
    await embedded.declare_group(topic, early, max_deliveries=3)  # again: no backfill of what it acked
    assert await drain(embedded, topic, early) == 0
    await embedded.declare_group(topic, late, max_deliveries=3)
    got = await embedded.fetch(topic, late, max_messages=10, wait_s=0, visibility_s=30)
    assert {d.key for d in got} == keys


async def test_a_crash_on_the_last_delivery_is_dead_lettered_with_the_reason(
    embedded: EmbeddedBroker, clock: Clock
) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=1)
    await embedded.publish(message(topic), timeout_s=5)
    assert await drain(embedded, topic, group, ack=False, visibility_s=1) == 1
    clock.now_ms += 1001
    assert await drain(embedded, topic, group, ack=False) == 0
    (dead,) = await embedded.dead_letters(group)
    assert (dead.reason, dead.delivery_count, dead.dead_at_ms) == (CRASHED_REASON, 1, clock.now_ms)


async def test_publishes_sharing_a_transaction_fan_out_once_each_and_a_repeated_key_gets_the_first_id(
    embedded: EmbeddedBroker,
) -> None:
    topic, first, second = unique("topic"), unique("g"), unique("g")
    for group in (first, second):
        await embedded.declare_group(topic, group, max_deliveries=3)
    sent = [message(topic) for _ in range(20)]
    again = sent[3]
    ids = await asyncio.gather(*(embedded.publish(m, timeout_s=5) for m in [*sent, again, again]))
    assert len(set(ids[:20])) == 20 and ids[20] == ids[21] == ids[3]  # the repeats stored nothing
    for group in (first, second):
        got = await embedded.fetch(topic, group, max_messages=50, wait_s=0, visibility_s=30)
        assert sorted(d.key for d in got) == sorted(m.key for m in sent)  # once each, to each group
        assert {d.message_id for d in got} == set(ids)


async def test_sent_messages_keep_their_order_while_their_acknowledgements_are_outstanding(
    embedded: EmbeddedBroker,
) -> None:
    assert isinstance(embedded, PipelinedBroker)  # so the outbox worker pipelines a room's rows on it
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    sent = [message(topic) for _ in range(30)]
    acks = [await embedded.send(m) for m in sent]
    assert all(not ack.done() for ack in acks)  # queued, none committed yet
    publish = asyncio.create_task(embedded.publish(message(topic, "published after"), timeout_s=5))
    again = await embedded.send(sent[3])  # a re-send of the same key
    ids = await asyncio.gather(*acks)
    assert [int(i) for i in ids] == sorted(int(i) for i in ids) and len(set(ids)) == len(sent)
    assert await again == ids[3]  # stored once
    later = await publish
    assert int(later) > int(ids[-1])  # queued after the sends: stored after them
    got = await embedded.fetch(topic, group, max_messages=50, wait_s=0, visibility_s=30)
    assert [d.key for d in got] == [m.key for m in sent] + ["published after"]


async def test_a_send_given_up_and_sent_again_is_stored_once(embedded: EmbeddedBroker) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    sent = message(topic, "given up")
    (await embedded.send(sent)).cancel()  # its outcome is unknown: the worker sends the row again later
    again = await (await embedded.send(sent))
    got = await embedded.fetch(topic, group, max_messages=10, wait_s=0, visibility_s=30)
    assert [(d.key, d.message_id) for d in got] == [("given up", again)]


async def test_a_sent_message_is_checked_as_a_published_one_is(embedded: EmbeddedBroker) -> None:
    with pytest.raises(BrokerError):
        await embedded.send(message("t" * 200, "k"))
    await embedded.close()
    with pytest.raises(BrokerUnavailable):
        await embedded.send(message(unique("topic"), "k"))


async def test_a_body_too_large_is_refused_for_good_and_alone(embedded: EmbeddedBroker) -> None:
    """Past MariaDB's max_allowed_packet a body failed as "unavailable" (retried for ever) and took the
    publishes sharing its transaction with it (found by review): refused before any SQL, alone."""
    topic, group = unique("topic"), unique("group")
    await embedded.declare_group(topic, group, max_deliveries=3)
    big = message(topic, "big", body=b"x" * (BODY_MAX_BYTES + 1))
    small = message(topic, "small")
    results = await asyncio.gather(embedded.publish(big, timeout_s=5), embedded.publish(small, timeout_s=5),
                                   return_exceptions=True)
    assert isinstance(results[0], BrokerError) and "too large" in str(results[0])
    assert isinstance(results[1], str)
    got = await embedded.fetch(topic, group, max_messages=10, wait_s=0, visibility_s=30)
    assert [d.key for d in got] == ["small"]
    assert await embedded.publish(message(topic, "at-limit", body=b"x" * BODY_MAX_BYTES), timeout_s=5)


async def test_a_fetch_right_after_one_that_handed_messages_out_claims_checks_and_then_waits(
    embedded: EmbeddedBroker,
) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    keys = [unique("ev") for _ in range(3)]
    for key in keys:
        await embedded.publish(message(topic, key), timeout_s=5)
    first = await embedded.fetch(topic, group, max_messages=2, wait_s=0, visibility_s=30)
    # the group's last claim handed messages out: the next fetch claims at once, and still checks the group
    with pytest.raises(BrokerError, match="consumes topic"):
        await embedded.fetch(unique("topic"), group, max_messages=2, wait_s=0, visibility_s=30)
    rest = await embedded.fetch(topic, group, max_messages=2, wait_s=0, visibility_s=30)
    assert [d.key for d in first + rest] == keys
    # nothing left: no spinning on claims, it waits its wait out, then gets what comes next
    assert await embedded.fetch(topic, group, max_messages=2, wait_s=0.1, visibility_s=30) == []
    late = message(topic)
    waiting = asyncio.create_task(embedded.fetch(topic, group, max_messages=2, wait_s=20, visibility_s=30))
    await asyncio.sleep(0.05)
    await embedded.publish(late, timeout_s=5)
    assert [d.key for d in await asyncio.wait_for(waiting, timeout=10)] == [late.key]


async def test_claims_acks_and_publishes_queued_together_share_a_transaction_and_a_refused_claim_fails_alone(
    database: Database, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = count_calls(monkeypatch, database, "run_write")
    embedded = EmbeddedBroker(database, config=FAST, clock=clock)
    topic, groups = unique("topic"), [unique("g") for _ in range(3)]
    for group in groups:
        await embedded.declare_group(topic, group, max_deliveries=3)
    first, second, third = (message(topic) for _ in range(3))
    for sent in (first, second):
        await embedded.publish(sent, timeout_s=5)
    held = [(await embedded.fetch(topic, g, max_messages=1, wait_s=0, visibility_s=30))[0] for g in groups]
    before = writes.count  # every group's last claim handed out: the next ones claim at once
    got_1, got_2, refused, acked, published = await asyncio.gather(
        embedded.fetch(topic, groups[1], max_messages=5, wait_s=0, visibility_s=30),
        embedded.fetch(topic, groups[2], max_messages=5, wait_s=0, visibility_s=30),
        embedded.fetch(unique("topic"), groups[0], max_messages=5, wait_s=0, visibility_s=30),
        embedded.ack(held[0]),
        embedded.publish(third, timeout_s=5),
        return_exceptions=True,
    )
    if database.is_sqlite:  # one writer: one shared transaction (MySQL/MariaDB: each claim its own)
        assert writes.count == before + 1
    assert isinstance(refused, BrokerError) and "consumes topic" in str(refused)  # alone: the others committed
    assert acked is None and isinstance(published, str)
    for got in (got_1, got_2):  # SQLite: claimed before the publish queued after them (MySQL: either way)
        assert isinstance(got, list)
        claimed = [d.key for d in got]
        assert claimed == [second.key] or (not database.is_sqlite and claimed == [second.key, third.key])
    rest = await embedded.fetch(topic, groups[0], max_messages=5, wait_s=0, visibility_s=30)
    assert [d.key for d in rest] == [second.key, third.key]  # its first message acked, nothing lost


async def test_acks_queued_with_ack_nowait_share_a_transaction_and_refuse_what_ack_refuses(
    database: Database, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = count_calls(monkeypatch, database, "run_write")
    embedded = EmbeddedBroker(database, config=FAST, clock=clock)
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    for _ in range(3):
        await embedded.publish(message(topic), timeout_s=5)
    got = await embedded.fetch(topic, group, max_messages=5, wait_s=0, visibility_s=30)
    before = writes.count
    acks = [embedded.ack_nowait(d) for d in got]  # queued before they return: no task each
    assert await asyncio.gather(*acks) == [None] * 3
    assert writes.count == before + 1  # one executemany, one transaction
    assert (await embedded.group_stats(topic, group)).lag == 0
    with pytest.raises(BrokerError, match="not a delivery of the embedded broker"):
        embedded.ack_nowait(dataclasses.replace(got[0], receipt=None))


# --------------------------------------------------------------------------- retention


async def test_purge_is_bounded_and_deletes_messages_every_group_acknowledged(
    embedded: EmbeddedBroker, database: Database, clock: Clock
) -> None:
    topic, first, second = unique("topic"), unique("g"), unique("g")
    await embedded.declare_group(topic, first, max_deliveries=3)
    await embedded.declare_group(topic, second, max_deliveries=3)
    sent = [message(topic) for _ in range(5)]
    for m in sent:
        await embedded.publish(m, timeout_s=5)
    assert await drain(embedded, topic, first) == 5
    clock.now_ms = T0 + RETENTION_MS + 1
    # The second group has not acknowledged them, but is not stopped for longer than the retention:
    assert await embedded.purge(T0, 100) == 0
    assert await drain(embedded, topic, second) == 5
    # Acknowledged by every group, and retained until the retention is over: a duplicate is stored once.
    assert await embedded.purge(T0, 100) == 0
    await embedded.publish(sent[0], timeout_s=5)
    assert await drain(embedded, topic, first) == 0
    assert [await embedded.purge(T0 + 1, 2) for _ in range(4)] == [2, 2, 1, 0]
    assert await rows(database, broker_message) == 0
    # Forgotten with its message: the same key is a new message now.
    await embedded.publish(sent[0], timeout_s=5)
    assert await drain(embedded, topic, first) == 1


async def test_a_stopped_groups_backlog_is_kept_for_the_whole_retention(
    embedded: EmbeddedBroker, database: Database, clock: Clock
) -> None:
    topic, busy, stopped = unique("topic"), unique("g"), unique("g")
    await embedded.declare_group(topic, busy, max_deliveries=3)
    await embedded.declare_group(topic, stopped, max_deliveries=3)
    for _ in range(3):
        await embedded.publish(message(topic), timeout_s=5)
    await embedded.publish(message(topic, deliver_at_ms=T0 + 10 * RETENTION_MS), timeout_s=5)  # held long
    assert await drain(embedded, topic, busy) == 3
    clock.now_ms = T0 + RETENTION_MS  # exactly the retention: nothing is older than it yet
    assert await embedded.purge(clock.now_ms - RETENTION_MS, 100) == 0
    assert (await embedded.group_stats(topic, stopped)).lag == 4
    clock.now_ms += 1  # the backlog (3 deliveries) expires, then its 3 messages; the held one stays
    assert await embedded.purge(clock.now_ms - RETENTION_MS, 100) == 6
    assert (await embedded.group_stats(topic, stopped)).lag == 1
    assert (await embedded.group_stats(topic, busy)).lag == 1
    assert await rows(database, broker_message) == 1


async def test_a_message_in_flight_is_not_purged_until_acknowledged(
    embedded: EmbeddedBroker, database: Database, clock: Clock
) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    await embedded.publish(message(topic), timeout_s=5)
    clock.now_ms = T0 + 2 * RETENTION_MS  # handed out long after it was published
    (d,) = await embedded.fetch(topic, group, max_messages=1, wait_s=0, visibility_s=30)
    assert await embedded.purge(clock.now_ms - RETENTION_MS, 100) == 0
    await embedded.ack(d)
    assert await embedded.purge(clock.now_ms - RETENTION_MS, 100) == 1
    assert await rows(database, broker_message) == 0


async def test_dead_letters_are_purged_after_the_retention_with_their_message(
    embedded: EmbeddedBroker, database: Database, clock: Clock
) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=1)
    for _ in range(3):
        await embedded.publish(message(topic), timeout_s=5)
    clock.now_ms = T0 + 1000
    for d in await embedded.fetch(topic, group, max_messages=10, wait_s=0, visibility_s=30):
        await embedded.nack(d, delay_s=0, reason="broken")
    assert len(await embedded.dead_letters(group)) == 3
    assert await embedded.purge(T0 + 1000, 100) == 0  # died at T0 + 1000: not older than that
    assert len(await embedded.dead_letters(group)) == 3
    assert await embedded.purge(T0 + 1001, 4) == 4  # three dead letters, then one message
    assert await embedded.dead_letters(group) == []
    assert await rows(database, broker_delivery) == 0
    assert await rows(database, broker_message) == 2
    assert await embedded.purge(T0 + 1001, 100) == 2


# --------------------------------------------------------------------------- two processes, one database


async def test_two_processes_never_hold_one_delivery_at_once(backend_url: str) -> None:
    async with migrated_database(backend_url) as db, second_process(backend_url) as other_db:
        a, b = EmbeddedBroker(db, config=FAST), EmbeddedBroker(other_db, config=FAST)
        topic, group = unique("topic"), unique("g")
        await a.declare_group(topic, group, max_deliveries=3)
        keys = [unique("ev") for _ in range(60)]
        for i, key in enumerate(keys):
            await (a if i % 2 else b).publish(message(topic, key), timeout_s=5)

        # What one process holds, the other cannot take while it is visible to nobody.
        held = await a.fetch(topic, group, max_messages=15, wait_s=0, visibility_s=30)
        rest = await b.fetch(topic, group, max_messages=100, wait_s=0, visibility_s=30)
        assert len(held) == 15 and len(rest) == 45
        assert not {d.key for d in held} & {d.key for d in rest}
        assert await a.fetch(topic, group, max_messages=100, wait_s=0.1, visibility_s=30) == []
        for d in held:
            await a.nack(d, delay_s=0)
        for d in rest:
            await b.nack(d, delay_s=0)

        # Both fetching at once: every message reaches exactly one of them.
        seen: dict[str, list[str]] = {}

        async def consume(broker: EmbeddedBroker, name: str) -> None:
            end = time.monotonic() + 20
            while sum(map(len, seen.values())) < len(keys) and time.monotonic() < end:
                for d in await broker.fetch(topic, group, max_messages=3, wait_s=0.2, visibility_s=30):
                    seen.setdefault(d.key, []).append(name)
                    await asyncio.sleep(0)  # let the other process claim meanwhile
                    await broker.ack(d)

        await asyncio.gather(consume(a, "a1"), consume(a, "a2"), consume(b, "b1"), consume(b, "b2"))
        assert sorted(seen) == sorted(keys)
        assert all(len(names) == 1 for names in seen.values()), seen
        assert (await b.group_stats(topic, group)).lag == 0


async def test_a_closed_broker_refuses_and_ends_waiting_fetches(embedded: EmbeddedBroker) -> None:
    topic, group = unique("topic"), unique("g")
    await embedded.declare_group(topic, group, max_deliveries=3)
    waiting = asyncio.create_task(embedded.fetch(topic, group, max_messages=1, wait_s=30, visibility_s=1))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await embedded.close()
    assert await asyncio.wait_for(waiting, timeout=5) == []
    assert time.monotonic() - started < 5
    with pytest.raises(BrokerUnavailable):
        await embedded.publish(message(topic), timeout_s=5)


# --------------------------------------------------------------------------- waiting and outages

SLOW_POLL = EmbeddedBrokerConfig.model_validate({"poll_interval": "30s"})


async def test_a_waiting_fetch_wakes_on_a_publish_in_its_process(database: Database) -> None:
    broker = EmbeddedBroker(database, config=SLOW_POLL)
    topic, group = unique("topic"), unique("g")
    await broker.declare_group(topic, group, max_deliveries=3)
    started = time.monotonic()
    waiting = asyncio.create_task(broker.fetch(topic, group, max_messages=1, wait_s=20, visibility_s=5))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    sent = message(topic)
    await broker.publish(sent, timeout_s=5)
    (got,) = await asyncio.wait_for(waiting, timeout=10)
    assert got.key == sent.key
    assert time.monotonic() - started < 10  # not the 30 s poll, nor the 20 s wait


async def test_a_waiting_fetch_wakes_when_a_held_message_is_due(database: Database) -> None:
    broker = EmbeddedBroker(database, config=SLOW_POLL)
    topic, group = unique("topic"), unique("g")
    await broker.declare_group(topic, group, max_deliveries=3)
    due_ms = int(time.time() * 1000) + 500
    await broker.publish(message(topic, deliver_at_ms=due_ms), timeout_s=5)
    (got,) = await broker.fetch(topic, group, max_messages=1, wait_s=20, visibility_s=5)
    assert due_ms - 50 <= time.time() * 1000 < due_ms + 10_000  # at its time, not at the next 30 s poll
    assert got.delivery_count == 1


async def test_a_database_that_does_not_answer_is_broker_unavailable() -> None:
    db = Database.from_url("mysql+asyncmy://root@127.0.0.1:9/nowhere", timeout_s=0.5)
    broker = EmbeddedBroker(db)
    try:
        with pytest.raises(BrokerUnavailable):
            await broker.publish(message("topic"), timeout_s=2)
        with pytest.raises(BrokerUnavailable):
            await (await broker.send(message("topic")))
        with pytest.raises(BrokerUnavailable):
            await broker.ping()
        with pytest.raises(BrokerUnavailable):
            await broker.fetch("topic", "g", max_messages=1, wait_s=0, visibility_s=1)
    finally:
        await db.dispose()


# --------------------------------------------------------------------------- a group declared mid-publish


async def _in_lock_wait(db: Database) -> bool:
    """Whether a transaction of the server waits for a row lock (the tests here run one at a time;
    MariaDB's INNODB_TRX does not name the waiting connection by its CONNECTION_ID())."""
    query = "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
    async with db.read() as conn:
        return bool(await conn.scalar(sa.text(query)))


@pytest.mark.parametrize("first", ["publish", "declare"])
async def test_a_group_declared_while_a_publish_is_uncommitted_still_gets_the_message(
    migrated_mariadb_url: str, first: str
) -> None:
    """READ COMMITTED, two transactions: one publishes a message of the topic, the other declares a new
    group of it. Whichever runs first stays uncommitted while the other runs; the group must end up
    with the message either way — by the publish's fan-out or by the declare's backfill."""
    from roomservice.brokers.embedded import _declare, _publish_all

    topic, group = unique("topic"), unique("late")
    async with migrated_database(migrated_mariadb_url) as db:
        broker = await open_embedded_broker(db, FAST)
        try:
            row = broker._outgoing(message(topic))

            def publish(conn: sa.Connection) -> None:
                _publish_all(conn, [row])

            def declare(conn: sa.Connection) -> None:
                _declare(conn, topic, group, 5, T0)

            steps = (publish, declare) if first == "publish" else (declare, publish)
            async with db.engine.connect() as one, db.engine.connect() as two:
                await one.begin()
                await one.run_sync(steps[0])  # in flight: not committed yet
                await two.begin()
                second = asyncio.create_task(two.run_sync(steps[1]))
                deadline = time.monotonic() + 10
                while not second.done() and not await _in_lock_wait(db):  # it waits for the first, or not
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                await one.commit()
                await second
                await two.commit()
            async with db.read() as conn:
                groups = (await conn.execute(sa.select(broker_delivery.c.group_name))).scalars().all()
            assert group in groups
        finally:
            await broker.close()
