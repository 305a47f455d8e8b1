"""`room-service serve` with the embedded IM sandbox, restarted on the same data dir: the
room's group is still there, so the next event's message reaches it and its row is delivered
(before, the sandbox forgot every group and such rows retried 10010 until dead letters)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from tests.e2e.server import LOCAL_GIFTS, ServerProcess

from roomservice.integrations.tencent_im.client import group_id_for

pytestmark = pytest.mark.slow

APP, ROOM = "demo", "r1"


def sandbox_url(server: ServerProcess, start: int) -> str:
    """The URL the ``start``-th start (0-based) logged as ``im_sandbox_started``."""
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if '"im_sandbox_started"' in line]
    assert len(lines) > start, lines
    entry = lines[start]
    assert entry["state"] != "memory", entry  # kept under the data dir
    return str(entry["url"])


def wait_delivered(server: ServerProcess, token: str, event_id: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        row: dict[str, Any] = httpx.get(
            f"{server.url}/admin/outbox/{event_id}", headers={"Authorization": f"Bearer {token}"}
        ).json()
        if row["status"] == "delivered":
            return row
        assert time.monotonic() < deadline, f"never delivered: {row}"
        time.sleep(0.1)


def command(server: ServerProcess, path: str, body: dict[str, Any]) -> str:
    """Run a command; the id of its one event."""
    response = httpx.post(f"{server.url}/v1/apps/{APP}{path}", json=body)
    response.raise_for_status()
    events = response.json()["events"]
    assert len(events) == 1, events
    return str(events[0]["event_id"])


def test_a_restarted_serve_still_has_the_rooms_im_group(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("logging: {level: info, json: true}\n" + LOCAL_GIFTS)
    data_dir = tmp_path / "data"
    server = ServerProcess(config=config, data_dir=data_dir)
    group = quote(group_id_for(APP, ROOM), safe="")

    server.start()
    try:
        token = (data_dir / "admin-token").read_text().strip()
        created = command(server, "/rooms", {"command_id": "c1", "room_id": ROOM, "owner_id": "alice", "title": "t"})
        wait_delivered(server, token, created)
        first = sandbox_url(server, 0)
        before = httpx.get(f"{first}/_sandbox/groups/{group}").json()
        assert before["destroyed"] is False and before["owner"]
    finally:
        server.stop()

    server.start()
    try:
        second = sandbox_url(server, 1)
        assert second != first  # another sandbox (another port): what it knows, it read from the data dir
        assert httpx.get(f"{server.url}/readyz").json()["checks"]["im_sandbox"] == "ok"
        joined = command(server, f"/rooms/{ROOM}/join", {"command_id": "c2", "user_id": "bob"})
        row = wait_delivered(server, token, joined)
        assert "im" in row["targets_done"]
        messages = httpx.get(f"{second}/_sandbox/groups/{group}/messages").json()["messages"]
        assert [json.loads(m["data"])["event_id"] for m in messages] == [joined]
        after = httpx.get(f"{second}/_sandbox/groups/{group}").json()
        assert after["created_at"] == before["created_at"]  # the same group, not one made again
        requests = httpx.get(f"{second}/_sandbox/requests").json()["counts"]
        assert requests.get("create_group", 0) == 0 and requests["send_group_msg"] == 1  # found at once
    finally:
        server.stop()
