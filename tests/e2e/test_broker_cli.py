"""``room-service broker …`` on the embedded default: a consumer group's dead letters listed and replayed, audited."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.brokers.port import OutgoingMessage
from roomservice.cli.main import app
from roomservice.store.migrate import opened_database

GROUP, TOPIC = "hyapp-room-im-bridge", "hyapp_room_outbox"


def test_dead_letters_are_listed_then_replayed_to_their_group_and_audited(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    data.mkdir()

    async def bury() -> None:
        async with opened_database(f"sqlite+aiosqlite:///{data}/room.db", migrate=True) as db:
            broker = EmbeddedBroker(db)
            await broker.declare_group(TOPIC, GROUP, max_deliveries=1)
            for key in ("ev-a", "ev-b"):
                await broker.publish(
                    OutgoingMessage(topic=TOPIC, body=b"x", key=key, tag="RoomUserJoined"), timeout_s=5
                )
            for delivery in await broker.fetch(TOPIC, GROUP, max_messages=10, wait_s=1, visibility_s=30):
                await broker.nack(delivery, delay_s=0, reason="IM down")

    asyncio.run(bury())
    monkeypatch.setenv("USER", "ops-kim")
    runner = CliRunner()
    listed = runner.invoke(app, ["broker", "dead-letters", GROUP, "--data-dir", str(data), "--json"])
    assert listed.exit_code == 0, listed.output
    assert sorted(d["key"] for d in json.loads(listed.stdout)) == ["ev-a", "ev-b"]
    unknown = runner.invoke(app, ["broker", "replay", "nope", "--all", "--data-dir", str(data)])
    assert unknown.exit_code == 2 and "unknown consumer group" in unknown.output
    replayed = runner.invoke(app, ["broker", "replay", GROUP, "--all", "--data-dir", str(data), "--json"])
    assert replayed.exit_code == 0, replayed.output
    assert len(json.loads(replayed.stdout)["replayed"]) == 2
    again = runner.invoke(app, ["broker", "dead-letters", GROUP, "--data-dir", str(data), "--json"])
    assert json.loads(again.stdout) == []
    with sqlite3.connect(data / "room.db") as conn:
        audit = conn.execute("SELECT event_id, action, actor FROM room_outbox_audit ORDER BY event_id").fetchall()
    assert audit == [("ev-a", "consumer_replay", "ops-kim"), ("ev-b", "consumer_replay", "ops-kim")]
