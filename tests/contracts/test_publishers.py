"""Contract suite of the publisher port (``roomservice.publishers.port``), one subclass per adapter.

What every publisher promises the outbox worker: its ``name`` is a routing
target; an event routed to it is delivered to a healthy peer; delivering the
same event twice is harmless (the peer shows one effect); a peer that is down,
or that accepts the connection and never answers, or a deadline already passed,
is a :class:`RetryableError` — raised within the deadline, never a bare
exception and never a hang.

An adapter's suite subclasses :class:`PublisherContract` and provides:

* ``publisher`` — the adapter wired to a healthy peer;
* ``event`` — an event routed to the adapter's target, that the healthy peer
  can take (the suite prepares the peer if it must, e.g. the IM group);
* ``effects`` — ``await effects(event)``: how many times the healthy peer has
  applied the event, as far as the test can observe;
* ``down_publisher`` — the adapter wired to a peer that is down (nothing listening);
* ``hung_publisher`` — the adapter wired to a peer that accepts and never answers.

Future adapters (the broker publisher) add one subclass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest
import pytest_asyncio
import sqlalchemy as sa

from roomservice.activity.service import RunningActivityService, running_activity_service
from roomservice.activity.store import ActivityStore
from roomservice.brokers.fake import FakeBroker
from roomservice.domain import events as e
from roomservice.domain.commands import treasure_open_command_id
from roomservice.domain.routing import Target, targets_of
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient
from roomservice.publishers.activity import ActivityPublisher
from roomservice.publishers.broker import BrokerPublisher
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import Publisher, RetryableError
from roomservice.publishers.tencent_im import SentSteps, TencentImPublisher
from roomservice.publishers.treasure_wakeup import TreasureWakeupPublisher
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.timers.delay_message import DelayMessageScheduler, TreasureWakeup
from roomservice.timers.treasure import DatabaseTreasureTimer
from roomservice.wire import decode_event, encode_event

APP, ROOM, OWNER = "app1", "room-1", "alice"
NOW_MS = 1_780_000_000_000
DEADLINE_S = 0.5  # what the hung-peer test gives a publish
SLACK_S = 1.5  # how far past its deadline a publish may still return
Effects = Callable[[e.Event], Awaitable[int]]


def free_port() -> int:
    """A port nobody listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def blackhole() -> AsyncIterator[int]:
    """A TCP server that accepts connections, reads what is sent and never answers: a hung peer."""
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


def event_of(payload: e.EventPayload, *, version: int = 2, room: str = ROOM) -> e.Event:
    return e.Event(uuid.uuid4().hex, APP, room, version, NOW_MS, payload)


async def publish(publisher: Publisher, event: e.Event, *, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    await publisher.publish(event, payload=encode_event(event), deadline=deadline)


class PublisherContract:
    """What every :class:`Publisher` promises."""

    __test__: ClassVar[bool] = False

    # The fixtures ``publisher``, ``event``, ``effects``, ``down_publisher`` and ``hung_publisher``
    # come from the adapter's subclass (see the module docstring); pytest names any that is missing.

    # ---------------------------------------------------------------- naming and routing

    def test_name_is_a_routing_target(self, publisher: Publisher) -> None:
        assert publisher.name in {target.value for target in Target}

    def test_the_suite_event_is_routed_to_the_target(self, publisher: Publisher, event: e.Event) -> None:
        assert publisher.name in targets_of(event.type)

    # ---------------------------------------------------------------- delivery

    async def test_publish_to_a_healthy_peer_delivers(
        self, publisher: Publisher, event: e.Event, effects: Effects
    ) -> None:
        assert await effects(event) == 0
        await publish(publisher, event)
        assert await effects(event) == 1

    async def test_delivering_the_same_event_twice_is_harmless(
        self, publisher: Publisher, event: e.Event, effects: Effects
    ) -> None:
        await publish(publisher, event)
        await publish(publisher, event)  # the worker retried after a lost acknowledgement
        assert await effects(event) == 1

    async def test_concurrent_duplicates_are_harmless(
        self, publisher: Publisher, event: e.Event, effects: Effects
    ) -> None:
        await asyncio.gather(publish(publisher, event), publish(publisher, event))  # two workers, one row
        assert await effects(event) == 1

    # ---------------------------------------------------------------- failures

    async def test_a_peer_that_is_down_is_retryable(self, down_publisher: Publisher, event: e.Event) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RetryableError):
            await publish(down_publisher, event, timeout_s=5.0)
        assert loop.time() - started < 5.0 + SLACK_S

    async def test_a_hung_peer_is_retryable_within_the_deadline(
        self, hung_publisher: Publisher, event: e.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RetryableError):
            await asyncio.wait_for(publish(hung_publisher, event, timeout_s=DEADLINE_S), timeout=30)
        assert loop.time() - started < DEADLINE_S + SLACK_S

    async def test_a_deadline_already_passed_is_retryable_at_once(
        self, publisher: Publisher, event: e.Event, effects: Effects
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RetryableError):
            await publisher.publish(event, payload=encode_event(event), deadline=started - 1.0)
        assert loop.time() - started < SLACK_S
        await publish(publisher, event)  # the retry with a fresh deadline delivers, once
        assert await effects(event) == 1


