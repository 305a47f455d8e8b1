"""A scriptable publisher for tests (the port's own fake)."""

from __future__ import annotations

import asyncio

from roomservice.domain.events import Event
from roomservice.publishers.port import PermanentError, RetryableError


class FakePublisher:
    """A scriptable publisher for tests: succeed, fail N times, fail permanently, or hang.

    ``hang`` ignores the deadline (a misbehaving publisher, for the worker's own bound);
    ``unresponsive`` is a peer that never answers, seen by a well-behaved publisher: it
    waits out the deadline and raises :class:`RetryableError`, as a deadline already
    passed does at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []  # event ids, one per attempt
        self.delivered: list[str] = []
        self.fail_times = 0  # retryable failures before the first success
        self.permanent = False
        self.hang = False
        self.unresponsive = False
        self.down = False
        self._seen: set[str] = set()
        self.called = asyncio.Event()

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        self.calls.append(event.event_id)
        self.called.set()
        if self.hang:
            await asyncio.sleep(3600)
        loop = asyncio.get_running_loop()
        if self.unresponsive:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise RetryableError(f"{self.name} did not answer before the deadline")
        if loop.time() >= deadline:
            raise RetryableError(f"{self.name}: the deadline passed before sending")
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
