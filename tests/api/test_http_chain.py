"""The real chain over HTTP: create → join → mic take → sendGift → leave → kick → close."""

from __future__ import annotations

import httpx
from structlog.testing import capture_logs
from tests.api.conftest import ADMIN_TOKEN
from tests.service.test_pipeline import TIMING_FIELDS

BASE = "/v1/apps/demo/rooms"


async def test_real_chain_over_http(client: httpx.AsyncClient) -> None:
    steps = [
        ("CreateRoom", BASE, {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "Hello 🎤"}),
        ("JoinRoom", f"{BASE}/r1/join", {"command_id": "c2", "user_id": "bob"}),
        ("JoinRoom", f"{BASE}/r1/join", {"command_id": "c3", "user_id": "carol"}),
        ("TakeMic", f"{BASE}/r1/mic/take", {"command_id": "c4", "user_id": "bob", "seat": 2}),
        (
            "SendGift",
            f"{BASE}/r1/gifts",
            {"command_id": "c5", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 3},
        ),
        ("LeaveMic", f"{BASE}/r1/mic/leave", {"command_id": "c6", "user_id": "bob"}),
        ("LeaveRoom", f"{BASE}/r1/leave", {"command_id": "c7", "user_id": "bob"}),
        ("KickUser", f"{BASE}/r1/kick", {"command_id": "c8", "operator_id": "alice", "target_id": "carol"}),
        ("CloseRoom", f"{BASE}/r1/close", {"command_id": "c9", "operator_id": "alice"}),
    ]
    with capture_logs() as logs:
        versions = []
        for _name, path, body in steps:
            resp = await client.post(path, json=body)
            assert resp.status_code == 200, resp.text
            data = resp.json()
            assert set(data) == {"room", "version", "events", "replayed"}
            assert data["replayed"] is False
            versions.append(data["version"])
    assert versions == list(range(1, 10))
    timings = [e for e in logs if e["event"] == "room_command_timing"]
    assert [e["command"] for e in timings] == [name for name, _, _ in steps]
    for entry in timings:
        assert set(entry) >= TIMING_FIELDS
        assert entry["result"] == "ok"

    view = (await client.get(f"{BASE}/r1")).json()
    assert view["status"] == "closed"
    assert view["title"] == "Hello 🎤"
    assert [m["user_id"] for m in view["members"]] == ["alice"]
    assert view["heat"] == 3 * 10
    assert set(view) >= {"app_code", "room_id", "version", "owner_id", "title", "status", "members", "seats", "heat"}
    assert set(view["treasure"]) == {"energy", "level", "box_id", "state", "open_at_ms"}
    assert view["seats"][2] == {"index": 2, "user_id": None}

    after_close = await client.post(f"{BASE}/r1/join", json={"command_id": "c10", "user_id": "dave"})
    assert after_close.status_code == 409
    assert after_close.json()["error"]["code"] == "room_closed"


async def test_replay_and_reuse_over_http(client: httpx.AsyncClient) -> None:
    create = {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"}
    first = await client.post(BASE, json=create)
    again = await client.post(BASE, json=create)
    assert again.status_code == 200
    assert again.json() == {**first.json(), "replayed": True}
    reused = await client.post(BASE, json={**create, "title": "y"})
    assert reused.status_code == 409
    assert reused.json()["error"]["code"] == "command_id_reused"
    exists = await client.post(BASE, json={**create, "command_id": "c2"})
    assert exists.json()["error"]["code"] == "room_exists"


async def test_reads(client: httpx.AsyncClient) -> None:
    gifts = (await client.get("/v1/gifts")).json()
    assert all(set(g) == {"id", "name", "price"} for g in gifts) and len(gifts) >= 3
    await client.post(BASE, json={"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"})
    listing = (await client.get(BASE)).json()
    assert [r["room_id"] for r in listing["rooms"]] == ["r1"]
    missing = await client.get(f"{BASE}/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "room_not_found"


async def test_health_ready_metrics(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
    await client.post(BASE, json={"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"})
    metrics = (await client.get("/metrics")).text
    assert 'room_commands_total{command="CreateRoom",result="ok"}' in metrics
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/apps/{app_code}/rooms/{room_id}/mic/take" in spec["paths"]


async def test_admin_requires_the_token(client: httpx.AsyncClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        resp = await client.get("/admin/status", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "unauthorized"
    ok = await client.get("/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200
