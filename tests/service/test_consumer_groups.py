"""The seed's production topology in one process: mq mode with the activity, notice, IM-bridge and
treasure-open groups, on the embedded broker and on real NATS JetStream (issue 9's acceptance, seed rows 4 and 6)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.service.helpers import ACTIVITY, APP, GROUPS, IM_BRIDGE, NOTICE, im_types, lag, lag_is_zero, notices, run
from tests.service.test_mq_mode import all_delivered, eventually

from roomservice.activity.store import ActivityStore
from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.domain.state import utc_day


async def test_every_group_applies_every_event_meant_for_it_once(topology: Callable[..., Any]) -> None:
    async with topology() as rt:
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
        assert await notices(rt) == [("carol", "sent")]
        assert rt.sandbox is not None
        assert len(rt.sandbox.state.c2c_messages("carol")) == 1
        types = im_types(rt, "r1")
        assert types.count("RoomGiftSent") == 1 and types.count("RoomUserKicked") == 1
        assert types.index("RoomUserJoined") < types.index("RoomGiftSent")  # an order that makes sense


async def test_a_stopped_group_catches_up_with_no_loss_and_no_duplicate(topology: Callable[..., Any]) -> None:
    async with topology(**{"consumers.activity.enabled": False}) as rt:  # the activity group is down
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="lag"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await run(rt, "r1", "c3", c.JoinRoom(user_id="carol"))
        for i in range(3):
            await run(rt, "r1", f"g{i}", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))
        await run(rt, "r1", "k1", c.KickUser(operator_id="alice", target_id="carol"))
        await eventually(lambda: all_delivered(rt), what="room_outbox delivered while the group is down")
        assert rt.broker is not None
        await rt.broker.declare_group("hyapp_room_outbox", ACTIVITY, max_deliveries=17)
        # the other groups go on meanwhile: the notice and the IM bridge applied every event meant for them
        await eventually(lambda: lag_is_zero(rt, (NOTICE, IM_BRIDGE)), deadline_s=30, what="the other groups")
        assert await notices(rt) == [("carol", "sent")]
        assert rt.sandbox is not None and len(rt.sandbox.state.c2c_messages("carol")) == 1
        assert im_types(rt, "r1").count("RoomGiftSent") == 3 and im_types(rt, "r1").count("RoomUserKicked") == 1
        assert await lag(rt, ACTIVITY) >= 7
        assert await sent_board(rt, "r1") == []  # nothing applied the activity group's events
        assert await all_delivered(rt)  # the rows stay delivered: the broker holds the backlog
    async with topology() as rt:  # started again: it catches up
        await eventually(lambda: lag_is_zero(rt, (ACTIVITY,)), deadline_s=30, what="the activity group caught up")
        assert await sent_board(rt, "r1") == [("bob", 30)]
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="every group caught up")
        assert await notices(rt) == [("carol", "sent")]  # the restart applied nothing twice elsewhere
        assert rt.sandbox is not None and len(rt.sandbox.state.c2c_messages("carol")) == 1
        assert im_types(rt, "r1").count("RoomGiftSent") == 3


async def sent_board(rt: Process, room: str) -> list[tuple[str, int]]:
    day = utc_day(rt.service.clock())
    board = await ActivityStore(rt.db).gift_leaderboard(app_code=APP, room_id=room, day=day, board="sent", limit=10)
    return [(entry.user_id, entry.value) for entry in board]
