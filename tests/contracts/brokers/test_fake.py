"""The contract run against the in-memory fake broker (the reference the adapters are held to)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from tests.contracts.brokers.base import BrokerContract

from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import OutgoingMessage


class TestFakeBroker(BrokerContract):
    @pytest_asyncio.fixture
    async def broker(self) -> AsyncIterator[FakeBroker]:
        broker = FakeBroker()
        yield broker
        await broker.close()


async def test_the_fake_broker_reads_the_wall_clock_it_is_given() -> None:
    """published_at_ms, dead_at_ms and deliver_at_ms are on the injected clock (the project's one clock,
    ``roomservice.clock``), as on the embedded broker; here a clock far from the machine's."""
    now_ms = 4_102_444_800_000  # 2100-01-01: a deliver_at_ms a second behind it is due on this clock only
    broker = FakeBroker(clock=lambda: now_ms)
    await broker.declare_group("t-clock", "g-clock", max_deliveries=1)
    due = OutgoingMessage(topic="t-clock", body=b"x", key="due", deliver_at_ms=now_ms - 1_000)
    await broker.publish(due, timeout_s=1)

    (delivery,) = await broker.fetch("t-clock", "g-clock", max_messages=10, wait_s=0, visibility_s=30)
    assert (delivery.key, delivery.published_at_ms) == ("due", now_ms)
    await broker.nack(delivery, delay_s=0, reason="poison")  # its last delivery: buried
    (dead,) = await broker.dead_letters("g-clock")
    assert dead.dead_at_ms == now_ms
