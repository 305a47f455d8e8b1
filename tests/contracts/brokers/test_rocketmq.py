"""The RocketMQ 5 adapter, through the official client, against a protocol-level fake proxy.

No RocketMQ can run here: ``tests/fakes/rocketmq_proxy.py`` serves the gRPC
``MessagingService`` from the protobuf modules inside the client package, so
these tests check the adapter at the wire level — what a real proxy would
receive — plus the port's contract for what such a fake can honestly show.
What needs a real RocketMQ is listed in docs/rocketmq.md.

The fake is configured like RocketMQ's own proxy integration tests: the
minimum invisible duration of a receive is lowered (the proxy's default is
10 s), so the contract's short visibility timeouts stay short. The adapter
rounds them up to whole seconds, which the contract's deadlines allow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import threading
import time
from collections.abc import AsyncIterator, Iterator
from hashlib import sha1

import pytest
import pytest_asyncio
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.v5.client.connection.rpc_client import RpcClient
from structlog.testing import capture_logs
from tests.contracts.brokers.base import BrokerContract, fetch, fetch_until, message, unique
from tests.fakes.rocketmq_proxy import FakeRocketMQProxy

from roomservice.brokers.port import BrokerError, BrokerUnavailable
from roomservice.brokers.rocketmq import DELIVER_AT, FOR_GROUP, SHARDING_KEY, RocketMQBroker, open_rocketmq_broker
from roomservice.config import RocketMQConfig

AK, SK = "room-ak", "room-sk-secret"


@pytest.fixture
def proxy() -> Iterator[FakeRocketMQProxy]:
    fake = FakeRocketMQProxy(min_invisible_for_recv_s=1)
    fake.start()
    yield fake
    fake.stop()


def adapter(proxy: FakeRocketMQProxy, **kw: object) -> RocketMQBroker:
    options: dict[str, object] = {"endpoints": proxy.endpoint, "min_invisible_s": 1, "settings_wait_s": 5}
    options.update(kw)
    return RocketMQBroker(**options)  # type: ignore[arg-type]


class TestRocketMQBroker(BrokerContract):
    reports_lag = False  # the gRPC proxy has no lag for a pop consumer group (dashboard / mqadmin consumerProgress)

    @pytest_asyncio.fixture
    async def broker(self, proxy: FakeRocketMQProxy) -> AsyncIterator[RocketMQBroker]:
        broker = adapter(proxy)
        yield broker
        await broker.close()

    async def test_a_duplicate_publish_of_one_key_is_stored_once(self) -> None:  # type: ignore[override]
        pytest.skip(
            "RocketMQ 5 has no broker-side deduplication by message key: a re-publish is stored twice "
            "(consumers dedup on the key, the event_id). Not a fake limitation; see docs/rocketmq.md."
        )


# ---------------------------------------------------------------------------------------------- wire level


@pytest_asyncio.fixture
async def signed(proxy: FakeRocketMQProxy) -> AsyncIterator[RocketMQBroker]:
    proxy.credentials = {AK: SK}
    broker = adapter(proxy, access_key=AK, secret_key=SK, namespace="ns-test")
    yield broker
    await broker.close()


@pytest_asyncio.fixture
async def plain(proxy: FakeRocketMQProxy) -> AsyncIterator[RocketMQBroker]:
    broker = adapter(proxy)
    yield broker
    await broker.close()


async def test_a_publish_carries_topic_tag_key_message_group_and_properties(
    proxy: FakeRocketMQProxy, signed: RocketMQBroker
) -> None:
    topic = unique("topic")
    sent = message(topic, tag="RoomGiftSent", sharding_key="demo:r1", headers={"traceparent": "00-abc-01"})
    message_id = await signed.publish(sent, timeout_s=5)
    (request,) = proxy.requests("SendMessage")
    (m,) = request.messages
    sp = m.system_properties
    assert (m.topic.resource_namespace, m.topic.name) == ("ns-test", topic)
    assert (sp.tag, list(sp.keys), sp.message_group, sp.message_type) == (
        "RoomGiftSent",
        [sent.key],
        "demo:r1",
        pb.FIFO,
    )
    assert not sp.HasField("delivery_timestamp")
    assert dict(m.user_properties) == {"traceparent": "00-abc-01", SHARDING_KEY: "demo:r1"}
    assert (m.body, sp.message_id) == (b"payload", message_id)
    (route,) = proxy.requests("QueryRoute")
    assert (route.topic.resource_namespace, route.topic.name) == ("ns-test", topic)


async def test_without_message_groups_the_sharding_key_travels_as_a_property(proxy: FakeRocketMQProxy) -> None:
    broker = adapter(proxy, use_message_group=False)
    try:
        await broker.publish(message(unique("topic"), sharding_key="demo:r9"), timeout_s=5)
    finally:
        await broker.close()
    (m,) = proxy.requests("SendMessage")[0].messages
    assert (m.system_properties.message_group, m.system_properties.message_type) == ("", pb.NORMAL)
    assert m.user_properties[SHARDING_KEY] == "demo:r9"


async def test_a_delay_is_a_delivery_timestamp_in_seconds_rounded_up(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    due_ms = int(time.time() * 1000) + 90_500  # 90.5 s from now: not whole seconds
    await plain.publish(message(unique("topic"), sharding_key="demo:r1", deliver_at_ms=due_ms), timeout_s=5)
    (m,) = proxy.requests("SendMessage")[0].messages
    sp = m.system_properties
    assert sp.message_type == pb.DELAY
    assert (sp.delivery_timestamp.seconds, sp.delivery_timestamp.nanos) == (-(-due_ms // 1000), 0)  # ceil, seconds
    assert sp.message_group == ""  # a delay message cannot have a message group; the room is a property
    assert m.user_properties[SHARDING_KEY] == "demo:r1" and m.user_properties[DELIVER_AT] == str(due_ms)


async def test_a_delay_beyond_the_proxys_cap_is_chained_and_held_for_its_group_only(proxy: FakeRocketMQProxy) -> None:
    """The proxy takes at most 24 h: a 3 s hop cap stands in for it, a 5 s delay takes two hops."""
    proxy.max_delay_s = 3
    broker = adapter(proxy, max_delay_s=2)
    topic, group, other = unique("topic"), unique("g"), unique("g")
    try:
        await broker.declare_group(topic, group, max_deliveries=3)
        await broker.declare_group(topic, other, max_deliveries=3)
        due_ms = int(time.time() * 1000) + 5000
        await broker.publish(message(topic, "late", deliver_at_ms=due_ms), timeout_s=5)
        first_hop = proxy.requests("SendMessage")[0].messages[0].system_properties.delivery_timestamp.seconds
        assert first_hop <= time.time() + 2.01  # not the due time: the longest hop
        got, other_got = await asyncio.gather(fetch_until(broker, topic, group), fetch_until(broker, topic, other))
        assert time.time() * 1000 >= due_ms - 50
        assert (got.key, got.delivery_count, other_got.key, other_got.delivery_count) == ("late", 1, "late", 1)
        assert FOR_GROUP not in got.headers and DELIVER_AT not in got.headers
        await broker.ack(got)
        await broker.ack(other_got)
        sends = proxy.calls_of("SendMessage")
        hops = [(c.at, c.request.messages[0]) for c in sends[1:]]
        assert {h.user_properties[FOR_GROUP] for _, h in hops} == {group, other}  # each group re-published its own
        for at, h in [(sends[0].at, sends[0].request.messages[0]), *hops]:  # never beyond the cap, never past due
            assert h.system_properties.delivery_timestamp.seconds <= min(at + 2.01, -(-due_ms // 1000))
        last = {h.user_properties[FOR_GROUP]: h.system_properties.delivery_timestamp.seconds for _, h in hops}
        assert last == {group: -(-due_ms // 1000), other: -(-due_ms // 1000)}  # the last hop is due on time
        assert await fetch(broker, topic, group, wait_s=0.5) == []  # the other group's hop is not delivered here
    finally:
        await broker.close()


async def test_every_call_is_signed_with_hmac_sha1_over_the_date_time(
    proxy: FakeRocketMQProxy, signed: RocketMQBroker
) -> None:
    topic, group = unique("topic"), unique("g")
    await signed.declare_group(topic, group, max_deliveries=3)
    await signed.publish(message(topic), timeout_s=5)
    await signed.ack(await fetch_until(signed, topic, group))
    methods = {c.method for c in proxy.calls}
    assert {"QueryRoute", "Telemetry", "SendMessage", "ReceiveMessage", "AckMessage"} <= methods
    for call in proxy.calls:
        assert call.auth.valid and call.auth.access_key == AK, call.method
        assert call.metadata["x-mq-namespace"] == "ns-test"
        expected = hmac.new(SK.encode(), call.metadata["x-mq-date-time"].encode(), sha1).hexdigest()
        assert call.metadata["authorization"].endswith(f"Signature={expected}")


async def test_a_wrong_secret_is_refused_by_the_proxy_and_the_publish_fails_for_good(proxy: FakeRocketMQProxy) -> None:
    proxy.credentials = {AK: SK}
    broker = adapter(proxy, access_key=AK, secret_key="not-the-secret")
    try:
        with pytest.raises(BrokerUnavailable):  # the client reports a route it could not fetch, not why
            await broker.publish(message(unique("topic")), timeout_s=5)
    finally:
        await broker.close()
    assert proxy.calls and not any(c.auth.valid for c in proxy.calls)
    assert proxy.requests("SendMessage") == []  # refused at the route already


async def test_without_credentials_the_authorization_carries_no_access_key(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    await plain.publish(message(unique("topic")), timeout_s=5)
    # The client always sends the header; without credentials its Credential is empty (a proxy without ACL ignores it).
    assert proxy.calls and all(c.auth.access_key == "" and not c.auth.valid for c in proxy.calls)


async def test_receive_ack_and_change_invisible_duration_on_the_wire(
    proxy: FakeRocketMQProxy, signed: RocketMQBroker
) -> None:
    topic, group = unique("topic"), unique("g")
    await signed.declare_group(topic, group, max_deliveries=5)
    await signed.publish(message(topic, "k1"), timeout_s=5)
    got = await fetch_until(signed, topic, group)
    receive = proxy.requests("ReceiveMessage")[-1]
    assert (receive.group.resource_namespace, receive.group.name) == ("ns-test", group)
    assert receive.message_queue.topic.name == topic and receive.invisible_duration.seconds == 1  # 0.6 s rounded up
    await signed.nack(got, delay_s=2.2, reason="later")
    (change,) = proxy.requests("ChangeInvisibleDuration")
    assert (change.group.name, change.topic.name, change.message_id) == (group, topic, got.message_id)
    assert (change.invisible_duration.seconds, change.invisible_duration.nanos) == (3, 0)
    assert change.receipt_handle and change.receipt_handle.startswith(got.message_id)
    again = await fetch_until(signed, topic, group)
    assert again.delivery_count == 2
    await signed.ack(again)
    (ack,) = proxy.requests("AckMessage")
    assert (ack.group.name, ack.topic.name) == (group, topic)
    assert [(e.message_id, e.receipt_handle) for e in ack.entries] == [
        (again.message_id, again.receipt.message.receipt_handle)
    ]  # type: ignore[attr-defined]


async def test_a_stale_receipt_is_a_no_op(proxy: FakeRocketMQProxy, plain: RocketMQBroker) -> None:
    topic, group = unique("topic"), unique("g")
    await plain.declare_group(topic, group, max_deliveries=5)
    await plain.publish(message(topic), timeout_s=5)
    first = await fetch_until(plain, topic, group)
    second = await fetch_until(plain, topic, group)  # redelivered after the visibility timeout
    await plain.ack(first)  # the proxy answers INVALID_RECEIPT_HANDLE: ignored, the current delivery stands
    assert proxy.calls_of("AckMessage")[-1].request.entries[0].receipt_handle != second.receipt.message.receipt_handle  # type: ignore[attr-defined]
    await plain.ack(second)
    assert await fetch(plain, topic, group, wait_s=1.5) == []


async def test_a_refused_touch_keeps_the_receipt_the_ack_needs(proxy: FakeRocketMQProxy, plain: RocketMQBroker) -> None:
    """The client writes the answer's receipt handle onto the message before it checks the status: a
    refused ChangeInvisibleDuration replaced the good handle, and the ack after it was lost (found by
    review). A touch works on a copy and takes a handle over only from a call that succeeded."""
    topic, group = unique("topic"), unique("g")
    await plain.declare_group(topic, group, max_deliveries=5)
    await plain.publish(message(topic), timeout_s=5)
    got = await fetch_until(plain, topic, group)
    handle = got.receipt.message.receipt_handle  # type: ignore[attr-defined]
    allowed, proxy.max_invisible_s = proxy.max_invisible_s, 0.5  # the touch's duration is refused now
    with pytest.raises(BrokerError):
        await plain.touch(got, visibility_s=1)
    proxy.max_invisible_s = allowed
    assert got.receipt.message.receipt_handle == handle  # type: ignore[attr-defined]
    await plain.ack(got)
    assert await fetch(plain, topic, group, wait_s=1.5) == []  # acknowledged: not back


async def test_the_proxy_redelivers_after_the_invisible_duration_and_dead_letters_after_its_max_attempts(
    proxy: FakeRocketMQProxy,
) -> None:
    """The broker's own limit (the group's retryMaxTimes) is the backstop when it is lower than ours."""
    group = unique("g")
    proxy.group_max_attempts[group] = 2
    broker = adapter(proxy)
    topic = unique("topic")
    try:
        await broker.declare_group(topic, group, max_deliveries=5)
        await broker.publish(message(topic, "doomed"), timeout_s=5)
        assert (await fetch_until(broker, topic, group)).delivery_count == 1
        assert (await fetch_until(broker, topic, group)).delivery_count == 2
        await asyncio.sleep(1.2)
        assert await fetch(broker, topic, group, wait_s=0.5) == []  # moved by the broker, not delivered a third time
        assert proxy.requests("ForwardMessageToDeadLetterQueue") == []
        (dead,) = proxy.stored("%DLQ%" + group)
        assert dead.system_properties.dead_letter_queue.topic == topic
        assert [d.key for d in await broker.dead_letters(group)] == ["doomed"]
    finally:
        await broker.close()


async def test_the_last_failed_delivery_is_forwarded_to_the_dead_letter_queue(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    topic, group = unique("topic"), unique("g")
    await plain.declare_group(topic, group, max_deliveries=2)
    await plain.publish(message(topic), timeout_s=5)
    await plain.nack(await fetch_until(plain, topic, group), delay_s=0, reason="one")
    last = await fetch_until(plain, topic, group)
    await plain.nack(last, delay_s=0, reason="two")
    (forward,) = proxy.requests("ForwardMessageToDeadLetterQueue")
    assert (forward.group.name, forward.topic.name, forward.message_id) == (group, topic, last.message_id)
    assert (forward.delivery_attempt, forward.max_delivery_attempts) == (2, 2)
    assert [c.invisible_duration.seconds for c in proxy.requests("ChangeInvisibleDuration")] == [0]


@pytest.fixture
def warnings() -> Iterator[list[dict[str, object]]]:
    with capture_logs() as logs:
        yield logs


async def test_the_groups_retry_policy_reported_by_the_proxy_is_checked_loudly(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker, warnings: list[dict[str, object]]
) -> None:
    topic, mismatched, matching = unique("topic"), unique("g"), unique("g")
    proxy.group_max_attempts[matching] = 4
    await plain.declare_group(topic, mismatched, max_deliveries=4)  # the fake's default: 17 attempts (16 retries)
    await plain.declare_group(topic, matching, max_deliveries=4)
    settings = [c.request.settings for c in proxy.calls_of("Telemetry") if c.request.settings.HasField("subscription")]
    assert {s.subscription.group.name for s in settings} >= {mismatched, matching}
    found = [w for w in warnings if w["event"] == "rocketmq_retry_policy_mismatch"]
    assert [(w["group"], w["server_max_attempts"], w["consumer_max_reconsume_times"]) for w in found] == [
        (mismatched, 17, 3)
    ]
    assert found[0]["log_level"] == "warning"


async def test_send_timeout_and_retry_act_inside_the_publish_timeout(proxy: FakeRocketMQProxy) -> None:
    broker = adapter(proxy, retry=3, send_timeout_s=1)
    try:
        proxy.fail_sends = [pb.INTERNAL_ERROR] * 3
        await broker.publish(message(unique("topic")), timeout_s=5)  # the fourth attempt succeeds
        assert len(proxy.requests("SendMessage")) == 4  # retry + 1, not the 3 attempts the proxy's Settings say
        proxy.fail_sends = [pb.INTERNAL_ERROR] * 4
        with pytest.raises(BrokerUnavailable):
            await broker.publish(message(unique("topic")), timeout_s=5)
        assert len(proxy.requests("SendMessage")) == 8
        assert {c.request.settings.request_timeout.seconds for c in proxy.calls_of("Telemetry")} == {1}  # send_timeout
        proxy.send_hang_s = 3
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match=r"within 0\.5s"):
            await broker.publish(message(unique("topic")), timeout_s=0.5)
        assert time.monotonic() - started < 1.5  # the publish timeout bounds the whole publish
    finally:
        proxy.send_hang_s = 0
        await broker.close()


async def test_a_refused_message_is_a_broker_error(proxy: FakeRocketMQProxy, plain: RocketMQBroker) -> None:
    proxy.create_topic("typed_normal", types=(pb.NORMAL,))
    with pytest.raises(BrokerError):
        await plain.publish(message("typed_normal", sharding_key="demo:r1"), timeout_s=5)  # FIFO on a NORMAL topic
    with pytest.raises(BrokerError):
        await plain.publish(message(unique("topic"), body=b""), timeout_s=5)


async def test_an_unreachable_proxy_is_unavailable(proxy: FakeRocketMQProxy) -> None:
    endpoint = proxy.endpoint
    proxy.stop()
    broker = RocketMQBroker(endpoints=endpoint, settings_wait_s=1, send_timeout_s=1)
    try:
        with pytest.raises(BrokerUnavailable):
            await broker.publish(message(unique("topic")), timeout_s=3)
        with pytest.raises(BrokerUnavailable):
            await broker.declare_group(unique("topic"), unique("g"), max_deliveries=3)
        with pytest.raises(BrokerUnavailable):
            await broker.ping()
    finally:
        await broker.close()


async def test_ping_answers_while_the_proxy_does(plain: RocketMQBroker, proxy: FakeRocketMQProxy) -> None:
    await plain.ping()
    assert proxy.requests("QueryRoute")


async def test_group_stats_says_what_shows_the_lag(plain: RocketMQBroker) -> None:
    with pytest.raises(BrokerError, match="consumerProgress"):
        await plain.group_stats("t", "g")


async def test_from_config_takes_the_rocketmq_block(proxy: FakeRocketMQProxy) -> None:
    proxy.credentials = {AK: SK}
    config = RocketMQConfig.model_validate(
        {
            "name_servers": [proxy.endpoint],
            "access_key": AK,
            "secret_key": SK,
            "namespace": "prod",
            "send_timeout": "2s",
            "retry": 4,
        }
    )
    broker = await open_rocketmq_broker(config, min_invisible_s=1)
    try:
        assert (broker.namespace, broker.request_timeout_s, broker.max_send_attempts) == ("prod", 2, 5)
        await broker.publish(message(unique("topic")), timeout_s=5)
    finally:
        await broker.close()
    send = proxy.calls_of("SendMessage")[0]
    assert send.auth.valid and send.request.messages[0].topic.resource_namespace == "prod"


# ------------------------------------------------------------------- the client's route-callback race


@pytest.fixture
def routes_answered_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every route query returns its future only once answered, as a descheduled caller would see it.

    The client attaches its route callback after the query returns; a future that is already done runs
    the callback at once on the calling thread (an ``asyncio.to_thread`` worker, which has no event loop)
    instead of on the client's I/O loop. On a loaded machine this happens by chance; here, every time.
    """
    query = RpcClient.query_topic_route_async

    def answered(self: RpcClient, *args: object, **kwargs: object) -> object:
        future = query(self, *args, **kwargs)
        future.exception(timeout=10)  # wait for the answer, whatever it is
        return future

    monkeypatch.setattr(RpcClient, "query_topic_route_async", answered)


