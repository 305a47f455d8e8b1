"""The publisher port: one named target, one event per call, errors that say whether to retry.

    PublishError
    ├── RetryableError   the target may accept it later (timeout, outage, throttling)
    └── PermanentError   it never will (rejected payload, invalid argument): dead letter now

A :class:`PublisherSet` holds one publisher per target name (``im``,
``activity``, ``broker``, ``treasure_wakeup``); which of them a row needs is
decided by :func:`roomservice.outbox.model.required_targets` from the routing
table and the publish mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from roomservice.domain.events import Event
from roomservice.outbox.treasure import TreasureScheduler


class PublishError(Exception):
    retryable: bool = True


class RetryableError(PublishError):
    retryable = True


class PermanentError(PublishError):
    retryable = False


class Publisher(Protocol):
    name: str

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        """Deliver ``event`` (``payload`` is its protobuf envelope) before ``deadline``
        (``loop.time()`` seconds); raise :class:`PublishError` when it was not delivered.
        Delivering twice must be harmless: consumers deduplicate by event_id."""
        ...


@dataclass(frozen=True, slots=True)
class PublisherSet:
    """The publishers of this process, by target name."""

    publishers: Mapping[str, Publisher] = field(default_factory=dict)

    def get(self, target: str) -> Publisher | None:
        return self.publishers.get(target)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.publishers)


class FakePublisher:
    """A scriptable publisher for tests: succeed, fail N times, fail permanently, or hang."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []  # event ids, one per attempt
        self.delivered: list[str] = []
        self.fail_times = 0  # retryable failures before the first success
        self.permanent = False
        self.hang = False
        self.down = False
        self._seen: set[str] = set()
        self.called = asyncio.Event()

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        self.calls.append(event.event_id)
        self.called.set()
        if self.hang:
            await asyncio.sleep(3600)
        if self.permanent:
            raise PermanentError(f"{self.name} rejects {event.type}")
        if self.down:
            raise RetryableError(f"{self.name} is down")
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RetryableError(f"{self.name} failed transiently")
        if event.event_id not in self._seen:
            self._seen.add(event.event_id)
            self.delivered.append(event.event_id)


class TreasureWakeupPublisher:
    """The ``treasure_wakeup`` target: hands RoomTreasureCountdownStarted to a scheduler
    (the durable database timer, or later the broker's delay messages)."""

    name = "treasure_wakeup"

    def __init__(self, scheduler: TreasureScheduler) -> None:
        self.scheduler = scheduler

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        try:
            await self.scheduler.schedule(event)
        except PublishError:
            raise
        except Exception as exc:  # the timer table is in our database: an outage, retry
            raise RetryableError(f"scheduling the wake-up failed: {exc!r}") from exc
