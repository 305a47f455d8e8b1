"""The broker port's contract: one abstract suite that every adapter subclasses (faststream-style).

A subclass provides the ``broker`` fixture (a ready :class:`Broker`); adapters
whose test can stop and start the broker (a real process, or the database
behind it) subclass :class:`DurableBrokerContract` and implement ``restart``.
Names are unique per test, so adapters on shared servers (the shared NATS,
the shared MariaDB) never see each other's messages.

Times are short but real: visibility timeouts, delays and nack delays are
observed by polling with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

import pytest

from roomservice.brokers.port import Broker, Delivery, OutgoingMessage

VIS = 0.6  # visibility timeout of a fetch in these tests
DEADLINE = 10.0  # generous bound for what must happen "soon"


def unique(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


def message(topic: str, key: str | None = None, *, body: bytes = b"payload", **kw: object) -> OutgoingMessage:
    return OutgoingMessage(topic=topic, body=body, key=key or unique("ev"), **kw)  # type: ignore[arg-type]


async def fetch(broker: Broker, topic: str, group: str, *, wait_s: float = 0.2, n: int = 10) -> Sequence[Delivery]:
    return await broker.fetch(topic, group, max_messages=n, wait_s=wait_s, visibility_s=VIS)


async def fetch_until(broker: Broker, topic: str, group: str, *, deadline_s: float = DEADLINE) -> Delivery:
    """The next delivery of the group, polling until ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = await fetch(broker, topic, group, wait_s=0.3, n=1)
        if got:
            return got[0]
    raise AssertionError(f"no delivery for {group} within {deadline_s}s")


async def eventually(check: Callable[[], Awaitable[bool]], *, deadline_s: float = DEADLINE) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


