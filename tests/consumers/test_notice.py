"""The notice group against the real IM sandbox: a kick becomes one ``notice_delivery_events`` row
and one C2C message, however often it is delivered; IM outages are retried and counted; a
permanent refusal marks the row failed and dead-letters the delivery, replayable once fixed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa

from roomservice.activity.service import InvalidEvent
from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import Delivery, OutgoingMessage
from roomservice.consumers.notice import NoticeHandler
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Outcome
from roomservice.domain import events as e
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im import ImPermanentError, ImRetryableError, TencentImClient, account_id_for
from roomservice.outbox.policy import RetryPolicy
from roomservice.store.database import Database
from roomservice.store.tables import notice_delivery_events
from roomservice.wire import encode_event

TOPIC = "hyapp_room_outbox"
GROUP = "hyapp-notice-room-outbox"
APP = 1_400_000_090
KEY = "notice-sandbox-key"
ADMIN = "administrator"
NOW = 1_780_000_000_000
FAST = RetryPolicy(initial_backoff_ms=10, max_backoff_ms=40, max_retry_count=1 << 30, jitter=0.0)
PERMANENT = 90001  # openim: the request is malformed — retrying the same request cannot help


def kick(target: str = "bob", *, event_id: str = "", repair_of: str | None = None) -> e.Event:
    return e.Event(
        event_id=event_id or uuid.uuid4().hex,
        app_code="demo",
        room_id="r1",
        room_version=7,
        occurred_at_ms=NOW - 5,
        payload=e.RoomUserKicked(operator_id="owner", target_id=target, ban_seconds=600, banned_until_ms=NOW + 600_000),
        repair_of=repair_of,
    )


def delivery(body: bytes, *, count: int = 1, tag: str = "RoomUserKicked") -> Delivery:
    return Delivery(
        topic=TOPIC,
        group=GROUP,
        message_id=uuid.uuid4().hex,
        key="k",
        tag=tag,
        sharding_key="demo:r1",
        body=body,
        headers={},
        delivery_count=count,
        published_at_ms=NOW,
    )


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[RunningSandbox]:
    async with running_sandbox(APP, KEY, rate_limit_per_second=None) as running:
        yield running


@pytest_asyncio.fixture
async def im(sandbox: RunningSandbox) -> AsyncIterator[TencentImClient]:
    async with TencentImClient(
        base_url=sandbox.base_url, sdk_app_id=APP, admin_identifier=ADMIN, secret_key=KEY, request_timeout=5.0
    ) as client:
        yield client


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def notice(database: Database, im: TencentImClient, clock: Clock) -> NoticeHandler:
    return NoticeHandler(database, im, group=GROUP, topic=TOPIC, clock=clock)


async def rows(db: Database) -> list[dict[str, Any]]:
    async with db.read() as conn:
        result = await conn.execute(sa.select(notice_delivery_events).order_by(notice_delivery_events.c.event_id))
        return [dict(r._mapping) for r in result]


def sendmsg_calls(sandbox: RunningSandbox) -> int:
    return sandbox.state.request_counts().get("sendmsg", 0)


async def test_a_kick_writes_one_row_and_sends_one_c2c_notice(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox, clock: Clock
) -> None:
    event = kick()
    clock.now = NOW + 250
    assert await notice.handle(delivery(encode_event(event))) is Outcome.APPLIED
    [message] = sandbox.state.c2c_messages("bob")
    [row] = await rows(database)
    assert {k: row[k] for k in ("event_id", "app_code", "room_id", "user_id", "im_account", "kind")} == {
        "event_id": event.event_id,
        "app_code": "demo",
        "room_id": "r1",
        "user_id": "bob",
        "im_account": "bob",
        "kind": "kicked",
    }
    assert (row["status"], row["attempts"], row["last_error"]) == ("sent", 1, None)
    assert (row["created_at_ms"], row["sent_at_ms"], row["msg_key"]) == (NOW + 250, NOW + 250, message.msg_key)
    assert message.from_account == ADMIN and message.data == row["payload"]
    data = json.loads(row["payload"])
    assert data["kind"] == "kicked" and data["event_id"] == event.event_id and data["room_id"] == "r1"
    assert data["payload"] == {
        "operator_id": "owner",
        "target_id": "bob",
        "ban_seconds": 600,
        "banned_until_ms": NOW + 600_000,
    }
    assert "bob" in sandbox.state.accounts  # imported before the send, as Tencent requires


async def test_a_redelivered_kick_and_its_repair_send_nothing_more(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    event = kick()
    assert await notice.handle(delivery(encode_event(event))) is Outcome.APPLIED
    sandbox.state.advance_clock(600)  # long past Tencent's own 120 s window: only our row can tell
    assert await notice.handle(delivery(encode_event(event), count=2)) is Outcome.DUPLICATE
    repair = replace(event, event_id=uuid.uuid4().hex, repair_of=event.event_id)
    assert await notice.handle(delivery(encode_event(repair))) is Outcome.DUPLICATE
    assert sendmsg_calls(sandbox) == 1 and len(sandbox.state.c2c_messages("bob")) == 1
    assert [r["event_id"] for r in await rows(database)] == [event.event_id]


async def test_a_repair_of_a_lost_kick_is_the_kicks_notice(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    original = kick()
    repair = replace(original, event_id=uuid.uuid4().hex, repair_of=original.event_id)
    assert await notice.handle(delivery(encode_event(repair))) is Outcome.APPLIED
    assert await notice.handle(delivery(encode_event(original))) is Outcome.DUPLICATE
    [row] = await rows(database)
    assert row["event_id"] == original.event_id and json.loads(row["payload"])["event_id"] == original.event_id
    assert len(sandbox.state.c2c_messages("bob")) == 1


async def test_a_long_user_id_gets_the_notice_on_its_im_account(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    long_id = "u" * 64
    assert await notice.handle(delivery(encode_event(kick(long_id)))) is Outcome.APPLIED
    account = account_id_for(long_id)
    assert account != long_id and len(sandbox.state.c2c_messages(account)) == 1
    assert [(r["user_id"], r["im_account"]) for r in await rows(database)] == [(long_id, account)]


async def test_other_event_types_are_acked_without_a_row_or_a_message(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    gift = replace(kick(), payload=e.RoomGiftSent("alice", "bob", "rose", 1, 5, 5))
    assert await notice.handle(delivery(encode_event(gift))) is Outcome.DUPLICATE
    assert await rows(database) == [] and sandbox.state.requests == []


async def test_a_message_tagged_with_a_type_that_has_no_notice_is_acked_undecoded(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    """A body this group cannot read is not its poison when the tag says it is no kick (found by review:
    it was retried into the notice group's dead letter). An unknown tag may be a newer type: decoded."""
    assert await notice.handle(delivery(b"\xff\xfe not an envelope", tag="RoomGiftSent")) is Outcome.DUPLICATE
    assert await rows(database) == [] and sandbox.state.requests == []
    with pytest.raises(InvalidEvent):
        await notice.handle(delivery(b"\xff\xfe not an envelope", tag="RoomSomethingNew"))
    assert await notice.handle(delivery(encode_event(kick()), tag="")) is Outcome.APPLIED  # no tag: the body


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xff\xfe not an envelope", id="garbage"),
        pytest.param(encode_event(kick("not an id!")), id="bad-target"),
        pytest.param(encode_event(kick(event_id="x" * 65)), id="long-event-id"),
    ],
)
async def test_a_body_that_is_no_valid_kick_is_poison(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox, body: bytes
) -> None:
    with pytest.raises(InvalidEvent) as info:
        await notice.handle(delivery(body))
    assert isinstance(info.value, ValueError)
    assert await rows(database) == [] and sandbox.state.requests == []


