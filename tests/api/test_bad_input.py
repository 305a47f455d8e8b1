"""Bad input: always a 4xx in the one error shape, and nothing written."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from roomservice.bootstrap import Process
from roomservice.store import tables as t

BASE = "/v1/apps/demo/rooms"
CREATE = {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"}


async def _written(rt: Process) -> tuple[int, int]:
    async with rt.db.read() as conn:
        log = await conn.scalar(sa.select(sa.func.count()).select_from(t.room_command_log))
        outbox = await conn.scalar(sa.select(sa.func.count()).select_from(t.room_outbox))
    return int(log or 0), int(outbox or 0)


def _expect(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json() == {"error": {"code": code, "message": resp.json()["error"]["message"]}}
    assert resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (BASE, {**CREATE, "seat_count": "3"}),
        (BASE, {**CREATE, "seat_count": True}),
        (BASE, {**CREATE, "seat_count": 2.0}),
        (BASE, {**CREATE, "seat_count": 0}),
        (BASE, {**CREATE, "seat_count": 21}),
        (BASE, {**CREATE, "seat_count": 2**64}),
        (BASE, {**CREATE, "title": ""}),
        (BASE, {**CREATE, "title": "t" * 65}),
        (BASE, {**CREATE, "title": "🎤" * 65}),
        (BASE, {**CREATE, "title": "nul\x00"}),
        (BASE, {**CREATE, "title": "two\r\nlines"}),
        (BASE, {**CREATE, "title": "abc\u202edcba"}),
        (BASE, {**CREATE, "title": "\u2066isolate\u2069"}),
        (BASE, {**CREATE, "title": " \t "}),
        (BASE, {**CREATE, "title": "\u3000"}),
        (BASE, {**CREATE, "room_id": "bad room"}),
        (BASE, {**CREATE, "room_id": "r" * 49}),
        (BASE, {**CREATE, "owner_id": "x" * 65}),
        (BASE, {**CREATE, "command_id": ""}),
        (BASE, {k: v for k, v in CREATE.items() if k != "owner_id"}),
        (BASE, {**CREATE, "extra": 1}),
        (BASE, [CREATE]),
        (BASE, "just a string"),
        (BASE, None),
        ("/v1/apps/Bad-App/rooms", CREATE),
        (f"{BASE}/r1/mic/take", {"command_id": "m", "user_id": "alice", "seat": -1}),
        (f"{BASE}/r1/mic/take", {"command_id": "m", "user_id": "alice", "seat": 20}),
        (f"{BASE}/r1/gifts", {"command_id": "g", "sender_id": "a", "receiver_id": "b", "gift_id": "rose", "count": -3}),
        (f"{BASE}/r1/gifts", {"command_id": "g", "sender_id": "a", "receiver_id": "b", "gift_id": "rose", "count": 0}),
        (
            f"{BASE}/r1/gifts",
            {"command_id": "g", "sender_id": "a", "receiver_id": "b", "gift_id": "rose", "count": 1e4},
        ),
        (f"{BASE}/r1/kick", {"command_id": "k", "operator_id": "a", "target_id": "b", "ban_seconds": 0}),
        (f"{BASE}/r1/kick", {"command_id": "k", "operator_id": "a", "target_id": "b", "ban_seconds": 2_592_001}),
        (f"{BASE}/{'r' * 49}/join", {"command_id": "j", "user_id": "bob"}),
    ],
)
async def test_invalid_argument(client: httpx.AsyncClient, api_runtime: Process, path: str, body: Any) -> None:
    before = await _written(api_runtime)
    _expect(await client.post(path, json=body), 400, "invalid_argument")
    assert await _written(api_runtime) == before


async def test_titles_count_code_points_and_keep_format_characters(client: httpx.AsyncClient) -> None:
    for i, title in enumerate(["🎤" * 64, "👨\u200d👩\u200d👧", "e\u0301" * 32]):
        resp = await client.post(BASE, json={**CREATE, "command_id": f"t{i}", "room_id": f"t{i}", "title": title})
        assert resp.status_code == 200, resp.text
        assert resp.json()["room"]["title"] == title


async def test_malformed_json(client: httpx.AsyncClient, api_runtime: Process) -> None:
    resp = await client.post(BASE, content=b'{"command_id": "c1", ', headers={"content-type": "application/json"})
    _expect(resp, 400, "invalid_argument")
    resp = await client.post(BASE, content=b"\xff\xfe", headers={"content-type": "application/json"})
    _expect(resp, 400, "invalid_argument")
    assert await _written(api_runtime) == (0, 0)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 30_000 + b"]" * 30_000,  # deeper than the JSON parser's stack: was a 500
        b'{"command_id": "c1", "room_id": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        b'{"command_id": "c1", "title": "\\ud800", "x": ' + b"[" * 990 + b"]" * 990 + b"}",
    ],
    ids=["array", "in a field", "objects", "with a surrogate escape"],
)
async def test_deeply_nested_json_is_invalid_not_a_500(client: httpx.AsyncClient, api_runtime: Process,
                                                       body: bytes) -> None:
    for path in (BASE, f"{BASE}/r1/join"):
        resp = await client.post(path, content=body, headers={"content-type": "application/json"})
        _expect(resp, 400, "invalid_argument")
    assert await _written(api_runtime) == (0, 0)


async def test_oversized_body_is_413(client: httpx.AsyncClient, api_runtime: Process) -> None:
    resp = await client.post(BASE, json={**CREATE, "title": "x" * 70_000})
    _expect(resp, 413, "payload_too_large")

    async def chunks() -> Any:  # no content-length: the limit still holds while streaming
        for _ in range(80):
            yield b"x" * 1024

    resp = await client.post(BASE, content=chunks(), headers={"content-type": "application/json"})
    _expect(resp, 413, "payload_too_large")
    assert await _written(api_runtime) == (0, 0)


async def test_routing_errors(client: httpx.AsyncClient) -> None:
    _expect(await client.get("/nope"), 404, "not_found")
    _expect(await client.post("/v1/apps/demo/rooms/r1/dance", json={}), 404, "not_found")
    _expect(await client.delete(BASE), 405, "method_not_allowed")
    _expect(await client.get("/v1/apps/demo/rooms/r1/join"), 405, "method_not_allowed")


async def test_domain_errors_map_to_the_table(client: httpx.AsyncClient, api_runtime: Process) -> None:
    _expect(await client.post(f"{BASE}/nope/join", json={"command_id": "j", "user_id": "bob"}), 404, "room_not_found")
    await client.post(BASE, json=CREATE)
    before = await _written(api_runtime)
    gift = {"command_id": "g", "sender_id": "alice", "receiver_id": "alice", "gift_id": "nope", "count": 1}
    _expect(await client.post(f"{BASE}/r1/gifts", json=gift), 400, "unknown_gift")
    take = f"{BASE}/r1/mic/take"
    _expect(await client.post(take, json={"command_id": "m", "user_id": "zed", "seat": 0}), 403, "not_member")
    _expect(await client.post(take, json={"command_id": "m", "user_id": "alice", "seat": 9}), 400, "invalid_argument")
    _expect(await client.post(f"{BASE}/r1/close", json={"command_id": "x", "operator_id": "zed"}), 403, "not_allowed")
    big = {"command_id": "g2", "sender_id": "alice", "receiver_id": "alice", "gift_id": "crown", "count": 9999}
    _expect(await client.post(f"{BASE}/r1/gifts", json=big), 402, "insufficient_balance")
    assert await _written(api_runtime) == before
