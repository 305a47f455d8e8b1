"""The reference activity service over a real grpc.aio channel on loopback, on SQLite and MariaDB."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from roomservice.activity.service import HANDLE_ROOM_EVENT_METHOD, RunningActivityService, running_activity_service
from roomservice.activity.store import ActivityStore
from roomservice.domain import events as e
from roomservice.domain.state import utc_day
from roomservice.proto import activity_pb2 as apb
from roomservice.proto import activity_pb2_grpc as apb_grpc
from roomservice.proto import room_outbox_event_pb2 as epb
from roomservice.store.database import Database
from roomservice.wire import encode_event

NOW_MS = 1_700_000_000_000
DAY_MS = 86_400_000
DAY = utc_day(NOW_MS)
APP = "app1"
ROOM = "room-1"


def event(payload: e.EventPayload, *, room_id: str = ROOM, occurred_at_ms: int = NOW_MS, event_id: str = "") -> e.Event:
    return e.Event(
        event_id=event_id or uuid.uuid4().hex,
        app_code=APP,
        room_id=room_id,
        room_version=1,
        occurred_at_ms=occurred_at_ms,
        payload=payload,
    )


def gift(sender: str, receiver: str, value: int, **kwargs: Any) -> e.Event:
    return event(e.RoomGiftSent(sender, receiver, "rose", 1, value, value), **kwargs)


class Client:
    """The generated stub for reads, plus HandleRoomEvent with raw bytes (garbage included)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = apb_grpc.ActivityServiceStub(channel)
        self._raw = channel.unary_unary(
            HANDLE_ROOM_EVENT_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=apb.HandleRoomEventReply.FromString,
        )

    async def send_bytes(self, payload: bytes) -> apb.HandleRoomEventReply:
        reply: apb.HandleRoomEventReply = await self._raw(payload, timeout=10)
        return reply

    async def send(self, ev: e.Event) -> bool:
        """Send ``ev``; True when it was a duplicate."""
        return (await self.send_bytes(encode_event(ev))).duplicate

    async def board(self, board: str, *, day: int = DAY, room_id: str = ROOM, limit: int = 0) -> list[tuple[str, int]]:
        reply = await self.stub.GetGiftLeaderboard(
            apb.GiftLeaderboardRequest(app_code=APP, room_id=room_id, day=day, board=board, limit=limit), timeout=10
        )
        return [(entry.user_id, entry.value) for entry in reply.entries]

    async def rewards(self, box_id: str = "") -> list[tuple[str, int, str, str]]:
        reply = await self.stub.GetTreasureRewards(
            apb.TreasureRewardsRequest(app_code=APP, room_id=ROOM, box_id=box_id), timeout=10
        )
        return [(r.box_id, r.level, r.user_id, r.event_id) for r in reply.rewards]


@pytest_asyncio.fixture
async def service(database: Database) -> AsyncIterator[RunningActivityService]:
    async with running_activity_service(database, clock=lambda: NOW_MS) as svc:
        yield svc


@pytest_asyncio.fixture
async def client(service: RunningActivityService) -> AsyncIterator[Client]:
    async with grpc.aio.insecure_channel(service.target) as channel:
        yield Client(channel)


