"""``room-service broker …`` on the embedded default: a consumer group's dead letters listed and replayed, audited."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from roomservice import errors
from roomservice.admin import dead_letters
from roomservice.admin.dead_letters import DeadLetterAdmin
from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap.broker import GroupSpec
from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.brokers.port import BrokerUnavailable, OutgoingMessage
from roomservice.cli.main import app
from roomservice.clock import wall_clock_ms
from roomservice.store.migrate import opened_database

GROUP, TOPIC = "hyapp-room-im-bridge", "hyapp_room_outbox"


def test_dead_letters_are_listed_then_replayed_to_their_group_and_audited(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    data.mkdir()
    bury(data, ["ev-a", "ev-b"])
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


async def buried(data: Path, keys: list[str]) -> None:
    """Dead letters of GROUP on the embedded broker under ``data``: one per key, message ids 1, 2, ..."""
    async with opened_database(f"sqlite+aiosqlite:///{data}/room.db", migrate=True) as db:
        broker = EmbeddedBroker(db)
        await broker.declare_group(TOPIC, GROUP, max_deliveries=1)
        for key in keys:
            await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key, tag="RoomUserJoined"), timeout_s=5)
        for delivery in await broker.fetch(TOPIC, GROUP, max_messages=len(keys), wait_s=1, visibility_s=30):
            await broker.nack(delivery, delay_s=0, reason="IM down")


def bury(data: Path, keys: list[str]) -> None:
    asyncio.run(buried(data, keys))


def consumer_audit(data: Path) -> list[tuple[str, ...]]:
    with sqlite3.connect(data / "room.db") as conn:
        return conn.execute(
            "SELECT event_id, detail FROM room_outbox_audit WHERE action = 'consumer_replay' ORDER BY id"
        ).fetchall()


@pytest.mark.parametrize("bad_id", ["\u00b2", "99999999999999999999999", "01", "1.0"])
def test_a_message_id_the_broker_never_wrote_is_no_dead_letter_not_a_traceback(tmp_path: Path, bad_id: str) -> None:
    """'²' passed isdigit() and then failed int(); a huge one overflowed SQLite; '01' replayed message 1
    with no audit row (found by review). None of them is an id the embedded broker writes."""
    bury(tmp_path, ["ev-a"])
    result = CliRunner().invoke(app, ["broker", "replay", GROUP, bad_id, "--data-dir", str(tmp_path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and f"not a dead letter of {GROUP}: {bad_id}" in result.output
    left = CliRunner().invoke(app, ["broker", "dead-letters", GROUP, "--data-dir", str(tmp_path), "--json"])
    assert [d["key"] for d in json.loads(left.stdout)] == ["ev-a"] and consumer_audit(tmp_path) == []


def test_ids_and_all_together_are_refused(tmp_path: Path) -> None:
    bury(tmp_path, ["ev-a", "ev-b"])
    result = CliRunner().invoke(app, ["broker", "replay", GROUP, "1", "--all", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not both" in result.output  # it replayed every dead letter
    assert consumer_audit(tmp_path) == []


def test_a_database_without_the_schema_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    sqlite3.connect(tmp_path / "room.db").close()  # a file, no tables
    result = CliRunner().invoke(app, ["broker", "dead-letters", GROUP, "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "db upgrade" in result.output


async def test_a_replay_cut_short_audits_what_it_replayed_and_says_how_far(tmp_path: Path) -> None:
    await buried(tmp_path, ["ev-a", "ev-b", "ev-c"])
    async with opened_database(f"sqlite+aiosqlite:///{tmp_path}/room.db", migrate=False) as db:
        broker = EmbeddedBroker(db)
        replays = 0
        real = broker.replay_dead_letter

        async def fails_second(group: str, message_id: str) -> bool:
            nonlocal replays
            replays += 1
            if replays == 2:
                raise BrokerUnavailable("the database went away")
            return await real(group, message_id)

        broker.replay_dead_letter = fails_second  # type: ignore[method-assign]
        admin = DeadLetterAdmin(broker, [GroupSpec(GROUP, TOPIC, 1)], audit=OutboxAdmin(db, clock=wall_clock_ms))
        seen: list[tuple[int, int]] = []
        with pytest.raises(errors.Unavailable, match=r"replay stopped after 1 of 3 dead letter\(s\)"):
            await admin.replay(GROUP, None, actor="ops", progress=lambda d, n: seen.append((d, n)))
    assert seen == [(1, 3)]
    assert [event_id for event_id, _ in consumer_audit(tmp_path)] == ["ev-a"]  # audited though the call failed


async def test_replay_all_goes_past_one_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port lists at most MAX_DEAD_LETTERS a call: --all lists again until none is left (it stopped
    after the first listing, and said nothing; found by review). Here a listing is 2 long."""
    monkeypatch.setattr(dead_letters, "MAX_DEAD_LETTERS", 2)
    await buried(tmp_path, ["ev-a", "ev-b", "ev-c", "ev-d", "ev-e"])
    async with opened_database(f"sqlite+aiosqlite:///{tmp_path}/room.db", migrate=False) as db:
        admin = DeadLetterAdmin(
            EmbeddedBroker(db), [GroupSpec(GROUP, TOPIC, 1)], audit=OutboxAdmin(db, clock=wall_clock_ms)
        )
        seen: list[tuple[int, int]] = []
        result = await admin.replay(GROUP, None, actor="ops", progress=lambda d, n: seen.append((d, n)))
        assert len(result.replayed) == 5 and await EmbeddedBroker(db).dead_letters(GROUP, limit=10) == []
    assert seen[-1] == (5, 5)
    assert sorted(event_id for event_id, _ in consumer_audit(tmp_path)) == ["ev-a", "ev-b", "ev-c", "ev-d", "ev-e"]
