"""SPEC §9 in mq and dual mode on MariaDB and real NATS JetStream, wired as serve wires them.

* Normal: every event is in the stream once, with its tag and key, and decodes
  with nothing but the ``.proto`` file (compiled here with protoc); rows are
  delivered.
* Broker down (seed row 3): the test's own NATS server is killed under load;
  commands keep succeeding and rows go retryable; after a restart every row is
  delivered and each event_id is stored once.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import nats
import pytest
from tests.acceptance.conftest import FAST_RETRIES, all_delivered, eventually, statuses
from tests.nats_server import OwnNatsServer
from tests.service.conftest import make_settings

from roomservice.bootstrap import Process
from roomservice.domain import commands as c

pytestmark = pytest.mark.slow

APP = "demo"
ENVELOPE = "roomservice.v1.RoomOutboxEvent"
PROTO = Path(__file__).parents[2] / "src" / "roomservice" / "proto" / "room_outbox_event.proto"


def mq_settings(url: str, tmp_path: Path, nats_url: str, **extra: Any) -> Any:
    overrides = {
        **FAST_RETRIES,
        "outbox_worker.publish_mode": "mq",
        "rocketmq.room_outbox.enabled": True,
        "broker.driver": "nats",
        "broker.nats.url": nats_url,
        "broker.nats.stream": f"acc_{secrets.token_hex(4)}",
        "broker.nats.connect_timeout": "1s",
        **extra,
    }
    return make_settings(url, tmp_path, **overrides)


def decode_with_the_proto_alone(data: bytes) -> dict[str, str]:
    """``protoc --decode`` with nothing but the .proto file: top-level fields of the envelope as text."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO.parent}",
            "--decode=roomservice.v1.RoomOutboxEvent",
            PROTO.name,
        ],
        input=data,
        capture_output=True,
        check=True,
        timeout=30,
    )
    fields: dict[str, str] = {}
    for line in result.stdout.decode().splitlines():
        if not line.startswith(" ") and ":" in line:
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip().strip('"')
        elif line.endswith("{") and not line.startswith(" "):
            fields["payload"] = line.rstrip(" {")
    return fields


async def stream_messages(nats_url: str, stream: str) -> list[Any]:
    """Every message the stream holds, read with the bare client."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        return [await js.get_msg(stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await nc.close()


async def chain(rt: Process, room: str) -> list[str]:
    bodies = [
        await rt.service.execute(APP, room, f"{room}-1", c.CreateRoom(owner_id="alice", title="mq")),
        await rt.service.execute(APP, room, f"{room}-2", c.JoinRoom(user_id="bob")),
        await rt.service.execute(APP, room, f"{room}-3", c.TakeMic(user_id="bob", seat=0)),
        await rt.service.execute(
            APP, room, f"{room}-4", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=2)
        ),
        await rt.service.execute(APP, room, f"{room}-5", c.LeaveRoom(user_id="bob")),
    ]
    return [e["event_id"] for b in bodies for e in b["events"]]


@pytest.fixture
def shared_nats(require_service: Any) -> str:
    require_service("NATS", "127.0.0.1", 4222, hint="start-stop-daemon ... /usr/sbin/nats-server -js")
    return "nats://127.0.0.1:4222"


@pytest.mark.parametrize("mode", ["mq", "dual"])
async def test_every_event_is_in_the_stream_once_and_decodes_with_the_proto_alone(
    fresh_mariadb_url: str, tmp_path: Path, shared_nats: str, mode: str
) -> None:
    settings = mq_settings(fresh_mariadb_url, tmp_path, shared_nats, **{"outbox_worker.publish_mode": mode})
    stream = settings.broker.nats.stream
    try:
        async with Process.running(settings) as rt:
            event_ids = await chain(rt, "r1") + await chain(rt, "r2")
            await eventually(lambda: all_delivered(rt), what="every row delivered")
        messages = [m for m in await stream_messages(shared_nats, stream) if m.subject == "hyapp_room_outbox"]
        assert sorted(m.headers["Nats-Msg-Id"] for m in messages) == sorted(event_ids)  # each exactly once
        for m in messages[:6]:  # protoc is a process per message: a sample of each kind is enough
            envelope = decode_with_the_proto_alone(m.data)
            assert envelope["event_id"] == m.headers["Nats-Msg-Id"] == m.headers["Roomservice-Key"]
            assert envelope["type"] == m.headers["Roomservice-Tag"]
            assert m.headers["Roomservice-Sharding-Key"] == f"{APP}:{envelope['room_id']}"
            assert envelope["payload"].startswith("room_")
    finally:
        nc = await nats.connect(shared_nats)
        try:
            await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()


async def test_commands_go_on_while_the_broker_is_down_and_everything_is_delivered_once_after(
    fresh_mariadb_url: str, tmp_path: Path, own_server: OwnNatsServer
) -> None:
    settings = mq_settings(fresh_mariadb_url, tmp_path, own_server.url, **{"outbox_worker.max_retry_count": 50})
    stream = settings.broker.nats.stream
    async with Process.running(settings) as rt:
        before = await chain(rt, "before")
        await eventually(lambda: all_delivered(rt), what="delivered before the outage")
        own_server.kill()
        during: list[str] = []
        for i in range(5):  # commands never wait for the broker
            during += await chain(rt, f"down{i}")
        await eventually(lambda: _has(rt, "retryable"), what="rows retryable while the broker is down")
        ready, report = await rt.health.run()
        assert ready and report["broker"].startswith("degraded") and report["database"] == "ok"
        own_server.start()
        await eventually(lambda: all_delivered(rt), timeout_s=60, what="every row delivered after the restart")
    messages = [m for m in await stream_messages(own_server.url, stream) if m.subject == "hyapp_room_outbox"]
    ids = [m.headers["Nats-Msg-Id"] for m in messages]
    assert sorted(ids) == sorted(before + during)  # nothing lost, nothing stored twice


async def _has(rt: Process, status: str) -> bool:
    await asyncio.sleep(0)
    return (await statuses(rt)).get(status, 0) > 0
