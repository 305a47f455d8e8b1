"""The IM-bridge group against the real IM sandbox (over loopback HTTP) and our sent record on
SQLite and MariaDB: the publisher's work driven from the broker, deduplicated by our record and
``Random``, and the one order IM needs — a room's close waits for (or, past its bound, sends
itself) the room's earlier messages before it destroys the group.

Room events are "committed" by writing their ``room_outbox`` rows (status ``delivered``, as in
mq mode once the broker has them) and published to the in-memory broker in whatever order the
test wants; the consumer runtime or direct ``handle()`` calls consume them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import pytest_asyncio
import sqlalchemy as sa
from structlog.testing import capture_logs

from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import Delivery, OutgoingMessage
from roomservice.consumers.im_bridge import ImBridgeHandler
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Outcome, Redeliver
from roomservice.domain import events as e
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient, group_id_for
from roomservice.outbox.policy import RetryPolicy
from roomservice.publishers.port import RetryableError
from roomservice.publishers.tencent_im import DESTROY, MEMBER, MESSAGE, SentSteps, TencentImPublisher
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.wire import encode_event

APP_ID = 1_400_000_043
KEY = "im-bridge-test-key"
APP, ROOM, OTHER = "demo", "r1", "r2"
OWNER = "alice"
TOPIC, GROUP = "hyapp_room_outbox", "hyapp-room-im-bridge"
FAST = RetryPolicy(initial_backoff_ms=10, max_backoff_ms=40, max_retry_count=1 << 30, jitter=0.0)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- fixtures


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[RunningSandbox]:
    async with running_sandbox(APP_ID, KEY, rate_limit_per_second=None) as running:
        yield running


@pytest_asyncio.fixture
async def client(sandbox: RunningSandbox) -> AsyncIterator[TencentImClient]:
    async with TencentImClient(
        base_url=sandbox.base_url,
        sdk_app_id=APP_ID,
        admin_identifier="administrator",
        secret_key=KEY,
        request_timeout=5.0,
        transport=sandbox.transport(),
    ) as im:
        yield im


@pytest.fixture
def publisher(client: TencentImClient, database: Database) -> TencentImPublisher:
    return TencentImPublisher(client, SentSteps(database, clock=now_ms))


class Clock:
    """Wall-clock ms plus an offset a test moves forward (the close's wait bound)."""

    def __init__(self) -> None:
        self.offset_ms = 0
        self.fixed: int | None = None  # set: the clock stands still there

    def __call__(self) -> int:
        return self.fixed if self.fixed is not None else now_ms() + self.offset_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


Make = Callable[..., ImBridgeHandler]


@pytest.fixture
def make_handler(publisher: TencentImPublisher, clock: Clock) -> Make:
    def make(**kw: Any) -> ImBridgeHandler:
        kw.setdefault("close_poll_s", 0.02)
        kw.setdefault("close_poll_max_s", 0.1)
        return ImBridgeHandler(publisher, group=GROUP, topic=TOPIC, clock=clock, **kw)

    return make


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    broker = FakeBroker()
    yield broker
    await broker.close()


# --------------------------------------------------------------------------- a room's events


class Room:
    """Events of one room with increasing room_version."""

    def __init__(self, room_id: str = ROOM) -> None:
        self.room_id = room_id
        self.version = 0

    def next(self, payload: e.EventPayload) -> e.Event:
        self.version += 1
        return e.Event(uuid.uuid4().hex, APP, self.room_id, self.version, now_ms(), payload)

    def chain(self) -> list[e.Event]:
        """create, join, gift, kick, close."""
        return [
            self.next(e.RoomCreated(owner_id=OWNER, title="Room one", seat_count=8)),
            self.next(e.RoomUserJoined(user_id="bob", role="member")),
            self.next(
                e.RoomGiftSent(
                    sender_id="bob", receiver_id=OWNER, gift_id="rose", count=2, unit_price=5, total_value=10
                )
            ),
            self.next(
                e.RoomUserKicked(operator_id=OWNER, target_id="carol", ban_seconds=600, banned_until_ms=now_ms())
            ),
            self.next(e.RoomClosed(operator_id=OWNER)),
        ]


async def commit(db: Database, *events: e.Event) -> None:
    """The events' room_outbox rows, as an mq-mode worker leaves them once the broker has them."""
    now = now_ms()
    async with db.write() as conn:
        for ev in events:
            await conn.execute(
                sa.insert(t.room_outbox).values(
                    event_id=ev.event_id, app_code=ev.app_code, room_id=ev.room_id, room_version=ev.room_version,
                    event_type=ev.type, payload=encode_event(ev), status="delivered", targets_done="broker",
                    due_at_ms=now, created_at_ms=now, updated_at_ms=now, delivered_at_ms=now,
                )
            )  # fmt: skip


async def send(broker: FakeBroker, *events: e.Event) -> None:
    for ev in events:
        message = OutgoingMessage(
            topic=TOPIC, body=encode_event(ev), key=ev.event_id, tag=ev.type, sharding_key=f"{APP}:{ev.room_id}"
        )
        await broker.publish(message, timeout_s=1)


def delivery(ev: e.Event | None = None, *, body: bytes | None = None, count: int = 1) -> Delivery:
    return Delivery(
        topic=TOPIC,
        group=GROUP,
        message_id="1",
        key=ev.event_id if ev else "x",
        tag=ev.type if ev else "",
        sharding_key=f"{APP}:{ROOM}",
        body=encode_event(ev) if ev is not None and body is None else (body or b""),
        headers={},
        delivery_count=count,
        published_at_ms=now_ms(),
    )


def options(max_deliveries: int = 17, concurrency: int = 1) -> GroupOptions:
    return GroupOptions(
        max_deliveries=max_deliveries, concurrency=concurrency, wait_s=0.05, visibility_s=5, backoff=FAST
    )


@pytest.fixture
def consuming(broker: FakeBroker) -> Iterator[Callable[..., ConsumerRuntime]]:
    started: list[ConsumerRuntime] = []

    def start(handler: ImBridgeHandler, **kw: Any) -> ConsumerRuntime:
        runtime = ConsumerRuntime(broker, [(handler, options(**kw))])
        runtime.start()
        started.append(runtime)
        return runtime

    yield start
    for runtime in started:  # a failed test's runtime must not outlive its loop
        for runner in runtime.runners:
            if runner._task is not None:
                runner._task.cancel()


async def until(check: Callable[[], bool | Awaitable[bool]], deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def group_of(room: str = ROOM) -> str:
    return group_id_for(APP, room)


def im_messages(sandbox: RunningSandbox, room: str = ROOM) -> list[dict[str, Any]]:
    return [json.loads(m.data or "null") for m in sandbox.state.messages(group_of(room))]


def ids_in_im(sandbox: RunningSandbox, room: str = ROOM) -> list[str]:
    return [m["event_id"] for m in im_messages(sandbox, room)]


def destroyed(sandbox: RunningSandbox, room: str = ROOM) -> bool:
    group = sandbox.state.group(group_of(room))
    return group is not None and group.destroyed_at is not None and group_of(room) not in sandbox.state.groups


def lag_is(broker: FakeBroker, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await broker.group_stats(TOPIC, GROUP)).lag == n

    return check


async def handle_all(handler: ImBridgeHandler, events: list[e.Event]) -> list[Outcome]:
    return [await handler.handle(delivery(ev)) for ev in events]


# --------------------------------------------------------------------------- normal delivery and duplicates


async def test_a_chain_in_order_shows_each_message_once_in_order_and_destroys_the_group(
    make_handler: Make, broker: FakeBroker, sandbox: RunningSandbox, database: Database, consuming: Any
) -> None:
    events = Room().chain()
    await commit(database, *events)
    runtime = consuming(make_handler())
    await send(broker, *events)
    await until(lag_is(broker, 0))
    await runtime.shutdown(grace_s=1)
    assert ids_in_im(sandbox) == [ev.event_id for ev in events[1:]]  # RoomCreated is the group, not a message
    assert [m["room_version"] for m in im_messages(sandbox)] == [2, 3, 4, 5]
    assert destroyed(sandbox)
    assert sandbox.state.group(group_of()).banned.keys() == {"carol"}  # type: ignore[union-attr]
    counts = runtime.runner(GROUP).counts
    assert (counts.applied, counts.duplicates, counts.failures, counts.redelivered) == (5, 0, 0, 0)


async def test_a_chain_delivered_twice_reaches_im_once_and_the_second_time_is_duplicate(
    make_handler: Make, sandbox: RunningSandbox, database: Database
) -> None:
    events = Room().chain()
    await commit(database, *events)
    handler = make_handler()
    assert await handle_all(handler, events) == [Outcome.APPLIED] * 5
    before = sandbox.state.request_counts()
    assert await handle_all(handler, events) == [Outcome.DUPLICATE] * 5
    assert sandbox.state.request_counts() == before  # our record: not a single request to IM
    assert ids_in_im(sandbox) == [ev.event_id for ev in events[1:]]


async def test_a_repair_event_counts_as_its_original(
    make_handler: Make, publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    room = Room()
    created, joined = (
        room.next(e.RoomCreated(owner_id=OWNER, title="t", seat_count=8)),
        room.next(e.RoomUserJoined(user_id="bob", role="member")),
    )
    repair = replace(joined, event_id=uuid.uuid4().hex, repair_of=joined.event_id)
    await commit(database, created, joined, repair)
    handler = make_handler()
    await handle_all(handler, [created, repair])
    assert await handler.handle(delivery(joined)) is Outcome.DUPLICATE  # the original, after its repair
    assert ids_in_im(sandbox) == [joined.event_id]  # the message the repair sent names its original
    close = room.next(e.RoomClosed(operator_id=OWNER))
    await commit(database, close)
    assert await handler.unsent_before(close) == []  # the repair row's record is its original's
    assert await handler.handle(delivery(close)) is Outcome.APPLIED
    assert destroyed(sandbox)


async def test_a_body_that_does_not_decode_is_poison(make_handler: Make) -> None:
    with pytest.raises(ValueError, match="not a room_outbox_event"):
        await make_handler().handle(delivery(body=b"\xff\x00garbage"))


# --------------------------------------------------------------------------- order: the close waits


async def test_a_close_delivered_first_waits_for_the_earlier_messages_then_destroys(
    make_handler: Make, broker: FakeBroker, sandbox: RunningSandbox, database: Database, consuming: Any
) -> None:
    events = Room().chain()
    close = events[-1]
    await commit(database, *events)
    await send(broker, close)
    runtime = consuming(make_handler())
    await until(lambda: runtime.runner(GROUP).counts.redelivered >= 1)  # the close came back, still waiting
    assert not destroyed(sandbox) and ids_in_im(sandbox) == []
    await send(broker, *events[:-1])
    await until(lag_is(broker, 0))
    await runtime.shutdown(grace_s=1)
    assert sorted(ids_in_im(sandbox)) == sorted(ev.event_id for ev in events[1:])  # none lost, none twice
    assert ids_in_im(sandbox)[-1] == close.event_id  # the group's last message is the close
    assert destroyed(sandbox)
    assert runtime.runner(GROUP).counts.failures == 0  # waiting is not failing


async def test_the_close_redelivers_while_an_earlier_message_is_unsent_and_proceeds_once_it_is(
    make_handler: Make, sandbox: RunningSandbox, database: Database
) -> None:
    events = Room().chain()
    created, joined, gift, kick, close = events
    await commit(database, *events)
    handler = make_handler(close_wait_s=30, close_poll_s=0.5, close_poll_max_s=4)
    await handle_all(handler, [created, joined, kick])
    delays = []
    for count in (1, 2, 3, 4):
        with pytest.raises(Redeliver, match=gift.event_id) as again:
            await handler.handle(delivery(close, count=count))
        delays.append(again.value.delay_s)
    assert delays == [0.5, 1.0, 2.0, 4.0]  # growing, capped
    assert not destroyed(sandbox)
    assert [u.event_id for u in await handler.unsent_before(close)] == [gift.event_id]
    await handler.handle(delivery(gift))
    assert await handler.handle(delivery(close, count=5)) is Outcome.APPLIED
    assert destroyed(sandbox)
    assert ids_in_im(sandbox) == [joined.event_id, kick.event_id, gift.event_id, close.event_id]


async def test_the_wait_never_goes_past_the_bound(
    make_handler: Make, database: Database, sandbox: RunningSandbox, clock: Clock
) -> None:
    events = Room().chain()
    await commit(database, *events)
    handler = make_handler(close_wait_s=30, close_poll_s=10, close_poll_max_s=10)
    await handler.handle(delivery(events[0]))
    clock.fixed = events[-1].occurred_at_ms + 28_000
    with pytest.raises(Redeliver) as again:
        await handler.handle(delivery(events[-1]))
    assert again.value.delay_s == pytest.approx(2.0)  # the next look is at the bound, not after it


async def test_a_close_never_waits_itself_into_the_dead_letter(
    make_handler: Make, database: Database, sandbox: RunningSandbox, clock: Clock
) -> None:
    events = Room().chain()
    close = events[-1]
    await commit(database, *events)
    handler = make_handler(close_wait_s=30, close_poll_s=0.5, close_poll_max_s=5, max_deliveries=5)
    await handler.handle(delivery(events[0]))
    clock.fixed = close.occurred_at_ms + 10_000
    with pytest.raises(Redeliver) as again:
        await handler.handle(delivery(close, count=3))
    assert again.value.delay_s == pytest.approx(2.0)  # doubling
    with pytest.raises(Redeliver) as again:
        await handler.handle(delivery(close, count=4))  # the next delivery is the last one
    assert again.value.delay_s == pytest.approx(20.0)  # spent at the bound
    with capture_logs() as logs:  # the last delivery, still inside the bound: no wait, forced
        assert await handler.handle(delivery(close, count=5)) is Outcome.APPLIED
    assert destroyed(sandbox)
    assert ids_in_im(sandbox) == [ev.event_id for ev in events[1:]]  # the close sent them itself, first
    assert [entry["event"] for entry in logs if entry["event"] == "im_close_forced"] == []


async def test_a_message_after_we_destroyed_the_group_is_acknowledged_as_done(
    make_handler: Make, sandbox: RunningSandbox, database: Database
) -> None:
    events = Room().chain()
    close = events[-1]
    await commit(database, *events)
    handler = make_handler()
    assert await handle_all(handler, events) == [Outcome.APPLIED] * 5
    assert destroyed(sandbox)
    # an earlier event the close did not wait for (its outbox row was cleaned up) arrives now
    straggler = replace(events[1], event_id=uuid.uuid4().hex, room_version=close.room_version - 1)
    before = len(sandbox.state.requests)
    assert await handler.handle(delivery(straggler)) is Outcome.APPLIED
    assert [(r.command, r.error_code) for r in sandbox.state.requests[before:]] == [("send_group_msg", 10010)]
    assert await handler.publisher.steps.done(straggler.event_id) == {MESSAGE}  # done: never retried
    assert await handler.handle(delivery(straggler, count=2)) is Outcome.DUPLICATE
    assert straggler.event_id not in ids_in_im(sandbox)
    assert group_of() not in sandbox.state.groups  # not brought back
    late_create = replace(events[0], event_id=uuid.uuid4().hex)  # nor by a late RoomCreated
    assert await handler.handle(delivery(late_create)) is Outcome.DUPLICATE
    assert group_of() not in sandbox.state.groups


async def test_a_close_past_its_bound_sends_the_earlier_messages_itself_before_destroying(
    make_handler: Make, sandbox: RunningSandbox, database: Database, clock: Clock
) -> None:
    """An IM outage longer than the bound: the earlier messages are still backing off when the
    close's wait runs out; the close sends them first, so destroying loses none."""
    events = Room().chain()
    created, joined, gift, kick, close = events
    await commit(database, *events)
    handler = make_handler(close_wait_s=5)
    await handler.handle(delivery(created))
    sandbox.state.set_outage("http_503")
    for ev in (joined, gift, kick):
        with pytest.raises(RetryableError):
            await handler.handle(delivery(ev))
    clock.offset_ms = 6_000
    with pytest.raises(Redeliver, match="3 failed for now"):  # past the bound, but IM is down: no destroy
        await handler.handle(delivery(close))
    assert ids_in_im(sandbox) == [] and not destroyed(sandbox)
    sandbox.state.set_outage(None)
    with capture_logs() as logs:
        assert await handler.handle(delivery(close, count=2)) is Outcome.APPLIED
    assert ids_in_im(sandbox) == [ev.event_id for ev in events[1:]]  # in room_version order, the close last
    assert destroyed(sandbox)
    assert [entry for entry in logs if entry["event"] == "im_close_forced"] == []  # nothing had to be left out
    assert await handle_all(handler, [joined, gift, kick]) == [Outcome.DUPLICATE] * 3  # their own deliveries


async def join_then_close_past_the_bound(
    make_handler: Make, database: Database, clock: Clock, *, max_deliveries: int
) -> tuple[e.Event, e.Event, ImBridgeHandler]:
    """A room created (its group made), a join not yet sent, the close committed 6 s ago (bound 5 s)."""
    room = Room()
    created = room.next(e.RoomCreated(owner_id=OWNER, title="t", seat_count=8))
    joined = room.next(e.RoomUserJoined(user_id="bob", role="member"))
    close = room.next(e.RoomClosed(operator_id=OWNER))
    await commit(database, created, joined, close)
    handler = make_handler(close_wait_s=5, max_deliveries=max_deliveries)
    await handler.handle(delivery(created))
    clock.offset_ms = 6_000  # past the bound: the join is still backing off
    return joined, close, handler


async def test_a_close_past_its_bound_does_not_destroy_over_a_transient_error_of_an_earlier_message(
    make_handler: Make, sandbox: RunningSandbox, database: Database, clock: Clock
) -> None:
    """IM flaky, not down: the earlier message the close sends itself gets one "try again" (10002)
    while the close's own steps would succeed. Destroying then swallowed the message for good (its own
    redelivery found the group destroyed and recorded it done; found by review). The close waits again."""
    joined, close, handler = await join_then_close_past_the_bound(make_handler, database, clock, max_deliveries=17)
    sandbox.state.inject_error("send_group_msg", 10002, "internal error, retry", count=1)
    with pytest.raises(Redeliver, match="1 failed for now"):
        await handler.handle(delivery(close))
    assert ids_in_im(sandbox) == [] and not destroyed(sandbox)
    assert await handler.handle(delivery(close, count=2)) is Outcome.APPLIED
    assert ids_in_im(sandbox) == [joined.event_id, close.event_id]
    assert destroyed(sandbox)


async def test_what_one_delivery_had_no_time_for_is_sent_by_the_next_before_the_destroy(
    make_handler: Make, sandbox: RunningSandbox, database: Database, clock: Clock
) -> None:
    """The close sends its earlier messages under one publish deadline; those it had no time for
    are not poison: the close is redelivered and sends them, and only then destroys."""
    room = Room()
    created = room.next(e.RoomCreated(owner_id=OWNER, title="t", seat_count=8))
    earlier = [room.next(e.RoomUserJoined(user_id=f"u{i}", role="member")) for i in range(4)]
    close = room.next(e.RoomClosed(operator_id=OWNER))
    await commit(database, created, *earlier, close)
    handler = make_handler(close_wait_s=5, max_deliveries=17, publish_timeout_s=0.5)
    await handler.handle(delivery(created))
    clock.offset_ms = 6_000
    sandbox.state.set_latency(0.2, "send_group_msg")  # slow, not down: about two fit in one deadline
    with pytest.raises(Redeliver, match="failed for now"):
        await handler.handle(delivery(close))
    assert 0 < len(ids_in_im(sandbox)) < len(earlier) and not destroyed(sandbox)
    outcome: Outcome | None = None
    for count in range(2, 10):  # each delivery sends what its deadline allows
        with contextlib.suppress(Redeliver):
            outcome = await handler.handle(delivery(close, count=count))
            break
        assert not destroyed(sandbox)
    assert outcome is Outcome.APPLIED
    assert ids_in_im(sandbox) == [ev.event_id for ev in [*earlier, close]]  # none lost, in order
    assert destroyed(sandbox)


async def test_on_its_last_delivery_a_close_destroys_past_a_transient_failure(
    make_handler: Make, sandbox: RunningSandbox, database: Database, clock: Clock
) -> None:
    """The bound on the wait stays: the last delivery forces past whatever is left, and names it."""
    joined, close, handler = await join_then_close_past_the_bound(make_handler, database, clock, max_deliveries=3)
    sandbox.state.inject_error("send_group_msg", 10002, "internal error, retry", count=1)
    with capture_logs() as logs:
        assert await handler.handle(delivery(close, count=3)) is Outcome.APPLIED
    assert destroyed(sandbox)
    (forced,) = [entry for entry in logs if entry["event"] == "im_close_forced"]
    assert "10002" in forced["errors"][joined.event_id]


async def test_a_poison_earlier_message_holds_the_close_only_for_its_bound_and_nothing_else(
    make_handler: Make, broker: FakeBroker, sandbox: RunningSandbox, database: Database, consuming: Any
) -> None:
    room, other = Room(ROOM), Room(OTHER)
    events = room.chain()
    kick, close = events[3], events[4]
    others = [
        other.next(e.RoomCreated(owner_id=OWNER, title="Other", seat_count=8)),
        other.next(e.RoomUserJoined(user_id="bob", role="member")),
    ]
    await commit(database, *events, *others)
    sandbox.state.inject_error("ban_group_member", 10004, "invalid parameter", count=1000)  # the kick always fails
    wait_s = 1.0
    with capture_logs() as logs:
        handler = make_handler(close_wait_s=wait_s, max_deliveries=4)
        runtime = consuming(handler, max_deliveries=4, concurrency=4)
        await send(broker, *events[:3], kick, *others)
        # while the kick fails, other rooms go on, and so do this room's other events
        await until(lambda: ids_in_im(sandbox, OTHER) == [others[1].event_id])
        await until(lambda: sorted(ids_in_im(sandbox)) == sorted(ev.event_id for ev in events[1:3]))
        await send(broker, close)
        await until(lag_is(broker, 0))
        await runtime.shutdown(grace_s=1)
    assert destroyed(sandbox)
    assert sorted(ids_in_im(sandbox)[:2]) == sorted(ev.event_id for ev in events[1:3])
    assert ids_in_im(sandbox)[2:] == [close.event_id]  # the kick's message never went out
    assert now_ms() - close.occurred_at_ms >= wait_s * 1000  # not before its bound
    (forced,) = [entry for entry in logs if entry["event"] == "im_close_forced"]
    assert forced["event_id"] == close.event_id
    assert forced["unsent"] == [f"{kick.event_id} (RoomUserKicked v4)"]
    assert "10004" in forced["errors"][kick.event_id]  # the close tried it itself before leaving it out
    (dead,) = await broker.dead_letters(GROUP)
    assert dead.key == kick.event_id  # the poison itself: in the dead letter, replayable


# --------------------------------------------------------------------------- IM trouble


async def test_im_down_is_retried_and_everything_reaches_im_once_it_is_back(
    make_handler: Make, broker: FakeBroker, sandbox: RunningSandbox, database: Database, consuming: Any
) -> None:
    events = Room().chain()
    await commit(database, *events)
    sandbox.state.set_outage("reset")
    runtime = consuming(make_handler(), concurrency=4)
    await send(broker, *events)
    await until(lambda: runtime.runner(GROUP).counts.failures >= 8)
    assert ids_in_im(sandbox) == [] and not destroyed(sandbox)
    sandbox.state.set_outage(None)
    await until(lag_is(broker, 0))
    await runtime.shutdown(grace_s=1)
    assert sorted(ids_in_im(sandbox)) == sorted(ev.event_id for ev in events[1:])
    assert ids_in_im(sandbox)[-1] == events[-1].event_id
    assert destroyed(sandbox)
    assert await broker.dead_letters(GROUP) == []


async def test_a_missing_group_of_an_open_room_is_created_again_and_the_message_delivered(
    make_handler: Make, sandbox: RunningSandbox, database: Database
) -> None:
    room = Room()
    created = room.next(e.RoomCreated(owner_id=OWNER, title="Friday night", seat_count=8))
    joined = room.next(e.RoomUserJoined(user_id="bob", role="member"))
    await commit(database, created, joined)
    now = now_ms()
    async with database.write() as conn:
        await conn.execute(
            sa.insert(t.room_meta).values(
                app_code=APP, room_id=ROOM, version=2, lease_epoch=1, owner_id=OWNER, title="Friday night",
                status="open", seat_count=8, member_count=2, heat=0, created_at_ms=now, updated_at_ms=now,
            )
        )  # fmt: skip
    handler = make_handler()
    await handler.handle(delivery(created))
    async with httpx.AsyncClient(base_url=sandbox.base_url, transport=sandbox.transport()) as http:
        answer = await http.post(f"/_sandbox/groups/{quote(group_of(), safe='')}/dismiss")  # IM dismisses it
    assert answer.status_code == 200, answer.text
    assert group_of() not in sandbox.state.groups
    assert await handler.handle(delivery(joined)) is Outcome.APPLIED
    group = sandbox.state.groups[group_of()]
    assert (group.owner, group.name) == (OWNER, "Friday night")
    assert ids_in_im(sandbox) == [joined.event_id]
    assert await handler.publisher.steps.done(joined.event_id) == {MESSAGE}


async def test_a_kick_that_failed_half_way_resends_only_the_message(
    make_handler: Make, sandbox: RunningSandbox, database: Database
) -> None:
    room = Room()
    created = room.next(e.RoomCreated(owner_id=OWNER, title="t", seat_count=8))
    kick = room.next(e.RoomUserKicked(operator_id=OWNER, target_id="carol", ban_seconds=60, banned_until_ms=0))
    await commit(database, created, kick)
    handler = make_handler()
    await handler.handle(delivery(created))
    sandbox.state.inject_error("send_group_msg", 10002, "internal error, retry", count=1)
    with pytest.raises(RetryableError):
        await handler.handle(delivery(kick))
    assert await handler.publisher.steps.done(kick.event_id) == {MEMBER}
    before = sandbox.state.request_counts()
    assert await handler.handle(delivery(kick, count=2)) is Outcome.APPLIED
    after = sandbox.state.request_counts()
    assert after.get("ban_group_member") == before.get("ban_group_member")  # not banned twice
    assert ids_in_im(sandbox) == [kick.event_id]
    assert DESTROY not in await handler.publisher.steps.done(kick.event_id)
