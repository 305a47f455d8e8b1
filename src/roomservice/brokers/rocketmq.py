"""The RocketMQ 5 adapter of the broker port, through the official ``rocketmq-python-client`` (gRPC proxy).

The client is thread-based: its public calls block the caller (``send``,
``receive``, ``ack`` …) or return ``concurrent.futures.Future`` objects driven
by one shared asyncio loop in a thread of its own, and every client starts a
few scheduler threads. The adapter never blocks the service's event loop:
blocking calls run in ``asyncio.to_thread`` and futures are awaited with
``asyncio.wrap_future``, each under the caller's timeout.

Mapping (``namespace`` is the ``rocketmq.namespace`` resource namespace):

* **Publish**: a ``Producer``; topic = the port's topic, tag = the event type,
  keys = [event_id], message group = the sharding key (the room) when the
  message is not delayed and ``use_message_group`` is on (a FIFO message:
  the topic must then be a FIFO or mixed topic). The sharding key also travels
  in the property ``Roomservice-Sharding-Key`` (a delay message cannot carry a
  message group). Headers are user properties. ``send_timeout`` is the
  client's per-RPC request timeout (whole seconds: the client writes it into
  its Settings as seconds) and the client makes ``retry`` + 1 attempts — both
  inside the caller's ``timeout_s`` (the publish_timeout), which bounds the
  whole publish. SEND_OK is the durable acknowledgement. RocketMQ has **no
  broker-side deduplication by key**: a re-publish is stored twice and
  consumers dedup on the key (the consumer runtime does).
* **Delay**: ``delivery_timestamp`` in **seconds** (rounded up, so never
  early). A proxy rejects delays beyond ``maxDelayTimeMills`` (24 h by
  default), so a longer delay is chained: the message is published due at
  ``now + max_delay_s`` (a little under the cap, for clock skew) with the real
  due time in ``Roomservice-Deliver-At-Ms``; a group that fetches it early
  re-publishes it for itself only (``Roomservice-For-Group``) with the next
  hop and acks the early copy, so holding costs no delivery attempt.
* **Consume**: one ``SimpleConsumer`` per group, subscribed to its topic
  (``*``). ``fetch`` = ReceiveMessage with ``invisible_duration`` =
  ``visibility_s`` rounded up to whole seconds and clamped to the proxy's
  bounds (``min_invisible_s``: the proxy's minInvisibleTimeMillsForRecv, 10 s
  by default; 12 h max); ``ack`` = AckMessage; ``nack(delay)`` =
  ChangeInvisibleDuration(delay). ``delivery_count`` = the message's
  ``delivery_attempt``. A stale receipt handle (redelivered since) makes
  ack/nack a no-op, like the port's reference fake.
* **Retry limit and dead letters**: in RocketMQ 5 they are settings of the
  consumer group on the server (retryMaxTimes, ``%DLQ%<group>``). The proxy
  reports the group's policy in the Settings it answers on the telemetry
  stream (``backoff_policy.max_attempts`` = retryMaxTimes + 1); the adapter
  logs ``rocketmq_retry_policy_mismatch`` (warning) when it is not
  ``max_deliveries``. The adapter also enforces ``max_deliveries`` itself
  (the Java push consumer does the same): a nack of the last delivery, or a
  delivery beyond the limit (the consumer crashed during the last one), is
  moved with ForwardMessageToDeadLetterQueue. The broker's own limit is the
  backstop, and wins when it is lower.
* **Dead letters** are read from ``%DLQ%<group>`` through a SimpleConsumer of
  the admin group ``<group><dlq_reader_suffix>``: listing receives them and
  keeps them invisible for ``dlq_hold_s`` (RocketMQ has no browse over gRPC);
  a replay re-publishes the message to the group's topic for that group only
  (``Roomservice-For-Group``; other groups consuming through this adapter ack
  it unseen) with its key, then acks it in the dead-letter topic. The reason
  of a dead letter is known only to the process that dead-lettered it (a
  RocketMQ dead letter carries no reason). Needs a real RocketMQ to confirm:
  the DLQ topic's permission (``%DLQ%`` topics are write-only on many
  installations: make it readable, perm 6) and ACL for the admin group.
* ``group_stats``: the gRPC proxy offers no lag of a pop consumer group; it
  raises :class:`BrokerError` naming the tool that shows it (the RocketMQ
  dashboard, or ``mqadmin consumerProgress -g <group>``).

Endpoints: ``rocketmq.name_servers`` (``host:port`` of the **proxy**, several
joined with ``;``) or ``rocketmq.name_server_domain``; credentials sign every
call (``MQv2-HMAC-SHA1`` over ``x-mq-date-time``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer
from rocketmq.grpc_protocol import Code, ForwardMessageToDeadLetterQueueRequest, QueryRouteRequest
from rocketmq.v5.client.connection.rpc_client import RpcClient
from rocketmq.v5.exception import (
    BadRequestException,
    ForbiddenException,
    IllegalArgumentException,
    NotFoundException,
    PayloadEmptyException,
    PayloadTooLargeException,
    UnauthorizedException,
)
from rocketmq.v5.model.retry_policy import ExponentialBackoffRetryPolicy

from roomservice.brokers.port import (
    BrokerError,
    BrokerUnavailable,
    DeadLetter,
    Delivery,
    GroupStats,
    OutgoingMessage,
    within,
)
from roomservice.clock import wall_clock_ms
from roomservice.config import ROCKETMQ_MAX_INVISIBLE, ROCKETMQ_MIN_INVISIBLE, RocketMQConfig
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.brokers.rocketmq")

SHARDING_KEY = "Roomservice-Sharding-Key"
DELIVER_AT = "Roomservice-Deliver-At-Ms"
FOR_GROUP = "Roomservice-For-Group"
_INTERNAL = frozenset({SHARDING_KEY, DELIVER_AT, FOR_GROUP})
_REFUSED = (
    BadRequestException,
    IllegalArgumentException,
    PayloadTooLargeException,
    PayloadEmptyException,
    UnauthorizedException,
    ForbiddenException,
    NotFoundException,
)


def endpoints_of(config: RocketMQConfig) -> str:
    """The proxy endpoints the client takes: ``name_servers`` joined with ``;``, else ``name_server_domain``."""
    if config.name_servers:
        return ";".join(s.strip() for s in config.name_servers if s.strip())
    return config.name_server_domain.strip()


_ON_LOOP_S = 10.0  # bound on handing the making of a telemetry stream to the client's I/O loop


def _on_the_client_loop(work: Callable[[], None]) -> None:
    """Run ``work`` on the client's I/O loop and wait for it (at most ``_ON_LOOP_S``), or at once when
    this is that loop or the client has none yet."""
    io_loop = RpcClient.get_channel_io_loop()
    try:
        on_io_loop = asyncio.get_running_loop() is io_loop
    except RuntimeError:
        on_io_loop = False
    if on_io_loop or io_loop is None:
        work()
        return

    async def there() -> None:
        work()

    # Waits as the caller would have (making a stream is quick: nothing is awaited), within a bound so a
    # stuck loop fails the caller's step (a route query: its publish or startup says so) instead of hanging.
    handed = asyncio.run_coroutine_threadsafe(there(), io_loop)
    try:
        handed.result(timeout=_ON_LOOP_S)
    except TimeoutError:
        handed.cancel()  # not run later behind the caller's back
        raise


class _StreamsOnTheClientLoop:
    """Makes every telemetry stream on the client's I/O loop, whichever thread asks for it.

    A gRPC stream can only be made on a thread with an event loop. The client makes one in two places
    that can run elsewhere:

    * a new endpoint, learnt in a route query's callback, which the client attaches after the query
      returns: a query already answered by then runs the callback at once on the calling thread, an
      ``asyncio.to_thread`` worker with no event loop; the stream is not made, the callback fails and
      the route is dropped ("failed to fetch topic route", or no Settings for a consumer);
    * a broken stream, rebuilt in a failed settings write's callback: a write that fails before the
      client attaches it runs it on the writing thread, the settings scheduler's, which has no event
      loop either; the rebuild fails and the stream stays broken until the next sync (5 minutes).

    A loaded machine makes either race now and then; both are handed to the I/O loop here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the client's telemetry manager is private, its rebuild a method it calls on itself: the
        # instance's own attribute takes the call
        manager = self._Client__telemetry_manager  # type: ignore[attr-defined]
        retrieve = manager.retrieve_telemetry_stream_stream_call

        def retrieve_on_the_client_loop(endpoints: Any, rebuild: bool = False) -> None:
            _on_the_client_loop(lambda: retrieve(endpoints, rebuild))

        manager.retrieve_telemetry_stream_stream_call = retrieve_on_the_client_loop

    def on_new_endpoints(self, endpoints: Any) -> None:
        opened = super().on_new_endpoints  # type: ignore[misc]
        _on_the_client_loop(lambda: opened(endpoints))


