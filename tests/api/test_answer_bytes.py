"""A command's answer is encoded once: the HTTP body is, byte for byte, the text its command log row holds."""

from __future__ import annotations

import copy

import httpx
import orjson
import sqlalchemy as sa

from roomservice.bootstrap import Process
from roomservice.store import tables as t
from roomservice.store.port import Answer

BASE = "/v1/apps/demo/rooms"


async def _logged_response(rt: Process, room_id: str, command_id: str) -> str:
    log = t.room_command_log
    async with rt.db.read() as conn:
        text = await conn.scalar(
            sa.select(log.c.response).where((log.c.room_id == room_id) & (log.c.command_id == command_id))
        )
    assert isinstance(text, str)
    return text


async def test_the_http_answer_is_the_logged_answer_byte_for_byte(
    client: httpx.AsyncClient, api_runtime: Process
) -> None:
    created = await client.post(BASE, json={"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "ü x"})
    joined = await client.post(f"{BASE}/r1/join", json={"command_id": "c2", "user_id": "bob"})
    for resp, command_id in ((created, "c1"), (joined, "c2")):
        assert resp.status_code == 200, resp.text
        assert resp.content == (await _logged_response(api_runtime, "r1", command_id)).encode()
        assert resp.content == orjson.dumps(resp.json())  # the same compact form as before
    replayed = await client.post(f"{BASE}/r1/join", json={"command_id": "c2", "user_id": "bob"})
    assert replayed.json() == {**joined.json(), "replayed": True}


def test_an_answer_is_its_body_and_copies_with_its_encoding() -> None:
    body = {"room": {"members": ["a", "b"]}, "version": 2, "events": [], "replayed": False}
    answer = Answer(body)
    assert answer == body and answer.encoded == orjson.dumps(body) == orjson.dumps(answer)
    for copied in (copy.copy(answer), copy.deepcopy(answer)):
        assert isinstance(copied, Answer) and copied == body and copied.encoded == answer.encoded
