"""The ``hyapp-room-im-bridge`` group: the IM publisher's work, driven from the broker.

Each delivery is one ``room_outbox_event``; the handler hands it to
:class:`~roomservice.publishers.tencent_im.TencentImPublisher`, which does what the
direct ``im`` target does (EnsureGroup on RoomCreated, one custom message per event
with ``Random`` from the event_id, membership control on a kick, destroy on close,
re-ensure the missing group of an open room) and records every step it did in
``im_sent_event`` under ``dedup_id(event)`` (a repair counts as its original). So a
redelivery re-sends only what did not happen, and one whose steps are all recorded is
acknowledged as ``DUPLICATE`` without a request to IM.

Failures: a body that does not decode is ``ValueError`` (poison: dead-lettered after the
group's limit). A retryable publish error (outage, timeout, 60008...) is raised, so the
runtime retries with backoff. A permanent one (10004, a group id taken by another owner)
is raised too: retrying it costs a few requests, and it ends in the group's dead letter,
where an operator can see it and replay it once the cause is fixed — acknowledging it
would lose the message silently.

Order. The broker may deliver a room's events out of order and more than once; for IM
only the close needs order:

* **RoomClosed waits for the room's earlier messages.** Before its steps run, the handler
  reads the room's ``room_outbox`` rows with a lower ``room_version`` whose type routes to
  IM and checks our sent record for each (the outbox row's ``delivered`` status says only
  that the broker has it). While any is unsent, the close is redelivered later
  (``Redeliver``, delays growing from ``close_poll_s`` and never past the bound), so its
  destroy cannot swallow a message still in flight. The wait is bounded: once
  ``close_wait_s`` have passed since the close was committed (``occurred_at_ms``), the
  handler sends the still-unsent earlier events itself, in ``room_version`` order and under
  one ``publish_timeout_s`` deadline (re-ordering them before the close; this is what
  makes a long IM outage lose nothing: the close cannot destroy while IM is down, and once
  IM is back it sends what it waited for first). An earlier event that failed for now — a
  retryable IM error, or left untried when the deadline ran out — redelivers the close
  again (it is no poison; destroying would swallow it), until the close's last delivery.
  Whatever fails for good — a poison message: it does not decode, or IM refuses it
  permanently — is named in ``im_close_forced`` and the group is destroyed anyway. A poison
  message so holds up only itself and, for at most ``close_wait_s``, its room's close.
  Each wait is a delivery to the broker (its count goes up): with the defaults (0.5 s
  doubling, capped at 5 s, 30 s bound) a close takes about ten deliveries at most. Give the
  handler the group's ``max_deliveries`` (1 + ``consumer_max_reconsume_times``) and a close
  never waits itself into the dead letter: its second-to-last delivery waits until the
  bound, its last one does not wait.
* **A message after the group is gone for good counts as done**: the publisher finds no
  group, sees that we destroyed it (or that ``room_meta`` says closed) and records the step
  done instead of bringing the group back; a late RoomCreated never re-creates it either.
* **Nothing else in IM depends on order.** Messages carry ``room_version`` in their
  ``Data`` and clients order and reconcile by it; IM keeps what arrives. Membership of an
  AVChatRoom is client-driven (clients join IM themselves); the only membership step the
  bridge takes is the kick's ban/removal, which no other event of ours undoes (the ban
  runs out by its own length, a later join in the room service does not unban in IM), so a
  late kick applied after a newer join changes nothing a newer event set. RoomCreated's
  EnsureGroup is idempotent (10025 is success) and CreateRoom makes the group
  synchronously, so a message that overtakes it is retryable until the group exists, or
  finds the group ensured again from ``room_meta``.

A group dismissed by IM (not by us) after the room closed in ``room_meta`` is not brought
back for earlier messages (the publisher's rule): nobody is in a group IM dismissed, so
those messages are recorded done. The outbox rows may be cleaned up after their retention;
a close then waits only for what is still there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome, Redeliver
from roomservice.domain import events as e
from roomservice.domain.routing import Target, targets_of
from roomservice.observability.logging import get_logger
from roomservice.publishers.port import PublishError
from roomservice.publishers.tencent_im import GROUP, MESSAGE, TencentImPublisher, message_step_of
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.wire import decode_event

_log = get_logger("roomservice.consumers.im_bridge")

IM_EVENT_TYPES = tuple(sorted(k for k in e.PAYLOAD_TYPES if Target.IM in targets_of(k)))
_NAMED_IN_LOG = 20  # im_close_forced names at most this many unsent events


@dataclass(frozen=True, slots=True)
class EarlierEvent:
    """An earlier IM event of a closing room whose message our sent record does not show."""

    event_id: str
    event_type: str
    room_version: int
    payload: bytes  # the outbox row's envelope

    def describe(self) -> str:
        return f"{self.event_id} ({self.event_type} v{self.room_version})"


@dataclass(frozen=True, slots=True)
class _Failed:
    """Why an earlier event the close sent itself is still unsent, and whether trying again may help."""

    error: str
    retryable: bool


def decode(body: bytes) -> e.Event:
    try:
        return decode_event(body)
    except Exception as exc:  # protobuf DecodeError, an unknown type, a field that does not fit
        raise ValueError(f"not a room_outbox_event: {type(exc).__name__}: {exc}") from exc


class ImBridgeHandler:
    def __init__(
        self,
        publisher: TencentImPublisher,
        *,
        group: str,
        topic: str,
        clock: Callable[[], int],
        close_wait_s: float = 30.0,
        publish_timeout_s: float = 3.0,
        close_poll_s: float = 0.5,
        close_poll_max_s: float = 5.0,
        max_deliveries: int | None = None,
        db: Database | None = None,
    ) -> None:
        self.publisher = publisher
        self.group = group
        self.topic = topic
        self.clock = clock
        self.close_wait_s = close_wait_s
        self.publish_timeout_s = publish_timeout_s
        self.close_poll_s = close_poll_s
        self.close_poll_max_s = close_poll_max_s
        self.max_deliveries = max_deliveries
        self.db = db if db is not None else publisher.steps.db
        o, s = t.room_outbox.c, t.im_sent_event.c
        # the room's earlier IM rows with no sent record of their message step (RoomCreated: its group)
        step = sa.case((o.event_type == "RoomCreated", GROUP), else_=MESSAGE)
        self._unsent = (
            sa.select(o.event_id, o.event_type, o.room_version, o.payload)
            .select_from(
                t.room_outbox.outerjoin(t.im_sent_event, sa.and_(s.event_id == o.event_id, s.operation == step))
            )
            .where(
                o.app_code == sa.bindparam("app_code"),
                o.room_id == sa.bindparam("room_id"),
                o.room_version < sa.bindparam("room_version"),
                o.event_type.in_(IM_EVENT_TYPES),
                s.event_id.is_(None),
            )
            .order_by(o.room_version, o.id)
        )

    async def handle(self, delivery: Delivery) -> Outcome:
        event = decode(delivery.body)  # ValueError: poison, dead-lettered after the limit
        if Target.IM not in targets_of(event.type):
            return Outcome.APPLIED  # nothing for IM: acknowledged with no effect
        done: set[str] | None = await self.publisher.steps_done(event)
        if await self.publisher.already_sent(event, done):
            return Outcome.DUPLICATE
        if isinstance(event.payload, e.RoomClosed):
            await self._close_in_order(event, delivery)
            done = None  # it waited or sent earlier events meanwhile: the publisher reads its record again
        await self._publish(event, delivery.body, done=done)  # PublishError: retried, dead-lettered after the limit
        return Outcome.APPLIED

    async def _publish(
        self, event: e.Event, payload: bytes, deadline: float | None = None, done: set[str] | None = None
    ) -> None:
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.publish_timeout_s
        await self.publisher.publish(event, payload=payload, deadline=deadline, done=done)

    # ------------------------------------------------------------------ order

    async def unsent_before(self, event: e.Event) -> list[EarlierEvent]:
        """The room's events before ``event`` (lower room_version) that route to IM and whose
        message our sent record does not show (a repair whose original was sent counts as sent)."""
        params = {"app_code": event.app_code, "room_id": event.room_id, "room_version": event.room_version}
        rows = await self.db.run_read(_rows, self._unsent, params)
        unsent = []
        for row in rows:
            earlier = EarlierEvent(str(row.event_id), str(row.event_type), int(row.room_version), bytes(row.payload))
            if await self._sent_as_original(earlier):
                continue
            unsent.append(earlier)
        return unsent

    async def _sent_as_original(self, earlier: EarlierEvent) -> bool:
        """A repair row's record is its original's (``dedup_id``): look there."""
        try:
            decoded = decode_event(earlier.payload)
        except Exception:
            return False  # undecodable: it waits like any unsent event (and is forced past)
        if decoded.repair_of is None:
            return False
        return message_step_of(earlier.event_type) in await self.publisher.steps.done(decoded.repair_of)

    async def _close_in_order(self, close: e.Event, delivery: Delivery) -> None:
        unsent = await self.unsent_before(close)
        if not unsent:
            return
        waited_s = (self.clock() - close.occurred_at_ms) / 1000
        remaining_s = self.close_wait_s - waited_s
        last = self.max_deliveries is not None and delivery.delivery_count >= self.max_deliveries
        grown = self.close_poll_s * 2 ** min(max(delivery.delivery_count - 1, 0), 16)
        if remaining_s > 0 and not last:  # a wait on the last delivery would dead-letter the close
            delay_s = min(grown, self.close_poll_max_s, remaining_s)
            if self.max_deliveries is not None and delivery.delivery_count + 1 >= self.max_deliveries:
                delay_s = remaining_s  # one delivery left: spend it at the bound
            delay_s = max(0.01, delay_s)
            raise Redeliver(
                delay_s,
                f"RoomClosed {close.event_id} waits for {len(unsent)} earlier IM event(s) of "
                f"{close.app_code}/{close.room_id}: {', '.join(u.describe() for u in unsent[:3])}",
            )
        failed = await self._send_earlier(unsent)
        still = await self.unsent_before(close)
        transient = [u for u in still if u.event_id not in failed or failed[u.event_id].retryable]
        if transient and not last:
            # "try again" from IM, or out of this delivery's time, is no poison: destroying now would
            # swallow the message (its own redelivery then finds the group destroyed, and records it done)
            raise Redeliver(
                max(0.01, min(grown, self.close_poll_max_s)),
                f"RoomClosed {close.event_id} sent {len(unsent) - len(still)} earlier IM event(s) of "
                f"{close.app_code}/{close.room_id} itself; {len(transient)} failed for now: "
                + ", ".join(f"{u.describe()}: {failed[u.event_id].error if u.event_id in failed else 'unsent'}"
                            for u in transient[:3]),
            )
        if still:
            _log.warning(
                "im_close_forced",
                app_code=close.app_code,
                room_id=close.room_id,
                event_id=close.event_id,
                room_version=close.room_version,
                waited_s=round(waited_s, 3),
                unsent_count=len(still),
                unsent=[u.describe() for u in still[:_NAMED_IN_LOG]],
                errors={u.event_id: failed[u.event_id].error for u in still[:_NAMED_IN_LOG] if u.event_id in failed},
            )

    async def _send_earlier(self, unsent: Sequence[EarlierEvent]) -> dict[str, _Failed]:
        """Send the close's unsent earlier events ourselves, in room_version order, under one
        deadline; what fails is left for the caller to judge and name. Returns event_id -> why."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_timeout_s
        failed: dict[str, _Failed] = {}
        for earlier in unsent:
            if loop.time() >= deadline:
                failed[earlier.event_id] = _Failed("not tried: out of time", retryable=True)
                continue
            try:
                event = decode_event(earlier.payload)
            except Exception as exc:
                failed[earlier.event_id] = _Failed(f"does not decode: {type(exc).__name__}", retryable=False)
                continue
            try:
                await self._publish(event, earlier.payload, deadline=deadline)
            except PublishError as exc:
                failed[earlier.event_id] = _Failed(f"{exc.code}: {exc.message}", retryable=exc.retryable)
        return failed


def _rows(conn: sa.Connection, statement: sa.Executable, params: dict[str, object]) -> list[sa.Row[Any]]:
    return list(conn.execute(statement, params).all())
