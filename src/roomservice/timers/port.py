"""The treasure scheduler port: where the outbox worker sends countdowns to be woken up later."""

from __future__ import annotations

from typing import Protocol

from roomservice.domain.events import Event


class TreasureScheduler(Protocol):
    """Where the outbox worker sends ``RoomTreasureCountdownStarted``.

    ``schedule`` is idempotent per (app_code, room_id, box_id); once it returns,
    the wake-up is durable (the worker then records the target as done).
    """

    async def schedule(self, event: Event) -> None: ...
