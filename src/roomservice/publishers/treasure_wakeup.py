"""The ``treasure_wakeup`` target: hands countdowns to a treasure scheduler."""

from __future__ import annotations

from roomservice.domain.events import Event
from roomservice.domain.routing import Target
from roomservice.publishers.port import PublishError, RetryableError
from roomservice.timers.port import TreasureScheduler


class TreasureWakeupPublisher:
    """The ``treasure_wakeup`` target: hands RoomTreasureCountdownStarted to a scheduler
    (the durable database timer, or later the broker's delay messages)."""

    name = Target.TREASURE_WAKEUP.value

    def __init__(self, scheduler: TreasureScheduler) -> None:
        self.scheduler = scheduler

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        try:
            await self.scheduler.schedule(event)
        except PublishError:
            raise
        except Exception as exc:  # the timer table is in our database: an outage, retry
            raise RetryableError(f"scheduling the wake-up failed: {exc!r}") from exc
