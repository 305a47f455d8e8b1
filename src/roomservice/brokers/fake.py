"""An in-memory broker with the port's full semantics, for tests of publishers and consumers (not durable)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from roomservice.brokers.port import (
    BrokerUnavailable,
    DeadLetter,
    Delivery,
    GroupStats,
    OutgoingMessage,
)
from roomservice.clock import wall_clock_ms


@dataclass(slots=True)
class _Message:
    message_id: str
    message: OutgoingMessage
    published_at_ms: int


@dataclass(slots=True)
class _Entry:
    message: _Message
    visible_at: float  # time.monotonic(): visibility and delays are durations
    deliveries: int = 0
    receipt: int = 0  # the current delivery's receipt; an ack with an older one is stale


@dataclass(slots=True)
class _Group:
    topic: str
    max_deliveries: int
    entries: dict[str, _Entry] = field(default_factory=dict)  # message_id -> entry, in publish order
    dead: dict[str, DeadLetter] = field(default_factory=dict)


class FakeBroker:
    """Every group sees every message of its topic, including those published before it was declared."""

    name = "fake"

    def __init__(self, *, clock: Callable[[], int] = wall_clock_ms) -> None:
        self._clock = clock  # the wall clock of published_at_ms, dead_at_ms and deliver_at_ms
        self.down = False  # publish/fetch raise BrokerUnavailable while set
        self.hang = False  # publish never answers while set (a broker that accepted the connection and went quiet)
        self.published: list[OutgoingMessage] = []  # every accepted publish, duplicates dropped
        self._messages: dict[str, list[_Message]] = {}
        self._keys: set[tuple[str, str]] = set()
        self._groups: dict[str, _Group] = {}
        self._ids = itertools.count(1)
        self._receipts = itertools.count(1)
        self._arrived = asyncio.Event()

    def _check(self) -> None:
        if self.down:
            raise BrokerUnavailable("fake broker is down")

    async def publish(self, message: OutgoingMessage, *, timeout_s: float | None) -> str:
        self._check()
        if self.hang:
            await asyncio.Event().wait()
        if (message.topic, message.key) in self._keys:
            return next(m.message_id for m in self._messages[message.topic] if m.message.key == message.key)
        stored = _Message(str(next(self._ids)), message, self._clock())
        self._keys.add((message.topic, message.key))
        self._messages.setdefault(message.topic, []).append(stored)
        self.published.append(message)
        for group in self._groups.values():
            if group.topic == message.topic:
                group.entries[stored.message_id] = _Entry(stored, self._visible_at(message))
        self._arrived.set()
        return stored.message_id

    async def declare_group(self, topic: str, group: str, *, max_deliveries: int) -> None:
        self._check()
        if group in self._groups:
            self._groups[group].max_deliveries = max_deliveries
            return
        g = self._groups[group] = _Group(topic, max_deliveries)
        for stored in self._messages.get(topic, []):
            g.entries[stored.message_id] = _Entry(stored, self._visible_at(stored.message))

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> Sequence[Delivery]:
        deadline = time.monotonic() + wait_s
        while True:
            self._check()
            got = self._take(self._groups[group], group, max_messages, visibility_s)
            remaining = deadline - time.monotonic()
            if got or remaining <= 0:
                return got
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=min(remaining, 0.02))

    def _take(self, g: _Group, group: str, limit: int, visibility_s: float) -> list[Delivery]:
        now = time.monotonic()
        out: list[Delivery] = []
        for message_id, entry in list(g.entries.items()):
            if len(out) >= limit:
                break
            if entry.visible_at > now:
                continue
            if entry.deliveries >= g.max_deliveries:  # crashed during its last delivery
                self._bury(g, group, entry, "no ack after the last delivery")
                continue
            entry.deliveries += 1
            entry.receipt = next(self._receipts)
            entry.visible_at = now + visibility_s
            m = entry.message.message
            out.append(
                Delivery(
                    topic=m.topic,
                    group=group,
                    message_id=message_id,
                    key=m.key,
                    tag=m.tag,
                    sharding_key=m.sharding_key,
                    body=m.body,
                    headers=dict(m.headers),
                    delivery_count=entry.deliveries,
                    published_at_ms=entry.message.published_at_ms,
                    receipt=(message_id, entry.receipt),
                )
            )
        return out

    def _current(self, delivery: Delivery) -> tuple[_Group, _Entry] | None:
        g = self._groups[delivery.group]
        entry = g.entries.get(delivery.message_id)
        if entry is None or (delivery.message_id, entry.receipt) != delivery.receipt:
            return None  # acked already, or redelivered since: this receipt is stale
        return g, entry

    async def ack(self, delivery: Delivery) -> None:
        self._check()
        found = self._current(delivery)
        if found is not None:
            del found[0].entries[delivery.message_id]

    async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
        self._check()
        found = self._current(delivery)
        if found is not None:
            found[1].visible_at = time.monotonic() + visibility_s

    async def nack(self, delivery: Delivery, *, delay_s: float, reason: str = "") -> None:
        self._check()
        found = self._current(delivery)
        if found is None:
            return
        g, entry = found
        if entry.deliveries >= g.max_deliveries:
            self._bury(g, delivery.group, entry, reason or "failed on its last delivery")
        else:
            entry.visible_at = time.monotonic() + delay_s

    def _bury(self, g: _Group, group: str, entry: _Entry, reason: str) -> None:
        m = entry.message
        del g.entries[m.message_id]
        g.dead[m.message_id] = DeadLetter(
            group=group,
            topic=m.message.topic,
            message_id=m.message_id,
            key=m.message.key,
            tag=m.message.tag,
            body=m.message.body,
            headers=dict(m.message.headers),
            delivery_count=entry.deliveries,
            dead_at_ms=self._clock(),
            reason=reason,
        )

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        g = self._groups.get(group)
        return [] if g is None else list(g.dead.values())[:limit]

    async def replay_dead_letter(self, group: str, message_id: str) -> bool:
        g = self._groups[group]
        dead = g.dead.pop(message_id, None)
        if dead is None:
            return False
        stored = next(m for m in self._messages[g.topic] if m.message_id == message_id)
        g.entries[message_id] = _Entry(stored, time.monotonic())
        self._arrived.set()
        return True

    async def group_stats(self, topic: str, group: str) -> GroupStats:
        g = self._groups.get(group)
        if g is None:  # not declared yet: it will receive what the topic holds
            return GroupStats(
                topic=topic, group=group, lag=len(self._messages.get(topic, [])), in_flight=0, dead_letters=0
            )
        now = time.monotonic()
        in_flight = sum(1 for e in g.entries.values() if e.deliveries and e.visible_at > now)
        return GroupStats(topic=topic, group=group, lag=len(g.entries), in_flight=in_flight, dead_letters=len(g.dead))

    async def ping(self) -> None:
        self._check()

    async def close(self) -> None:
        return None

    def _visible_at(self, message: OutgoingMessage) -> float:
        """When ``message`` becomes visible, on the monotonic clock: at once, or at its ``deliver_at_ms``."""
        if message.deliver_at_ms is None:
            return 0.0
        return time.monotonic() + max(0.0, (message.deliver_at_ms - self._clock()) / 1000)
