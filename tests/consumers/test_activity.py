"""The activity group: the gRPC path's effects from the broker, once per event across deliveries,
repairs and the gRPC path itself; poison is dead-lettered; other event types touch nothing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from sqlalchemy import func, select

from roomservice.activity.service import HANDLE_ROOM_EVENT_METHOD, InvalidEvent, running_activity_service
from roomservice.activity.store import ActivityStore, LeaderboardEntry, TreasureReward
from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import Delivery, OutgoingMessage
from roomservice.consumers.activity import ActivityHandler
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Outcome
from roomservice.domain import events as e
from roomservice.domain.state import utc_day
from roomservice.outbox.policy import RetryPolicy
from roomservice.proto import activity_pb2 as apb
from roomservice.store.database import Database
from roomservice.store.tables import activity_processed_event
from roomservice.wire import encode_event

TOPIC = "hyapp_room_outbox"
GROUP = "hyapp-activity-room-outbox"
NOW = 1_780_000_000_000
DAY = utc_day(NOW)
FAST = RetryPolicy(initial_backoff_ms=10, max_backoff_ms=40, max_retry_count=1 << 30, jitter=0.0)


def event(payload: e.EventPayload, *, event_id: str = "", repair_of: str | None = None) -> e.Event:
    return e.Event(
        event_id=event_id or uuid.uuid4().hex,
        app_code="demo",
        room_id="r1",
        room_version=3,
        occurred_at_ms=NOW,
        payload=payload,
        repair_of=repair_of,
    )


def gift(value: int = 10, *, event_id: str = "") -> e.Event:
    return event(e.RoomGiftSent("alice", "bob", "rose", 1, value, value), event_id=event_id)


def delivery(body: bytes, *, count: int = 1, tag: str = "RoomGiftSent") -> Delivery:
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


def handler(store: ActivityStore) -> ActivityHandler:
    return ActivityHandler(store, group=GROUP, topic=TOPIC)


async def boards(store: ActivityStore) -> tuple[list[LeaderboardEntry], list[LeaderboardEntry]]:
    sent = await store.gift_leaderboard("demo", "r1", day=DAY, board="sent", limit=10)
    received = await store.gift_leaderboard("demo", "r1", day=DAY, board="received", limit=10)
    return sent, received


async def processed_rows(db: Database) -> int:
    async with db.read() as conn:
        return int((await conn.execute(select(func.count()).select_from(activity_processed_event))).scalar_one())


@pytest.fixture
def store(database: Database) -> ActivityStore:
    return ActivityStore(database, clock=lambda: NOW)


async def test_a_gift_delivered_twice_counts_once(store: ActivityStore) -> None:
    body = encode_event(gift(10))
    assert await handler(store).handle(delivery(body)) is Outcome.APPLIED
    assert await handler(store).handle(delivery(body, count=2)) is Outcome.DUPLICATE
    sent, received = await boards(store)
    assert sent == [LeaderboardEntry("alice", 10)] and received == [LeaderboardEntry("bob", 10)]


async def test_a_repair_counts_as_its_original_whichever_arrives_first(store: ActivityStore) -> None:
    original = gift(7)
    repair = replace(original, event_id=uuid.uuid4().hex, repair_of=original.event_id)
    assert await handler(store).handle(delivery(encode_event(repair))) is Outcome.APPLIED
    assert await handler(store).handle(delivery(encode_event(original))) is Outcome.DUPLICATE
    assert (await boards(store))[0] == [LeaderboardEntry("alice", 7)]
    assert await store.is_processed(original.event_id) and not await store.is_processed(repair.event_id)


async def test_a_treasure_opening_pays_each_recipient_once(store: ActivityStore) -> None:
    opened = event(e.RoomTreasureOpened("box-1", 2, ("u1", "u2")))
    assert await handler(store).handle(delivery(encode_event(opened))) is Outcome.APPLIED
    assert await handler(store).handle(delivery(encode_event(opened), count=2)) is Outcome.DUPLICATE
    assert await store.treasure_rewards("demo", "r1") == [
        TreasureReward("box-1", 2, "u1", opened.event_id),
        TreasureReward("box-1", 2, "u2", opened.event_id),
    ]


async def test_a_routed_type_without_an_effect_is_recorded_like_the_grpc_path_does(store: ActivityStore) -> None:
    joined = event(e.RoomUserJoined("carol", "audience"))
    assert await handler(store).handle(delivery(encode_event(joined))) is Outcome.APPLIED
    assert await store.is_processed(joined.event_id)
    assert await handler(store).handle(delivery(encode_event(joined))) is Outcome.DUPLICATE


@pytest.mark.parametrize(
    "payload",
    [e.RoomMicTaken("carol", 1), e.RoomTreasureCountdownStarted("box-1", 1, NOW + 60_000, "treasure-open:box-1")],
    ids=lambda p: p.type,
)
async def test_types_the_activity_service_is_not_sent_are_acked_without_touching_the_database(
    store: ActivityStore, database: Database, payload: e.EventPayload
) -> None:
    ev = event(payload)
    assert await handler(store).handle(delivery(encode_event(ev))) is Outcome.DUPLICATE
    assert await processed_rows(database) == 0


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xff\xff\xff\xff", id="garbage"),
        pytest.param(encode_event(gift(event_id="x" * 65)), id="long-event-id"),
        pytest.param(encode_event(event(e.RoomGiftSent("alice", "bob", "rose", 1, -5, -5))), id="negative-value"),
        pytest.param(encode_event(event(e.RoomTreasureOpened("b", 1, ("ok", "not ok")))), id="bad-recipient"),
    ],
)
async def test_an_invalid_body_is_poison(store: ActivityStore, database: Database, body: bytes) -> None:
    with pytest.raises(InvalidEvent) as info:
        await handler(store).handle(delivery(body))
    assert isinstance(info.value, ValueError)
    assert await processed_rows(database) == 0


async def test_a_message_tagged_with_a_type_activity_does_not_take_is_acked_undecoded(
    store: ActivityStore, database: Database
) -> None:
    assert await handler(store).handle(delivery(b"\x00not an envelope", tag="RoomMicTaken")) is Outcome.DUPLICATE
    with pytest.raises(InvalidEvent):  # a tag this version does not know may be a newer type of ours
        await handler(store).handle(delivery(b"\x00not an envelope", tag="RoomSomethingNew"))
    assert await processed_rows(database) == 0


async def test_an_event_applied_by_the_grpc_path_is_a_duplicate_here_and_the_other_way_round(
    database: Database, store: ActivityStore
) -> None:
    by_grpc, by_broker = gift(3), gift(4)
    async with (
        running_activity_service(database, clock=lambda: NOW) as svc,
        grpc.aio.insecure_channel(svc.target) as channel,
    ):
        call = channel.unary_unary(
            HANDLE_ROOM_EVENT_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=apb.HandleRoomEventReply.FromString,
        )
        assert (await call(encode_event(by_grpc), timeout=10)).duplicate is False
        assert await handler(store).handle(delivery(encode_event(by_grpc))) is Outcome.DUPLICATE
        assert await handler(store).handle(delivery(encode_event(by_broker))) is Outcome.APPLIED
        assert (await call(encode_event(by_broker), timeout=10)).duplicate is True
    assert (await boards(store))[0] == [LeaderboardEntry("alice", 7)]


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


async def publish(broker: FakeBroker, ev: e.Event, *, body: bytes | None = None) -> None:
    message = OutgoingMessage(
        topic=TOPIC, body=encode_event(ev) if body is None else body, key=ev.event_id, tag=ev.type
    )
    await broker.publish(message, timeout_s=1)


async def test_on_the_runtime_republished_gifts_apply_once_and_poison_is_dead_lettered_alone(
    broker: FakeBroker, store: ActivityStore
) -> None:
    first, second = gift(5), gift(6)
    runtime = ConsumerRuntime(
        broker, [(handler(store), GroupOptions(max_deliveries=2, wait_s=0.05, visibility_s=2, backoff=FAST))]
    )
    runtime.start()
    try:
        await publish(broker, first)
        await publish(broker, replace(first, event_id=uuid.uuid4().hex, repair_of=first.event_id))
        await publish(broker, gift(1, event_id="poison"), body=b"\x00not an envelope")
        await publish(broker, second)
        await until(lambda: _settled(broker))
    finally:
        await runtime.shutdown(grace_s=2)
    assert (await boards(store))[0] == [LeaderboardEntry("alice", 11)]
    counts = runtime.runner(GROUP).counts
    assert (counts.applied, counts.duplicates, counts.failures) == (2, 1, 2)
    (dead,) = await broker.dead_letters(GROUP)
    assert dead.key == "poison" and "InvalidEvent" in dead.reason


async def _settled(broker: FakeBroker) -> bool:
    stats = await broker.group_stats(TOPIC, GROUP)
    return stats.lag == 0 and stats.dead_letters == 1


async def test_duplicates_handled_together_apply_once_and_the_others_of_their_transaction_stand(
    store: ActivityStore, database: Database
) -> None:
    first, second = gift(3), gift(4)
    outcomes = await asyncio.gather(
        handler(store).handle(delivery(encode_event(first))),
        handler(store).handle(delivery(encode_event(first), count=2)),  # same event, same transaction
        handler(store).handle(delivery(encode_event(second))),
    )
    assert outcomes == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.APPLIED]
    sent, received = await boards(store)
    assert sent == [LeaderboardEntry("alice", 7)] and received == [LeaderboardEntry("bob", 7)]
    assert await processed_rows(database) == 2