# --------------------------------------------------------------------------- the fake


class TestFakePublisher(PublisherContract):
    __test__ = True

    @pytest.fixture
    def publisher(self) -> FakePublisher:
        return FakePublisher(Target.ACTIVITY.value)

    @pytest.fixture
    def event(self) -> e.Event:
        return event_of(e.RoomGiftSent(OWNER, "bob", "rose", 1, 10, 10))

    @pytest.fixture
    def effects(self, publisher: FakePublisher) -> Effects:
        async def count(event: e.Event) -> int:
            return publisher.delivered.count(event.event_id)

        return count

    @pytest.fixture
    def down_publisher(self) -> FakePublisher:
        fake = FakePublisher(Target.ACTIVITY.value)
        fake.down = True
        return fake

    @pytest.fixture
    def hung_publisher(self) -> FakePublisher:
        fake = FakePublisher(Target.ACTIVITY.value)
        fake.unresponsive = True
        return fake


# --------------------------------------------------------------------------- treasure_wakeup -> the database timer


def countdown(box: str = "box-1") -> e.Event:
    return event_of(
        e.RoomTreasureCountdownStarted(
            box_id=box, level=1, open_at_ms=NOW_MS + 60_000, open_command_id=treasure_open_command_id(box)
        ),
        version=3,
    )


def unreachable_database(port: int) -> Database:
    return Database.from_url(f"mysql+asyncmy://root@127.0.0.1:{port}/nothing", pool_size=1, max_overflow=0)


class TestTreasureWakeupPublisher(PublisherContract):
    __test__ = True

    @pytest.fixture
    def publisher(self, database: Database) -> TreasureWakeupPublisher:
        return TreasureWakeupPublisher(DatabaseTreasureTimer(database, clock=lambda: NOW_MS, owner="contract"))

    @pytest.fixture
    def event(self) -> e.Event:
        return countdown()

    @pytest.fixture
    def effects(self, database: Database) -> Effects:
        async def wakeups(event: e.Event) -> int:
            """The wake-ups the timer holds for the event's box (each one opens the box once)."""
            p = event.payload
            assert isinstance(p, e.RoomTreasureCountdownStarted)
            tt = t.treasure_timer
            async with database.read() as conn:
                rows = await conn.scalar(
                    sa.select(sa.func.count())
                    .select_from(tt)
                    .where(tt.c.app_code == event.app_code, tt.c.room_id == event.room_id, tt.c.box_id == p.box_id)
                )
            return int(rows or 0)

        return wakeups

    @pytest_asyncio.fixture
    async def down_publisher(self) -> AsyncIterator[TreasureWakeupPublisher]:
        db = unreachable_database(free_port())
        try:
            yield TreasureWakeupPublisher(DatabaseTreasureTimer(db, clock=lambda: NOW_MS, owner="down"))
        finally:
            await db.dispose()

    @pytest_asyncio.fixture
    async def hung_publisher(self) -> AsyncIterator[TreasureWakeupPublisher]:
        async with blackhole() as port:
            db = unreachable_database(port)
            try:
                yield TreasureWakeupPublisher(DatabaseTreasureTimer(db, clock=lambda: NOW_MS, owner="hung"))
            finally:
                await db.dispose()


