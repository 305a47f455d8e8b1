"""An in-memory :class:`~roomservice.timers.port.TreasureScheduler` for tests.

It keeps the port's promises within one object: ``schedule`` is idempotent per
(app_code, room_id, box_id) — a box that already fired is not scheduled again —
and :meth:`FakeTreasureScheduler.fire_due` hands out the wake-ups whose
``open_at_ms`` has come, each once. Nothing survives the object (the durable
timer is :class:`~roomservice.timers.treasure.DatabaseTreasureTimer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from roomservice.domain.events import Event, RoomTreasureCountdownStarted
from roomservice.errors import Unavailable


@dataclass(frozen=True, slots=True)
class WakeUp:
    """A due treasure box: open it with ``OpenTreasure`` under ``command_id``."""

    app_code: str
    room_id: str
    box_id: str
    level: int
    open_at_ms: int
    command_id: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.app_code, self.room_id, self.box_id)


class FakeTreasureScheduler:
    """Scheduled wake-ups in a dict; ``down`` makes ``schedule`` fail as an outage would."""

    def __init__(self) -> None:
        self.scheduled: dict[tuple[str, str, str], WakeUp] = {}
        self.fired: list[WakeUp] = []
        self.calls = 0  # schedule calls, duplicates included
        self.down = False
        self._done: set[tuple[str, str, str]] = set()

    async def schedule(self, event: Event) -> None:
        payload = event.payload
        if not isinstance(payload, RoomTreasureCountdownStarted):
            raise TypeError(f"treasure scheduler cannot schedule a {event.type} event")
        self.calls += 1
        if self.down:
            raise Unavailable("treasure scheduler is down")
        wake_up = WakeUp(
            app_code=event.app_code,
            room_id=event.room_id,
            box_id=payload.box_id,
            level=payload.level,
            open_at_ms=payload.open_at_ms,
            command_id=payload.open_command_id,
        )
        if wake_up.key in self._done or wake_up.key in self.scheduled:
            return
        self.scheduled[wake_up.key] = wake_up

    def fire_due(self, now_ms: int) -> list[WakeUp]:
        """The wake-ups due at ``now_ms`` (``open_at_ms <= now_ms``), earliest first; each fires once."""
        due = sorted((w for w in self.scheduled.values() if w.open_at_ms <= now_ms), key=lambda w: w.open_at_ms)
        for wake_up in due:
            del self.scheduled[wake_up.key]
            self._done.add(wake_up.key)
        self.fired.extend(due)
        return due

    def next_fire_at(self) -> int | None:
        """The earliest ``open_at_ms`` still scheduled."""
        return min((w.open_at_ms for w in self.scheduled.values()), default=None)
