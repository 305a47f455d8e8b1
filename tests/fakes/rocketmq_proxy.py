"""A protocol-level fake of a RocketMQ 5 gRPC proxy, for wire-level tests of the RocketMQ adapter.

It serves ``apache.rocketmq.v2.MessagingService`` from the protobuf modules that
ship inside the official client package (``rocketmq.grpc_protocol``), so the
official ``rocketmq-python-client`` talks to it exactly as it talks to a proxy.
It implements just enough of the proxy's behaviour for the adapter:

* ``QueryRoute`` (one read-write queue per topic on this server; topics are
  auto-created unless ``auto_create_topics`` is off; ``%DLQ%`` topics exist
  only once something was dead-lettered, as on a real broker),
  ``Heartbeat``, ``NotifyClientTermination``;
* ``Telemetry``: the client sends its Settings and gets Settings back — for a
  consumer group with the group's retry policy (``max_attempts`` =
  retryMaxTimes + 1, as the proxy's GrpcClientSettingsManager reports it), for
  a producer the proxy's producer backoff (3 attempts);
* ``SendMessage``: typed topics (``accept_message_types``), delay messages held
  until ``delivery_timestamp`` (whole seconds), the proxy's 24 h cap on delays;
* ``ReceiveMessage`` (long polling), ``AckMessage``, ``ChangeInvisibleDuration``,
  ``ForwardMessageToDeadLetterQueue``: per-group invisibility, delivery attempts,
  receipt handles that go stale on redelivery, the proxy's bounds on invisible
  durations (receive: ``minInvisibleTimeMillsForRecv`` 10 s default, 12 h max),
  and the broker's move to ``%DLQ%<group>`` once a message had its group's
  max attempts (at the next receive, as the revive service does).

Every call is recorded (method, request, metadata, authorization verdict) so tests
assert what a real proxy would see. With ``credentials`` set, calls must carry a
valid ``MQv2-HMAC-SHA1`` signature over ``x-mq-date-time``; others get
``UNAUTHORIZED``. Not modelled: multiple brokers/queues, FIFO ordering locks,
transactions, SQL filters, retention, persistence.
"""

from __future__ import annotations

import hmac
import itertools
import re
import secrets
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from hashlib import sha1
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc

Key = tuple[str, str]  # (resource_namespace, name)

MIXED = (pb.NORMAL, pb.FIFO, pb.DELAY)
_AUTH = re.compile(r"^MQv2-HMAC-SHA1 Credential=(?P<ak>[^,]*), SignedHeaders=(?P<h>[^,]*), Signature=(?P<sig>\S*)$")


@dataclass(frozen=True, slots=True)
class Auth:
    """What the fake made of a call's authorization header."""

    present: bool
    access_key: str
    signed_headers: str
    valid: bool  # the signature matches HMAC-SHA1(secret of access_key, x-mq-date-time)


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    request: Any  # a copy of the request (for Telemetry: the TelemetryCommand)
    metadata: Mapping[str, str]
    auth: Auth
    at: float  # time.time()


@dataclass(slots=True)
class _Stored:
    key: Key
    offset: int
    message: pb.Message  # as stored (system properties completed by the "broker")
    visible_at: float  # time.time(): the delivery timestamp of a delay message


@dataclass(slots=True)
class _Entry:
    stored: _Stored
    visible_at: float  # time.time()
    attempts: int = 0
    handle: str = ""
    invisible_until: float = 0.0  # the current handle expires then


@dataclass(slots=True)
class _Group:
    key: Key
    max_attempts: int
    topics: set[Key] = field(default_factory=set)
    entries: dict[tuple[Key, str], _Entry] = field(default_factory=dict)  # (topic, message_id), publish order