# --------------------------------------------------------------------------- activity -> the reference activity service


def gift() -> e.Event:
    return event_of(e.RoomGiftSent(OWNER, "bob", "rose", 1, 10, 10))


class TestActivityPublisher(PublisherContract):
    __test__ = True

    @pytest_asyncio.fixture
    async def service(self, sqlite_database: Database) -> AsyncIterator[RunningActivityService]:
        async with running_activity_service(sqlite_database, clock=lambda: NOW_MS) as svc:
            yield svc

    @pytest_asyncio.fixture
    async def publisher(self, service: RunningActivityService) -> AsyncIterator[ActivityPublisher]:
        pub = ActivityPublisher(service.target)
        try:
            yield pub
        finally:
            await pub.close()

    @pytest.fixture
    def event(self) -> e.Event:
        return gift()

    @pytest.fixture
    def effects(self, sqlite_database: Database) -> Effects:
        async def points(event: e.Event) -> int:
            """The sender's leaderboard points, in gifts of this event's value."""
            p = event.payload
            assert isinstance(p, e.RoomGiftSent)
            board = await ActivityStore(sqlite_database).gift_leaderboard(
                event.app_code, event.room_id, day=NOW_MS // 86_400_000, board="sent", limit=10
            )
            value = sum(entry.value for entry in board if entry.user_id == p.sender_id)
            assert value % p.total_value == 0
            return value // p.total_value

        return points

    @pytest_asyncio.fixture
    async def down_publisher(self) -> AsyncIterator[ActivityPublisher]:
        pub = ActivityPublisher(f"127.0.0.1:{free_port()}")
        try:
            yield pub
        finally:
            await pub.close()

    @pytest_asyncio.fixture
    async def hung_publisher(self) -> AsyncIterator[ActivityPublisher]:
        async with blackhole() as port:
            pub = ActivityPublisher(f"127.0.0.1:{port}")
            try:
                yield pub
            finally:
                await pub.close()


# --------------------------------------------------------------------------- im -> the IM sandbox

IM_APP_ID = 1_400_000_042
IM_KEY = "contract-test-key"


def im_client(base_url: str, transport: Any = None) -> TencentImClient:
    return TencentImClient(
        base_url=base_url,
        sdk_app_id=IM_APP_ID,
        admin_identifier="administrator",
        secret_key=IM_KEY,
        request_timeout=5.0,
        transport=transport,
    )


