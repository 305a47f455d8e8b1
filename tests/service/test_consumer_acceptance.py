"""Issue 9's acceptance rows on the real brokers (embedded, and a real NATS server), through the real consumer
runtime and groups: duplicates (a redelivery after a kill, and a re-published event), a poison message at a
consumer, and Tencent IM down behind the IM bridge. The per-handler tests (tests/consumers) run the same rules on
the in-memory FakeBroker; these check that the brokers' redelivery, dead letters and replay keep them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import nats
import sqlalchemy as sa
from structlog.testing import capture_logs
from tests.service.helpers import (
    ACTIVITY,
    APP,
    GROUPS,
    IM_BRIDGE,
    NOTICE,
    OUTBOX_TOPIC,
    TREASURE_OPEN,
    count,
    im_types,
    lag_is_zero,
    notices,
    run,
)
from tests.service.test_consumer_groups import sent_board
from tests.service.test_mq_mode import all_delivered, eventually

from roomservice.admin.dead_letters import DeadLetterAdmin
from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap import Process
from roomservice.bootstrap.broker import consumer_groups
from roomservice.brokers import nats as nats_adapter
from roomservice.brokers.port import Delivery, OutgoingMessage
from roomservice.consumers.runtime import Outcome
from roomservice.domain import commands as c
from roomservice.outbox.policy import RetryPolicy
from roomservice.store import tables as t

FAST = RetryPolicy(initial_backoff_ms=20, max_backoff_ms=50, max_retry_count=1 << 30, jitter=0.0)
# the shutdown lets deliveries in flight finish for the publish timeout, then cancels them (no ack); a
# delivery not acked comes back after consumers.visibility_timeout (by default max(5 s, twice the publish timeout))
QUICK_SHUTDOWN = {"outbox_worker.publish_timeout": "1s", "consumers.visibility_timeout": "1s"}


def retry_quickly(rt: Process, policy: RetryPolicy = FAST) -> None:
    """Every group's nack backoff (not a configuration key: the runtime's default, 1 s doubling) made short."""
    assert rt.consumers is not None
    for runner in rt.consumers.runners:
        runner.options = dataclasses.replace(runner.options, backoff=policy)


Handle = Callable[[Delivery], Any]


def wrap(rt: Process, group: str, wrapper: Callable[[Handle, Delivery], Any]) -> None:
    """Route the group's deliveries through ``wrapper(real_handle, delivery)``, in the running group."""
    assert rt.consumers is not None
    handler = rt.consumers.runner(group).handler
    real = handler.handle

    async def handle(delivery: Delivery) -> Outcome:
        return await wrapper(real, delivery)  # type: ignore[no-any-return]

    handler.handle = handle  # type: ignore[method-assign]


async def dead_letters(rt: Process, group: str) -> int:
    assert rt.broker is not None
    return (await rt.broker.group_stats(OUTBOX_TOPIC, group)).dead_letters


def dead_letter_admin(rt: Process) -> DeadLetterAdmin:
    """The admin replay path (``room-service broker replay``, the console) on this process's broker."""
    assert rt.broker is not None
    return DeadLetterAdmin(rt.broker, consumer_groups(rt.settings), audit=OutboxAdmin(rt.db, clock=rt.service.clock))


async def outbox_row(rt: Process, room: str, event_type: str) -> Any:
    async with rt.db.read() as conn:
        query = sa.select(t.room_outbox).where(
            t.room_outbox.c.room_id == room, t.room_outbox.c.event_type == event_type
        )
        return (await conn.execute(query)).one()


