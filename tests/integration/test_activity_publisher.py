"""The direct activity publisher against the reference activity service over loopback gRPC."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import grpc.aio
import pytest
import pytest_asyncio

from roomservice.activity.service import ActivityServicer, RunningActivityService, running_activity_service
from roomservice.activity.store import ActivityStore
from roomservice.domain import events as e
from roomservice.proto import activity_pb2 as apb
from roomservice.publishers.activity import ActivityPublisher
from roomservice.publishers.port import PermanentError, RetryableError
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

NOW_MS = 1_700_000_000_000


def gift(*, room_id: str = "room-1", value: int = 10) -> e.Event:
    return e.Event(
        event_id=uuid.uuid4().hex,
        app_code="app1",
        room_id=room_id,
        room_version=3,
        occurred_at_ms=NOW_MS,
        payload=e.RoomGiftSent("alice", "bob", "rose", 1, value, value),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def deadline_in(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


@pytest_asyncio.fixture
async def db(sqlite_url: str) -> AsyncIterator[Database]:
    database = Database.from_url(sqlite_url)
    await upgrade(database)
    try:
        yield database
    finally:
        await database.dispose()


@pytest_asyncio.fixture
async def service(db: Database) -> AsyncIterator[RunningActivityService]:
    async with running_activity_service(db, clock=lambda: NOW_MS) as svc:
        yield svc


@pytest_asyncio.fixture
async def publisher(service: RunningActivityService) -> AsyncIterator[ActivityPublisher]:
    pub = ActivityPublisher(service.target)
    try:
        yield pub
    finally:
        await pub.close()


async def sent_board(db: Database) -> list[tuple[str, int]]:
    store = ActivityStore(db)
    entries = await store.gift_leaderboard("app1", "room-1", day=NOW_MS // 86_400_000, board="sent", limit=10)
    return [(entry.user_id, entry.value) for entry in entries]


async def test_publish_delivers_and_a_duplicate_is_success(publisher: ActivityPublisher, db: Database) -> None:
    ev = gift()
    assert publisher.name == "activity"
    await publisher.publish(ev, payload=encode_event(ev), deadline=deadline_in(5))
    await publisher.publish(ev, payload=encode_event(ev), deadline=deadline_in(5))  # duplicate: no error
    assert await ActivityStore(db).is_processed(ev.event_id)
    assert await sent_board(db) == [("alice", 10)]


async def test_the_payload_bytes_are_sent_as_they_are(publisher: ActivityPublisher, db: Database) -> None:
    ev = gift(value=42)
    other = gift(value=1)  # the event object is only for messages; the payload is what travels
    await publisher.publish(other, payload=encode_event(ev), deadline=deadline_in(5))
    assert await ActivityStore(db).is_processed(ev.event_id)
    assert not await ActivityStore(db).is_processed(other.event_id)


async def test_invalid_argument_is_permanent(publisher: ActivityPublisher) -> None:
    ev = gift(room_id="not a room id")
    with pytest.raises(PermanentError, match="INVALID_ARGUMENT") as info:
        await publisher.publish(ev, payload=encode_event(ev), deadline=deadline_in(5))
    assert "room_id" in str(info.value)
    with pytest.raises(PermanentError, match="INVALID_ARGUMENT"):
        await publisher.publish(ev, payload=b"\xff\xff\xff", deadline=deadline_in(5))


async def test_nobody_listening_is_retryable() -> None:
    publisher = ActivityPublisher(f"127.0.0.1:{free_port()}")
    ev = gift()
    try:
        with pytest.raises(RetryableError, match="UNAVAILABLE"):
            await publisher.publish(ev, payload=encode_event(ev), deadline=deadline_in(5))
    finally:
        await publisher.close()


async def test_database_down_behind_the_service_is_retryable() -> None:
    dead = Database.from_url(f"mysql+asyncmy://root@127.0.0.1:{free_port()}/nothing", pool_size=1, max_overflow=0)
    publisher: ActivityPublisher | None = None
    try:
        async with running_activity_service(dead) as svc:
            publisher = ActivityPublisher(svc.target)
            ev = gift()
            with pytest.raises(RetryableError, match="UNAVAILABLE"):
                await publisher.publish(ev, payload=encode_event(ev), deadline=deadline_in(5))
    finally:
        if publisher is not None:
            await publisher.close()
        await dead.dispose()


class StuckServicer(ActivityServicer):
    """Holds every HandleRoomEvent until released."""

    def __init__(self, store: ActivityStore) -> None:
        super().__init__(store)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def HandleRoomEvent(self, request: bytes, context: grpc.aio.ServicerContext) -> apb.HandleRoomEventReply:
        self.entered.set()
        await self.release.wait()
        return await super().HandleRoomEvent(request, context)


async def test_a_service_slower_than_the_deadline_is_retryable_in_time(db: Database) -> None:
    stuck = StuckServicer(ActivityStore(db))
    async with running_activity_service(db, servicer=stuck, grace=0) as svc:
        publisher = ActivityPublisher(svc.target)
        try:
            ev = gift()
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RetryableError, match="DEADLINE_EXCEEDED"):
                await publisher.publish(ev, payload=encode_event(ev), deadline=started + 0.5)
            elapsed = loop.time() - started
            assert stuck.entered.is_set()
            assert 0.4 <= elapsed < 1.5, elapsed
            # an expired deadline fails at once, without waiting
            started = loop.time()
            with pytest.raises(RetryableError, match="DEADLINE_EXCEEDED"):
                await publisher.publish(ev, payload=encode_event(ev), deadline=started - 1)
            assert loop.time() - started < 0.5
        finally:
            stuck.release.set()
            await publisher.close()


async def test_the_publisher_recovers_when_the_service_is_back_on_the_same_port(db: Database) -> None:
    loop = asyncio.get_running_loop()
    async with running_activity_service(db) as first:
        port = first.port
        publisher = ActivityPublisher(first.target)
        before = gift()
        await publisher.publish(before, payload=encode_event(before), deadline=deadline_in(5))
    try:
        during = gift(value=5)
        with pytest.raises(RetryableError, match="UNAVAILABLE"):
            await publisher.publish(during, payload=encode_event(during), deadline=deadline_in(5))

        async with running_activity_service(db, port=port) as second:
            assert second.port == port
            started = loop.time()
            give_up = started + 15
            while True:  # what the outbox worker does: retry the row until the target accepts it
                try:
                    await publisher.publish(during, payload=encode_event(during), deadline=deadline_in(2))
                    break
                except RetryableError:
                    if loop.time() > give_up:
                        raise
                    await asyncio.sleep(0.05)
            # the channel's reconnect backoff is capped at about a second
            assert loop.time() - started < 5
        assert await ActivityStore(db).is_processed(during.event_id)
        assert await sent_board(db) == [("alice", 15)]
    finally:
        await publisher.close()


async def test_close_then_publish_opens_a_new_channel(publisher: ActivityPublisher, db: Database) -> None:
    first, second = gift(), gift()
    await publisher.publish(first, payload=encode_event(first), deadline=deadline_in(5))
    await publisher.close()
    await publisher.close()  # idempotent
    await publisher.publish(second, payload=encode_event(second), deadline=deadline_in(5))
    assert await ActivityStore(db).is_processed(second.event_id)


def test_a_target_is_required() -> None:
    with pytest.raises(ValueError, match="target"):
        ActivityPublisher("")
