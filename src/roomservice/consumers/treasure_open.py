"""The ``hyapp-room-treasure-open`` group: a due wake-up becomes ``OpenTreasure`` on the room.

The room re-validates it (stale, already-open and closed-room wake-ups are
no-ops; the command_id ``treasure-open:<box_id>`` makes a redelivery a
replay). A wake-up that arrives before ``open_at_ms`` is delivered again at
that time; an answer that retrying cannot change (say, the room never
existed) is acknowledged and logged once; an outage is retried with backoff.
"""

from __future__ import annotations

from collections.abc import Callable

from roomservice import errors
from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome, Redeliver
from roomservice.domain.commands import OpenTreasure
from roomservice.observability.logging import get_logger
from roomservice.timers.delay_message import TreasureWakeup
from roomservice.timers.treasure import Opener

_log = get_logger("roomservice.consumers.treasure_open")


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
            raise Redeliver(max(0.05, (exc.open_at_ms - self.clock()) / 1000), exc.message) from exc
        except errors.RoomServiceError as exc:
            if exc.retryable:
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