@pytest.mark.usefixtures("routes_answered_early")
async def test_a_route_answered_before_its_callback_is_attached_still_serves_the_publish(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    topic = unique("topic")
    first = await plain.publish(message(topic), timeout_s=5)
    second = await plain.publish(message(topic), timeout_s=5)
    assert first != second
    assert len(proxy.requests("QueryRoute")) == 1  # the first answer was cached, not dropped
    producer = await plain._ensure_producer()
    channel = producer.rpc_client.retrieve_or_create_channel(producer.client_configuration.rpc_endpoints)
    assert channel.telemetry_stream_stream_call is not None  # the new endpoint's telemetry stream is open


@pytest.mark.usefixtures("routes_answered_early")
async def test_a_consumer_whose_route_is_answered_early_starts_and_receives(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    topic, group = unique("topic"), unique("g")
    await plain.declare_group(topic, group, max_deliveries=5)
    sent = message(topic)
    await plain.publish(sent, timeout_s=5)
    got = await fetch_until(plain, topic, group)
    assert got.key == sent.key
    consumer = plain._group(group).consumer
    channel = consumer.rpc_client.retrieve_or_create_channel(consumer.client_configuration.rpc_endpoints)
    assert channel.telemetry_stream_stream_call is not None


# ------------------------------------------------------------------- the client's stream-rebuild race


async def test_a_stream_rebuilt_on_a_thread_without_an_event_loop_is_made_on_the_clients_loop(
    proxy: FakeRocketMQProxy, plain: RocketMQBroker
) -> None:
    """A settings write that fails before the client attaches its callback runs the callback on the
    writing thread: the settings scheduler's, which has no event loop. The callback rebuilds the
    telemetry stream; made there, the rebuild failed and the broken stream stayed until the next sync
    five minutes later. Here the scheduler's thread runs that callback on a failed write, then the next
    sync: the rebuild must make a new stream, and the sync's Settings must reach the proxy on it."""
    await plain.publish(message(unique("topic")), timeout_s=5)
    producer = await plain._ensure_producer()
    endpoints = producer.client_configuration.rpc_endpoints
    channel = producer.rpc_client.retrieve_or_create_channel(endpoints)
    broken = channel.telemetry_stream_stream_call
    manager = producer._Client__telemetry_manager
    failed: concurrent.futures.Future[None] = concurrent.futures.Future()
    failed.set_exception(RuntimeError("the telemetry stream was closed"))
    settings_seen = len([c for c in proxy.calls_of("Telemetry") if c.request.HasField("settings")])

    def settings_scheduler() -> None:  # as the client's scheduler thread: no event loop
        with pytest.raises(RuntimeError):
            asyncio.get_event_loop()
        manager._ClientTelemetryManager__setting_write_callback(failed, endpoints=endpoints)
        manager.setting_write(endpoints)  # the next sync

    thread = threading.Thread(target=settings_scheduler, name="sync_setting_schedule_thread")
    thread.start()
    await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive()
    assert channel.telemetry_stream_stream_call is not None
    assert channel.telemetry_stream_stream_call is not broken  # rebuilt
    async with asyncio.timeout(10):
        while len([c for c in proxy.calls_of("Telemetry") if c.request.HasField("settings")]) <= settings_seen:
            await asyncio.sleep(0.01)
