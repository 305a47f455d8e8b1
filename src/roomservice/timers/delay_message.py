"""Treasure wake-ups as broker delay messages (``rocketmq.treasure_open.enabled``).

The outbox worker hands ``RoomTreasureCountdownStarted`` to
:class:`DelayMessageScheduler`, which publishes a message on the treasure
topic held until ``open_at_ms``; the ``hyapp-room-treasure-open`` group
consumes it and sends ``OpenTreasure`` to the room, which re-validates it. The
message carries only the wake-up's parameters (JSON), never room state.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from roomservice.brokers.port import Broker, OutgoingMessage
from roomservice.domain.events import Event, RoomTreasureCountdownStarted
from roomservice.observability import tracing

WAKEUP_TAG = "TreasureOpen"


@dataclass(frozen=True, slots=True)
class TreasureWakeup:
    app_code: str
    room_id: str
    box_id: str
    level: int
    open_at_ms: int
    command_id: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, body: bytes) -> TreasureWakeup:
        """Raises ValueError for a body that is not a wake-up (a poison message)."""
        try:
            raw = json.loads(body)
            wakeup = cls(
                app_code=str(raw["app_code"]),
                room_id=str(raw["room_id"]),
                box_id=str(raw["box_id"]),
                level=int(raw["level"]),
                open_at_ms=int(raw["open_at_ms"]),
                command_id=str(raw["command_id"]),
            )
        except (KeyError, TypeError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"not a treasure wake-up: {exc!r}") from exc
        return wakeup

    @property
    def key(self) -> str:
        """One wake-up per box: a re-schedule of the same box is the broker's duplicate."""
        return f"{self.app_code}:{self.room_id}:{self.box_id}"


class DelayMessageScheduler:
    """A TreasureScheduler that publishes the wake-up as a delay message (durable once published)."""

    def __init__(self, broker: Broker, *, topic: str, publish_timeout_s: float) -> None:
        self.broker = broker
        self.topic = topic
        self.publish_timeout_s = publish_timeout_s

    async def schedule(self, event: Event) -> None:
        payload = event.payload
        if not isinstance(payload, RoomTreasureCountdownStarted):
            raise TypeError(f"cannot schedule a wake-up for a {event.type} event")
        wakeup = TreasureWakeup(
            app_code=event.app_code,
            room_id=event.room_id,
            box_id=payload.box_id,
            level=payload.level,
            open_at_ms=payload.open_at_ms,
            command_id=payload.open_command_id,
        )
        await self.broker.publish(
            OutgoingMessage(
                topic=self.topic,
                body=wakeup.encode(),
                key=wakeup.key,
                tag=WAKEUP_TAG,
                sharding_key=f"{event.app_code}:{event.room_id}",
                deliver_at_ms=payload.open_at_ms,
                headers=tracing.inject(None) or {},  # the treasure-open consumer continues the countdown's trace
            ),
            timeout_s=self.publish_timeout_s,
        )