async def republish(rt: Process, row: Any) -> None:
    """The outbox's event published again with its event_id: through the port (inside the broker's duplicate
    window: stored once), and on NATS also as a message of its own, as after the window (the group must dedup)."""
    assert rt.broker is not None
    message = OutgoingMessage(
        topic=OUTBOX_TOPIC,
        body=row.payload,
        key=row.event_id,
        tag=row.event_type,
        sharding_key=f"{APP}:{row.room_id}",
    )
    await rt.broker.publish(message, timeout_s=5)
    if isinstance(rt.broker, nats_adapter.NatsBroker):
        headers = {
            nats_adapter.H_KEY: row.event_id,
            nats_adapter.H_TAG: row.event_type,
            nats_adapter.H_SHARDING_KEY: message.sharding_key,
            nats_adapter.H_PUBLISHED_AT: str(rt.service.clock()),
            "Nats-Msg-Id": f"{row.event_id}:after-the-window",
        }
        nc = await nats.connect(rt.settings.broker.nats.url)
        try:
            await nc.jetstream().publish(rt.broker.subject(OUTBOX_TOPIC), row.payload, headers=headers)
        finally:
            await nc.close()


async def test_a_redelivery_after_a_kill_and_a_republished_event_apply_nothing_twice(
    topology: Callable[..., Any],
) -> None:
    # each group is killed right after its effect, before its ack: activity after the leaderboard points of
    # the gift, notice after the kicked user's C2C notice, the IM bridge after the gift's IM message,
    # treasure-open after the box opened by its wake-up (any of its deliveries: wake-ups are all it gets)
    killed_at = {ACTIVITY: "RoomGiftSent", NOTICE: "RoomUserKicked", IM_BRIDGE: "RoomGiftSent", TREASURE_OPEN: ""}
    killed: set[str] = set()
    async with topology(**QUICK_SHUTDOWN) as rt:
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="dup"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await run(rt, "r1", "c3", c.JoinRoom(user_id="carol"))
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the room's first events consumed")
        for group, tag in killed_at.items():

            async def effect_then_die(real: Handle, d: Delivery, group: str = group, tag: str = tag) -> Outcome:
                outcome: Outcome = await real(d)
                if d.tag == tag or not tag:
                    killed.add(group)
                    await asyncio.Event().wait()  # the process dies here: no ack, no nack
                return outcome

            wrap(rt, group, effect_then_die)
        await run(rt, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rocket", count=1))
        await run(rt, "r1", "k1", c.KickUser(operator_id="alice", target_id="carol"))

        async def all_killed() -> bool:
            return killed == set(killed_at)

        await eventually(all_killed, what="every group applied its effect and hangs before the ack")
        assert await sent_board(rt, "r1") == [("bob", 1000)]  # the effects happened
        assert (await rt.service.room(APP, "r1"))["treasure"]["level"] == 1
    async with topology(**QUICK_SHUTDOWN) as rt:  # started again: the unacked deliveries come back
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the redeliveries settled")
        assert rt.consumers is not None
        for group in killed_at:
            counts = rt.consumers.runner(group).counts
            assert counts.redelivered >= 1 and counts.duplicates >= 1, (group, counts)
        await eventually(lambda: all_delivered(rt), what="rows delivered")
        outbox_groups = (ACTIVITY, NOTICE, IM_BRIDGE)
        before = {g: rt.consumers.runner(g).counts.duplicates for g in outbox_groups}
        await republish(rt, await outbox_row(rt, "r1", "RoomGiftSent"))
        await republish(rt, await outbox_row(rt, "r1", "RoomUserKicked"))
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the re-published events settled")
        if rt.broker is not None and rt.broker.name == "nats":  # the copies after the window reached every group
            await eventually(lambda: _seen_again(rt, before), what="each group saw the copies as duplicates")
        assert await sent_board(rt, "r1") == [("bob", 1000)]
        assert await notices(rt) == [("carol", "sent")]
        assert rt.sandbox is not None and len(rt.sandbox.state.c2c_messages("carol")) == 1
        types = im_types(rt, "r1")
        assert [types.count(k) for k in ("RoomGiftSent", "RoomUserKicked", "RoomTreasureOpened")] == [1, 1, 1]
        opened = await count(rt, t.room_command_log, t.room_command_log.c.command_type == "OpenTreasure")
        assert opened == 1


async def _seen_again(rt: Process, before: dict[str, int]) -> bool:
    assert rt.consumers is not None
    return all(rt.consumers.runner(g).counts.duplicates >= n + 2 for g, n in before.items())


async def test_a_poison_message_is_dead_lettered_after_the_limit_and_applied_once_replayed(
    topology: Callable[..., Any],
) -> None:
    poison_room = f"{APP}:poison"
    broken = True

    async def fails_in_the_poison_room(real: Handle, d: Delivery) -> Outcome:
        if broken and d.sharding_key == poison_room and d.tag == "RoomGiftSent":
            raise RuntimeError("the activity store refuses this event")
        return await real(d)  # type: ignore[no-any-return]

    async with topology(**{"rocketmq.room_outbox.consumer_max_reconsume_times": 2}) as rt:  # 3 deliveries
        retry_quickly(rt)
        wrap(rt, ACTIVITY, fails_in_the_poison_room)
        for room in ("r1", "poison"):
            await run(rt, room, f"{room}-c1", c.CreateRoom(owner_id="alice", title=room))
            await run(rt, room, f"{room}-c2", c.JoinRoom(user_id="bob"))
        with capture_logs() as logs:
            gift = await run(
                rt, "poison", "pg", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1)
            )
            for i in range(3):
                await run(rt, "r1", f"g{i}", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))

            async def dead_lettered() -> bool:
                return await dead_letters(rt, ACTIVITY) == 1

            await eventually(dead_lettered, deadline_s=30, what="the poison message in the activity dead letter")
            await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="every group went on")
        (poison_id,) = [e["event_id"] for e in gift["events"] if e["type"] == "RoomGiftSent"]
        failed = [e for e in logs if e["event"] == "consumer_delivery_failed"]
        assert [(e["key"], e["delivery_count"], e["dead_letter"]) for e in failed] == [
            (poison_id, 1, False),
            (poison_id, 2, False),
            (poison_id, 3, True),
        ]  # one line per delivery, nothing else failed
        assert await sent_board(rt, "r1") == [("bob", 30)]  # the other messages of the group
        assert await sent_board(rt, "poison") == []
        assert im_types(rt, "poison").count("RoomGiftSent") == 1  # the other groups applied the poison event
        assert [await dead_letters(rt, g) for g in (NOTICE, IM_BRIDGE)] == [0, 0]

        broken = False  # fixed: the operator replays the dead letter
        admin = dead_letter_admin(rt)
        (letter,) = await admin.dead_letters(ACTIVITY)
        assert (letter.key, letter.delivery_count) == (poison_id, 3)
        report = await admin.replay(ACTIVITY, [letter.message_id], actor="test")
        assert report.replayed == (letter.message_id,)

        async def replayed_and_applied() -> bool:
            return await sent_board(rt, "poison") == [("bob", 10)] and await lag_is_zero(rt)

        await eventually(replayed_and_applied, deadline_s=30, what="the replayed dead letter applied")
        assert await dead_letters(rt, ACTIVITY) == 0
        assert await sent_board(rt, "poison") == [("bob", 10)]  # once
        assert await sent_board(rt, "r1") == [("bob", 30)]
        assert im_types(rt, "poison").count("RoomGiftSent") == 1  # the replay went to the activity group only


