"""kill -9 the server during concurrent traffic, restart, and account for every command.

Every acknowledged command must be in the recovered state, and every committed
command must have exactly its outbox rows: nothing lost, nothing extra.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from tests.e2e.server import ServerProcess, write_config

from roomservice.store import tables as t
from roomservice.store.database import Database

pytestmark = pytest.mark.slow

ROOMS = 6
CLIENTS = 24
KILL_AFTER_ACKS = 400


async def _traffic(base: str, acked: list[dict[str, Any]], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5.0) as http:

        async def client(n: int) -> None:
            i = 0
            while not stop.is_set():
                room = f"room{(n + i) % ROOMS}"
                user = f"u{n}-{i}"
                command_id = f"join-{user}"
                try:
                    resp = await http.post(
                        f"/v1/apps/crash/rooms/{room}/join", json={"command_id": command_id, "user_id": user}
                    )
                except httpx.HTTPError:
                    return  # the server died under us
                if resp.status_code == 200:
                    acked.append({"room": room, "user": user, "command_id": command_id, "body": resp.json()})
                i += 1
                if len(acked) >= KILL_AFTER_ACKS:
                    stop.set()

        await asyncio.gather(*(client(n) for n in range(CLIENTS)))


@pytest.fixture(params=["sqlite", "mariadb"])
def crash_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "sqlite":
        return None  # the embedded default: <data-dir>/room.db
    url: str = request.getfixturevalue("fresh_mariadb_url")
    return url


async def test_kill_minus_nine_loses_nothing(tmp_path: Path, crash_database_url: str | None) -> None:
    data_dir = tmp_path / "data"
    config = write_config(tmp_path / "crash.yaml", database_url=crash_database_url)
    server = ServerProcess(config=config, data_dir=data_dir)
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as http:
            for r in range(ROOMS):
                resp = await http.post(
                    "/v1/apps/crash/rooms",
                    json={"command_id": f"create-{r}", "room_id": f"room{r}", "owner_id": "owner", "title": "t"},
                )
                assert resp.status_code == 200, resp.text
        acked: list[dict[str, Any]] = []
        stop = asyncio.Event()
        traffic = asyncio.create_task(_traffic(server.url, acked, stop))
        await stop.wait()
        server.kill()  # mid-traffic: requests are in flight
        await traffic
        assert len(acked) >= KILL_AFTER_ACKS

        server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as http:
            views = {}
            for r in range(ROOMS):
                views[f"room{r}"] = (await http.get(f"/v1/apps/crash/rooms/room{r}")).json()
            # every acknowledged command is in the state ...
            for ack in acked:
                members = [m["user_id"] for m in views[ack["room"]]["members"]]
                assert ack["user"] in members, f"acknowledged {ack['command_id']} lost"
            # ... and replays with its original answer
            for ack in acked[:: max(1, len(acked) // 50)]:
                resp = await http.post(
                    f"/v1/apps/crash/rooms/{ack['room']}/join",
                    json={"command_id": ack["command_id"], "user_id": ack["user"]},
                )
                assert resp.json() == {**ack["body"], "replayed": True}
    finally:
        server.stop()

    url = crash_database_url or f"sqlite+aiosqlite:///{data_dir}/room.db"
    db = Database.from_url(url)
    try:
        async with db.read() as conn:
            log_rows = (await conn.execute(sa.select(t.room_command_log))).all()
            outbox = (await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.room_id))).all()
            meta = (await conn.execute(sa.select(t.room_meta))).all()
    finally:
        await db.dispose()
    logged_events = {e["event_id"]: row.room_id for row in log_rows for e in json.loads(row.events)}
    assert {r.event_id: r.room_id for r in outbox} == logged_events  # nothing more, nothing less
    for m in meta:
        versions = sorted({row.version for row in log_rows if row.room_id == m.room_id})
        assert versions == list(range(1, m.version + 1)), f"{m.room_id}: versions not consecutive"
        assert m.member_count == len(views[m.room_id]["members"])
