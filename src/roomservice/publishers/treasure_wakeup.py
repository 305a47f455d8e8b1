"""The ``treasure_wakeup`` target: hands countdowns to a treasure scheduler."""

from __future__ import annotations

import asyncio

from roomservice.domain.events import Event
from roomservice.domain.routing import Target
from roomservice.publishers.port import PublishError, RetryableError
from roomservice.timers.port import TreasureScheduler


class TreasureWakeupPublisher:
    """The ``treasure_wakeup`` target: hands RoomTreasureCountdownStarted to a scheduler
    (the durable database timer, or later the broker's delay messages), within the deadline."""

    name = Target.TREASURE_WAKEUP.value

    def __init__(self, scheduler: TreasureScheduler) -> None:
        self.scheduler = scheduler

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        if asyncio.get_running_loop().time() >= deadline:
            raise RetryableError("scheduling the wake-up: the deadline passed before it started")
        try:
            async with asyncio.timeout_at(deadline):  # a hung database must not hold the row
                await self.scheduler.schedule(event)
        except PublishError:
            raise
        except TimeoutError as exc:
            raise RetryableError("scheduling the wake-up did not finish before the deadline") from exc
        except Exception as exc:  # the timer table is in our database: an outage, retry
            raise RetryableError(f"scheduling the wake-up failed: {exc!r}") from exc
