"""The ``broker`` target (mq and dual modes): the ``room_outbox_event`` envelope to the outbox topic.

Tag = event type, key = event_id (the broker's duplicate window and every
consumer deduplicate on it), sharding key = the room (RocketMQ message group).
The row's broker target succeeds only on the broker's durable acknowledgement
within the attempt's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from roomservice.brokers.port import Broker, BrokerUnavailable, OutgoingMessage
from roomservice.domain.events import Event
from roomservice.domain.routing import Target
from roomservice.observability import tracing
from roomservice.publishers.port import PermanentError, RetryableError


def room_sharding_key(app_code: str, room_id: str) -> str:
    return f"{app_code}:{room_id}"


class BrokerPublisher:
    name = Target.BROKER.value

    def __init__(self, broker: Broker, *, topic: str) -> None:
        self.broker = broker
        self.topic = topic

    async def publish(
        self, event: Event, *, payload: bytes, deadline: float, headers: Mapping[str, str] | None = None
    ) -> None:
        """The publisher port: bounded by ``deadline`` here, whatever the broker does."""
        try:
            async with asyncio.timeout_at(deadline):
                await self.publish_claimed(
                    event_id=event.event_id,
                    event_type=event.type,
                    app_code=event.app_code,
                    room_id=event.room_id,
                    payload=payload,
                    deadline=deadline,
                    headers=headers,
                )
        except TimeoutError as exc:
            raise RetryableError(f"broker {self.broker.name}: no acknowledgement before the deadline") from exc

    async def publish_claimed(
        self,
        *,
        event_id: str,
        event_type: str,
        app_code: str,
        room_id: str,
        payload: bytes,
        deadline: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The outbox worker's path: a claimed row's own fields, no decoded Event needed.

        Adds no timer of its own: the broker is given what is left of ``deadline``
        (every adapter bounds its publish by it) and the caller bounds the attempt
        by the same deadline (the worker does, for every publisher)."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise RetryableError("publishing to the broker: the deadline passed before it started")
        if tracing.ENABLED:  # the message's headers carry the publish span's context
            with tracing.broker_publish_span(self.topic, key=event_id, tag=event_type, broker=self.broker.name) as tc:
                headers = {**(headers or {}), **tc}
                await self._send(event_id, event_type, app_code, room_id, payload, remaining, headers)
        else:
            await self._send(event_id, event_type, app_code, room_id, payload, remaining, headers)

    async def _send(
        self,
        event_id: str,
        event_type: str,
        app_code: str,
        room_id: str,
        payload: bytes,
        remaining: float,
        headers: Mapping[str, str] | None,
    ) -> None:
        message = OutgoingMessage(
            topic=self.topic,
            body=payload,
            key=event_id,
            tag=event_type,
            sharding_key=room_sharding_key(app_code, room_id),
            headers=dict(headers) if headers else {},
        )
        try:
            await self.broker.publish(message, timeout_s=remaining)
        except BrokerUnavailable as exc:
            raise RetryableError(f"broker {self.broker.name} unavailable: {exc}") from exc
        except RetryableError:
            raise
        except TimeoutError as exc:  # an adapter's own timer ran out first
            raise RetryableError(f"broker {self.broker.name}: no acknowledgement before the deadline") from exc
        except Exception as exc:  # refused for good (name, size): a dead letter, not a retry loop
            if getattr(exc, "retryable", False):
                raise RetryableError(f"broker {self.broker.name}: {exc}") from exc
            raise PermanentError(f"broker {self.broker.name} refused the event: {exc}") from exc