async def test_an_undecodable_message_is_dead_lettered_in_each_group_and_holds_up_nothing(
    topology: Callable[..., Any],
) -> None:
    """Every group that takes its type (its tag) dead-letters it; the notice group, which takes only
    kicks, acknowledges it by its tag without reading the body."""
    outbox_groups = (ACTIVITY, IM_BRIDGE)
    async with topology(**{"rocketmq.room_outbox.consumer_max_reconsume_times": 2}) as rt:  # 3 deliveries
        retry_quickly(rt)
        assert rt.broker is not None
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="garbage"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the room's first events consumed")
        garbage = OutgoingMessage(
            topic=OUTBOX_TOPIC,
            body=b"\xff not an envelope",
            key="garbage-1",
            tag="RoomGiftSent",
            sharding_key=f"{APP}:r1",
        )
        with capture_logs() as logs:
            await rt.broker.publish(garbage, timeout_s=5)
            await run(rt, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))

            async def dead_lettered_everywhere() -> bool:
                counts = [await dead_letters(rt, g) for g in (*outbox_groups, NOTICE)]
                return counts == [1, 1, 0] and await lag_is_zero(rt)

            await eventually(dead_lettered_everywhere, deadline_s=30, what="the garbage in each group's dead letter")
        failed = [e for e in logs if e["event"] == "consumer_delivery_failed"]
        for group in outbox_groups:  # one line per delivery, the last one saying it went to the dead letter
            lines = [(e["key"], e["delivery_count"], e["dead_letter"]) for e in failed if e["group"] == group]
            assert lines == [("garbage-1", 1, False), ("garbage-1", 2, False), ("garbage-1", 3, True)], group
        assert len(failed) == 6  # nothing else failed, and nothing in the notice group
        assert await sent_board(rt, "r1") == [("bob", 10)]  # the room's next event went through every group
        assert im_types(rt, "r1").count("RoomGiftSent") == 1
        (letter,) = await dead_letter_admin(rt).dead_letters(IM_BRIDGE)
        assert (letter.key, letter.delivery_count) == ("garbage-1", 3) and letter.reason


