"""The NATS JetStream adapter of the broker port (nats-py, NATS server 2.9+).

Layout (``P`` is ``rocketmq.namespace`` + ``.`` when set, else empty):

* One stream (``broker.nats.stream``, file storage, limits retention with
  ``max_age``, ``duplicate_window``) holds every topic on the subject
  ``P<topic>``. Its subjects are added as topics are first used, so the seed's
  topic names are the subjects. ``Nats-Msg-Id`` is the message key (the
  event_id): a re-publish inside the duplicate window is stored once and
  answered with the first copy's sequence, which is the message id.
* One durable pull consumer per group (named after the group, filtered on its
  topic's subject, explicit ack, ``ack_wait`` = the fetch's ``visibility_s``,
  updated when a fetch asks for another one, no server-side ``max_deliver``).
  A fetch polls it with ``no_wait`` pull requests every ``poll_interval_s``
  until ``wait_s`` (see :class:`_Puller` for why not lingering requests).
* Dead letters are the adapter's job: JetStream's ``max_deliver`` only stops
  delivering, silently. When a fetch receives a message whose
  ``num_delivered`` exceeds the group's ``max_deliveries`` (the consumer
  crashed during the last delivery), or a nack comes for the last delivery,
  the adapter copies it durably to the stream ``<stream>_dlq`` on
  ``Pdlq.<group>.<stream sequence>`` (``Nats-Msg-Id`` = ``<group>:<sequence>``,
  so a copy repeated after a crash is stored once) with the original headers,
  the reason, the delivery count and the original sequence, and then
  terminates the original. ``max_deliveries`` lives in the consumer's
  description, so every process (and the admin CLI) agrees on it.
* Delays: JetStream 2.9 has no scheduled messages. A message with
  ``deliver_at_ms`` in the future is stored on ``P<topic>.delayed`` in the same
  stream; a per-topic "mover" (a durable consumer ``delay_mover__<topic>``
  that every process running a group of the topic pulls from) negative-acks
  each one with the remaining delay until it is due, then publishes it to the
  topic subject (``Nats-Msg-Id`` = ``<key>:due``: a move repeated after a crash
  is stored once) and acks it. The groups see it only from then on, so holding
  it costs no delivery: its first delivery has ``delivery_count`` 1, with no
  bookkeeping of "holding" nacks. (Holding it in the group consumers instead
  would inflate ``num_delivered`` by a number of holds nobody can know for
  sure: an early redelivery or a crash between fetch and nak adds one.)
  The delivery's ``message_id`` is the moved copy's sequence (``publish``
  returned the delayed copy's). Delays longer than ``max_age`` are not kept.
* Replay: NATS 2.9 consumers have one filter subject, and no single filter
  matches the topic and one group's replays but not another's. A replay is
  therefore published on the topic subject with the header
  ``Roomservice-Replay-For: <group>`` (``Nats-Msg-Id`` =
  ``replay:<group>:<dead-letter sequence>``); every other group's fetch acks it
  unseen, so it reaches that group only, with its key and a fresh delivery
  count. The dead letter is then deleted from the dead-letter stream.

Connection: nats-py connects within ``connect_timeout`` and reconnects forever
in the background; a publish has its timeout; while disconnected, or when the
server does not answer in time, calls raise :class:`BrokerUnavailable`.
``send`` is the pipelined publish (the outbox worker's, for a room's rows): the
message is queued on the connection, in call order, and its PubAck comes as a
future, bounded by the caller. Every publish (``publish`` too) is the adapter's
own: a core publish with a reply subject under one wildcard subscription of
acknowledgements (see ``NatsBroker._put``); outstanding acknowledgements fail
with ``BrokerUnavailable`` when the connection is lost or the broker closed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

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
from roomservice.config import NatsConfig
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.brokers.nats")

# Our headers (what the port's message carries besides body and user headers).
H_KEY = "Roomservice-Key"
H_TAG = "Roomservice-Tag"
H_SHARDING_KEY = "Roomservice-Sharding-Key"
H_PUBLISHED_AT = "Roomservice-Published-At-Ms"
H_DELIVER_AT = "Roomservice-Deliver-At-Ms"
H_TOPIC = "Roomservice-Topic"
H_REPLAY_FOR = "Roomservice-Replay-For"
H_DEAD_REASON = "Roomservice-Dead-Reason"
H_DEAD_COUNT = "Roomservice-Dead-Delivery-Count"
H_DEAD_SEQ = "Roomservice-Dead-Stream-Seq"
H_DEAD_AT = "Roomservice-Dead-At-Ms"
H_DEAD_GROUP = "Roomservice-Dead-Group"
_MSG_ID = "Nats-Msg-Id"
_EXPECTED_STREAM = "Nats-Expected-Stream"  # refused (400) unless the subject's stream is ours
_OURS = "Roomservice-"
_THEIRS = "Nats-"

_MAX_DELIVERIES = re.compile(r"max_deliveries=(\d+)")
_MOVER = "delay_mover__"
_TOKEN = re.compile(r"^[^\s.*>]+$")  # one subject token / a consumer name
_DEFAULT_ACK_WAIT_S = 30.0
_SEEN_LIMIT = 100_000
# Outstanding acknowledgements at most: the outbox worker has publish_concurrency of them;
# beyond this a caller is not giving up on them (a publish then fails, retryably).
_ACKS_LIMIT = 65_536
# A nak's delay does not survive a server restart: the held message then comes back
# after ack_wait from its last delivery, so the mover's is short (each hold is a nak
# again, and a move repeated by a second mover is stored once).
_MOVER_ACK_WAIT_S = 2.0


class _NoStream(BrokerUnavailable):
    """JetStream's "no responders" to a publish: no stream (any more) on its subject."""


