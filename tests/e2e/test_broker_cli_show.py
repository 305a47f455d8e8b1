"""``room-service broker show GROUP MESSAGE_ID`` as a real process: one dead letter in full, its body decoded."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.brokers.port import OutgoingMessage
from roomservice.domain.events import Event, RoomUserKicked
from roomservice.store.migrate import opened_database
from roomservice.timers.delay_message import WAKEUP_TAG, TreasureWakeup
from roomservice.wire import encode_event

IM_GROUP, OUTBOX_TOPIC = "hyapp-room-im-bridge", "hyapp_room_outbox"
TREASURE_GROUP, TREASURE_TOPIC = "hyapp-room-treasure-open", "hyapp_room_treasure_open"
KICK = Event(
    "ev-kick",
    "demo",
    "r1",
    4,
    1_780_000_000_000,
    RoomUserKicked(operator_id="alice", target_id="bob", ban_seconds=60, banned_until_ms=1_780_000_060_000),
)
WAKEUP = TreasureWakeup("demo", "r1", "box-1", 2, 1_780_000_060_000, "treasure-open:box-1")


def broker_cli(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "roomservice.cli", "broker", *args, "--data-dir", str(data)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        cwd=data,
        timeout=60,
    )


def bury(data: Path) -> None:
    """Dead letters as the consumers leave them: a kick the IM bridge gave up on, a poison message, a wake-up."""

    async def main() -> None:
        async with opened_database(f"sqlite+aiosqlite:///{data}/room.db", migrate=True) as db:
            broker = EmbeddedBroker(db)
            await broker.declare_group(OUTBOX_TOPIC, IM_GROUP, max_deliveries=2)
            await broker.declare_group(TREASURE_TOPIC, TREASURE_GROUP, max_deliveries=1)
            await broker.publish(
                OutgoingMessage(
                    OUTBOX_TOPIC, encode_event(KICK), key=KICK.event_id, tag=KICK.type, sharding_key="demo:r1"
                ),
                timeout_s=5,
            )
            await broker.publish(OutgoingMessage(OUTBOX_TOPIC, b"\xffnot protobuf", key="ev-poison"), timeout_s=5)
            await broker.publish(
                OutgoingMessage(TREASURE_TOPIC, WAKEUP.encode(), key=WAKEUP.key, tag=WAKEUP_TAG), timeout_s=5
            )
            for attempt in (1, 2):
                for d in await broker.fetch(OUTBOX_TOPIC, IM_GROUP, max_messages=10, wait_s=1, visibility_s=30):
                    await broker.nack(d, delay_s=0, reason=f"10010 group does not exist (attempt {attempt})")
            for d in await broker.fetch(TREASURE_TOPIC, TREASURE_GROUP, max_messages=10, wait_s=1, visibility_s=30):
                await broker.nack(d, delay_s=0, reason="room unavailable")

    asyncio.run(main())


def test_show_prints_one_dead_letter_with_its_envelope_decoded(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    bury(data)
    listed = broker_cli(data, "dead-letters", IM_GROUP, "--json")
    assert listed.returncode == 0, listed.stderr
    ids = {d["key"]: d["message_id"] for d in json.loads(listed.stdout)}
    assert set(ids) == {"ev-kick", "ev-poison"}

    shown = broker_cli(data, "show", IM_GROUP, ids["ev-kick"], "--json")
    assert shown.returncode == 0, shown.stderr
    letter = json.loads(shown.stdout)
    assert letter["message_id"] == ids["ev-kick"] and letter["group"] == IM_GROUP
    assert letter["delivery_count"] == 2
    assert letter["last_error"] == "10010 group does not exist (attempt 2)"
    assert letter["event"] == json.loads(json.dumps(KICK.to_dict()))  # event id, type, room, payload
    assert letter["event"]["event_id"] == "ev-kick" and letter["event"]["type"] == "RoomUserKicked"
    assert letter["event"]["room_id"] == "r1" and letter["event"]["app_code"] == "demo"

    text = broker_cli(data, "show", IM_GROUP, ids["ev-kick"])
    assert text.returncode == 0, text.stderr
    assert "delivery_count: 2" in text.stdout and "type: RoomUserKicked" in text.stdout
    assert "last_error: 10010 group does not exist (attempt 2)" in text.stdout

    poison = json.loads(broker_cli(data, "show", IM_GROUP, ids["ev-poison"], "--json").stdout)
    assert "event" not in poison and poison["undecodable"] and poison["body_size"] == len(b"\xffnot protobuf")

    wakeups = json.loads(broker_cli(data, "dead-letters", TREASURE_GROUP, "--json").stdout)
    assert len(wakeups) == 1
    wakeup = json.loads(broker_cli(data, "show", TREASURE_GROUP, wakeups[0]["message_id"], "--json").stdout)
    assert wakeup["wakeup"] == {
        "app_code": "demo",
        "room_id": "r1",
        "box_id": "box-1",
        "level": 2,
        "open_at_ms": 1_780_000_060_000,
        "command_id": "treasure-open:box-1",
    }
    assert wakeup["last_error"] == "room unavailable" and wakeup["delivery_count"] == 1

    missing = broker_cli(data, "show", IM_GROUP, "999999")
    assert missing.returncode == 1 and "not a dead letter of hyapp-room-im-bridge: 999999" in missing.stderr
    unknown = broker_cli(data, "show", "nope", ids["ev-kick"])
    assert unknown.returncode == 2 and "unknown consumer group" in unknown.stderr