async def test_im_down_is_retried_counted_and_sent_once_it_is_back(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox, clock: Clock
) -> None:
    body = encode_event(kick())
    sandbox.state.set_outage("http_503")
    for count in (1, 2):
        clock.now = NOW + count
        with pytest.raises(ImRetryableError):
            await notice.handle(delivery(body, count=count))
        [row] = await rows(database)
        assert (row["status"], row["attempts"], row["updated_at_ms"]) == ("pending", count, NOW + count)
        assert "503" in row["last_error"]
    sandbox.state.set_outage(None)
    clock.now = NOW + 3
    assert await notice.handle(delivery(body, count=3)) is Outcome.APPLIED
    [row] = await rows(database)
    assert (row["status"], row["attempts"], row["sent_at_ms"]) == ("sent", 3, NOW + 3)
    assert "503" in row["last_error"]  # what happened last before it went through
    assert len(sandbox.state.c2c_messages("bob")) == 1


async def test_a_permanent_im_error_marks_the_row_failed_and_fails_the_delivery(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    body = encode_event(kick())
    sandbox.state.inject_error("sendmsg", PERMANENT, "malformed", service="openim")
    with pytest.raises(ImPermanentError):
        await notice.handle(delivery(body))
    [row] = await rows(database)
    assert (row["status"], row["attempts"], row["sent_at_ms"]) == ("failed", 1, None)
    assert str(PERMANENT) in row["last_error"] and "malformed" in row["last_error"]
    sandbox.state.clear_errors()
    assert await notice.handle(delivery(body, count=2)) is Outcome.APPLIED  # a replay, once fixed
    [row] = await rows(database)
    assert (row["status"], row["attempts"]) == ("sent", 2)
    assert len(sandbox.state.c2c_messages("bob")) == 1


async def test_a_crash_between_the_send_and_the_row_update_still_leaves_one_message(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry re-sends the stored body with the same MsgSeq/MsgRandom: Tencent keeps one."""
    body = encode_event(kick())
    real_run_write = database.run_write
    calls = 0

    async def dies_on_the_sent_update(fn: Any, *args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # 1: insert the row; 2: mark it sent
            raise ConnectionError("the process died here")
        return await real_run_write(fn, *args, **kw)

    monkeypatch.setattr(database, "run_write", dies_on_the_sent_update)
    with pytest.raises(ConnectionError):
        await notice.handle(delivery(body))
    assert len(sandbox.state.c2c_messages("bob")) == 1
    assert [r["status"] for r in await rows(database)] == ["pending"]
    assert await notice.handle(delivery(body, count=2)) is Outcome.APPLIED
    assert sendmsg_calls(sandbox) == 2 and len(sandbox.state.c2c_messages("bob")) == 1
    assert sandbox.state.c2c_duplicates_absorbed == 1
    assert [r["status"] for r in await rows(database)] == ["sent"]


async def test_another_sender_is_imported_once_and_sends_the_notices(
    database: Database, im: TencentImClient, sandbox: RunningSandbox, clock: Clock
) -> None:
    notice = NoticeHandler(database, im, group=GROUP, topic=TOPIC, clock=clock, sender="system")
    assert await notice.handle(delivery(encode_event(kick("bob")))) is Outcome.APPLIED
    assert await notice.handle(delivery(encode_event(kick("carol")))) is Outcome.APPLIED
    assert [m.from_account for m in sandbox.state.c2c_messages()] == ["system", "system"]
    assert sandbox.state.request_counts()["account_import"] == 3  # system once, then bob and carol


# --------------------------------------------------------------------------- on the runtime


async def until(check: Callable[[], Awaitable[bool]], deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    broker = FakeBroker()
    yield broker
    await broker.close()


async def publish(broker: FakeBroker, event: e.Event, *, key: str | None = None) -> None:
    message = OutgoingMessage(topic=TOPIC, body=encode_event(event), key=key or event.event_id, tag=event.type)
    await broker.publish(message, timeout_s=1)


def runtime(broker: FakeBroker, notice: NoticeHandler, max_deliveries: int) -> ConsumerRuntime:
    options = GroupOptions(max_deliveries=max_deliveries, wait_s=0.05, visibility_s=5, backoff=FAST)
    return ConsumerRuntime(broker, [(notice, options)])


async def test_on_the_runtime_an_outage_is_retried_and_a_republished_kick_sends_once(
    broker: FakeBroker, notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    event = kick()
    sandbox.state.set_outage("reset")
    consumers = runtime(broker, notice, max_deliveries=50)
    consumers.start()
    try:
        await publish(broker, event)

        async def failed_twice() -> bool:
            found = await rows(database)
            return bool(found) and found[0]["attempts"] >= 2

        await until(failed_twice)
        sandbox.state.set_outage(None)
        await until(lambda: _lag(broker, 0))
        await publish(broker, event, key=f"{event.event_id}-again")  # the same event, published once more
        await until(lambda: _lag(broker, 0))
        await until(lambda: _counted(consumers, applied=1, duplicates=1))
    finally:
        await consumers.shutdown(grace_s=2)
    [row] = await rows(database)
    counts = consumers.runner(GROUP).counts
    assert row["status"] == "sent" and row["attempts"] == counts.failures + 1 >= 3
    assert len(sandbox.state.c2c_messages("bob")) == 1


async def test_on_the_runtime_a_permanent_error_is_dead_lettered_and_replayable(
    broker: FakeBroker, notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    sandbox.state.inject_error("sendmsg", PERMANENT, "malformed", service="openim")
    consumers = runtime(broker, notice, max_deliveries=3)
    consumers.start()
    try:
        await publish(broker, kick())
        await until(lambda: _dead(broker, 1))
        [row] = await rows(database)
        assert (row["status"], row["attempts"]) == ("failed", 3)
        assert sandbox.state.c2c_messages() == []
        sandbox.state.clear_errors()
        (dead,) = await broker.dead_letters(GROUP)
        assert "ImPermanentError" in dead.reason
        assert await broker.replay_dead_letter(GROUP, dead.message_id)
        await until(lambda: _counted(consumers, applied=1, duplicates=0))
    finally:
        await consumers.shutdown(grace_s=2)
    [row] = await rows(database)
    assert (row["status"], row["attempts"]) == ("sent", 4)
    assert len(sandbox.state.c2c_messages("bob")) == 1


async def _lag(broker: FakeBroker, n: int) -> bool:
    return (await broker.group_stats(TOPIC, GROUP)).lag == n


async def _dead(broker: FakeBroker, n: int) -> bool:
    return (await broker.group_stats(TOPIC, GROUP)).dead_letters == n


async def _counted(consumers: ConsumerRuntime, *, applied: int, duplicates: int) -> bool:
    counts = consumers.runner(GROUP).counts
    return (counts.applied, counts.duplicates) == (applied, duplicates)


async def test_two_deliveries_of_one_kick_at_once_send_one_message_and_apply_once(
    notice: NoticeHandler, database: Database, sandbox: RunningSandbox
) -> None:
    body = encode_event(kick())
    outcomes = await asyncio.gather(notice.handle(delivery(body)), notice.handle(delivery(body, count=2)))
    assert sorted(outcomes) == [Outcome.APPLIED, Outcome.DUPLICATE]
    assert len(sandbox.state.c2c_messages("bob")) == 1
    [row] = await rows(database)
    assert (row["status"], row["attempts"]) == ("sent", 1)