class _Puller:
    """Pulls from one durable consumer with ``no_wait`` requests, polled.

    Not nats-py's ``PullSubscription.fetch``: its pull requests linger until they
    expire, and on NATS 2.9 a redelivery that races a request's expiry can come
    back with its delivery count reset to 1 (fixed in 2.10.14, nats-server #5305),
    while the client's ``wait_for(queue.get())`` can drop a message that arrives as
    it times out (Python 3.11). A ``no_wait`` request is answered at once (the
    messages there are, then a status), so no request is left to expire, and this
    reader never drops a message it received: one that comes late is returned by
    the next pull (its delivery is real, its visibility timeout running)."""

    def __init__(self, nc: Client, stream: str, consumer: str) -> None:
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Any = None

    async def start(self) -> None:
        async def received(msg: Msg) -> None:
            self._queue.put_nowait(msg)

        self._sub = await self._nc.subscribe(self._inbox, cb=received)

    async def stop(self) -> None:
        if self._sub is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def pull(self, batch: int, *, answer_s: float) -> list[Msg]:
        """What the consumer has for us now, at most ``batch`` (late ones from an earlier pull first)."""
        msgs: list[Msg] = []
        while not self._queue.empty() and len(msgs) < batch:
            late = self._queue.get_nowait()
            if not _status(late):
                msgs.append(late)
        if msgs:
            return msgs
        request = json.dumps({"batch": batch, "no_wait": True}).encode()
        await self._nc.publish(self._next, request, reply=self._inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + answer_s
        while len(msgs) < batch:
            msg = await self._get(deadline - loop.time())
            if msg is None:
                if msgs:
                    break
                raise nats.errors.TimeoutError  # the server did not answer the request
            status = _status(msg)
            if status in ("404", "408"):  # no (more) messages: the end of this request's answer
                break
            if status:
                if msgs:
                    break
                raise nats.js.errors.APIError.from_msg(msg)
            msgs.append(msg)
        return msgs

    async def _get(self, within_s: float) -> Msg | None:
        """The next message within ``within_s``, or None; never loses one to the timeout."""
        if not self._queue.empty():
            return self._queue.get_nowait()
        if within_s <= 0:
            return None
        getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({getter}, timeout=within_s)
        if getter in done:
            return getter.result()
        getter.cancel()
        try:
            return await getter  # it may have completed just now: keep that message
        except asyncio.CancelledError:
            return None


@dataclass(slots=True)
class _Group:
    topic: str
    max_deliveries: int
    ack_wait_s: float
    puller: _Puller
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Highest delivery count this process saw per stream sequence not yet settled, with the
    # message's stored time: a guard against a count that went backwards (see _Puller); bounded.
    # (A stream recreated after a lost store numbers its messages from 1 again: a sequence seen
    # with another stored time is another message, and counts afresh.)
    seen: dict[int, tuple[datetime, int]] = field(default_factory=dict)


class NatsBroker:
    """The broker port on one JetStream stream plus its dead-letter stream (see the module doc)."""

    name = "nats"

    def __init__(
        self,
        nc: Client,
        config: NatsConfig,
        *,
        subject_prefix: str,
        duplicate_window_s: float,
        op_timeout_s: float,
        poll_interval_s: float,
        clock: Callable[[], int],
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=op_timeout_s)
        # Publishes (``_put``): the acknowledgements' wildcard subscription (made by the first
        # publish), the outstanding ones by token, and the counter the tokens come from (the
        # inbox prefix is unique to this broker, so a counter is unique enough). No timer per
        # message: each caller bounds its wait with its own deadline.
        # The subscription's subject prefix and the loop it was made on, whose futures the
        # acknowledgements resolve (looked up once: asyncio.get_running_loop() makes a getpid
        # system call every time in 3.11).
        self._acks_on: tuple[str, asyncio.AbstractEventLoop] | None = None
        self._ack_sub: Any = None
        self._ack_lock = asyncio.Lock()
        self._acks: dict[str, asyncio.Future[str]] = {}
        self._ack_counter = 0
        self._config = config
        self.stream = config.stream
        self.dlq_stream = f"{config.stream}_dlq"
        self._prefix = f"{subject_prefix}." if subject_prefix else ""
        self._duplicate_window_s = duplicate_window_s
        self._max_age_s = config.max_age.total_seconds()
        self._op_timeout_s = op_timeout_s
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._subjects: dict[str, set[str]] = {self.stream: set(), self.dlq_stream: set()}
        self._subjects_lock = asyncio.Lock()
        self._topic_subjects: dict[str, tuple[str, str]] = {}  # topic -> (subject, delayed subject), validated
        self._groups: dict[str, _Group] = {}
        self._movers: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    # ------------------------------------------------------------------ names

    def subject(self, topic: str) -> str:
        return f"{self._prefix}{_token(topic, 'topic')}"

    def delayed_subject(self, topic: str) -> str:
        return f"{self.subject(topic)}.delayed"

    def dlq_subject(self, group: str, seq: int | str = "*") -> str:
        return f"{self._prefix}dlq.{_token(group, 'group')}.{seq}"

    # ------------------------------------------------------------------ publish

    async def publish(self, message: OutgoingMessage, *, timeout_s: float | None) -> str:
        self._check_connected()
        subjects, subject, headers = self._outgoing(message)
        known = self._subjects[self.stream]
        try:
            async with asyncio.timeout(timeout_s):  # the one deadline of this publish (None: the caller's)
                if subjects[0] not in known or subjects[1] not in known:
                    await self._ensure_subjects(self.stream, subjects)
                return await self._publish(subject, message.body, headers, stream=self.stream)
        except TimeoutError:
            raise BrokerUnavailable(f"NATS did not acknowledge the publish {within(timeout_s)}") from None

    async def send(self, message: OutgoingMessage) -> asyncio.Future[str]:
        """Pipelined publish: queue ``message`` on the connection and return the future of its
        acknowledgement (the message id, as :meth:`publish` returns it).

        Messages reach the server in the order their ``send`` calls returned (one connection,
        written in order) and the stream stores them in that order, so a caller that awaits
        ``send`` after ``send`` keeps its order while the acknowledgements are outstanding.
        The future fails as :meth:`publish` fails (``BrokerUnavailable``, ``BrokerError``),
        except that a stream that lost the subject is not repaired inline: that message is
        ``BrokerUnavailable`` and the next call binds the subject again. It also fails
        (``BrokerUnavailable``) when the connection is lost or the broker closed before the
        acknowledgement came (see :meth:`_connection_lost`). The future has no deadline: the
        caller bounds its wait and cancels it to give up (which frees its place in the table
        of outstanding acknowledgements)."""
        self._check_connected()
        subjects, subject, headers = self._outgoing(message)
        known = self._subjects[self.stream]
        if subjects[0] not in known or subjects[1] not in known:
            await self._ensure_subjects(self.stream, subjects)
        return await self._put(subject, message.body, headers, self.stream)

    # ------------------------------------------------------------------ acknowledgements
    #
    # Our own JetStream publish: a plain core-NATS publish whose reply subject is
    # <our inbox prefix>.<token>, JetStream answering each with a PubAck (or an error,
    # or a 503 status when no stream listens on the subject) on the one wildcard
    # subscription. Not nats-py's publish_async / publish: per message they pay a
    # semaphore under wait_for, a NUID plus os.urandom token, a dataclass built from
    # the reply, and (publish) a request future with a timer; here it is a counter,
    # a future in a dict and a JSON parse, the one cost that matters for the outbox
    # worker's rows (bench.mq_drain).

    async def _put(self, subject: str, body: bytes, headers: dict[str, str], stream: str) -> asyncio.Future[str]:
        """Write one JetStream publish on the connection (in call order) and return the future
        of its message id. ``headers`` is the caller's own dict (the expected-stream header is
        added to it). Raises the port's error when nats-py refuses the message itself."""
        prefix, loop = self._acks_on or await self._subscribe_acks()
        acks = self._acks
        if len(acks) >= _ACKS_LIMIT:  # callers that never give up: a bound, not a queue
            raise BrokerUnavailable(f"NATS: {len(acks)} publishes wait for their acknowledgement")
        self._ack_counter += 1
        token = str(self._ack_counter)
        ack: asyncio.Future[str] = loop.create_future()
        acks[token] = ack
        # pop(token, ack): a cancelled (given up) publish lets go of its entry; an answered one
        # was popped by the handler already. A C-level callback, no Python frame.
        ack.add_done_callback(functools.partial(acks.pop, token))
        headers[_EXPECTED_STREAM] = stream
        try:
            with _mapped():
                await self._nc.publish(subject, body, reply=prefix + token, headers=headers)
        except BaseException:  # refused by nats-py, or the caller cancelled while it flushed
            acks.pop(token, None)
            ack.cancel()
            raise
        return ack

    async def _subscribe_acks(self) -> tuple[str, asyncio.AbstractEventLoop]:
        """The wildcard subscription every acknowledgement comes to (the first publish makes it): its
        subjects' prefix, and the loop it was made on."""
        async with self._ack_lock:
            if self._acks_on is None:
                prefix = f"{self._nc.new_inbox()}."
                with _mapped():
                    # A cb subscription: nats-py's reader queues the replies and one task runs
                    # _acknowledged for each in turn, without suspending while replies are
                    # queued. (Its ``future=`` subscriptions are resolved inline, but they are
                    # meant for one reply; using one for many would rely on nats-py internals.)
                    self._ack_sub = await self._nc.subscribe(prefix + "*", cb=self._acknowledged)
                self._acks_on = prefix, asyncio.get_running_loop()
            return self._acks_on

    async def _acknowledged(self, msg: Msg) -> None:
        """One JetStream answer: resolve its publish's future (one already given up on is gone: ignored)."""
        prefix = self._acks_on[0] if self._acks_on is not None else ""
        ack = self._acks.pop(msg.subject[len(prefix) :], None)
        if ack is None or ack.done():
            return
        data = msg.data
        if not data:  # a status only: 503 is "no responders", no stream bound to the subject
            status = msg.headers.get("Status", "") if msg.headers else ""
            if status == "503":
                for known in self._subjects.values():  # bound again on the next publish
                    known.clear()
                ack.set_exception(_NoStream("NATS: no stream took the message (bound again on the next publish)"))
            else:
                ack.set_exception(BrokerUnavailable(f"NATS answered the publish with status {status or '-'}"))
            return
        try:
            answer = orjson.loads(data)
            error = answer.get("error")  # first: a refusal carries "stream" and "seq": 0 as well
            seq = answer.get("seq")
        except (orjson.JSONDecodeError, AttributeError):
            error = seq = None
        if error is None and isinstance(seq, int) and seq > 0:
            ack.set_result(str(seq))
        elif isinstance(error, dict):
            ack.set_exception(_refusal(error))
        else:
            ack.set_exception(BrokerUnavailable(f"NATS answered the publish with {data[:200]!r}"))

    def _connection_lost(self, why: str) -> None:
        """Fail every outstanding acknowledgement with BrokerUnavailable (disconnected or closed).

        An acknowledgement of a message written on a lost connection never comes: JetStream
        answers on the reply subject, and the connection that listened is gone (the
        re-subscription after the reconnect is new interest; nothing is re-sent to it).
        Waiting would only hold the caller until its own timeout, and the outbox worker's
        concurrency slot with it. A message that was stored, or that nats-py still held in its
        buffer and writes after the reconnect, is stored once all the same: the retry carries
        the same Nats-Msg-Id inside the duplicate window and is answered with the first copy's
        sequence. Publishes made after this, while reconnecting, are answered normally."""
        if not self._acks:
            return
        outstanding = list(self._acks.values())
        self._acks.clear()
        for ack in outstanding:
            if not ack.done():
                ack.set_exception(BrokerUnavailable(f"NATS: {why} before the publish was acknowledged"))

    def _outgoing(self, message: OutgoingMessage) -> tuple[tuple[str, str], str, dict[str, str]]:
        """The topic's (subject, delayed subject), the subject to publish on, and the headers."""
        now = self._clock()
        topic = message.topic
        subjects = self._topic_subjects.get(topic) or self._topic_subjects_of(topic)
        # The headers in one pass, in the order they always had: the caller's (ours and
        # the server's reserved names dropped), key, tag, sharding key (when set), then ours.
        headers = {k: v for k, v in message.headers.items() if not _reserved(k)} if message.headers else {}
        if message.key:
            headers[H_KEY] = message.key
        if message.tag:
            headers[H_TAG] = message.tag
        if message.sharding_key:
            headers[H_SHARDING_KEY] = message.sharding_key
        headers[H_PUBLISHED_AT] = str(now)
        headers[_MSG_ID] = message.key
        deliver_at = message.deliver_at_ms
        delayed = deliver_at is not None and deliver_at > now
        if delayed:
            headers[H_DELIVER_AT] = str(deliver_at)
        return subjects, subjects[1] if delayed else subjects[0], headers

    def _topic_subjects_of(self, topic: str) -> tuple[str, str]:
        """``topic``'s subject and delayed subject, validated once (BrokerError for a bad name)."""
        subject = self.subject(topic)
        if len(self._topic_subjects) >= 1024:  # topics are few; a bound all the same
            self._topic_subjects.clear()
        pair = self._topic_subjects[topic] = (subject, f"{subject}.delayed")
        return pair

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str], *, stream: str) -> str:
        """Publish, wait for the acknowledgement and return the message id; rebinds the subject
        once if the stream lost it (a racing update).

        No timeout here: every caller holds one around the call (its cancellation frees the
        outstanding acknowledgement). ``headers`` is the caller's own dict."""
        try:
            return await (await self._put(subject, body, headers, stream))
        except _NoStream:
            if not self._nc.is_connected:
                raise
        self._subjects[stream].clear()
        await self._ensure_subjects(stream, [subject])
        return await (await self._put(subject, body, headers, stream))

    # ------------------------------------------------------------------ groups

    async def declare_group(self, topic: str, group: str, *, max_deliveries: int) -> None:
        if max_deliveries < 1:
            raise BrokerError("max_deliveries must be >= 1")
        self._check_connected()
        async with asyncio.timeout(self._op_timeout_s * 4):
            try:
                await self._ensure_topic(topic)
                await self._ensure_subjects(self.dlq_stream, [self.dlq_subject(group)])
                ack_wait = self._groups[group].ack_wait_s if group in self._groups else None
                if ack_wait is None:
                    ack_wait = await self._current_ack_wait(group)
                await self._put_consumer(topic, group, max_deliveries=max_deliveries, ack_wait_s=ack_wait)
                await self._ensure_mover(topic)
            except TimeoutError:
                raise BrokerUnavailable("NATS did not answer while declaring the group") from None
        await self._bind(topic, group, max_deliveries, ack_wait)

    async def _current_ack_wait(self, group: str) -> float:
        with _mapped():
            try:
                info = await self._js.consumer_info(self.stream, group)
            except nats.js.errors.NotFoundError:
                return _DEFAULT_ACK_WAIT_S
        return float(info.config.ack_wait or _DEFAULT_ACK_WAIT_S)

    async def _put_consumer(self, topic: str, group: str, *, max_deliveries: int, ack_wait_s: float) -> None:
        """Create the group's durable consumer, or update it (ack_wait, max_deliveries) in place."""
        config = api.ConsumerConfig(
            name=group,
            durable_name=group,
            description=f"roomservice group of topic {topic}; max_deliveries={max_deliveries}",
            filter_subject=self.subject(topic),
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=-1,  # the adapter dead-letters (JetStream's limit would drop silently)
            max_ack_pending=-1,  # held (nacked with a delay) messages must not stall the group
        )
        with _mapped():
            await self._js.add_consumer(self.stream, config)

    async def _bind(self, topic: str, group: str, max_deliveries: int, ack_wait_s: float) -> _Group:
        g = self._groups.get(group)
        if g is not None:
            g.topic, g.max_deliveries, g.ack_wait_s = topic, max_deliveries, ack_wait_s
            return g
        puller = _Puller(self._nc, self.stream, group)
        with _mapped():
            await puller.start()
        g = self._groups.setdefault(group, _Group(topic, max_deliveries, ack_wait_s, puller))
        if g.puller is not puller:
            await puller.stop()
        return g

    async def _group(self, topic: str, group: str) -> _Group:
        """This process's handle on the group, loaded from the consumer when another process declared it."""
        g = self._groups.get(group)
        if g is not None:
            return g
        with _mapped():
            try:
                info = await self._js.consumer_info(self.stream, group)
            except nats.js.errors.NotFoundError:
                raise BrokerError(f"group {group!r} is not declared") from None
        found = _MAX_DELIVERIES.search(info.config.description or "")
        if found is None or info.config.filter_subject != self.subject(topic):
            raise BrokerError(f"consumer {group!r} is not a room-service group of topic {topic!r}")
        await self._ensure_mover(topic)
        return await self._bind(topic, group, int(found.group(1)), float(info.config.ack_wait or _DEFAULT_ACK_WAIT_S))

    # ------------------------------------------------------------------ fetch, ack, nack

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> Sequence[Delivery]:
        self._check_connected()
        g = await self._group(topic, group)
        if abs(g.ack_wait_s - visibility_s) > 1e-3:
            await self._put_consumer(topic, group, max_deliveries=g.max_deliveries, ack_wait_s=visibility_s)
            g.ack_wait_s = visibility_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        async with g.lock:  # one pull at a time on the group's inbox
            while True:
                try:
                    with _mapped():
                        msgs = await g.puller.pull(max(1, max_messages), answer_s=self._op_timeout_s)
                except BrokerUnavailable:
                    await self._redeclare_if_lost(g, group)
                    raise
                out = await self._admitted(g, group, msgs)
                remaining = deadline - loop.time()
                if out or remaining <= 0:
                    return out
                await asyncio.sleep(min(self._poll_interval_s, remaining))
                self._check_connected()

    async def _redeclare_if_lost(self, g: _Group, group: str) -> None:
        """A pull nobody answered: if the server lost the consumer (a store wiped), declare it again."""
        if not self._nc.is_connected:
            return
        try:
            await self._js.consumer_info(self.stream, group)
        except nats.js.errors.NotFoundError:
            _log.warning("broker_nats_group_lost", group=group, topic=g.topic)
            with contextlib.suppress(Exception):
                for known in self._subjects.values():
                    known.clear()
                await self.declare_group(g.topic, group, max_deliveries=g.max_deliveries)
        except Exception:  # the server does not answer at all: nothing to repair from here
            return

    async def _admitted(self, g: _Group, group: str, msgs: Sequence[Msg]) -> list[Delivery]:
        """The deliveries among ``msgs``. One whose settling fails here (a dead letter not written, another
        group's replay not acknowledged) stays out and comes back after the ack wait; the others go on."""
        out: list[Delivery] = []
        failed: list[BaseException] = []
        for msg in msgs:
            try:
                delivery = await self._admit(g, group, msg)
            except Exception as exc:
                failed.append(exc)
                continue
            if delivery is not None:
                out.append(delivery)
        if failed:  # one line a fetch, not one a message, while the dead-letter stream or the link is down
            _log.warning("broker_nats_admit_failed", group=group, messages=len(failed), error=repr(failed[0]))
        return out

    async def _admit(self, g: _Group, group: str, msg: Msg) -> Delivery | None:
        """The delivery for ``msg``, or None when it is not this group's to see (after settling it)."""
        headers = msg.headers or {}
        replay_for = headers.get(H_REPLAY_FOR)
        if replay_for is not None and replay_for != group:
            await self._settle(lambda: msg.ack_sync(timeout=self._op_timeout_s))  # another group's replay
            return None
        md = msg.metadata
        seq, stored = md.sequence.stream, md.timestamp
        before = g.seen.get(seq)
        delivered = md.num_delivered if before is None or before[0] != stored else max(md.num_delivered, before[1] + 1)
        if delivered > g.max_deliveries:  # the consumer crashed during its last delivery
            await self._bury(g, group, msg, "no ack after the last delivery", delivered - 1)
            return None
        g.seen[seq] = (stored, delivered)
        if len(g.seen) > _SEEN_LIMIT:
            del g.seen[next(iter(g.seen))]
        return self._delivery(g.topic, group, msg, delivered)

    def _delivery(self, topic: str, group: str, msg: Msg, delivery_count: int) -> Delivery:
        headers = msg.headers or {}
        md = msg.metadata
        published = headers.get(H_PUBLISHED_AT)
        if published and published.isascii() and published.isdigit():
            published_at_ms = int(published)
        else:  # not ours ("²".isdigit() is true, and int() refuses it): the stream's own time
            published_at_ms = int(md.timestamp.timestamp() * 1000)
        return Delivery(
            topic=topic,
            group=group,
            message_id=str(md.sequence.stream),
            key=headers.get(H_KEY) or headers.get(_MSG_ID, ""),
            tag=headers.get(H_TAG, ""),
            sharding_key=headers.get(H_SHARDING_KEY, ""),
            body=msg.data,
            headers=_user_headers(headers),
            delivery_count=delivery_count,
            published_at_ms=published_at_ms,
            receipt=msg,
        )

    async def ack(self, delivery: Delivery) -> None:
        msg = _receipt(delivery)
        self._check_connected()
        await self._settle(lambda: msg.ack_sync(timeout=self._op_timeout_s))
        g = self._groups.get(delivery.group)
        if g is not None:
            g.seen.pop(msg.metadata.sequence.stream, None)

    async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
        """Restarts the message's ack wait: the group's, which its fetch set to ``visibility_s``."""
        msg = _receipt(delivery)
        self._check_connected()
        await self._settle(msg.in_progress)

    async def nack(self, delivery: Delivery, *, delay_s: float, reason: str = "") -> None:
        msg = _receipt(delivery)
        self._check_connected()
        g = await self._group(delivery.topic, delivery.group)
        delivered = delivery.delivery_count
        if delivered >= g.max_deliveries:
            await self._bury(g, delivery.group, msg, reason or "failed on its last delivery", delivered)
            return
        await self._settle(lambda: msg.nak(delay=delay_s if delay_s > 0 else None))

    async def _settle(self, call: Callable[[], Any]) -> None:
        with _mapped():
            try:
                async with asyncio.timeout(self._op_timeout_s):
                    await call()
            except nats.errors.MsgAlreadyAckdError:
                pass  # settled already in this process

    # ------------------------------------------------------------------ dead letters

    async def _bury(self, g: _Group, group: str, msg: Msg, reason: str, delivery_count: int) -> None:
        """Copy ``msg`` durably to the group's dead letters, then terminate it (a copy repeated is stored once)."""
        seq = msg.metadata.sequence.stream
        topic = g.topic
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith(_THEIRS)}
        headers.pop(H_REPLAY_FOR, None)
        headers.pop(H_DELIVER_AT, None)
        headers.update(
            {
                H_TOPIC: topic,
                H_DEAD_GROUP: group,
                H_DEAD_REASON: _one_line(reason) or "-",
                H_DEAD_COUNT: str(delivery_count),
                H_DEAD_SEQ: str(seq),
                H_DEAD_AT: str(self._clock()),
                _MSG_ID: f"{group}:{seq}",
            }
        )
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._ensure_subjects(self.dlq_stream, [self.dlq_subject(group)])
                await self._publish(self.dlq_subject(group, seq), msg.data, headers, stream=self.dlq_stream)
        except TimeoutError:
            raise BrokerUnavailable("NATS did not store the dead letter in time") from None
        await self._settle(msg.term)
        g.seen.pop(seq, None)
        _log.warning("broker_dead_letter", group=group, topic=topic, key=headers.get(H_KEY), reason=reason)

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        self._check_connected()
        out: list[DeadLetter] = []
        seq = 1
        while len(out) < limit:
            with _mapped():
                try:
                    raw = await self._js.get_msg(self.dlq_stream, seq=seq, subject=self.dlq_subject(group), next=True)
                except nats.js.errors.NotFoundError:  # no further one (or no dead-letter stream yet)
                    break
            out.append(_dead_letter(group, raw))
            seq = (raw.seq or seq) + 1
        return out

    async def replay_dead_letter(self, group: str, message_id: str) -> bool:
        self._check_connected()
        if not message_id.isdigit():
            return False
        with _mapped():
            try:
                raw = await self._js.get_last_msg(self.dlq_stream, self.dlq_subject(group, message_id))
            except nats.js.errors.NotFoundError:
                return False
        headers = _stored_headers(raw)
        topic = headers.get(H_TOPIC, "")
        replay = {
            k: v for k, v in headers.items() if not k.startswith(_THEIRS) and not k.startswith("Roomservice-Dead-")
        }
        replay.pop(H_TOPIC, None)
        replay[H_REPLAY_FOR] = group
        replay[_MSG_ID] = f"replay:{group}:{raw.seq}"
        try:
            async with asyncio.timeout(self._op_timeout_s * 2):
                await self._ensure_topic(topic)
                await self._publish(self.subject(topic), raw.data or b"", replay, stream=self.stream)
                with _mapped():
                    await self._js.delete_msg(self.dlq_stream, int(raw.seq or 0))
        except TimeoutError:
            raise BrokerUnavailable("NATS did not answer while replaying the dead letter") from None
        return True

    # ------------------------------------------------------------------ stats, ping, close

    async def group_stats(self, topic: str, group: str) -> GroupStats:
        self._check_connected()
        with _mapped():
            held = await self._pending(_MOVER + topic)  # delayed messages not yet moved reach every group
            try:
                info = await self._js.consumer_info(self.stream, group)
            except nats.js.errors.NotFoundError:  # not declared yet: it will receive what the topic holds
                return GroupStats(
                    topic=topic, group=group, lag=await self._topic_messages(topic) + held, in_flight=0, dead_letters=0
                )
            try:
                dead = await self._js.stream_info(self.dlq_stream, subjects_filter=self.dlq_subject(group))
                dead_letters = sum((dead.state.subjects or {}).values())
            except nats.js.errors.NotFoundError:
                dead_letters = 0
        return GroupStats(
            topic=topic,
            group=group,
            lag=info.num_pending + info.num_ack_pending + held,
            in_flight=info.num_ack_pending,
            dead_letters=dead_letters,
        )

    async def _pending(self, consumer: str) -> int:
        try:
            info = await self._js.consumer_info(self.stream, consumer)
        except nats.js.errors.NotFoundError:
            return 0
        return int(info.num_pending + info.num_ack_pending)

    async def _topic_messages(self, topic: str) -> int:
        try:
            info = await self._js.stream_info(self.stream, subjects_filter=self.subject(topic))
        except nats.js.errors.NotFoundError:
            return 0
        return sum((info.state.subjects or {}).values())

    async def ping(self) -> None:
        self._check_connected()
        try:
            with _mapped():
                async with asyncio.timeout(self._op_timeout_s):
                    await self._js.account_info()  # the JetStream API answers, not only the connection
        except TimeoutError:
            raise BrokerUnavailable("NATS JetStream did not answer in time") from None

    async def close(self) -> None:
        self._closed = True
        self._connection_lost("the broker was closed")
        for task in self._movers.values():
            task.cancel()
        for task in self._movers.values():
            with contextlib.suppress(BaseException):
                await task
        self._movers.clear()
        if not self._nc.is_closed:
            await self._nc.close()

    def _check_connected(self) -> None:
        if self._closed:
            raise BrokerUnavailable("the NATS broker is closed")
        if not self._nc.is_connected:
            raise BrokerUnavailable("not connected to NATS (reconnecting)")

    # ------------------------------------------------------------------ delays

    async def _ensure_mover(self, topic: str) -> None:
        """The topic's delay mover: a durable consumer on ``P<topic>.delayed`` and this process's loop on it."""
        task = self._movers.get(topic)
        if task is not None and not task.done():
            return
        puller = _Puller(self._nc, self.stream, _MOVER + topic)
        with _mapped():
            await self._js.add_consumer(self.stream, self._mover_config(topic))
            await puller.start()
        if topic in self._movers and not self._movers[topic].done():  # a concurrent declare won
            await puller.stop()
            return
        self._movers[topic] = asyncio.create_task(self._move(topic, puller), name=f"nats-delay-mover:{topic}")

    def _mover_config(self, topic: str) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=_MOVER + topic,
            durable_name=_MOVER + topic,
            description=f"roomservice delay mover of topic {topic}",
            filter_subject=self.delayed_subject(topic),
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=_MOVER_ACK_WAIT_S,
            max_deliver=-1,
            max_ack_pending=-1,
        )

    async def _restore_mover_if_lost(self, topic: str) -> None:
        """After a failed pull: if the server lost the mover's consumer (a store wiped), create it again
        (the loop's puller goes on with it: same name). Nothing else is repaired from here."""
        if not self._nc.is_connected:
            return
        try:
            await self._js.consumer_info(self.stream, _MOVER + topic)
        except nats.js.errors.NotFoundError:
            _log.warning("broker_nats_delay_mover_lost", topic=topic)
            with contextlib.suppress(Exception):  # (the stream may not be back yet: the next failure tries again)
                await self._js.add_consumer(self.stream, self._mover_config(topic))
        except Exception:
            return

    async def _move(self, topic: str, puller: _Puller) -> None:
        failures = 0
        while not self._closed:
            try:
                if not self._nc.is_connected:
                    raise BrokerUnavailable("reconnecting")
                msgs = await puller.pull(64, answer_s=self._op_timeout_s)
                for msg in msgs:
                    await self._move_one(topic, msg)
                failures = 0
                if not msgs:
                    await asyncio.sleep(self._poll_interval_s)
            except asyncio.CancelledError:
                await puller.stop()
                raise
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    _log.warning("broker_delay_mover_failed", topic=topic, failures=failures, error=repr(exc))
                await self._restore_mover_if_lost(topic)
                await asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))

    async def _move_one(self, topic: str, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        due = headers.get(H_DELIVER_AT, "0")
        remaining_ms = (int(due) if due.isdigit() else 0) - self._clock()
        if remaining_ms > 0:
            await msg.nak(delay=remaining_ms / 1000)  # comes back to a mover when it is due
            return
        moved = {k: v for k, v in headers.items() if not k.startswith(_THEIRS)}
        moved[_MSG_ID] = f"{headers.get(H_KEY) or headers.get(_MSG_ID, '')}:due"
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._publish(self.subject(topic), msg.data, moved, stream=self.stream)
        except (TimeoutError, BrokerUnavailable):
            await msg.nak(delay=1.0)
            raise
        await msg.ack_sync(timeout=self._op_timeout_s)

    # ------------------------------------------------------------------ streams

    async def _ensure_topic(self, topic: str) -> None:
        await self._ensure_subjects(self.stream, [self.subject(topic), self.delayed_subject(topic)])

    async def _ensure_subjects(self, stream: str, subjects: Sequence[str]) -> None:
        """Create ``stream`` (our retention, duplicate window, replicas) or add ``subjects`` to it."""
        if all(s in self._subjects[stream] for s in subjects):
            return
        async with self._subjects_lock:
            known = self._subjects[stream]
            if all(s in known for s in subjects):
                return
            with _mapped():
                for _ in range(5):  # another process may create or update the stream at the same time
                    try:
                        info = await self._js.stream_info(stream)
                    except nats.js.errors.NotFoundError:
                        try:
                            await self._js.add_stream(self._stream_config(stream, sorted(set(subjects))))
                        except nats.js.errors.BadRequestError as exc:
                            if exc.err_code != 10058:  # 10058: stream name already in use
                                raise
                            continue
                        known.update(subjects)
                        return
                    have = set(info.config.subjects or [])
                    wanted = self._stream_config(stream, sorted(have | set(subjects)))
                    if have >= set(subjects) and not self._differs(info.config, wanted):
                        known.update(have)
                        return
                    await self._js.update_stream(wanted)
        raise BrokerUnavailable(f"could not add {list(subjects)} to the stream {stream!r}")

    def _stream_config(self, stream: str, subjects: list[str]) -> api.StreamConfig:
        return api.StreamConfig(
            name=stream,
            description="room-service dead letters" if stream == self.dlq_stream else "room-service topics",
            subjects=subjects,
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
            max_age=self._max_age_s,
            duplicate_window=self._duplicate_window_s,
            num_replicas=self._config.replicas,
        )

    @staticmethod
    def _differs(have: api.StreamConfig, wanted: api.StreamConfig) -> bool:
        return (
            abs((have.max_age or 0) - (wanted.max_age or 0)) > 1e-3
            or abs((have.duplicate_window or 0) - (wanted.duplicate_window or 0)) > 1e-3
            or have.num_replicas != wanted.num_replicas
        )


async def open_nats_broker(
    config: NatsConfig,
    *,
    subject_prefix: str = "",
    duplicate_window_s: float,
    op_timeout_s: float = 5.0,
    poll_interval_s: float = 0.1,
    reconnect_wait_s: float = 1.0,
    clock: Callable[[], int] = wall_clock_ms,
) -> NatsBroker:
    """Connect within ``config.connect_timeout`` (BrokerUnavailable otherwise); nats-py then reconnects forever.

    ``subject_prefix`` is ``rocketmq.namespace``. ``duplicate_window_s`` (the
    caller sizes it from the outbox worker's retry horizon and
    ``broker.nats.duplicate_window``) must not exceed ``max_age``.
    ``op_timeout_s`` bounds each JetStream API call, ack and dead-letter copy
    (``publish`` has its own ``timeout_s``); ``poll_interval_s`` is how often an
    idle fetch and the delay movers ask again. Streams are created, or brought to
    this configuration, when a topic or group is first used."""
    if not 0 < duplicate_window_s <= config.max_age.total_seconds():
        raise BrokerError(f"the duplicate window ({duplicate_window_s:g}s) must be > 0 and <= broker.nats.max_age")
    if subject_prefix and not all(_TOKEN.match(t) for t in subject_prefix.split(".")):
        raise BrokerError(f"subject prefix {subject_prefix!r} is not a valid NATS subject")
    connect_timeout = config.connect_timeout.total_seconds()

    lost: list[Callable[[str], None]] = []  # the broker's, once made (nats-py needs the callback first)

    async def disconnected() -> None:
        _log.warning("broker_nats_disconnected")
        for fail in lost:
            fail("the connection was lost")

    async def reconnected() -> None:
        _log.info("broker_nats_reconnected")

    async def error(exc: Exception) -> None:
        _log.warning("broker_nats_error", error=repr(exc))

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=[u.strip() for u in config.url.split(",") if u.strip()],
                name="room-service",
                connect_timeout=max(1, round(connect_timeout)),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
            ),
            timeout=connect_timeout + 1,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise BrokerUnavailable(f"cannot connect to NATS at {config.url}: {exc!r}") from exc
    broker = NatsBroker(
        nc,
        config,
        subject_prefix=subject_prefix,
        duplicate_window_s=duplicate_window_s,
        op_timeout_s=op_timeout_s,
        poll_interval_s=poll_interval_s,
        clock=clock,
    )
    lost.append(broker._connection_lost)
    return broker


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _mapped() -> Any:
    """nats-py errors as the port's: BrokerUnavailable (retryable) or BrokerError."""
    try:
        yield
    except Exception as exc:
        mapped = _port_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


