"""The ``broker`` target (mq and dual modes): the ``room_outbox_event`` envelope to the outbox topic.

Tag = event type, key = event_id (the broker's duplicate window and every
consumer deduplicate on it), sharding key = the room (RocketMQ message group).
The row's broker target succeeds only on the broker's durable acknowledgement
within the attempt's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import NoReturn, cast

from roomservice.brokers.port import Broker, BrokerError, BrokerUnavailable, OutgoingMessage, PipelinedBroker
from roomservice.domain.events import Event
from roomservice.domain.routing import Target
from roomservice.observability import tracing
from roomservice.publishers.port import PermanentError, PublishError, RetryableError


def room_sharding_key(app_code: str, room_id: str) -> str:
    return f"{app_code}:{room_id}"


class BrokerPublisher:
    name = Target.BROKER.value

    def __init__(self, broker: Broker, *, topic: str) -> None:
        self.broker = broker
        self.topic = topic
        self._pipelined = isinstance(broker, PipelinedBroker)

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

        No timer here or in the broker: every caller bounds the call by ``deadline``
        itself (the worker does, for every publisher; :meth:`publish` does), and a
        timer of the adapter's own at the same instant would fire after the caller's,
        so it was dead weight on every row (``timeout_s=None``, see the broker port)."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise RetryableError("publishing to the broker: the deadline passed before it started")
        if tracing.ENABLED:  # the message's headers carry the publish span's context
            with tracing.broker_publish_span(self.topic, key=event_id, tag=event_type, broker=self.broker.name) as tc:
                headers = {**(headers or {}), **tc}
                await self._send(self._message(event_id, event_type, app_code, room_id, payload, headers))
        else:
            await self._send(self._message(event_id, event_type, app_code, room_id, payload, headers))

    @property
    def pipelined(self) -> bool:
        """Whether :meth:`send_claimed` is available: the broker keeps the order of publishes
        whose acknowledgements are outstanding."""
        return self._pipelined

    async def send_claimed(
        self, *, event_id: str, event_type: str, app_code: str, room_id: str, payload: bytes
    ) -> asyncio.Future[str]:
        """The pipelined form of :meth:`publish_claimed` (only when :attr:`pipelined`, see
        :class:`~roomservice.publishers.port.PipeliningPublisher`): once this returns, the message
        goes before any sent after it. The future is the broker's own acknowledgement (the message
        id), failing with the broker's error: :meth:`failure` converts it (the worker does, once
        the attempt is over), so no second future follows the broker's. No deadline of its own:
        the caller bounds the wait and cancels the future to give up."""
        if not self._pipelined:
            raise TypeError(f"broker {self.broker.name} does not pipeline publishes")
        broker = cast(PipelinedBroker, self.broker)
        message = self._message(event_id, event_type, app_code, room_id, payload, None)
        try:
            return await broker.send(message)
        except Exception as exc:
            self._reraise(exc)

    def _message(
        self,
        event_id: str,
        event_type: str,
        app_code: str,
        room_id: str,
        payload: bytes,
        headers: Mapping[str, str] | None,
    ) -> OutgoingMessage:
        return OutgoingMessage(
            topic=self.topic,
            body=payload,
            key=event_id,
            tag=event_type,
            sharding_key=room_sharding_key(app_code, room_id),
            headers=dict(headers) if headers else {},
        )

    async def _send(self, message: OutgoingMessage) -> None:
        try:
            await self.broker.publish(message, timeout_s=None)
        except Exception as exc:
            self._reraise(exc)

    def _reraise(self, exc: Exception) -> NoReturn:
        failure = self.failure(exc)
        if failure is exc:
            raise exc
        raise failure from exc

    def failure(self, exc: BaseException) -> BaseException:
        """The publisher port's error for what the broker raised (``exc`` itself when it passes)."""
        if isinstance(exc, BrokerUnavailable):
            return RetryableError(f"broker {self.broker.name} unavailable: {exc}")
        if isinstance(exc, PublishError) or not isinstance(exc, Exception):
            return exc
        if isinstance(exc, TimeoutError):  # an adapter's own timer ran out first
            return RetryableError(f"broker {self.broker.name}: no acknowledgement before the deadline")
        if isinstance(exc, BrokerError) and not exc.retryable:
            # refused for good (name, size): a dead letter, not a retry loop
            return PermanentError(f"broker {self.broker.name} refused the event: {exc}")
        # anything an adapter did not classify (a client library's own error, a bug) is retried with
        # backoff, as the worker retries an unclassified publisher error: the port names BrokerError
        # alone as what retrying cannot fix, and a dead letter on the first attempt needs a replay
        return RetryableError(f"broker {self.broker.name}: {type(exc).__name__}: {exc}")