class _Producer(_StreamsOnTheClientLoop, Producer):  # type: ignore[misc]
    """Keeps ``retry`` + 1 send attempts: the client otherwise takes the attempts the proxy's Settings say (3)."""

    def __init__(self, configuration: Any, *, max_attempts: int) -> None:
        super().__init__(configuration)
        self.room_max_attempts = max_attempts
        self._room_pin_attempts()

    def reset_setting(self, settings: Any) -> None:
        super().reset_setting(settings)
        self._room_pin_attempts()

    def _room_pin_attempts(self) -> None:
        # The client has no public knob for its send attempts; its policy lives in a private attribute.
        self._Producer__backoff_policy = ExponentialBackoffRetryPolicy(None, self.room_max_attempts)


class _GroupConsumer(_StreamsOnTheClientLoop, SimpleConsumer):  # type: ignore[misc]
    """A SimpleConsumer that surfaces the group's retry policy from the Settings the proxy answers."""

    def __init__(
        self,
        configuration: Any,
        group: str,
        topic: str,
        *,
        await_s: int,
        on_settings: Callable[[_GroupConsumer], None] | None = None,
    ) -> None:
        super().__init__(configuration, group, {topic: FilterExpression()}, await_duration=await_s)
        self.room_topic = topic
        self.room_wait_s = float(await_s)
        self.room_settings = threading.Event()
        self.room_max_attempts: int | None = None
        self._room_on_settings = on_settings

    def _receive_req(  # the client writes whole seconds; a long poll may be shorter
        self,
        topic: str,
        queue: Any,
        max_message_num: int,
        auto_renew: bool,
        invisible_duration: int | None = None,
        long_polling_timeout: int | None = None,
        attempt_id: str | None = None,
    ) -> Any:
        request = super()._receive_req(topic, queue, max_message_num, auto_renew, invisible_duration, None, attempt_id)
        request.long_polling_timeout.FromNanoseconds(int(self.room_wait_s * 1e9))
        return request

    def reset_setting(self, settings: Any) -> None:
        super().reset_setting(settings)
        if settings.HasField("backoff_policy"):
            self.room_max_attempts = int(settings.backoff_policy.max_attempts)
        self.room_settings.set()
        if self._room_on_settings is not None:
            self._room_on_settings(self)


