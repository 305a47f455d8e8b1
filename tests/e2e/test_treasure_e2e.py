"""The treasure wake-up through real processes: outbox row -> durable timer or delay message -> OpenTreasure.

A countdown is committed over HTTP, the server is killed (-9) before the box
is due, and after a restart the box still opens, exactly once: from the
durable database timer, or from a delay message on the embedded broker or on
NATS JetStream (``rocketmq.treasure_open.enabled``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from tests.e2e.server import ServerProcess, write_config

from roomservice.store import tables as t
from roomservice.store.database import Database

pytestmark = pytest.mark.slow

FAST_TREASURE = """
treasure: {levels: [10, 20], countdown_seconds: 2}
outbox_worker: {poll_interval: "200ms", initial_backoff: "200ms", max_backoff: "1s", publish_timeout: "500ms",
                lock_timeout: "1s"}
"""
BASE = "/v1/apps/demo/rooms"


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def _wait_for_level(http: httpx.AsyncClient, level: int, *, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = (await http.get(f"{BASE}/r1")).json()
        if view["treasure"]["level"] >= level:
            return view
        assert time.monotonic() < deadline, f"box never opened: {view['treasure']}"
        await asyncio.sleep(0.1)


DELAY_MESSAGES = """
rocketmq: {treasure_open: {enabled: true}}
"""


def nats_broker() -> str:
    """The shared NATS, under a stream and subject namespace of this test alone (subjects may not overlap)."""
    tag = secrets.token_hex(4)
    return f"""
broker: {{driver: nats, nats: {{url: "nats://127.0.0.1:4222", stream: "e2e_{tag}"}}}}
rocketmq: {{namespace: "e2e{tag}", treasure_open: {{enabled: true}}}}
"""


@pytest.mark.parametrize("wakeup", ["database_timer", "embedded_broker", "nats"])
async def test_box_opens_once_after_a_kill_before_it_is_due(tmp_path: Path, wakeup: str, require_service: Any) -> None:
    extra = FAST_TREASURE
    if wakeup == "embedded_broker":
        extra += DELAY_MESSAGES
    if wakeup == "nats":
        require_service("NATS", "127.0.0.1", 4222)
        extra += nats_broker()
    server = ServerProcess(config=write_config(tmp_path / "c.yaml", extra=extra), data_dir=tmp_path / "data")
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            await _post(http, BASE, {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "t"})
            await _post(http, f"{BASE}/r1/join", {"command_id": "c2", "user_id": "bob"})
            body = await _post(
                http,
                f"{BASE}/r1/gifts",
                {"command_id": "c3", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 1},
            )
            assert [e["type"] for e in body["events"]] == ["RoomGiftSent", "RoomTreasureCountdownStarted"]
            open_at = body["room"]["treasure"]["open_at_ms"]
        server.kill()  # before open_at_ms; the wake-up lives only in the database
        assert time.time() * 1000 < open_at
        server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            # the kill may land while the countdown row is claimed: it comes back after its lease
            view = await _wait_for_level(http, 1, timeout_s=60)
            assert time.time() * 1000 >= open_at
            assert view["treasure"]["state"] == "idle"
            assert [m["user_id"] for m in view["members"]] == ["alice", "bob"]
    finally:
        server.stop()

    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/data/room.db")
    try:
        async with db.read() as conn:
            opened = (
                await conn.execute(
                    sa.select(t.room_command_log.c.events).where(t.room_command_log.c.command_type == "OpenTreasure")
                )
            ).all()
            timers = (await conn.execute(sa.select(t.treasure_timer.c.status))).all()
    finally:
        await db.dispose()
    opened_events = [ev["type"] for (events,) in opened for ev in json.loads(events)]
    assert opened_events == ["RoomTreasureOpened"]  # opened exactly once
    assert [s for (s,) in timers] == ([] if wakeup != "database_timer" else ["fired"])
