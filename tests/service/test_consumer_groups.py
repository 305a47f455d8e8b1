"""The seed's production topology in one process: mq mode with the activity, notice, IM-bridge and
treasure-open groups, on the embedded broker and on real NATS JetStream (issue 9's acceptance, seed rows 4 and 6)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from tests.service.conftest import make_settings
from tests.service.helpers import APP, run
from tests.service.test_mq_mode import all_delivered, eventually

from roomservice.activity.store import ActivityStore
from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.domain.state import utc_day
from roomservice.integrations.tencent_im.client import group_id_for
from roomservice.store import tables as t

TOPOLOGY = {
    "outbox_worker.publish_mode": "mq",
    "rocketmq.room_outbox.enabled": True,
    "rocketmq.room_outbox.tencent_im_consumer_enabled": True,
    "rocketmq.treasure_open.enabled": True,
    "consumers.activity.enabled": True,
    "consumers.notice.enabled": True,
    "treasure.countdown_seconds": 1,
}
GROUPS = ("hyapp-activity-room-outbox", "hyapp-notice-room-outbox", "hyapp-room-im-bridge", "hyapp-room-treasure-open")


@pytest.fixture(params=["embedded", "nats"])
def broker_overrides(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The embedded broker, or the shared NATS under a stream and subject namespace of this test alone."""
    if request.param == "embedded":
        yield {"broker.driver": "embedded"}
        return
    request.getfixturevalue("require_service")("NATS", "127.0.0.1", 4222)
    tag = secrets.token_hex(4)
    stream = f"cg_{tag}"
    yield {"broker.driver": "nats", "broker.nats.stream": stream, "rocketmq.namespace": f"cg{tag}"}
    asyncio.run(_drop_streams(stream))


async def _drop_streams(stream: str) -> None:
    nc = await nats.connect("nats://127.0.0.1:4222")
    try:
        for name in (stream, f"{stream}_dlq"):
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


@pytest.fixture
def started(database_url: str, tmp_path: Path, broker_overrides: dict[str, Any]) -> Callable[..., Any]:
    def start(**overrides: Any) -> Any:
        settings = make_settings(database_url, tmp_path, **{**TOPOLOGY, **broker_overrides, **overrides})
        return Process.running(settings)

    return start


def im_types(rt: Process, room: str) -> list[str]:
    assert rt.sandbox is not None
    group = group_id_for(APP, room, group_type=rt.settings.tencent_im.group_type)
    return [json.loads(m.data or "{}")["type"] for m in rt.sandbox.state.messages(group)]


async def lag_is_zero(rt: Process) -> bool:
    assert rt.broker is not None
    for group in GROUPS:
        topic = "hyapp_room_treasure_open" if group == "hyapp-room-treasure-open" else "hyapp_room_outbox"
        if (await rt.broker.group_stats(topic, group)).lag:
            return False
    return True


async def test_every_group_applies_every_event_meant_for_it_once(started: Callable[..., Any]) -> None:
    async with started() as rt:
        assert rt.consumers is not None and {r.group for r in rt.consumers.runners} == set(GROUPS)
        assert rt.worker is not None and rt.worker.publishers.names == {"broker", "treasure_wakeup"}
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="topology"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await run(rt, "r1", "c3", c.JoinRoom(user_id="carol"))
        gift = await run(rt, "r1", "c4", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rocket", count=1))
        await run(rt, "r1", "c5", c.KickUser(operator_id="alice", target_id="carol"))

        async def box_opened() -> bool:
            return (await rt.service.room(APP, "r1"))["treasure"]["level"] == 1

        await eventually(box_opened, what="the treasure box opened by its delay message")
        await eventually(lambda: all_delivered(rt), what="rows delivered to the broker")
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="every group caught up")

        assert gift["version"] == 4
        day = utc_day(rt.service.clock())
        board = await ActivityStore(rt.db).gift_leaderboard(
            app_code=APP, room_id="r1", day=day, board="received", limit=10
        )
        assert [(entry.user_id, entry.value) for entry in board] == [("alice", 1000)]
        async with rt.db.read() as conn:
            notices = (await conn.execute(sa.select(t.notice_delivery_events))).all()
        assert [(n.user_id, n.status) for n in notices] == [("carol", "sent")]
        assert rt.sandbox is not None
        assert len(rt.sandbox.state.c2c_messages("carol")) == 1
        types = im_types(rt, "r1")
        assert types.count("RoomGiftSent") == 1 and types.count("RoomUserKicked") == 1
        assert types.index("RoomUserJoined") < types.index("RoomGiftSent")  # an order that makes sense


async def test_a_stopped_group_catches_up_with_no_loss_and_no_duplicate(started: Callable[..., Any]) -> None:
    async with started(**{"consumers.activity.enabled": False}) as rt:  # the activity group is down
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="lag"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        for i in range(3):
            await run(rt, "r1", f"g{i}", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))
        await eventually(lambda: all_delivered(rt), what="room_outbox delivered while the group is down")
        assert rt.broker is not None
        await rt.broker.declare_group("hyapp_room_outbox", "hyapp-activity-room-outbox", max_deliveries=17)
        assert (await rt.broker.group_stats("hyapp_room_outbox", "hyapp-activity-room-outbox")).lag >= 5
    async with started() as rt:  # started again: it catches up

        async def caught_up() -> bool:
            assert rt.broker is not None
            return (await rt.broker.group_stats("hyapp_room_outbox", "hyapp-activity-room-outbox")).lag == 0

        await eventually(caught_up, deadline_s=30, what="the activity group caught up")
        day = utc_day(rt.service.clock())
        board = await ActivityStore(rt.db).gift_leaderboard(app_code=APP, room_id="r1", day=day, board="sent", limit=10)
        assert [(entry.user_id, entry.value) for entry in board] == [("bob", 30)]