@dataclass(slots=True)
class _Group:
    topic: str
    max_deliveries: int
    consumer: _GroupConsumer
    reported_max_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class _Receipt:
    message: Any  # the client's Message, with its receipt handle and endpoints
    consumer: _GroupConsumer


@dataclass(slots=True)
class _Held:
    message: Any
    dead: DeadLetter


class RocketMQBroker:
    name = "rocketmq"

    def __init__(
        self,
        *,
        endpoints: str,
        access_key: str = "",
        secret_key: str = "",
        namespace: str = "",
        send_timeout_s: float = 3.0,
        retry: int = 2,
        use_message_group: bool = True,
        max_delay_s: float = 24 * 3600 - 300,
        min_invisible_s: float = ROCKETMQ_MIN_INVISIBLE.total_seconds(),
        max_invisible_s: float = ROCKETMQ_MAX_INVISIBLE.total_seconds(),
        settings_wait_s: float = 10.0,
        dlq_reader_suffix: str = "-dlq-reader",
        dlq_hold_s: float = 60.0,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        if not endpoints:
            raise BrokerError("rocketmq: set rocketmq.name_servers (the proxy's host:port) or name_server_domain")
        self._configuration = ClientConfiguration(
            endpoints,
            Credentials(access_key, secret_key),
            namespace=namespace,
            request_timeout=max(1, math.ceil(send_timeout_s)),
        )
        if self._configuration.rpc_endpoints.facade == "":
            raise BrokerError(f"rocketmq: cannot parse endpoints {endpoints!r} (host:port;host:port)")
        self.namespace = namespace
        self.request_timeout_s = self._configuration.request_timeout
        self.max_send_attempts = retry + 1
        self.use_message_group = use_message_group
        self.max_delay_s = max_delay_s
        self.min_invisible_s = min_invisible_s
        self.max_invisible_s = max_invisible_s
        self.settings_wait_s = settings_wait_s
        self.dlq_reader_suffix = dlq_reader_suffix
        self.dlq_hold_s = dlq_hold_s
        self._clock = clock
        self._producer: _Producer | None = None
        self._producer_lock = asyncio.Lock()
        self._groups: dict[str, _Group] = {}
        self._group_lock = asyncio.Lock()
        self._readers: dict[str, _GroupConsumer] = {}
        self._held: dict[str, dict[str, _Held]] = {}  # group -> message id -> dead letter received from %DLQ%
        self._reasons: dict[tuple[str, str], tuple[int, str]] = {}  # (group, message id) -> (deliveries, reason)
        self._in_flight: set[concurrent.futures.Future[Any]] = set()  # client futures: sends and receives
        self._closed = False

    @classmethod
    def from_config(cls, config: RocketMQConfig, **overrides: Any) -> RocketMQBroker:
        kwargs: dict[str, Any] = {
            "endpoints": endpoints_of(config),
            "access_key": config.access_key.get_secret_value(),
            "secret_key": config.secret_key.get_secret_value(),
            "namespace": config.namespace,
            "send_timeout_s": config.send_timeout.total_seconds(),
            "retry": config.retry,
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------------ publish

    async def _ensure_producer(self) -> _Producer:
        if self._closed:
            raise BrokerUnavailable("rocketmq broker is closed")
        if self._producer is not None:
            return self._producer
        async with self._producer_lock:
            if self._producer is None:
                producer = _Producer(self._configuration, max_attempts=self.max_send_attempts)
                await asyncio.to_thread(producer.startup)
                self._producer = producer
        return self._producer

    async def publish(self, message: OutgoingMessage, *, timeout_s: float | None) -> str:
        return await self._publish(message, timeout_s=timeout_s)

    async def _publish(self, message: OutgoingMessage, *, timeout_s: float | None, for_group: str = "") -> str:
        outgoing = self._to_message(message, for_group=for_group)
        try:
            receipt = await asyncio.wait_for(self._send(outgoing), timeout=timeout_s)
        except TimeoutError:
            raise BrokerUnavailable(
                f"rocketmq: no SEND_OK for {message.topic} {within(timeout_s)} "
                f"({self.max_send_attempts} attempts of {self.request_timeout_s}s at most)"
            ) from None
        except _REFUSED as exc:
            raise BrokerError(f"rocketmq refused the message for {message.topic}: {exc}") from exc
        except Exception as exc:  # the client raises bare Exception for a route it could not fetch
            raise BrokerUnavailable(f"rocketmq publish to {message.topic} failed: {exc!r}") from exc
        return str(receipt.message_id)

    async def _send(self, outgoing: Any) -> Any:
        producer = await self._ensure_producer()
        # send_async looks the route up synchronously on first use of a topic: call it in a thread.
        future = await asyncio.to_thread(producer.send_async, outgoing)
        # A send the caller gave up on keeps running until the client's own attempts end; close() waits
        # for it: shutting a client down under a send in flight makes the client retry on its I/O
        # thread with the route cache cleared, which blocks that thread (shared by every client) for good.
        return await asyncio.shield(self._track(future))

    def _track(self, future: concurrent.futures.Future[Any]) -> asyncio.Future[Any]:
        """Await a client future; close() waits for those still running when their caller gave up."""
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        wrapped = asyncio.wrap_future(future)
        wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if abandoned
        return wrapped

    def _to_message(self, message: OutgoingMessage, *, for_group: str = "") -> Any:
        m = Message()
        try:
            m.topic = message.topic
            m.body = message.body
            if message.tag:
                m.tag = message.tag
            m.keys = message.key
            for name, value in message.headers.items():
                if name in _INTERNAL:
                    raise BrokerError(f"header {name!r} is reserved by the rocketmq adapter")
                if value:
                    m.add_property(name, value)
            if message.sharding_key:
                m.add_property(SHARDING_KEY, message.sharding_key)
            if for_group:
                m.add_property(FOR_GROUP, for_group)
            if message.deliver_at_ms is not None:
                m.add_property(DELIVER_AT, str(message.deliver_at_ms))
                m.delivery_timestamp = self._hop_seconds(message.deliver_at_ms)
            elif message.sharding_key and self.use_message_group:
                m.message_group = message.sharding_key
        except IllegalArgumentException as exc:
            raise BrokerError(f"rocketmq cannot carry this message: {exc}") from exc
        return m

    def _hop_seconds(self, deliver_at_ms: int) -> int:
        """The next delivery_timestamp (seconds): the due time rounded up, or the longest hop the proxy takes."""
        cap_ms = self._clock() + int(self.max_delay_s * 1000)
        if deliver_at_ms <= cap_ms:
            return math.ceil(deliver_at_ms / 1000)
        return cap_ms // 1000

    # ------------------------------------------------------------------ groups

    async def declare_group(self, topic: str, group: str, *, max_deliveries: int) -> None:
        async with self._group_lock:
            existing = self._groups.get(group)
            if existing is not None:
                if existing.topic != topic:
                    raise BrokerError(f"group {group} already consumes {existing.topic}, not {topic}")
                existing.max_deliveries = max_deliveries
                self._check_policy(group, existing)
                return
            consumer = await self._start_consumer(group, topic, await_s=1)
            g = _Group(topic, max_deliveries, consumer)
            self._groups[group] = g
            consumer._room_on_settings = lambda c: self._check_policy(group, g)
            self._check_policy(group, g)

    async def _start_consumer(self, group: str, topic: str, *, await_s: int) -> _GroupConsumer:
        if self._closed:
            raise BrokerUnavailable("rocketmq broker is closed")
        try:
            consumer = _GroupConsumer(self._configuration, group, topic, await_s=await_s)
        except IllegalArgumentException as exc:
            raise BrokerError(f"rocketmq: bad consumer group {group!r}: {exc}") from exc
        try:
            await asyncio.to_thread(consumer.startup)
            got = await asyncio.to_thread(consumer.room_settings.wait, self.settings_wait_s)
        except Exception as exc:
            raise BrokerUnavailable(f"rocketmq: consumer {group} did not start: {exc!r}") from exc
        if not got:
            await asyncio.to_thread(_quiet_shutdown, consumer)
            raise BrokerUnavailable(
                f"rocketmq: no Settings from the proxy for group {group} on {topic} within {self.settings_wait_s:g}s"
            )
        return consumer

    def _check_policy(self, group: str, g: _Group) -> None:
        reported = g.consumer.room_max_attempts
        if reported is None or reported == g.reported_max_attempts:
            return
        g.reported_max_attempts = reported
        if reported != g.max_deliveries:
            _log.warning(
                "rocketmq_retry_policy_mismatch",
                group=group,
                topic=g.topic,
                server_max_attempts=reported,
                server_retry_max_times=reported - 1,
                consumer_max_reconsume_times=g.max_deliveries - 1,
                effect=(
                    "the broker dead-letters earlier than configured"
                    if reported < g.max_deliveries
                    else "the adapter dead-letters after consumer_max_reconsume_times; the broker would retry longer"
                ),
                fix=f"set the group's retryMaxTimes to {g.max_deliveries - 1} (mqadmin updateSubGroup -g {group} -r N)",
            )
        else:
            _log.info("rocketmq_retry_policy", group=group, server_max_attempts=reported)

    def _group(self, group: str) -> _Group:
        g = self._groups.get(group)
        if g is None:
            raise BrokerError(f"rocketmq: group {group} was not declared in this process (declare_group first)")
        return g

    # ------------------------------------------------------------------ consume

    def _invisible(self, seconds: float) -> int:
        return int(min(self.max_invisible_s, max(self.min_invisible_s, math.ceil(seconds))))

    async def _receive(self, consumer: _GroupConsumer, n: int, invisible: int, wait_s: float) -> list[Any]:
        consumer.room_wait_s = max(0.0, wait_s)
        consumer.await_duration = max(1, math.ceil(wait_s))  # the client's RPC deadline: request timeout + this
        future = await asyncio.to_thread(consumer.receive_async, n, invisible)
        result: list[Any] = await asyncio.wait_for(
            asyncio.shield(self._track(future)), timeout=consumer.await_duration + self.request_timeout_s + 1
        )
        return result

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> Sequence[Delivery]:
        g = self._group(group)
        if topic != g.topic:
            raise BrokerError(f"group {group} consumes {g.topic}, not {topic}")
        try:
            messages = await self._receive(g.consumer, max_messages, self._invisible(visibility_s), wait_s)
        except _REFUSED as exc:
            raise BrokerError(f"rocketmq refused to deliver to {group}: {exc}") from exc
        except Exception as exc:
            raise BrokerUnavailable(f"rocketmq receive for {group} failed: {exc!r}") from exc
        out: list[Delivery] = []
        for m in messages:
            delivery = await self._admit(group, g, m)
            if delivery is not None:
                out.append(delivery)
        return out

    async def _admit(self, group: str, g: _Group, m: Any) -> Delivery | None:
        props: Mapping[str, str] = m.properties or {}
        receipt = _Receipt(m, g.consumer)
        for_group = props.get(FOR_GROUP)
        if for_group and for_group != group:  # a replay or a delay hop of another group
            await self._settle(receipt, lambda: g.consumer.ack(m))
            return None
        count = int(m.delivery_attempt or 1)
        delivery = _delivery(group, m, count, receipt)
        due = props.get(DELIVER_AT)
        if due is not None and int(due) > self._clock() + 1000:  # an early hop of a delay longer than the cap
            await self._chain(group, delivery, int(due), receipt)
            return None
        if m.corrupted:
            await self._dead_letter(group, delivery, "body checksum mismatch")
            return None
        if count > g.max_deliveries:  # the consumer crashed during the last delivery
            await self._dead_letter(group, delivery, "no ack after the last delivery", deliveries=count - 1)
            return None
        return delivery

    async def _chain(self, group: str, delivery: Delivery, due_ms: int, receipt: _Receipt) -> None:
        hop = OutgoingMessage(
            topic=delivery.topic,
            body=delivery.body,
            key=delivery.key,
            tag=delivery.tag,
            sharding_key=delivery.sharding_key,
            headers=delivery.headers,
            deliver_at_ms=due_ms,
        )
        try:
            await self._publish(hop, timeout_s=self.request_timeout_s * self.max_send_attempts + 1, for_group=group)
        except (BrokerError, BrokerUnavailable) as exc:
            _log.warning("rocketmq_delay_hop_failed", group=group, key=delivery.key, error=str(exc))
            await self._settle(receipt, lambda: receipt.consumer.change_invisible_duration(receipt.message, 10))
            return
        await self._settle(receipt, lambda: receipt.consumer.ack(receipt.message))

    async def _settle(self, receipt: _Receipt, call: Callable[[], None]) -> None:
        """Run an ack / change-invisible call; a stale receipt handle (redelivered since) is a no-op."""
        try:
            await asyncio.wait_for(asyncio.to_thread(call), timeout=self.request_timeout_s + 1)
        except BadRequestException as exc:
            if exc.code != Code.INVALID_RECEIPT_HANDLE:
                raise BrokerError(f"rocketmq refused: {exc}") from exc
            _log.info("rocketmq_stale_receipt", message_id=receipt.message.message_id)
        except _REFUSED as exc:
            raise BrokerError(f"rocketmq refused: {exc}") from exc
        except Exception as exc:
            raise BrokerUnavailable(f"rocketmq did not answer: {exc!r}") from exc

    async def ack(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        await self._settle(receipt, lambda: receipt.consumer.ack(receipt.message))

    async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
        """ChangeInvisibleDuration (whole seconds, at least one). The answer carries a new receipt handle,
        which the later ack or nack must use. The client writes it onto the message it is given before
        it checks the answer's status (an error's, or a late answer after our timeout, would replace a
        good handle), so it is given a copy, and the handle is taken over only from a call that succeeded."""
        receipt = _receipt(delivery)
        seconds = int(min(self.max_invisible_s, max(1, math.ceil(visibility_s))))
        touched = copy.copy(receipt.message)
        await self._settle(receipt, lambda: receipt.consumer.change_invisible_duration(touched, seconds))
        if touched.receipt_handle:  # (a stale receipt, refused, is left as it was)
            receipt.message.receipt_handle = touched.receipt_handle

    async def nack(self, delivery: Delivery, *, delay_s: float, reason: str = "") -> None:
        g = self._group(delivery.group)
        if delivery.delivery_count >= g.max_deliveries:
            await self._dead_letter(delivery.group, delivery, reason or "failed on its last delivery")
            return
        receipt = _receipt(delivery)
        seconds = int(min(self.max_invisible_s, max(0, math.ceil(delay_s))))
        await self._settle(receipt, lambda: receipt.consumer.change_invisible_duration(receipt.message, seconds))

    async def _dead_letter(self, group: str, delivery: Delivery, reason: str, *, deliveries: int = 0) -> None:
        receipt = _receipt(delivery)
        m = receipt.message
        request = ForwardMessageToDeadLetterQueueRequest()
        request.group.name, request.group.resource_namespace = group, self.namespace
        request.topic.name, request.topic.resource_namespace = delivery.topic, self.namespace
        request.receipt_handle = m.receipt_handle
        request.message_id = m.message_id
        request.delivery_attempt = delivery.delivery_count
        request.max_delivery_attempts = self._group(group).max_deliveries
        consumer = receipt.consumer

        def forward() -> None:
            response = consumer.rpc_client.forward_message_to_dead_letter_queue_async(
                m.endpoints, request, metadata=consumer.sign(), timeout=self.request_timeout_s
            ).result()
            if response.status.code not in (Code.OK, Code.MULTIPLE_RESULTS):
                raise BadRequestException(response.status.message, response.status.code)

        self._reasons[(group, delivery.message_id)] = (deliveries or delivery.delivery_count, reason)
        await self._settle(receipt, forward)
        _log.warning("rocketmq_dead_lettered", group=group, key=delivery.key, deliveries=delivery.delivery_count)

    # ------------------------------------------------------------------ dead letters

    async def _reader(self, group: str) -> _GroupConsumer:
        reader = self._readers.get(group)
        if reader is None:
            reader = await self._start_consumer(group + self.dlq_reader_suffix, "%DLQ%" + group, await_s=1)
            self._readers[group] = reader
        return reader

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        held = await self._refresh_dead(group, limit)
        return [h.dead for h in held.values()][:limit]

    async def _refresh_dead(self, group: str, limit: int) -> dict[str, _Held]:
        held = self._held.setdefault(group, {})
        try:
            reader = await self._reader(group)
        except BrokerUnavailable:
            if held:
                return held
            raise
        hold = self._invisible(self.dlq_hold_s)
        while len(held) < limit:
            try:
                got = await self._receive(reader, min(32, limit), hold, 0.1)
            except Exception as exc:
                if "route" in str(exc):  # no %DLQ% topic yet: nothing was ever dead-lettered
                    return held
                raise BrokerUnavailable(f"rocketmq: reading %DLQ%{group} failed: {exc!r}") from exc
            if not got:
                break
            for m in got:
                held[m.message_id] = _Held(m, self._dead(group, m))
        return held

    def _dead(self, group: str, m: Any) -> DeadLetter:
        g = self._groups.get(group)
        props = {k: v for k, v in (m.properties or {}).items() if k not in _INTERNAL}
        count, reason = self._reasons.get(
            (group, m.message_id),
            (
                g.max_deliveries if g else 0,
                f"moved to %DLQ%{group} after its last delivery (the reason is known to the process that failed it)",
            ),
        )
        return DeadLetter(
            group=group,
            topic=g.topic if g else "",
            message_id=m.message_id,
            key=next(iter(sorted(m.keys)), "") if m.keys else "",
            tag=m.tag or "",
            body=m.body,
            headers=props,
            delivery_count=count,
            # when the broker stored it in %DLQ% (the client keeps it but has no accessor for it)
            dead_at_ms=int(getattr(m, "_Message__store_timestamp", None) or self._clock()),
            reason=reason,
        )

    async def replay_dead_letter(self, group: str, message_id: str) -> bool:
        g = self._group(group)
        held = self._held.get(group, {})
        if message_id not in held:
            held = await self._refresh_dead(group, 1000)
        h = held.pop(message_id, None)
        if h is None:
            return False
        m = h.message
        props = m.properties or {}
        replay = OutgoingMessage(
            topic=g.topic,
            body=m.body,
            key=h.dead.key,
            tag=h.dead.tag,
            sharding_key=m.message_group or props.get(SHARDING_KEY, ""),
            headers=h.dead.headers,
        )
        try:
            await self._publish(replay, timeout_s=self.request_timeout_s * self.max_send_attempts + 1, for_group=group)
        except Exception:
            held[message_id] = h
            raise
        reader = self._readers[group]
        await self._settle(_Receipt(m, reader), lambda: reader.ack(m))
        self._reasons.pop((group, message_id), None)
        return True

    async def group_stats(self, topic: str, group: str) -> GroupStats:
        raise BrokerError(
            f"rocketmq: the gRPC proxy reports no lag for consumer group {group}; "
            f"see the RocketMQ dashboard or `mqadmin consumerProgress -g {group}`"
        )

    # ------------------------------------------------------------------ health, close

    async def ping(self) -> None:
        producer = await self._ensure_producer()
        request = QueryRouteRequest()
        request.topic.name = next(iter(self._groups.values())).topic if self._groups else "hyapp_room_outbox"
        request.topic.resource_namespace = self.namespace
        request.endpoints.CopyFrom(self._configuration.rpc_endpoints.endpoints)

        def query() -> Any:
            return producer.rpc_client.query_topic_route_async(
                self._configuration.rpc_endpoints, request, metadata=producer.sign(), timeout=self.request_timeout_s
            ).result()

        try:
            response = await asyncio.wait_for(asyncio.to_thread(query), timeout=self.request_timeout_s + 1)
        except Exception as exc:
            raise BrokerUnavailable(f"rocketmq proxy does not answer: {exc!r}") from exc
        if response.status.code in (Code.UNAUTHORIZED, Code.FORBIDDEN):
            raise BrokerUnavailable(f"rocketmq proxy refuses our credentials: {response.status.message}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending = list(self._in_flight)
        if pending:  # bounded: every client future ends after its attempts' request timeouts
            bound = self.request_timeout_s * self.max_send_attempts + 2
            await asyncio.to_thread(concurrent.futures.wait, pending, timeout=bound)
        clients: list[Any] = [g.consumer for g in self._groups.values()] + list(self._readers.values())
        if self._producer is not None:
            clients.append(self._producer)
        await asyncio.gather(*(asyncio.to_thread(_quiet_shutdown, c) for c in clients))
        self._groups.clear()
        self._readers.clear()


def _quiet_shutdown(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.shutdown()


def _receipt(delivery: Delivery) -> _Receipt:
    if not isinstance(delivery.receipt, _Receipt):
        raise BrokerError("not a delivery of the rocketmq adapter")
    return delivery.receipt


def _delivery(group: str, m: Any, count: int, receipt: _Receipt) -> Delivery:
    props: Mapping[str, str] = m.properties or {}
    return Delivery(
        topic=m.topic,
        group=group,
        message_id=m.message_id,
        key=next(iter(sorted(m.keys)), "") if m.keys else "",
        tag=m.tag or "",
        sharding_key=m.message_group or props.get(SHARDING_KEY, ""),
        body=m.body,
        headers={k: v for k, v in props.items() if k not in _INTERNAL},
        delivery_count=count,
        published_at_ms=int(m.born_timestamp or 0),
        receipt=receipt,
    )


async def open_rocketmq_broker(
    config: RocketMQConfig, *, clock: Callable[[], int] = wall_clock_ms, **overrides: Any
) -> RocketMQBroker:
    """The adapter with its producer started (routes are looked up on first use of a topic)."""
    broker = RocketMQBroker.from_config(config, clock=clock, **overrides)
    try:
        await broker._ensure_producer()
    except Exception as exc:
        await broker.close()
        raise BrokerUnavailable(f"rocketmq producer did not start: {exc!r}") from exc
    return broker


__all__ = ["RocketMQBroker", "endpoints_of", "open_rocketmq_broker"]
