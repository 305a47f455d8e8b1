"""mq and dual mode on the embedded broker, wired as serve wires them: rows are delivered once the broker
holds the event; treasure wake-ups go through delay messages and open the box once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.service.conftest import make_settings
from tests.service.helpers import APP, count, outbox_rows, run

from roomservice.bootstrap import Process
from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.domain import commands as c
from roomservice.store import tables as t
from roomservice.wire import decode_event

MQ = {
    "outbox_worker.publish_mode": "mq",
    "rocketmq.room_outbox.enabled": True,
    "broker.driver": "embedded",
}
TREASURE = {"rocketmq.treasure_open.enabled": True, "treasure.countdown_seconds": 1}
PROBE = "probe-group"


async def eventually(check: Callable[[], Awaitable[bool]], *, deadline_s: float = 15.0, what: str = "") -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not in time: {what}")


async def all_delivered(rt: Process) -> bool:
    async with rt.db.read() as conn:
        rows = (await conn.execute(sa.select(t.room_outbox.c.status))).all()
    return bool(rows) and all(status == "delivered" for (status,) in rows)


async def chain(rt: Process, room: str = "r1") -> list[str]:
    bodies = [
        await run(rt, room, "c1", c.CreateRoom(owner_id="alice", title="mq")),
        await run(rt, room, "c2", c.JoinRoom(user_id="bob")),
        await run(rt, room, "c3", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=3)),
        await run(rt, room, "c4", c.KickUser(operator_id="alice", target_id="bob")),
    ]
    return [e["event_id"] for b in bodies for e in b["events"]]


@pytest.fixture
def started(database_url: str, tmp_path: Path) -> Callable[..., Any]:
    def start(**overrides: Any) -> Any:
        return Process.running(make_settings(database_url, tmp_path, **overrides))

    return start


async def _broker(rt: Process) -> EmbeddedBroker:
    assert isinstance(rt.broker, EmbeddedBroker)
    return rt.broker


@pytest.mark.parametrize("mode", ["mq", "dual"])
async def test_every_event_reaches_the_broker_once_with_its_tag_and_key(started: Callable[..., Any], mode: str) -> None:
    async with started(**{**MQ, "outbox_worker.publish_mode": mode}) as rt:
        broker = await _broker(rt)
        await broker.declare_group("hyapp_room_outbox", PROBE, max_deliveries=3)
        event_ids = await chain(rt)
        await eventually(lambda: all_delivered(rt), what="rows delivered")
        rows = await outbox_rows(rt, "r1")
        assert {r.event_id for r in rows} == set(event_ids)
        for row in rows:
            expected = {"broker"} | ({"im", "activity"} & set(row.targets_done.split(",")) if mode == "dual" else set())
            assert "broker" in row.targets_done.split(",") and expected <= set(row.targets_done.split(","))
        seen: dict[str, str] = {}
        while True:
            got = await broker.fetch("hyapp_room_outbox", PROBE, max_messages=50, wait_s=0.2, visibility_s=30)
            if not got:
                break
            for d in got:
                assert d.key not in seen  # stored once
                event = decode_event(d.body)
                assert (event.event_id, event.type, d.sharding_key) == (d.key, d.tag, f"{APP}:r1")
                seen[d.key] = d.tag
                await broker.ack(d)
        assert set(seen) == set(event_ids)


async def test_a_broker_outage_keeps_commands_succeeding_and_ready_degraded(started: Callable[..., Any]) -> None:
    async with started(**MQ, **{"outbox_worker.initial_backoff": "100ms", "outbox_worker.max_backoff": "200ms"}) as rt:
        broker = await _broker(rt)
        await broker.close()  # the broker refuses every call from now on
        await chain(rt)
        await eventually(lambda: _any_status(rt, "retryable"), what="rows retryable")
        ready, report = await rt.health.run()
        assert ready and report["broker"].startswith("degraded")
        assert report["database"] == "ok"


async def test_treasure_opens_once_by_delay_message(started: Callable[..., Any]) -> None:
    async with started(**MQ, **TREASURE) as rt:
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="box"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        body = await run(rt, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rocket", count=1))
        assert "RoomTreasureCountdownStarted" in [e["type"] for e in body["events"]]
        assert await count(rt, t.treasure_timer) == 0  # not the database timer

        async def opened() -> bool:
            return (await rt.service.room(APP, "r1"))["treasure"]["level"] == 1

        await eventually(opened, what="box opened")
        await eventually(lambda: all_delivered(rt), what="rows delivered")
        logged = await count(rt, t.room_command_log, t.room_command_log.c.command_type == "OpenTreasure")
        assert logged == 1


async def _any_status(rt: Process, status: str) -> bool:
    return await count(rt, t.room_outbox, t.room_outbox.c.status == status) > 0


async def test_a_consumer_killed_after_its_effect_and_before_its_ack_applies_nothing_twice(
    started: Callable[..., Any],
) -> None:
    async with started(**MQ, **TREASURE, **{"outbox_worker.publish_timeout": "1s"}) as rt:
        assert rt.consumers is not None
        handler = rt.consumers.runner("hyapp-room-treasure-open").handler
        opened_once = asyncio.Event()
        real_opener = handler.opener  # type: ignore[attr-defined]

        async def open_then_die(*args: Any) -> object:
            answer = await real_opener(*args)
            opened_once.set()
            await asyncio.Event().wait()  # the process dies here: no ack, no nack
            return answer

        handler.opener = open_then_die  # type: ignore[attr-defined]
        await run(rt, "r1", "c1", c.CreateRoom(owner_id="alice", title="box"))
        await run(rt, "r1", "c2", c.JoinRoom(user_id="bob"))
        await run(rt, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rocket", count=1))
        await asyncio.wait_for(opened_once.wait(), 15)
    async with started(**MQ, **TREASURE, **{"outbox_worker.publish_timeout": "1s"}) as rt:
        broker = await _broker(rt)

        async def redelivered_and_acked() -> bool:
            stats = await broker.group_stats("hyapp_room_treasure_open", "hyapp-room-treasure-open")
            return stats.lag == 0

        await eventually(redelivered_and_acked, deadline_s=30, what="the wake-up redelivered and acked")
        assert rt.consumers is not None
        counts = rt.consumers.runner("hyapp-room-treasure-open").counts
        assert (counts.duplicates, counts.applied) == (1, 0)  # the redelivery was a replay of the same command
        logged = await count(rt, t.room_command_log, t.room_command_log.c.command_type == "OpenTreasure")
        assert logged == 1