async def expect_status(code: grpc.StatusCode, call: Callable[[], Any]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call()
    assert info.value.code() == code, info.value
    details: str = info.value.details() or ""
    return details


# --------------------------------------------------------------------------- gift leaderboards


async def test_gifts_build_the_days_boards(client: Client) -> None:
    for sender, receiver, value in [
        ("alice", "bob", 100),
        ("alice", "carol", 50),
        ("bob", "carol", 30),
        ("dave", "bob", 150),
        ("erin", "alice", 20),
    ]:
        assert await client.send(gift(sender, receiver, value)) is False
    # other days and rooms are other boards
    await client.send(gift("alice", "bob", 1000, occurred_at_ms=NOW_MS + DAY_MS))
    await client.send(gift("zed", "bob", 7, room_id="room-2"))

    assert await client.board("sent") == [("alice", 150), ("dave", 150), ("bob", 30), ("erin", 20)]
    assert await client.board("received") == [("bob", 250), ("carol", 80), ("alice", 20)]
    assert await client.board("sent", limit=2) == [("alice", 150), ("dave", 150)]
    assert await client.board("received", limit=1) == [("bob", 250)]
    assert await client.board("sent", day=DAY + 1) == [("alice", 1000)]
    assert await client.board("received", day=DAY + 1) == [("bob", 1000)]
    assert await client.board("sent", day=DAY - 1) == []
    assert await client.board("sent", room_id="room-2") == [("zed", 7)]
    assert await client.board("received", room_id="room-2") == [("bob", 7)]


async def test_the_day_is_the_utc_day_of_occurred_at(client: Client) -> None:
    midnight = (DAY + 1) * DAY_MS
    await client.send(gift("alice", "bob", 5, occurred_at_ms=midnight - 1))
    await client.send(gift("alice", "bob", 7, occurred_at_ms=midnight))
    assert await client.board("sent", day=DAY) == [("alice", 5)]
    assert await client.board("sent", day=DAY + 1) == [("alice", 7)]


async def test_a_self_gift_counts_on_both_boards(client: Client) -> None:
    await client.send(gift("alice", "alice", 9))
    assert await client.board("sent") == [("alice", 9)]
    assert await client.board("received") == [("alice", 9)]


async def test_leaderboard_arguments_are_checked(client: Client) -> None:
    stub = client.stub
    for request in [
        apb.GiftLeaderboardRequest(app_code=APP, room_id=ROOM, day=DAY, board="both"),
        apb.GiftLeaderboardRequest(app_code=APP, room_id=ROOM, day=DAY, board="sent", limit=-1),
        apb.GiftLeaderboardRequest(app_code=APP, room_id=ROOM, day=-1, board="sent"),
        apb.GiftLeaderboardRequest(app_code="", room_id=ROOM, day=DAY, board="sent"),
        apb.GiftLeaderboardRequest(app_code=APP, room_id="no spaces", day=DAY, board="sent"),
    ]:
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda r=request: stub.GetGiftLeaderboard(r, timeout=10))
    await expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.GetTreasureRewards(apb.TreasureRewardsRequest(app_code=APP, room_id=""), timeout=10),
    )


# --------------------------------------------------------------------------- treasure rewards


async def test_treasure_opened_pays_one_reward_per_recipient(client: Client) -> None:
    first = event(e.RoomTreasureOpened("19675-1", 1, ("alice", "bob", "carol")))
    second = event(e.RoomTreasureOpened("19675-2", 2, ("bob",)))
    assert await client.send(first) is False
    assert await client.send(second) is False

    assert sorted(await client.rewards("19675-1")) == [
        ("19675-1", 1, "alice", first.event_id),
        ("19675-1", 1, "bob", first.event_id),
        ("19675-1", 1, "carol", first.event_id),
    ]
    assert await client.rewards("19675-2") == [("19675-2", 2, "bob", second.event_id)]
    assert len(await client.rewards()) == 4
    assert await client.rewards("no-such-box") == []


async def test_a_box_with_no_recipients_pays_nothing(client: Client) -> None:
    assert await client.send(event(e.RoomTreasureOpened("19675-1", 1, ()))) is False
    assert await client.rewards() == []


async def test_a_repair_event_for_a_paid_box_does_not_pay_twice(client: Client) -> None:
    original = event(e.RoomTreasureOpened("19675-1", 1, ("alice", "bob")))
    await client.send(original)
    assert await client.send(event(e.RoomTreasureOpened("19675-1", 1, ("alice", "bob", "carol")))) is False
    rewards = await client.rewards("19675-1")
    assert sorted(user for _, _, user, _ in rewards) == ["alice", "bob", "carol"]
    assert {event_id for _, _, user, event_id in rewards if user != "carol"} == {original.event_id}