def _port_error(exc: Exception) -> Exception:
    """The port's error for a nats-py one (``exc`` itself when it passes through unchanged)."""
    if isinstance(exc, (BrokerUnavailable, BrokerError, nats.js.errors.NotFoundError)):
        return exc
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return BrokerUnavailable(f"NATS JetStream is unavailable: {exc}")
    if isinstance(exc, nats.js.errors.APIError):
        if exc.code is not None and exc.code >= 500:
            return BrokerUnavailable(f"NATS JetStream error: {exc}")
        return BrokerError(f"NATS JetStream refused: {exc}")
    if isinstance(exc, nats.errors.MaxPayloadError):
        return BrokerError(f"message too large for NATS: {exc}")
    if isinstance(exc, (nats.errors.BadHeaderError, nats.errors.BadSubjectError)):
        return BrokerError(f"NATS cannot carry this header or subject: {exc!r}")
    if isinstance(exc, (TimeoutError, OSError, nats.errors.Error)):
        # timeouts, no responders (no stream bound yet, or JetStream down), closed or reconnecting
        return BrokerUnavailable(f"NATS did not answer: {exc!r}")
    return exc


def _refusal(error: Mapping[str, Any]) -> Exception:
    """The port's error for JetStream's answer ``{"error": {...}}`` to a publish, as ``_port_error``
    maps nats-py's APIError: a server-side failure (code >= 500) is worth a retry, the rest is not."""
    code = error.get("code")
    text = f"code={code} err_code={error.get('err_code')} description={error.get('description')!r}"
    if isinstance(code, int) and code >= 500:
        return BrokerUnavailable(f"NATS JetStream error: {text}")
    return BrokerError(f"NATS JetStream refused: {text}")