async def test_im_down_commands_succeed_the_bridge_retries_and_what_outlasts_the_horizon_is_replayable(
    topology: Callable[..., Any],
) -> None:
    # 6 deliveries 200 ms apart: IM back a poll after the first failure is well within the horizon
    horizon = RetryPolicy(initial_backoff_ms=200, max_backoff_ms=200, max_retry_count=1 << 30, jitter=0.0)
    overrides = {"rocketmq.room_outbox.consumer_max_reconsume_times": 5, "tencent_im.request_timeout": "1s"}
    async with topology(**overrides) as rt:
        retry_quickly(rt, horizon)
        assert rt.sandbox is not None and rt.consumers is not None
        im = rt.sandbox.state
        bridge = rt.consumers.runner(IM_BRIDGE).counts
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="im down"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the room's first events consumed")

        im.set_outage("http_503")
        for i in range(2):  # commands never wait for IM
            await run(rt, "r1", f"g{i}", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))

        async def retrying() -> bool:
            return bridge.failures >= 1

        await eventually(retrying, what="the bridge failing and retrying")
        im.set_outage(None)  # back within the horizon
        await eventually(lambda: lag_is_zero(rt), deadline_s=30, what="the bridge caught up")
        assert im_types(rt, "r1").count("RoomGiftSent") == 2
        assert await dead_letters(rt, IM_BRIDGE) == 0

        im.set_outage("http_503")  # longer than the horizon this time
        await run(rt, "r1", "g9", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1))

        async def outlasted() -> bool:
            return await dead_letters(rt, IM_BRIDGE) == 1

        await eventually(outlasted, deadline_s=30, what="the gift in the bridge's dead letter")
        im.set_outage(None)
        assert im_types(rt, "r1").count("RoomGiftSent") == 2
        assert await sent_board(rt, "r1") == [("bob", 30)]  # the other groups did not wait for IM
        report = await dead_letter_admin(rt).replay(IM_BRIDGE, None, actor="test")
        assert len(report.replayed) == 1

        async def reached_im() -> bool:
            return im_types(rt, "r1").count("RoomGiftSent") == 3 and await lag_is_zero(rt, GROUPS)

        await eventually(reached_im, deadline_s=30, what="the replayed gift in IM")
        assert im_types(rt, "r1").count("RoomGiftSent") == 3  # each once
        assert await dead_letters(rt, IM_BRIDGE) == 0