class TestTencentImPublisher(PublisherContract):
    __test__ = True

    @pytest_asyncio.fixture
    async def sandbox(self) -> AsyncIterator[RunningSandbox]:
        async with running_sandbox(IM_APP_ID, IM_KEY, rate_limit_per_second=None) as running:
            yield running

    @pytest_asyncio.fixture
    async def publisher(self, sandbox: RunningSandbox, database: Database) -> AsyncIterator[TencentImPublisher]:
        async with im_client(sandbox.base_url, sandbox.transport()) as client:
            yield TencentImPublisher(client, SentSteps(database, clock=lambda: time.time_ns() // 1_000_000))

    @pytest_asyncio.fixture
    async def event(self, publisher: TencentImPublisher) -> e.Event:
        await publish(publisher, event_of(e.RoomCreated(owner_id=OWNER, title="Room one", seat_count=8), version=1))
        return event_of(e.RoomUserJoined(user_id="bob", role="member"))

    @pytest.fixture
    def effects(self, sandbox: RunningSandbox, publisher: TencentImPublisher) -> Effects:
        async def messages(event: e.Event) -> int:
            group = publisher.group_of(event.app_code, event.room_id)
            data = [json.loads(m.data or "{}") for m in sandbox.state.messages(group)]
            return sum(d.get("event_id") == event.event_id for d in data)

        return messages

    async def _publisher_on(self, base_url: str, database: Database) -> AsyncIterator[TencentImPublisher]:
        async with im_client(base_url) as client:
            yield TencentImPublisher(client, SentSteps(database, clock=lambda: time.time_ns() // 1_000_000))

    @pytest_asyncio.fixture
    async def down_publisher(self, database: Database) -> AsyncIterator[TencentImPublisher]:
        async for pub in self._publisher_on(f"http://127.0.0.1:{free_port()}", database):
            yield pub

    @pytest_asyncio.fixture
    async def hung_publisher(self, database: Database) -> AsyncIterator[TencentImPublisher]:
        async with blackhole() as port:
            async for pub in self._publisher_on(f"http://127.0.0.1:{port}", database):
                yield pub


# --------------------------------------------------------------------------- broker (mq/dual) and delay messages


class BrokerPublisherContract(PublisherContract):
    """The ``broker`` target is not in the routing table: mq/dual mode sends every routed event to it."""

    def test_the_suite_event_is_routed_to_the_target(self, publisher: Publisher, event: e.Event) -> None:
        assert targets_of(event.type)


class TestBrokerPublisherOnTheFakeBroker(BrokerPublisherContract):
    __test__ = True

    @pytest.fixture
    def broker(self) -> FakeBroker:
        return FakeBroker()

    @pytest.fixture
    def publisher(self, broker: FakeBroker) -> BrokerPublisher:
        return BrokerPublisher(broker, topic="hyapp_room_outbox")

    @pytest.fixture
    def event(self) -> e.Event:
        return event_of(e.RoomGiftSent(OWNER, "bob", "rose", 1, 10, 10))

    @pytest.fixture
    def effects(self, broker: FakeBroker) -> Effects:
        async def count(event: e.Event) -> int:
            return sum(m.key == event.event_id for m in broker.published)

        return count

    @pytest.fixture
    def down_publisher(self) -> BrokerPublisher:
        broker = FakeBroker()
        broker.down = True
        return BrokerPublisher(broker, topic="hyapp_room_outbox")

    @pytest.fixture
    def hung_publisher(self) -> BrokerPublisher:
        broker = FakeBroker()
        broker.hang = True
        return BrokerPublisher(broker, topic="hyapp_room_outbox")

    async def test_the_message_carries_tag_key_sharding_key_and_the_envelope(
        self, publisher: BrokerPublisher, broker: FakeBroker, event: e.Event
    ) -> None:
        await publish(publisher, event)
        (sent,) = broker.published
        assert (sent.topic, sent.tag, sent.key, sent.sharding_key) == (
            "hyapp_room_outbox",
            "RoomGiftSent",
            event.event_id,
            f"{APP}:{ROOM}",
        )
        assert decode_event(sent.body) == event


class TestTreasureWakeupByDelayMessage(PublisherContract):
    __test__ = True

    @pytest.fixture
    def broker(self) -> FakeBroker:
        return FakeBroker()

    @pytest.fixture
    def publisher(self, broker: FakeBroker) -> TreasureWakeupPublisher:
        return TreasureWakeupPublisher(
            DelayMessageScheduler(broker, topic="hyapp_room_treasure_open", publish_timeout_s=5)
        )

    @pytest.fixture
    def event(self) -> e.Event:
        return countdown()

    @pytest.fixture
    def effects(self, broker: FakeBroker) -> Effects:
        async def count(event: e.Event) -> int:
            return len(broker.published)

        return count

    @pytest.fixture
    def down_publisher(self) -> TreasureWakeupPublisher:
        broker = FakeBroker()
        broker.down = True
        return TreasureWakeupPublisher(DelayMessageScheduler(broker, topic="t", publish_timeout_s=5))

    @pytest.fixture
    def hung_publisher(self) -> TreasureWakeupPublisher:
        broker = FakeBroker()
        broker.hang = True
        return TreasureWakeupPublisher(DelayMessageScheduler(broker, topic="t", publish_timeout_s=5))

    async def test_the_wakeup_is_held_until_open_at_and_carries_what_the_room_needs(
        self, publisher: TreasureWakeupPublisher, broker: FakeBroker, event: e.Event
    ) -> None:
        await publish(publisher, event)
        (sent,) = broker.published
        assert isinstance(event.payload, e.RoomTreasureCountdownStarted)
        assert sent.deliver_at_ms == event.payload.open_at_ms
        assert TreasureWakeup.decode(sent.body) == TreasureWakeup(
            app_code=APP,
            room_id=ROOM,
            box_id="box-1",
            level=1,
            open_at_ms=event.payload.open_at_ms,
            command_id=treasure_open_command_id("box-1"),
        )