def _status(msg: Msg) -> str:
    """The status of a JetStream control message ("404" no messages, "408" request expired...), else ""."""
    if msg.data or not msg.headers:
        return ""
    return str(msg.headers.get("Status", ""))


def _token(name: str, what: str) -> str:
    if not _TOKEN.match(name):
        raise BrokerError(f"{what} {name!r} cannot be a NATS subject token")
    return name


def _reserved(header: str) -> bool:
    return header.startswith(_OURS) or header.startswith(_THEIRS)


def _user_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if not _reserved(k)}


def _one_line(text: str) -> str:
    return " ".join(text.split())[:1000]


def _receipt(delivery: Delivery) -> Msg:
    if not isinstance(delivery.receipt, Msg):
        raise BrokerError("the delivery did not come from this NATS broker")
    return delivery.receipt


def _stored_headers(raw: api.RawStreamMsg) -> dict[str, str]:
    """The headers of a message read with STREAM.MSG.GET, as UTF-8 text.

    nats-py parses them with the ``email`` package, which turns a non-ASCII value
    (a reason in Chinese) into a mangled ``Header``; the raw block is still there."""
    if not raw.hdrs:
        return {}
    block = base64.b64decode(raw.hdrs).decode("utf-8", errors="replace")
    headers: dict[str, str] = {}
    for line in block.split("\r\n")[1:]:  # after "NATS/1.0"
        key, sep, value = line.partition(":")
        if sep and key.strip():
            headers[key.strip()] = value.strip()
    return headers


def _dead_letter(group: str, raw: api.RawStreamMsg) -> DeadLetter:
    headers = _stored_headers(raw)
    count, dead_at = headers.get(H_DEAD_COUNT, "0"), headers.get(H_DEAD_AT, "0")
    return DeadLetter(
        group=group,
        topic=headers.get(H_TOPIC, ""),
        message_id=headers.get(H_DEAD_SEQ, ""),
        key=headers.get(H_KEY) or "",
        tag=headers.get(H_TAG, ""),
        body=raw.data or b"",
        headers=_user_headers(headers),
        delivery_count=int(count) if count.isdigit() else 0,
        dead_at_ms=int(dead_at) if dead_at.isdigit() else 0,
        reason=headers.get(H_DEAD_REASON, ""),
    )