# --------------------------------------------------------------------------- idempotency


async def test_the_same_event_twice_applies_once(client: Client) -> None:
    gift_event = gift("alice", "bob", 100)
    box_event = event(e.RoomTreasureOpened("19675-1", 1, ("alice", "bob")))
    for ev in (gift_event, box_event):
        assert await client.send(ev) is False
        assert await client.send(ev) is True
        assert await client.send(ev) is True
    assert await client.board("sent") == [("alice", 100)]
    assert await client.board("received") == [("bob", 100)]
    assert len(await client.rewards()) == 2


def repair_of(original: e.Event) -> e.Event:
    """What ``outbox replay --as-repair`` sends: the original under a new event id, naming it."""
    return replace(original, event_id=uuid.uuid4().hex, repair_of=original.event_id)


async def test_a_repair_of_an_applied_event_is_a_duplicate(client: Client, database: Database) -> None:
    original = gift("alice", "bob", 30)
    assert await client.send(original) is False
    repair = repair_of(original)
    assert await client.send(repair) is True
    assert await client.send(repair_of(original)) is True  # a second repair too
    assert await client.board("sent") == [("alice", 30)]
    assert await client.board("received") == [("bob", 30)]
    assert not await ActivityStore(database).is_processed(repair.event_id)  # recorded as the original only


async def test_a_repair_of_a_lost_event_applies_once_and_the_late_original_is_a_duplicate(
    client: Client, database: Database
) -> None:
    original = gift("alice", "bob", 30)
    assert await client.send(repair_of(original)) is False
    assert await ActivityStore(database).is_processed(original.event_id)
    assert await client.board("sent") == [("alice", 30)]
    assert await client.send(original) is True
    assert await client.board("sent") == [("alice", 30)]
    assert await client.board("received") == [("bob", 30)]


async def test_a_repaired_box_pays_once_under_the_original_event(client: Client) -> None:
    original = event(e.RoomTreasureOpened("19675-2", 1, ("alice", "bob")))
    assert await client.send(repair_of(original)) is False
    assert await client.send(original) is True
    assert sorted(await client.rewards("19675-2")) == [
        ("19675-2", 1, "alice", original.event_id),
        ("19675-2", 1, "bob", original.event_id),
    ]


async def test_concurrent_original_and_repair_apply_once(client: Client) -> None:
    original = gift("alice", "bob", 30)
    payloads = [encode_event(original), encode_event(repair_of(original))] * 5
    replies = await asyncio.gather(*(client.send_bytes(p) for p in payloads))
    assert sorted(r.duplicate for r in replies) == [False] + [True] * 9
    assert await client.board("sent") == [("alice", 30)]


async def test_a_duplicate_with_another_payload_changes_nothing(client: Client) -> None:
    original = gift("alice", "bob", 100)
    assert await client.send(original) is False
    assert await client.send(gift("carol", "dave", 999, event_id=original.event_id)) is True
    assert await client.board("sent") == [("alice", 100)]


async def test_concurrent_identical_calls_apply_once(client: Client) -> None:
    gift_event = gift("alice", "bob", 100)
    box_event = event(e.RoomTreasureOpened("19675-1", 1, ("alice", "bob")))
    for ev in (gift_event, box_event):
        payload = encode_event(ev)
        replies = await asyncio.gather(*(client.send_bytes(payload) for _ in range(20)))
        assert sorted(r.duplicate for r in replies) == [False] + [True] * 19
    assert await client.board("sent") == [("alice", 100)]
    assert await client.board("received") == [("bob", 100)]
    assert len(await client.rewards()) == 2


async def test_concurrent_gifts_of_one_user_all_add_up(client: Client) -> None:
    gifts = [gift("alice", "bob" if i % 2 else "carol", 10) for i in range(20)]
    replies = await asyncio.gather(*(client.send(g) for g in gifts))
    assert replies == [False] * 20
    assert await client.board("sent") == [("alice", 200)]
    assert await client.board("received") == [("bob", 100), ("carol", 100)]