class FakeRocketMQProxy(service_pb2_grpc.MessagingServiceServicer):
    def __init__(
        self,
        *,
        credentials: Mapping[str, str] | None = None,
        default_max_attempts: int = 17,  # retryMaxTimes 16 + 1, the broker's default
        group_max_attempts: Mapping[str, int] | None = None,
        min_invisible_for_recv_s: float = 10.0,
        max_invisible_s: float = 12 * 3600,
        max_delay_s: float = 24 * 3600,
        producer_max_attempts: int = 3,
        auto_create_topics: bool = True,
    ) -> None:
        self.credentials = dict(credentials or {})
        self.default_max_attempts = default_max_attempts
        self.group_max_attempts = dict(group_max_attempts or {})
        self.min_invisible_for_recv_s = min_invisible_for_recv_s
        self.max_invisible_s = max_invisible_s
        self.max_delay_s = max_delay_s
        self.producer_max_attempts = producer_max_attempts
        self.auto_create_topics = auto_create_topics
        self.calls: list[Call] = []
        self.fail_sends: list[int] = []  # codes answered to the next SendMessage calls, one each
        self.send_hang_s = 0.0  # SendMessage answers only after this long
        self._topics: dict[Key, tuple[int, ...]] = {}
        self._log: dict[Key, list[_Stored]] = {}
        self._groups: dict[Key, _Group] = {}
        self._offsets = itertools.count()
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=[("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_MessagingServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return self.endpoint

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ what tests look at

    def create_topic(self, name: str, *, namespace: str = "", types: Sequence[int] = MIXED) -> None:
        with self._cond:
            self._topics[(namespace, name)] = tuple(types)
            self._log.setdefault((namespace, name), [])

    def requests(self, method: str) -> list[Any]:
        with self._cond:
            return [c.request for c in self.calls if c.method == method]

    def calls_of(self, method: str) -> list[Call]:
        with self._cond:
            return [c for c in self.calls if c.method == method]

    def stored(self, topic: str, *, namespace: str = "") -> list[pb.Message]:
        with self._cond:
            return [s.message for s in self._log.get((namespace, topic), [])]

    def group_exists(self, group: str, *, namespace: str = "") -> bool:
        with self._cond:
            return (namespace, group) in self._groups

    # ------------------------------------------------------------------ plumbing

    def _record(self, method: str, request: Any, context: grpc.ServicerContext) -> Auth:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        auth = self._check_auth(metadata)
        copy = type(request)()
        copy.CopyFrom(request)
        with self._cond:
            self.calls.append(Call(method, copy, metadata, auth, time.time()))
        return auth

    def _check_auth(self, metadata: Mapping[str, str]) -> Auth:
        header = metadata.get("authorization")
        if header is None:
            return Auth(False, "", "", False)
        match = _AUTH.match(header)
        if match is None:
            return Auth(True, "", "", False)
        ak, signed, sig = match["ak"], match["h"], match["sig"]
        secret = self.credentials.get(ak)
        valid = False
        if secret is not None and signed == "x-mq-date-time" and "x-mq-date-time" in metadata:
            expected = hmac.new(secret.encode(), metadata["x-mq-date-time"].encode(), sha1).hexdigest()
            valid = hmac.compare_digest(expected, sig)
        return Auth(True, ak, signed, valid)

    def _denied(self, auth: Auth) -> bool:
        return bool(self.credentials) and not auth.valid

    @staticmethod
    def _status(code: int, message: str = "") -> pb.Status:
        return pb.Status(code=code, message=message or pb.Code.Name(code))

    def _queue(self, key: Key) -> pb.MessageQueue:
        q = pb.MessageQueue(id=0, permission=pb.READ_WRITE)
        q.topic.resource_namespace, q.topic.name = key
        q.broker.name, q.broker.id = "fake-broker-a", 0
        q.broker.endpoints.scheme = pb.IPv4
        q.broker.endpoints.addresses.add(host="127.0.0.1", port=self.port)
        q.accept_message_types.extend(self._topics[key])
        return q

    def _group(self, resource: pb.Resource) -> _Group:
        key = (resource.resource_namespace, resource.name)
        g = self._groups.get(key)
        if g is None:  # autoCreateSubscriptionGroup, with the group's configured retry policy
            g = self._groups[key] = _Group(key, self.group_max_attempts.get(resource.name, self.default_max_attempts))
        return g

    def _subscribe(self, g: _Group, topic: Key) -> None:
        """A group's first subscription to a topic starts at the topic's first message: a broker with
        ``initPopOffsetByCheckMsgInMem`` (the default) does so while that message is still in memory."""
        if topic in g.topics:
            return
        g.topics.add(topic)
        for stored in self._log.get(topic, []):
            g.entries[(topic, stored.message.system_properties.message_id)] = _Entry(stored, stored.visible_at)

    # ------------------------------------------------------------------ routes, heartbeats, settings

    def QueryRoute(self, request: spb.QueryRouteRequest, context: grpc.ServicerContext) -> spb.QueryRouteResponse:
        auth = self._record("QueryRoute", request, context)
        if self._denied(auth):
            return spb.QueryRouteResponse(status=self._status(pb.UNAUTHORIZED))
        key = (request.topic.resource_namespace, request.topic.name)
        with self._cond:
            if key not in self._topics:
                if not self.auto_create_topics or key[1].startswith(("%DLQ%", "%RETRY%")):
                    return spb.QueryRouteResponse(status=self._status(pb.TOPIC_NOT_FOUND, f"topic {key} not found"))
                self._topics[key] = MIXED
                self._log[key] = []
            return spb.QueryRouteResponse(status=self._status(pb.OK), message_queues=[self._queue(key)])

    def Heartbeat(self, request: spb.HeartbeatRequest, context: grpc.ServicerContext) -> spb.HeartbeatResponse:
        auth = self._record("Heartbeat", request, context)
        if self._denied(auth):
            return spb.HeartbeatResponse(status=self._status(pb.UNAUTHORIZED))
        if request.HasField("group") and request.group.name:
            with self._cond:
                self._group(request.group)
        return spb.HeartbeatResponse(status=self._status(pb.OK))

    def NotifyClientTermination(
        self, request: spb.NotifyClientTerminationRequest, context: grpc.ServicerContext
    ) -> spb.NotifyClientTerminationResponse:
        self._record("NotifyClientTermination", request, context)
        return spb.NotifyClientTerminationResponse(status=self._status(pb.OK))

    def QueryAssignment(
        self, request: spb.QueryAssignmentRequest, context: grpc.ServicerContext
    ) -> spb.QueryAssignmentResponse:
        self._record("QueryAssignment", request, context)
        return spb.QueryAssignmentResponse(status=self._status(pb.OK))

    def Telemetry(
        self, request_iterator: Iterator[spb.TelemetryCommand], context: grpc.ServicerContext
    ) -> Iterator[spb.TelemetryCommand]:
        for command in request_iterator:
            auth = self._record("Telemetry", command, context)
            if not command.HasField("settings"):
                continue
            if self._denied(auth):
                yield spb.TelemetryCommand(status=self._status(pb.UNAUTHORIZED))
                continue
            reply = pb.Settings()
            reply.CopyFrom(command.settings)
            if command.settings.HasField("subscription"):
                with self._cond:
                    g = self._group(command.settings.subscription.group)
                    for entry in command.settings.subscription.subscriptions:
                        self._subscribe(g, (entry.topic.resource_namespace, entry.topic.name))
                    max_attempts = g.max_attempts
                reply.backoff_policy.max_attempts = max_attempts
                reply.backoff_policy.exponential_backoff.initial.seconds = 1
                reply.backoff_policy.exponential_backoff.max.seconds = 7200
                reply.backoff_policy.exponential_backoff.multiplier = 2.0
                reply.subscription.fifo = False
                reply.subscription.receive_batch_size = 32
                reply.subscription.long_polling_timeout.seconds = 20
            else:
                reply.backoff_policy.max_attempts = self.producer_max_attempts
                reply.backoff_policy.exponential_backoff.initial.seconds = 1
                reply.backoff_policy.exponential_backoff.max.seconds = 10
                reply.backoff_policy.exponential_backoff.multiplier = 2.0
                reply.publishing.max_body_size = 4 * 1024 * 1024
                reply.publishing.validate_message_type = True
            yield spb.TelemetryCommand(status=self._status(pb.OK), settings=reply)

    # ------------------------------------------------------------------ publish

    def SendMessage(self, request: spb.SendMessageRequest, context: grpc.ServicerContext) -> spb.SendMessageResponse:
        auth = self._record("SendMessage", request, context)
        if self._denied(auth):
            return spb.SendMessageResponse(status=self._status(pb.UNAUTHORIZED))
        if self.send_hang_s:
            time.sleep(self.send_hang_s)
        with self._cond:
            if self.fail_sends:
                return spb.SendMessageResponse(status=self._status(self.fail_sends.pop(0)))
        response = spb.SendMessageResponse(status=self._status(pb.OK))
        for message in request.messages:
            status, offset = self._store(message)
            if status.code != pb.OK:
                return spb.SendMessageResponse(status=status)
            response.entries.add(status=status, message_id=message.system_properties.message_id, offset=offset)
        return response

    def _store(self, message: pb.Message, *, key: Key | None = None) -> tuple[pb.Status, int]:
        key = key or (message.topic.resource_namespace, message.topic.name)
        sp = message.system_properties
        now = time.time()
        with self._cond:
            types = self._topics.get(key)
            if types is None:
                return self._status(pb.TOPIC_NOT_FOUND, f"topic {key} not found"), 0
            if sp.message_type not in types:
                return self._status(pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "topic does not accept this type"), 0
            visible_at = now
            if sp.HasField("delivery_timestamp"):
                if sp.message_type != pb.DELAY:
                    return self._status(pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "delivery time on a non-delay"), 0
                visible_at = sp.delivery_timestamp.seconds + sp.delivery_timestamp.nanos / 1e9
                if visible_at - now > self.max_delay_s:
                    return self._status(pb.ILLEGAL_DELIVERY_TIME, "delay exceeds the proxy's maxDelayTimeMills"), 0
            stored_msg = pb.Message()
            stored_msg.CopyFrom(message)
            stored_msg.topic.resource_namespace, stored_msg.topic.name = key
            stored_msg.system_properties.store_timestamp.FromNanoseconds(time.time_ns())
            stored_msg.system_properties.store_host = self.endpoint
            offset = next(self._offsets)
            stored = _Stored(key, offset, stored_msg, visible_at)
            self._log.setdefault(key, []).append(stored)
            for g in self._groups.values():
                if key in g.topics:
                    g.entries[(key, sp.message_id)] = _Entry(stored, visible_at)
            self._cond.notify_all()
            return self._status(pb.OK), offset

    # ------------------------------------------------------------------ consume

    def ReceiveMessage(
        self, request: spb.ReceiveMessageRequest, context: grpc.ServicerContext
    ) -> Iterator[spb.ReceiveMessageResponse]:
        auth = self._record("ReceiveMessage", request, context)
        if self._denied(auth):
            yield spb.ReceiveMessageResponse(status=self._status(pb.UNAUTHORIZED))
            return
        invisible = request.invisible_duration.ToNanoseconds() / 1e9
        if not request.auto_renew and not (self.min_invisible_for_recv_s <= invisible <= self.max_invisible_s):
            yield spb.ReceiveMessageResponse(
                status=self._status(
                    pb.ILLEGAL_INVISIBLE_TIME,
                    f"invisible duration {invisible}s not in [{self.min_invisible_for_recv_s}, {self.max_invisible_s}]",
                )
            )
            return
        topic = (request.message_queue.topic.resource_namespace, request.message_queue.topic.name)
        poll = request.long_polling_timeout.ToNanoseconds() / 1e9 if request.HasField("long_polling_timeout") else 20
        remaining = context.time_remaining()
        deadline = time.time() + max(0.0, min(poll, (remaining - 0.1) if remaining is not None else poll))
        with self._cond:
            if topic not in self._topics:
                yield spb.ReceiveMessageResponse(status=self._status(pb.TOPIC_NOT_FOUND))
                return
            g = self._group(request.group)
            self._subscribe(g, topic)
            while True:
                got = self._take(g, topic, max(1, request.batch_size), invisible)
                wait = deadline - time.time()
                if got or wait <= 0 or not context.is_active():
                    break
                self._cond.wait(timeout=min(wait, 0.05))
        yield spb.ReceiveMessageResponse(delivery_timestamp=_now_ts())
        for message in got:
            yield spb.ReceiveMessageResponse(message=message)
        yield spb.ReceiveMessageResponse(status=self._status(pb.OK if got else pb.MESSAGE_NOT_FOUND))

    def _take(self, g: _Group, topic: Key, limit: int, invisible: float) -> list[pb.Message]:
        now = time.time()
        out: list[pb.Message] = []
        for (t, message_id), entry in list(g.entries.items()):
            if len(out) >= limit:
                break
            if t != topic or entry.visible_at > now:
                continue
            if entry.attempts >= g.max_attempts:  # the revive service moves it instead of a further delivery
                self._bury(g, entry)
                continue
            entry.attempts += 1
            entry.handle = f"{message_id}:{entry.attempts}:{secrets.token_hex(4)}"
            entry.visible_at = entry.invisible_until = now + invisible
            m = pb.Message()
            m.CopyFrom(entry.stored.message)
            sp = m.system_properties
            sp.receipt_handle = entry.handle
            sp.delivery_attempt = entry.attempts
            sp.invisible_duration.FromNanoseconds(int(invisible * 1e9))
            sp.queue_id = 0
            sp.queue_offset = entry.stored.offset
            sp.body_digest.type = pb.CRC32
            sp.body_digest.checksum = format(zlib.crc32(m.body) & 0xFFFFFFFF, "08X")
            out.append(m)
        return out

    def _bury(self, g: _Group, entry: _Entry) -> None:
        """Move to ``%DLQ%<group>`` (created on first use) and out of the group."""
        origin = entry.stored.message
        del g.entries[(entry.stored.key, origin.system_properties.message_id)]
        dlq: Key = (g.key[0], "%DLQ%" + g.key[1])
        self._topics.setdefault(dlq, MIXED)
        dead = pb.Message()
        dead.CopyFrom(origin)
        dead.topic.resource_namespace, dead.topic.name = dlq
        dead.system_properties.ClearField("delivery_timestamp")
        dead.system_properties.message_type = pb.NORMAL
        dead.system_properties.dead_letter_queue.topic = origin.topic.name
        dead.system_properties.dead_letter_queue.message_id = origin.system_properties.message_id
        stored = _Stored(dlq, next(self._offsets), dead, time.time())
        self._log.setdefault(dlq, []).append(stored)
        for other in self._groups.values():
            if dlq in other.topics:
                other.entries[(dlq, dead.system_properties.message_id)] = _Entry(stored, time.time())
        self._cond.notify_all()

    def _current(self, group: pb.Resource, topic: pb.Resource, message_id: str, handle: str) -> _Entry | None:
        g = self._groups.get((group.resource_namespace, group.name))
        if g is None:
            return None
        entry = g.entries.get(((topic.resource_namespace, topic.name), message_id))
        if entry is None or entry.handle != handle or entry.invisible_until <= time.time():
            return None  # acked, redelivered since, or expired: the proxy answers INVALID_RECEIPT_HANDLE
        return entry

    def AckMessage(self, request: spb.AckMessageRequest, context: grpc.ServicerContext) -> spb.AckMessageResponse:
        auth = self._record("AckMessage", request, context)
        if self._denied(auth):
            return spb.AckMessageResponse(status=self._status(pb.UNAUTHORIZED))
        response = spb.AckMessageResponse(status=self._status(pb.OK))
        with self._cond:
            for e in request.entries:
                entry = self._current(request.group, request.topic, e.message_id, e.receipt_handle)
                if entry is None:
                    status = self._status(pb.INVALID_RECEIPT_HANDLE, "receipt handle is stale or expired")
                    response.status.CopyFrom(status)
                else:
                    g = self._groups[(request.group.resource_namespace, request.group.name)]
                    del g.entries[(entry.stored.key, e.message_id)]
                    status = self._status(pb.OK)
                response.entries.add(message_id=e.message_id, receipt_handle=e.receipt_handle, status=status)
        return response

    def ChangeInvisibleDuration(
        self, request: spb.ChangeInvisibleDurationRequest, context: grpc.ServicerContext
    ) -> spb.ChangeInvisibleDurationResponse:
        auth = self._record("ChangeInvisibleDuration", request, context)
        if self._denied(auth):
            return spb.ChangeInvisibleDurationResponse(status=self._status(pb.UNAUTHORIZED))
        duration = request.invisible_duration.ToNanoseconds() / 1e9
        if not 0 <= duration <= self.max_invisible_s:
            return spb.ChangeInvisibleDurationResponse(status=self._status(pb.ILLEGAL_INVISIBLE_TIME))
        with self._cond:
            entry = self._current(request.group, request.topic, request.message_id, request.receipt_handle)
            if entry is None:
                return spb.ChangeInvisibleDurationResponse(status=self._status(pb.INVALID_RECEIPT_HANDLE))
            entry.handle = f"{request.message_id}:{entry.attempts}:{secrets.token_hex(4)}"
            entry.visible_at = entry.invisible_until = time.time() + duration
            self._cond.notify_all()
            return spb.ChangeInvisibleDurationResponse(status=self._status(pb.OK), receipt_handle=entry.handle)

    def ForwardMessageToDeadLetterQueue(
        self, request: spb.ForwardMessageToDeadLetterQueueRequest, context: grpc.ServicerContext
    ) -> spb.ForwardMessageToDeadLetterQueueResponse:
        auth = self._record("ForwardMessageToDeadLetterQueue", request, context)
        if self._denied(auth):
            return spb.ForwardMessageToDeadLetterQueueResponse(status=self._status(pb.UNAUTHORIZED))
        with self._cond:
            entry = self._current(request.group, request.topic, request.message_id, request.receipt_handle)
            if entry is None:
                return spb.ForwardMessageToDeadLetterQueueResponse(status=self._status(pb.INVALID_RECEIPT_HANDLE))
            self._bury(self._groups[(request.group.resource_namespace, request.group.name)], entry)
        return spb.ForwardMessageToDeadLetterQueueResponse(status=self._status(pb.OK))


def _now_ts() -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(time.time_ns())
    return ts
