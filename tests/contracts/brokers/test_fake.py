"""The contract run against the in-memory fake broker (the reference the adapters are held to)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from tests.contracts.brokers.base import BrokerContract

from roomservice.brokers.fake import FakeBroker


class TestFakeBroker(BrokerContract):
    @pytest_asyncio.fixture
    async def broker(self) -> AsyncIterator[FakeBroker]:
        broker = FakeBroker()
        yield broker
        await broker.close()
