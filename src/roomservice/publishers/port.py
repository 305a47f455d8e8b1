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
from typing import Any, Protocol

from roomservice import errors
from roomservice.domain.events import Event


class PublishError(errors.RoomServiceError):
    """A target did not take the event; ``retryable`` says whether a later attempt may succeed."""

    code = "publish_failed"
    retryable = True


class RetryableError(PublishError):
    code = "publish_retryable"
    retryable = True


class PermanentError(PublishError):
    code = "publish_rejected"
    retryable = False


class Publisher(Protocol):
    name: str

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        """Deliver ``event`` (``payload`` is its protobuf envelope) before ``deadline``
        (``loop.time()`` seconds); raise :class:`PublishError` when it was not delivered.
        Delivering twice must be harmless: consumers deduplicate by event_id."""
        ...


class PipeliningPublisher(Publisher, Protocol):
    """A publisher that can also take a claimed row without waiting for its acknowledgement
    (``pipelined`` true: its target keeps the order of what it was sent). The outbox worker
    uses it for a batch's rows that need this one target."""

    pipelined: bool

    async def send_claimed(
        self, *, event_id: str, event_type: str, app_code: str, room_id: str, payload: bytes
    ) -> asyncio.Future[Any]:
        """Queue the row; once this returns it goes before any row sent after it. The future is
        the acknowledgement: done when the target holds the row, failing with the target's own
        error, which :meth:`failure` turns into a :class:`PublishError` (one future per row, not
        one per layer). No deadline of its own: the caller bounds the wait and cancels the
        future to give up."""
        ...

    def failure(self, exc: BaseException) -> BaseException:
        """The publisher port's error for what an acknowledgement failed with."""
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
