"""``room-service activity leaderboard`` reads what the activity effects wrote."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
