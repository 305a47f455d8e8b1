"""Repair replay end to end (issue 7, item 1.4): a repaired dead letter must not apply any effect twice.

The outbox worker delivers to the real targets — the Tencent IM publisher against
the IM sandbox, the activity publisher against the reference activity service
over loopback gRPC — on SQLite and MariaDB; only the broker is a recording
stand-in (there is no broker adapter yet), so that an original can fail there
alone in dual mode. The leaderboard and the sandbox's group messages are the
effects that must happen once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest_asyncio
import sqlalchemy as sa
from tests.service.conftest import T0, Clock

from roomservice import wire
from roomservice.activity.service import running_activity_service
from roomservice.activity.store import ActivityStore
from roomservice.admin.operations import OutboxAdmin
from roomservice.domain import events as e
from roomservice.domain.state import utc_day
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient, group_id_for
from roomservice.outbox.model import BROKER, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.activity import ActivityPublisher
from roomservice.publishers.fake import FakePublisher
from roomservice.publishers.port import PermanentError, Publisher, PublisherSet
from roomservice.publishers.tencent_im import SentSteps, TencentImPublisher
from roomservice.store import tables as t
from roomservice.store.database import Database

APP_ID, KEY = 1_400_000_077, "repair-test-key"
APP, ROOM = "demo", "r1"
GROUP = group_id_for(APP, ROOM, group_type="AVChatRoom")


class RecordingBroker:
    """The ``broker`` target: keeps every envelope it accepts; ``down`` makes it reject permanently."""

    name = BROKER

    def __init__(self) -> None:
        self.down = False
        self.received: list[e.Event] = []

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        if self.down:
            raise PermanentError("broker rejects everything")
        self.received.append(wire.decode_event(payload))  # what a consumer would decode


class Counting:
    """A target as the worker sees it, noting which event ids it was handed."""

    def __init__(self, inner: Publisher, calls: dict[str, list[str]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = calls

    async def publish(self, event: e.Event, *, payload: bytes, deadline: float) -> None:
        self.calls.setdefault(self.name, []).append(event.event_id)
        await self.inner.publish(event, payload=payload, deadline=deadline)


@dataclass
class Rig:
    database: Database
    clock: Clock
    admin: OutboxAdmin
    im: TencentImPublisher
    activity: ActivityPublisher
    broker: RecordingBroker
    sandbox: RunningSandbox
    calls: dict[str, list[str]] = field(default_factory=dict)  # target -> event ids the worker handed it

    def worker(self, mode: PublishMode, **replace: Publisher) -> OutboxWorker:
        targets: dict[str, Publisher] = {"im": self.im, "activity": self.activity, BROKER: self.broker}
        targets.update(replace)
        return OutboxWorker(
            repository=SqlOutboxRepository(self.database),
            publishers=PublisherSet({name: Counting(p, self.calls) for name, p in targets.items()}),
            policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=8_000, max_retry_count=5, jitter=0),
            options=WorkerOptions(mode=mode),
            clock=self.clock,
        )

    async def board(self) -> list[tuple[str, int]]:
        entries = await ActivityStore(self.database).gift_leaderboard(
            APP, ROOM, day=utc_day(T0), board="sent", limit=10
        )
        return [(entry.user_id, entry.value) for entry in entries]

    def im_messages(self) -> int:
        return len(self.sandbox.state.messages(GROUP))

    async def row(self, event_id: str) -> sa.Row[tuple[object, ...]]:
        async with self.database.read() as conn:
            return (await conn.execute(sa.select(t.room_outbox).where(t.room_outbox.c.event_id == event_id))).one()

    async def enqueue(self, event: e.Event) -> None:
        now = self.clock()
        async with self.database.write() as conn:
            await conn.execute(
                sa.insert(t.room_outbox),
                [
                    {
                        "event_id": event.event_id,
                        "app_code": event.app_code,
                        "room_id": event.room_id,
                        "room_version": event.room_version,
                        "event_type": event.type,
                        "payload": wire.encode_event(event),
                        "status": "pending",
                        "retry_count": 0,
                        "targets_done": "",
                        "due_at_ms": now,
                        "created_at_ms": now,
                        "updated_at_ms": now,
                    }
                ],
            )

    async def repair(self, event_id: str, targets: list[str] | None = None) -> str:
        report = await self.admin.replay([event_id], actor="ops", as_repair=True, targets=targets)
        (outcome,) = report.outcomes
        assert outcome.result == "replayed", outcome.message
        assert outcome.new_event_id is not None
        return outcome.new_event_id


@pytest_asyncio.fixture
async def rig(database: Database) -> AsyncIterator[Rig]:
    clock = Clock()
    async with (
        running_sandbox(APP_ID, KEY, rate_limit_per_second=None) as sandbox,
        running_activity_service(database, clock=clock) as service,
        TencentImClient(
            base_url=sandbox.base_url,
            sdk_app_id=APP_ID,
            admin_identifier="administrator",
            secret_key=KEY,
            request_timeout=5.0,
            transport=sandbox.transport(),
        ) as client,
    ):
        im = TencentImPublisher(client, SentSteps(database, clock=clock))
        activity = ActivityPublisher(service.target)
        try:
            await im.ensure_group(app_code=APP, room_id=ROOM, owner_id="alice", title="Room one")
            yield Rig(database, clock, OutboxAdmin(database, clock=clock), im, activity, RecordingBroker(), sandbox)
        finally:
            await activity.close()


def gift(value: int = 30) -> e.Event:
    payload = e.RoomGiftSent(
        sender_id="alice", receiver_id="bob", gift_id="rose", count=3, unit_price=10, total_value=value
    )
    return e.Event(uuid.uuid4().hex, APP, ROOM, 2, T0 - 1_000, payload)


async def failed_only_at_broker(rig: Rig) -> e.Event:
    """A gift that reached IM and activity and then died at the broker (dual mode)."""
    original = gift()
    await rig.enqueue(original)
    rig.broker.down = True
    assert await rig.worker(PublishMode.DUAL).run_once() == 1
    row = await rig.row(original.event_id)
    assert (row.status, row.targets_done) == ("failed", "activity,im")
    assert await rig.board() == [("alice", 30)]
    assert rig.im_messages() == 1
    rig.broker.down = False
    rig.calls.clear()
    return original


async def test_a_default_repair_goes_only_where_the_original_had_not_arrived(rig: Rig) -> None:
    original = await failed_only_at_broker(rig)
    repair_id = await rig.repair(original.event_id)

    assert await rig.worker(PublishMode.DUAL).run_once() == 1
    assert (await rig.row(repair_id)).status == "delivered"
    assert rig.calls == {BROKER: [repair_id]}  # was im, activity and broker
    assert await rig.board() == [("alice", 30)]  # was 60: the repair went to activity again
    assert rig.im_messages() == 1  # was 2: and to IM again
    (sent,) = rig.broker.received
    assert (sent.event_id, sent.repair_of, sent.payload) == (repair_id, original.event_id, original.payload)
    stored = wire.decode_event((await rig.row(repair_id)).payload)
    assert (stored.event_id, stored.repair_of) == (repair_id, original.event_id)


async def test_a_repair_sent_where_the_original_arrived_has_no_second_effect(rig: Rig) -> None:
    original = await failed_only_at_broker(rig)
    repair_id = await rig.repair(original.event_id, targets=["activity", "im"])

    assert await rig.worker(PublishMode.DUAL).run_once() == 1
    assert (await rig.row(repair_id)).status == "delivered"
    assert rig.calls == {"activity": [repair_id], "im": [repair_id]}  # not named: not sent to the broker
    assert await rig.board() == [("alice", 30)]  # the activity service dedups on the original id
    assert rig.im_messages() == 1  # the IM sent record too
    assert await rig.im.steps.done(repair_id) == set()  # recorded under the original only
    assert await rig.im.steps.done(original.event_id) == {"message"}


async def test_a_repair_of_a_gift_lost_at_activity_applies_it_once(rig: Rig) -> None:
    original = gift()
    await rig.enqueue(original)
    refusing = FakePublisher("activity")
    refusing.permanent = True
    assert await rig.worker(PublishMode.DIRECT, activity=refusing).run_once() == 1
    row = await rig.row(original.event_id)
    assert (row.status, row.targets_done) == ("failed", "im")
    assert await rig.board() == []
    assert rig.im_messages() == 1
    rig.calls.clear()

    repair_id = await rig.repair(original.event_id)
    assert await rig.worker(PublishMode.DIRECT).run_once() == 1
    assert (await rig.row(repair_id)).status == "delivered"
    assert rig.calls == {"activity": [repair_id]}
    assert await rig.board() == [("alice", 30)]
    assert rig.im_messages() == 1

    # the original turning up after all (a late retry, a broker redelivery) is a duplicate
    deadline = asyncio.get_running_loop().time() + 5
    await rig.activity.publish(original, payload=wire.encode_event(original), deadline=deadline)
    assert await rig.board() == [("alice", 30)]