# --------------------------------------------------------------------------- other types and bad input


@pytest.mark.parametrize(
    "payload",
    [
        e.RoomCreated("alice", "hello", 8),
        e.RoomUserJoined("bob", "member"),
        e.RoomUserLeft("bob"),
        e.RoomUserKicked("alice", "bob", 600, NOW_MS + 600_000),
        e.RoomClosed("alice"),
    ],
    ids=lambda p: p.type,
)
async def test_routed_types_without_an_effect_are_recorded(
    client: Client, database: Database, payload: e.EventPayload
) -> None:
    ev = event(payload)
    assert await client.send(ev) is False
    assert await ActivityStore(database).is_processed(ev.event_id)
    assert await client.send(ev) is True
    assert await client.board("sent") == []
    assert await client.rewards() == []


def envelope(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "event_id": uuid.uuid4().hex,
        "app_code": APP,
        "room_id": ROOM,
        "room_version": 1,
        "type": "RoomGiftSent",
        "occurred_at_ms": NOW_MS,
        "room_gift_sent": epb.RoomGiftSent(sender_id="alice", receiver_id="bob", gift_id="rose", total_value=5),
    }
    base.update(fields)
    data: bytes = epb.RoomOutboxEvent(**base).SerializeToString()
    return data


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xff\xff\xff\xff", id="garbage"),
        pytest.param(envelope(type="RoomTeleported"), id="unknown-type"),
        pytest.param(envelope(type=""), id="no-type"),
        pytest.param(envelope(event_id=""), id="empty-event-id"),
        pytest.param(envelope(event_id="x" * 65), id="long-event-id"),
        pytest.param(envelope(app_code="App!"), id="bad-app-code"),
        pytest.param(envelope(room_id=""), id="empty-room-id"),
        pytest.param(envelope(occurred_at_ms=-1), id="negative-time"),
        pytest.param(envelope(repair_of="not an id"), id="bad-repair-of"),
        pytest.param(envelope(event_id="same", repair_of="same"), id="repair-of-itself"),
        pytest.param(envelope(room_gift_sent=None), id="gift-without-payload"),
        pytest.param(
            envelope(room_gift_sent=epb.RoomGiftSent(sender_id="alice", receiver_id="bob", total_value=-5)),
            id="negative-value",
        ),
        pytest.param(
            envelope(
                type="RoomTreasureOpened",
                room_gift_sent=None,
                room_treasure_opened=epb.RoomTreasureOpened(box_id="b", level=1, recipients=["ok", "not ok"]),
            ),
            id="bad-recipient",
        ),
    ],
)
async def test_invalid_input_is_invalid_argument(client: Client, database: Database, payload: bytes) -> None:
    details = await expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: client.send_bytes(payload))
    assert details
    assert await client.board("sent") == []
    assert await client.board("received") == []


async def test_invalid_input_is_not_recorded(client: Client, database: Database) -> None:
    bad = envelope(room_id="bad room")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: client.send_bytes(bad))
    assert not await ActivityStore(database).is_processed(epb.RoomOutboxEvent.FromString(bad).event_id)


# --------------------------------------------------------------------------- database down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_database_down_is_unavailable() -> None:
    dead = Database.from_url(f"mysql+asyncmy://root@127.0.0.1:{free_port()}/nothing", pool_size=1, max_overflow=0)
    try:
        async with (
            running_activity_service(dead) as svc,
            grpc.aio.insecure_channel(svc.target) as channel,
        ):
            client = Client(channel)
            await expect_status(grpc.StatusCode.UNAVAILABLE, lambda: client.send(gift("alice", "bob", 1)))
            await expect_status(grpc.StatusCode.UNAVAILABLE, lambda: client.board("sent"))
            await expect_status(grpc.StatusCode.UNAVAILABLE, lambda: client.rewards())
    finally:
        await dead.dispose()
