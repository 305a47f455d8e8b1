"""``room-service activity leaderboard`` reads what the activity effects wrote; ``activity serve`` forgets old ids."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.service.test_dedup_retention import DAY, kept, seed
from typer.testing import CliRunner

from roomservice.activity.store import ActivityStore
from roomservice.cli.main import app
from roomservice.clock import wall_clock_ms
from roomservice.domain import events as e
from roomservice.domain.state import utc_day
from roomservice.store.migrate import opened_database


def test_the_leaderboard_shows_a_received_gift(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    now = wall_clock_ms()

    async def seed() -> None:
        async with opened_database(f"sqlite+aiosqlite:///{data}/room.db", migrate=True) as db:
            event = e.Event(
                event_id="e1",
                app_code="demo",
                room_id="r1",
                room_version=3,
                occurred_at_ms=now,
                payload=e.RoomGiftSent("bob", "alice", "rocket", 2, 1000, 2000),
            )
            assert await ActivityStore(db).handle(event)

    asyncio.run(seed())
    result = CliRunner().invoke(app, ["activity", "leaderboard", "demo", "r1", "--data-dir", str(data), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == '[{"user_id": "alice", "value": 2000}]'
    day = utc_day(now)
    result = CliRunner().invoke(
        app, ["activity", "leaderboard", "demo", "r1", "--board", "sent", "--day", str(day), "--data-dir", str(data)]
    )
    assert result.exit_code == 0 and "1. bob  2000" in result.stdout


def test_a_data_dir_without_a_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["activity", "leaderboard", "demo", "r1", "--data-dir", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no database at" in result.stderr
    assert not (tmp_path / "none").exists()


def test_activity_serve_forgets_old_processed_events(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    url = f"sqlite+aiosqlite:///{data}/room.db"
    now = wall_clock_ms()

    async def prepare() -> None:
        async with opened_database(url, migrate=True) as db:
            await seed(db, old=now - 31 * DAY, new=now - 29 * DAY)

    async def processed() -> list[str]:
        async with opened_database(url, migrate=False) as db:
            return (await kept(db))["activity"]

    asyncio.run(prepare())
    proc = subprocess.Popen(
        [sys.executable, "-m", "roomservice.cli", "activity", "serve", "--port", "0", "--data-dir", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 60
        while (left := asyncio.run(processed())) != ["new"]:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    async def im() -> list[str]:
        async with opened_database(url, migrate=False) as db:
            return (await kept(db))["im"]

    # the activity service sweeps its own table only
    assert asyncio.run(im()) == ["new-msg/message", "old-close/destroy", "old-msg/group", "old-msg/message"]
