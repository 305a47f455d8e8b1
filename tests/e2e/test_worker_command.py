"""`room-service worker` as its own process: claims rows, schedules wake-ups, stops gracefully."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.e2e.server import write_config

from roomservice.domain import events as e
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

pytestmark = pytest.mark.slow


async def test_worker_command_processes_rows_and_stops_on_sigterm(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/room.db"
    db = Database.from_url(url)
    now = time.time_ns() // 1_000_000
    box = e.RoomTreasureCountdownStarted(
        box_id="20990101-1", level=1, open_at_ms=now + 3_600_000, open_command_id="treasure-open:20990101-1"
    )
    ev = e.Event(uuid.uuid4().hex, "demo", "r1", 7, now, box)
    await upgrade(db)
    async with db.write() as conn:
        await conn.execute(
            sa.insert(t.room_outbox).values(
                event_id=ev.event_id, app_code="demo", room_id="r1", room_version=7, event_type=ev.type,
                payload=encode_event(ev), status="pending", retry_count=0, targets_done="",
                due_at_ms=now, created_at_ms=now, updated_at_ms=now,
            )
        )
    config = write_config(tmp_path / "c.yaml", database_url=url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "roomservice.cli", "worker", "--config", str(config), "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            async with db.read() as conn:
                row = (await conn.execute(sa.select(t.room_outbox))).one()
                timers = (await conn.execute(sa.select(t.treasure_timer))).all()
            if "treasure_wakeup" in row.targets_done.split(",") and timers:
                break
            assert time.monotonic() < deadline, "the worker never scheduled the wake-up"
            await asyncio.sleep(0.1)
        # the wake-up target is recorded on the row, so a retry will not schedule it again
        assert [(tm.box_id, tm.status, tm.fire_at_ms) for tm in timers] == [("20990101-1", "scheduled", box.open_at_ms)]
        # the IM target (the worker's in-process sandbox has no group for this made-up room) is not done
        assert "im" not in row.targets_done.split(",")
        assert row.status != "delivered"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        await db.dispose()
    assert code == 0


def test_worker_command_refuses_a_disabled_worker(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", extra="outbox_worker: {enabled: false}\n")
    result = subprocess.run(
        [sys.executable, "-m", "roomservice.cli", "worker", "--config", str(config), "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "outbox_worker.enabled is false" in result.stderr
