"""The ``hyapp-room-treasure-open`` group: a due wake-up becomes ``OpenTreasure`` on the room.

The room re-validates it (stale, already-open and closed-room wake-ups are
no-ops; the command_id ``treasure-open:<box_id>`` makes a redelivery a
replay). A wake-up that arrives before ``open_at_ms`` is delivered again at
that time; an answer that retrying cannot change (say, the room never
existed: :func:`~roomservice.timers.treasure.is_permanent`) is acknowledged and
logged once; an outage, or a failure at the room's owner, is retried with backoff.

"Too early" from the room itself — its owner's clock is behind this process's,
which already found the box due — is delivered again after the time the room
named as still to wait by this clock, but at least a floor that doubles with each
delivery (:data:`TOO_EARLY_FLOOR_S`, capped at :data:`TOO_EARLY_MAX_S`): each
redelivery counts against the group's delivery limit, and a fixed 50 ms wait spent
the whole budget in under a second of clock skew, dead-lettering the box.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from roomservice import errors
from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome, Redeliver
from roomservice.domain.commands import OpenTreasure
from roomservice.observability.logging import get_logger
from roomservice.timers.delay_message import TreasureWakeup
from roomservice.timers.treasure import Opener, is_permanent

_log = get_logger("roomservice.consumers.treasure_open")

TOO_EARLY_FLOOR_S: Final = 0.1  # the first "too early" of the room waits at least this long, then doubling
TOO_EARLY_MAX_S: Final = 30.0


class TreasureOpenHandler:
    def __init__(self, opener: Opener, *, group: str, topic: str, clock: Callable[[], int]) -> None:
        self.opener = opener
        self.group = group
        self.topic = topic
        self.clock = clock

    async def handle(self, delivery: Delivery) -> Outcome:
        wakeup = TreasureWakeup.decode(delivery.body)  # ValueError: poison, dead-lettered after the limit
        early_ms = wakeup.open_at_ms - self.clock()
        if early_ms > 0:
            raise Redeliver(early_ms / 1000, f"box {wakeup.box_id} opens in {early_ms} ms")
        command = OpenTreasure(box_id=wakeup.box_id, level=wakeup.level, open_at_ms=wakeup.open_at_ms)
        try:
            answer = await self.opener(wakeup.app_code, wakeup.room_id, wakeup.command_id, command)
        except errors.TreasureTooEarly as exc:  # the room's clock says not yet
            floor_s = min(TOO_EARLY_FLOOR_S * 2 ** min(max(delivery.delivery_count - 1, 0), 16), TOO_EARLY_MAX_S)
            raise Redeliver(max(floor_s, (exc.open_at_ms - self.clock()) / 1000), exc.message) from exc
        except errors.RoomServiceError as exc:
            if not is_permanent(exc):
                raise
            _log.warning(
                "treasure_wakeup_dropped",
                app_code=wakeup.app_code,
                room_id=wakeup.room_id,
                box_id=wakeup.box_id,
                error=f"{exc.code}: {exc.message}",
            )
            return Outcome.APPLIED
        if isinstance(answer, dict) and answer.get("replayed"):
            return Outcome.DUPLICATE
        return Outcome.APPLIED
