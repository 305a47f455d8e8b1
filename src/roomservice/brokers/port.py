"""The broker port: durable publish, consumer groups with independent progress, redelivery and dead letters.

Every adapter (embedded in our database, NATS JetStream, RocketMQ 5) gives the
same guarantees, checked by one contract suite (``tests/contracts/brokers``):

* ``publish`` returns only once the broker holds the message durably (JetStream
  PubAck, RocketMQ SEND_OK, the embedded commit). Publishing the same ``key``
  again inside the broker's duplicate window stores it once.
* Each consumer **group** of a topic sees every message of the topic that was
  published after the group was declared (``declare_group``; the embedded
  adapter and JetStream also deliver what the topic retains from before), at
  its own pace: groups never steal each other's messages, and a stopped
  group's backlog is kept for as long as the configured retention.
* A fetched delivery is invisible to other fetchers of its group for
  ``visibility_s``; unless acknowledged in time it comes back with
  ``delivery_count`` + 1. ``nack(delay_s)`` asks for it again after the delay.
* After ``max_deliveries`` deliveries without an ack (the seed's
  ``consumer_max_reconsume_times`` + 1) the message goes to the group's dead
  letter instead of a further delivery — also when the consumer crashed during
  its last delivery (the next fetch moves it). Dead letters are listed and
  replayed per group; a replay goes to that group only and keeps the key.
* ``deliver_at_ms`` holds a message until then (treasure wake-ups).

Headers carry a trace context (and whatever else a publisher needs) through.
Errors: :class:`BrokerUnavailable` (retryable) when the broker does not
answer or refuses for now; :class:`BrokerError` for what retrying cannot fix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from roomservice import errors


class BrokerError(errors.RoomServiceError):
    """The broker refused the request for good (bad name, message too large)."""

    code = "broker_error"


class BrokerUnavailable(errors.Unavailable):
    """The broker did not answer in time or refused for now; retrying is safe."""


def within(timeout_s: float | None) -> str:
    """How a publish's bound reads in an error: "within 3s", or the caller's deadline (``None``)."""
    return "before the caller's deadline" if timeout_s is None else f"within {timeout_s:g}s"


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    topic: str
    body: bytes
    key: str  # the event id: deduplication within the broker's window, and what a consumer dedups on
    tag: str = ""  # the event type
    sharding_key: str = ""  # the room: RocketMQ message group / FIFO key
    headers: Mapping[str, str] = field(default_factory=dict)
    deliver_at_ms: int | None = None  # hold until then (None: deliver now)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message to one group. ``receipt`` is the adapter's handle for ack/nack."""

    topic: str
    group: str
    message_id: str
    key: str
    tag: str
    sharding_key: str
    body: bytes
    headers: Mapping[str, str]
    delivery_count: int  # 1 on the first delivery
    published_at_ms: int
    receipt: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    group: str
    topic: str
    message_id: str
    key: str
    tag: str
    body: bytes
    headers: Mapping[str, str]
    delivery_count: int
    dead_at_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class GroupStats:
    topic: str
    group: str
    lag: int  # messages the group has not acknowledged yet (ready, held or in flight)
    in_flight: int
    dead_letters: int


class Broker(Protocol):
    name: str  # "embedded", "nats", "rocketmq"

    async def publish(self, message: OutgoingMessage, *, timeout_s: float | None) -> str:
        """Store ``message`` durably within ``timeout_s``; return the broker's message id.
        Raises BrokerUnavailable (retry) or BrokerError. ``None``: no timer of the adapter's own,
        for a caller that bounds the whole call by its own deadline (the outbox worker's attempts,
        through :class:`~roomservice.publishers.broker.BrokerPublisher`)."""
        ...

    async def declare_group(self, topic: str, group: str, *, max_deliveries: int) -> None:
        """Create the group's subscription to ``topic`` if it does not exist (idempotent)."""
        ...

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> Sequence[Delivery]:
        """Up to ``max_messages`` deliveries, waiting at most ``wait_s`` for the first one."""
        ...

    async def ack(self, delivery: Delivery) -> None:
        """The group is done with this message; it is never delivered to the group again."""
        ...

    async def nack(self, delivery: Delivery, *, delay_s: float, reason: str = "") -> None:
        """Deliver it again after ``delay_s``, or dead-letter it when it has had its last delivery."""
        ...

    async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
        """The consumer still holds ``delivery`` (it waits for its turn behind the same key's earlier
        one, say): it does not come back for ``visibility_s`` more from now, the visibility its fetch
        asked for (NATS restarts the group's ack wait, which the fetch set to it). A delivery acked
        since is left alone; one redelivered since is too, except on NATS, whose progress
        acknowledgement names the message, not the delivery (its current delivery is held then)."""
        ...

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        """The group's dead letters, oldest first."""
        ...

    async def replay_dead_letter(self, group: str, message_id: str) -> bool:
        """Deliver a dead letter to ``group`` again (delivery count reset); False if there is none."""
        ...

    async def group_stats(self, topic: str, group: str) -> GroupStats: ...

    async def ping(self) -> None:
        """Raise BrokerUnavailable unless the broker answers now (for /readyz and metrics)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class PipelinedBroker(Protocol):
    """What an adapter offers when it can keep the order of publishes whose acknowledgements
    are outstanding (NATS: one connection, written in order). The outbox worker then sends a
    room's rows one after another without waiting for each acknowledgement."""

    async def send(self, message: OutgoingMessage) -> asyncio.Future[str]:
        """Queue ``message``; once this returns it goes before any message queued later. The
        future is the acknowledgement (the message id), failing as ``publish`` would; it has no
        deadline of its own: the caller bounds the wait and cancels it to give up."""
        ...