class BrokerContract:
    """Subclass as ``TestXxxBroker(BrokerContract)`` and provide the ``broker`` fixture."""

    # False for a broker that cannot report a group's lag (RocketMQ's gRPC proxy): the tests then
    # check everything else they check, and the lag assertions are left out.
    reports_lag = True

    @pytest.fixture
    def topic(self) -> str:
        return unique("topic")

    # ------------------------------------------------------------------ publish and deliver

    async def test_a_published_message_reaches_its_group_with_everything_it_carried(
        self, broker: Broker, topic: str
    ) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        sent = message(topic, tag="RoomGiftSent", sharding_key="demo:r1", headers={"traceparent": "00-abc-01"})
        message_id = await broker.publish(sent, timeout_s=5)
        got = await fetch_until(broker, topic, group)
        assert (got.message_id, got.key, got.tag, got.sharding_key, got.body) == (
            message_id,
            sent.key,
            "RoomGiftSent",
            "demo:r1",
            b"payload",
        )
        assert got.headers.get("traceparent") == "00-abc-01"
        assert (got.topic, got.group, got.delivery_count) == (topic, group, 1)

    async def test_an_acknowledged_message_is_not_delivered_again(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        await broker.publish(message(topic), timeout_s=5)
        got = await fetch_until(broker, topic, group)
        await broker.ack(got)
        await asyncio.sleep(VIS + 0.2)  # past the visibility timeout: an unacked message would be back
        assert await fetch(broker, topic, group, wait_s=0.3) == []
        if self.reports_lag:
            assert (await broker.group_stats(topic, group)).lag == 0

    async def test_groups_progress_independently(self, broker: Broker, topic: str) -> None:
        first, second = unique("g"), unique("g")
        await broker.declare_group(topic, first, max_deliveries=3)
        await broker.declare_group(topic, second, max_deliveries=3)
        sent = message(topic)
        await broker.publish(sent, timeout_s=5)
        a = await fetch_until(broker, topic, first)
        await broker.ack(a)
        b = await fetch_until(broker, topic, second)  # acking in one group took nothing from the other
        assert a.key == b.key == sent.key and b.delivery_count == 1
        if self.reports_lag:
            assert (await broker.group_stats(topic, second)).lag == 1
        await broker.ack(b)
        if self.reports_lag:
            await eventually(lambda: _lag_is(broker, topic, second, 0))

    async def test_a_stopped_groups_backlog_waits_for_it(self, broker: Broker, topic: str) -> None:
        busy, stopped = unique("g"), unique("g")
        await broker.declare_group(topic, busy, max_deliveries=3)
        await broker.declare_group(topic, stopped, max_deliveries=3)
        keys = [unique("ev") for _ in range(5)]
        for key in keys:
            await broker.publish(message(topic, key), timeout_s=5)
        for _ in keys:
            await broker.ack(await fetch_until(broker, topic, busy))
        if self.reports_lag:
            assert (await broker.group_stats(topic, stopped)).lag == 5
        seen = set()
        for _ in keys:
            got = await fetch_until(broker, topic, stopped)
            seen.add(got.key)
            await broker.ack(got)
        assert seen == set(keys)

    async def test_a_duplicate_publish_of_one_key_is_stored_once(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        sent = message(topic)
        await broker.publish(sent, timeout_s=5)
        await broker.publish(sent, timeout_s=5)
        got = await fetch_until(broker, topic, group)
        await broker.ack(got)
        assert await fetch(broker, topic, group, wait_s=0.5) == []

    # ------------------------------------------------------------------ redelivery

    async def test_an_unacknowledged_delivery_comes_back_after_the_visibility_timeout(
        self, broker: Broker, topic: str
    ) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=5)
        await broker.publish(message(topic), timeout_s=5)
        first = await fetch_until(broker, topic, group)
        assert await fetch(broker, topic, group, wait_s=0.1) == []  # invisible while in flight
        again = await fetch_until(broker, topic, group)
        assert again.key == first.key and again.delivery_count == 2

    async def test_a_touched_delivery_stays_invisible_until_its_touches_stop(self, broker: Broker, topic: str) -> None:
        """A consumer that holds a delivery (waiting for its turn behind its room's earlier one) keeps it from
        coming back, and from counting a delivery more, for as long as it touches it."""
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=5)
        await broker.publish(message(topic), timeout_s=5)
        first = await fetch_until(broker, topic, group)
        touched_for = time.monotonic() + 2.5 * VIS  # well past its own visibility timeout
        while time.monotonic() < touched_for:
            assert await fetch(broker, topic, group, wait_s=VIS / 3) == []  # not back
            await broker.touch(first, visibility_s=VIS)
        again = await fetch_until(broker, topic, group)  # back once the touches stop
        assert again.key == first.key and again.delivery_count == 2
        await broker.ack(again)
        await broker.touch(first, visibility_s=VIS)  # a stale or settled delivery: nothing happens
        await broker.touch(again, visibility_s=VIS)
        assert await fetch(broker, topic, group, wait_s=VIS + 0.2) == []

    async def test_nack_redelivers_after_the_delay(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=5)
        await broker.publish(message(topic), timeout_s=5)
        first = await fetch_until(broker, topic, group)
        started = time.monotonic()
        await broker.nack(first, delay_s=1.0, reason="try later")
        again = await fetch_until(broker, topic, group)
        assert time.monotonic() - started >= 0.9
        assert again.delivery_count == 2

    async def test_a_poison_message_holds_up_nothing_but_itself(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=20)
        poison, good = unique("poison"), unique("good")
        await broker.publish(message(topic, poison), timeout_s=5)
        await broker.publish(message(topic, good), timeout_s=5)
        acked: set[str] = set()
        end = time.monotonic() + DEADLINE
        while good not in acked and time.monotonic() < end:
            for d in await fetch(broker, topic, group, wait_s=0.3):
                if d.key == poison:
                    await broker.nack(d, delay_s=0.1, reason="poison")
                else:
                    await broker.ack(d)
                    acked.add(d.key)
        assert good in acked

    # ------------------------------------------------------------------ dead letters

    async def test_a_message_that_keeps_failing_is_dead_lettered_after_the_limit(
        self, broker: Broker, topic: str
    ) -> None:
        group, other = unique("g"), unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        await broker.declare_group(topic, other, max_deliveries=3)
        sent = message(topic, tag="RoomUserKicked")
        await broker.publish(sent, timeout_s=5)
        for attempt in range(1, 4):
            got = await fetch_until(broker, topic, group)
            assert got.delivery_count == attempt
            await broker.nack(got, delay_s=0.05, reason=f"failure {attempt}")
        await eventually(lambda: _dead_count_is(broker, group, 1))
        assert await fetch(broker, topic, group, wait_s=0.5) == []
        (dead,) = await broker.dead_letters(group)
        assert (dead.key, dead.tag, dead.body, dead.delivery_count) == (sent.key, "RoomUserKicked", b"payload", 3)
        assert "failure 3" in dead.reason
        if self.reports_lag:
            stats = await broker.group_stats(topic, group)
            assert (stats.lag, stats.dead_letters) == (0, 1)
        assert (await fetch_until(broker, topic, other)).key == sent.key  # the other group is unaffected

    async def test_a_consumer_that_crashes_on_the_last_delivery_still_dead_letters(
        self, broker: Broker, topic: str
    ) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=2)
        sent = message(topic)
        await broker.publish(sent, timeout_s=5)
        assert (await fetch_until(broker, topic, group)).delivery_count == 1  # never acked: "crash"
        assert (await fetch_until(broker, topic, group)).delivery_count == 2  # the last one, never acked
        await asyncio.sleep(VIS + 0.2)

        async def moved() -> bool:
            assert await fetch(broker, topic, group, wait_s=0.2) == []  # never a third delivery
            return len(await broker.dead_letters(group)) == 1

        await eventually(moved)
        assert (await broker.dead_letters(group))[0].key == sent.key

    async def test_a_replayed_dead_letter_goes_to_its_group_only_with_its_key(self, broker: Broker, topic: str) -> None:
        group, other = unique("g"), unique("g")
        await broker.declare_group(topic, group, max_deliveries=1)
        await broker.declare_group(topic, other, max_deliveries=1)
        sent = message(topic)
        await broker.publish(sent, timeout_s=5)
        await broker.ack(await fetch_until(broker, topic, other))
        await broker.nack(await fetch_until(broker, topic, group), delay_s=0, reason="broken")
        await eventually(lambda: _dead_count_is(broker, group, 1))
        (dead,) = await broker.dead_letters(group)
        assert await broker.replay_dead_letter(group, dead.message_id)
        assert not await broker.replay_dead_letter(group, dead.message_id)  # gone from the dead letters
        again = await fetch_until(broker, topic, group)
        assert (again.key, again.body, again.delivery_count) == (sent.key, b"payload", 1)
        await broker.ack(again)
        assert await fetch(broker, topic, other, wait_s=0.5) == []
        assert await broker.dead_letters(group) == []

    # ------------------------------------------------------------------ delay

    async def test_a_delayed_message_is_held_until_its_time(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        due_ms = int(time.time() * 1000) + 1500
        await broker.publish(message(topic, deliver_at_ms=due_ms), timeout_s=5)
        await broker.publish(message(topic, "now"), timeout_s=5)
        first = await fetch_until(broker, topic, group)
        assert first.key == "now"
        await broker.ack(first)
        got = await fetch_until(broker, topic, group)
        assert time.time() * 1000 >= due_ms - 50  # not before its time (50 ms for clock granularity)
        assert got.delivery_count == 1  # holding it did not count as a delivery


class DurableBrokerContract(BrokerContract):
    """For adapters whose test can stop and start the broker: ``restart`` returns an adapter on the new one."""

    async def restart(self, broker: Broker) -> Broker:
        raise NotImplementedError

    # ------------------------------------------------------------------ durability

    async def test_an_acknowledged_publish_survives_a_broker_restart(self, broker: Broker, topic: str) -> None:
        group = unique("g")
        await broker.declare_group(topic, group, max_deliveries=3)
        sent = message(topic)
        await broker.publish(sent, timeout_s=5)
        restarted = await self.restart(broker)
        got = await fetch_until(restarted, topic, group)
        assert got.key == sent.key


async def _lag_is(broker: Broker, topic: str, group: str, lag: int) -> bool:
    return (await broker.group_stats(topic, group)).lag == lag


async def _dead_count_is(broker: Broker, group: str, n: int) -> bool:
    return len(await broker.dead_letters(group)) == n
