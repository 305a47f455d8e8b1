"""The ``hyapp-activity-room-outbox`` group: the activity gRPC path's effects, driven from the broker.

Each delivery is one ``room_outbox_event`` envelope. It is decoded and
validated exactly as ``HandleRoomEvent`` does (:func:`event_from_wire`: an
undecodable body, an unknown type or an id outside SPEC §3's limits is
:class:`~roomservice.activity.service.InvalidEvent`, raised so the delivery
fails and is dead-lettered after the limit: retrying cannot fix it). Then the
SAME :class:`~roomservice.activity.store.ActivityStore` call applies it: the
processed record (under :func:`~roomservice.domain.events.dedup_id`, so a
repair counts as its original) and the effect are one transaction, and the
store says when the event was processed already — by an earlier delivery, or
by the gRPC path (``direct``/``dual`` mode). An event arriving both ways has
its effect once.

Event types the routing table does not send to the activity service
(``Target.ACTIVITY`` not among ``targets_of(type)``: mic events, countdowns)
are acknowledged as ``DUPLICATE`` without touching the database: nothing was
applied, and they must not fill ``activity_processed_event`` with rows the
gRPC path never writes. A delivery whose tag names such a known type is
acknowledged before its body is decoded (the broker publisher tags each message
with its event type); an unknown tag is decoded, as above. A database outage raises
:class:`~roomservice.store.port.StoreUnavailable`: the delivery is retried.
"""

from __future__ import annotations

from roomservice.activity.service import event_from_wire
from roomservice.activity.store import ActivityStore
from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome
from roomservice.domain.routing import Target, for_others_only, targets_of
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.consumers.activity")


class ActivityHandler:
    def __init__(self, store: ActivityStore, *, group: str, topic: str) -> None:
        self.store = store
        self.group = group
        self.topic = topic

    async def handle(self, delivery: Delivery) -> Outcome:
        if for_others_only(delivery.tag, Target.ACTIVITY):
            return Outcome.DUPLICATE  # tagged with a type the activity service does not take: not decoded
        event = event_from_wire(delivery.body)  # InvalidEvent (a ValueError): poison
        if Target.ACTIVITY not in targets_of(event.type):
            return Outcome.DUPLICATE  # not the activity service's: nothing to apply, nothing recorded
        with tracing.effect_span("activity.apply", **{"activity.event_type": event.type}):
            applied = await self.store.handle(event)  # the leaderboard / reward ledger, once per event
        if not applied:
            return Outcome.DUPLICATE
        _log.debug("activity_event_applied", event_id=event.event_id, repair_of=event.repair_of, type=event.type)
        return Outcome.APPLIED
