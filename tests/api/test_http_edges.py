"""The edges of the HTTP contract: routing, media types, JSON strictness, bounds, one log line per command.

Every answer here is in the one error shape of SPEC §8; none is a redirect, an
empty body, plain text or a 5xx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from structlog.testing import capture_logs
from tests.api.test_admin_api import AUTH, admin_client  # noqa: F401 - the fixture
from tests.service.test_pipeline import TIMING_FIELDS

from roomservice.bootstrap import Process

BASE = "/v1/apps/demo/rooms"
CREATE = {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"}
JSON = {"content-type": "application/json"}


def assert_error(resp: httpx.Response, status: int, code: str, *fragments: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    for fragment in fragments:
        assert fragment in body["error"]["message"], body["error"]["message"]
    return body


@pytest_asyncio.fixture
async def room(client: httpx.AsyncClient) -> AsyncIterator[str]:
    resp = await client.post(BASE, json=CREATE)
    assert resp.status_code == 200, resp.text
    yield f"{BASE}/r1"


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"{BASE}/r1/"),
        ("GET", f"{BASE}/"),
        ("POST", f"{BASE}/"),
        ("POST", f"{BASE}/r1/join/"),
        ("GET", "/v1/gifts/"),
        ("GET", "/healthz/"),
        ("GET", f"{BASE}/r1%2F"),
        ("GET", f"{BASE}/r1%2f"),
        ("POST", f"{BASE}/r1%2Fjoin"),  # would be /rooms/r1/join once decoded
        ("GET", "/v1/apps/demo%2Frooms"),
    ],
)
async def test_a_trailing_slash_or_an_encoded_slash_is_404(
    client: httpx.AsyncClient, room: str, method: str, path: str
) -> None:
    resp = await client.request(method, path, json={"command_id": "j", "user_id": "bob"})
    assert_error(resp, 404, "not_found")
    assert "location" not in resp.headers
    view = (await client.get(room)).json()
    assert [m["user_id"] for m in view["members"]] == ["alice"]  # the %2F join did not run


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", BASE, {"GET", "POST"}),
        ("PUT", BASE, {"GET", "POST"}),
        ("GET", f"{BASE}/r1/join", {"POST"}),
        ("POST", f"{BASE}/r1", {"GET", "HEAD"}),
        ("POST", "/healthz", {"GET", "HEAD"}),
    ],
)
async def test_405_names_the_allowed_methods(
    client: httpx.AsyncClient, method: str, path: str, allow: set[str]
) -> None:
    resp = await client.request(method, path)
    assert_error(resp, 405, "method_not_allowed")
    assert {m.strip() for m in resp.headers["allow"].split(",")} >= allow - {"HEAD"}
    assert {m.strip() for m in resp.headers["allow"].split(",")} <= allow | {"HEAD"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/admin/outbox/stats"),
        ("DELETE", "/admin/outbox/f-1"),
        ("GET", "/admin/nope"),
        ("GET", "/admin/outbox/replay/extra"),
        ("POST", "/admin/status"),
        ("GET", "/admin"),
        ("GET", "/admin/"),
        ("GET", "/admin/outbox/stats/"),
    ],
)
async def test_admin_paths_answer_401_before_routing(admin_client: httpx.AsyncClient, method: str, path: str) -> None:  # noqa: F811
    # without a token nothing tells an existing admin route from a missing one
    assert_error(await admin_client.request(method, path), 401, "unauthorized")
    bad = {"Authorization": "Bearer nope"}
    assert_error(await admin_client.request(method, path, headers=bad), 401, "unauthorized")
    with_token = await admin_client.request(method, path, headers=AUTH)
    assert with_token.status_code in (404, 405), with_token.text
    if with_token.status_code == 405:
        assert with_token.headers["allow"]


# --------------------------------------------------------------------------- numeric bounds


async def test_after_id_beyond_a_signed_64_bit_integer_is_400(admin_client: httpx.AsyncClient) -> None:  # noqa: F811
    ok = await admin_client.get(f"/admin/outbox?after_id={2**63 - 1}", headers=AUTH)
    assert ok.status_code == 200, ok.text
    assert ok.json()["rows"] == []
    for value in (2**63, 2**64, 10**30):
        resp = await admin_client.get(f"/admin/outbox?after_id={value}", headers=AUTH)
        assert_error(resp, 400, "invalid_argument", "after_id")
    resp = await admin_client.get(f"/admin/outbox?limit={2**63}", headers=AUTH)
    assert_error(resp, 400, "invalid_argument", "limit")


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("content_type", "fragment"),
    [
        ("application/json-patch+json", "application/json-patch+json"),
        ("application/merge-patch+json", "application/merge-patch+json"),
        ("application/problem+json", "application/problem+json"),
        ("text/json", "text/json"),
        ("text/plain", "text/plain"),
        ("application/json; charset=latin-1", "charset"),
        ("application/json; charset=utf-16", "charset"),
        ("application/json; version=2", "version"),
        ("application/jsonx", "application/jsonx"),
    ],
)
async def test_only_application_json_is_accepted(
    client: httpx.AsyncClient, api_runtime: Process, content_type: str, fragment: str
) -> None:
    resp = await client.post(BASE, content=json.dumps(CREATE).encode(), headers={"content-type": content_type})
    assert_error(resp, 400, "invalid_argument", fragment, "application/json")
    assert (await client.get(f"{BASE}/r1")).status_code == 404


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON", "application/json; charset=utf-8", "application/json;charset=UTF-8"],
)
async def test_application_json_with_utf8_is_accepted(client: httpx.AsyncClient, content_type: str) -> None:
    resp = await client.post(BASE, content=json.dumps(CREATE).encode(), headers={"content-type": content_type})
    assert resp.status_code == 200, resp.text


async def test_a_body_without_a_content_type_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post(BASE, content=json.dumps(CREATE).encode())
    assert_error(resp, 400, "invalid_argument", "application/json")


@pytest.mark.parametrize(
    "raw",
    [
        '{"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x", "title": "y"}',
        '{"command_id": "c1", "room_id": "r1", "room_id": "r2", "owner_id": "alice", "title": "x"}',
        '{"command_id": "c1", "command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"}',
    ],
)
async def test_duplicate_keys_are_400(client: httpx.AsyncClient, api_runtime: Process, raw: str) -> None:
    resp = await client.post(BASE, content=raw.encode(), headers=JSON)
    assert_error(resp, 400, "invalid_argument", "duplicate key")
    assert (await client.get(f"{BASE}/r1")).status_code == 404
    assert (await client.get(f"{BASE}/r2")).status_code == 404


async def test_duplicate_keys_in_a_nested_object_are_400(admin_client: httpx.AsyncClient) -> None:  # noqa: F811
    raw = b'{"filter": {"type": "RoomGiftSent", "type": "RoomCreated"}}'
    resp = await admin_client.post("/admin/outbox/replay", content=raw, headers={**AUTH, **JSON})
    assert_error(resp, 400, "invalid_argument", "duplicate key", "'type'")


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(CREATE).encode("utf-16"),
        json.dumps(CREATE).encode("utf-32"),
        json.dumps({**CREATE, "title": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"),
        b'{"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "\xed\xa0\x80"}',  # a surrogate
    ],
    ids=["utf-16", "utf-32", "latin-1", "surrogate"],
)
async def test_a_body_that_is_not_utf8_is_400(client: httpx.AsyncClient, raw: bytes) -> None:
    resp = await client.post(BASE, content=raw, headers=JSON)
    assert_error(resp, 400, "invalid_argument", "UTF-8")
    assert (await client.get(f"{BASE}/r1")).status_code == 404


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        (b'{"command_id": "c1" "room_id": "r1"}', ("not valid JSON", "Expecting ',' delimiter", "line 1, column 21")),
        (b'{"command_id": "c1",\n  ', ("not valid JSON", "line 2, column 3")),
        (b"", ("not valid JSON", "line 1, column 1")),
        (b'{"command_id": NaN}', ("not valid JSON", "NaN")),
        (b'{"a": 1} trailing', ("not valid JSON", "Extra data", "line 1, column 10")),
    ],
)
async def test_malformed_json_says_what_and_where(
    client: httpx.AsyncClient, raw: bytes, fragments: tuple[str, ...]
) -> None:
    resp = await client.post(BASE, content=raw, headers=JSON)
    body = assert_error(resp, 400, "invalid_argument", *fragments)
    assert "JSON decode error" not in body["error"]["message"]


async def test_413_is_formatted_like_every_other_error(client: httpx.AsyncClient) -> None:
    big = await client.post(BASE, json={**CREATE, "title": "x" * 70_000})
    small = await client.post(BASE, json={**CREATE, "title": ""})
    assert_error(big, 413, "payload_too_large")
    assert_error(small, 400, "invalid_argument")
    assert big.headers["content-type"] == small.headers["content-type"]
    # the same encoder: re-encoding each body the way the other was encoded gives it back
    for resp in (big, small):
        assert resp.content == json.dumps(resp.json(), ensure_ascii=False, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- one timing line per command


COMMANDS = [
    ("CreateRoom", BASE, {"room_id": "r9", "owner_id": "alice", "title": "t"}),
    ("JoinRoom", f"{BASE}/r1/join", {"user_id": "bob"}),
    ("LeaveRoom", f"{BASE}/r1/leave", {"user_id": "bob"}),
    ("TakeMic", f"{BASE}/r1/mic/take", {"user_id": "alice", "seat": 0}),
    ("LeaveMic", f"{BASE}/r1/mic/leave", {"user_id": "alice"}),
    ("SendGift", f"{BASE}/r1/gifts", {"sender_id": "alice", "receiver_id": "alice", "gift_id": "rose", "count": 1}),
    ("KickUser", f"{BASE}/r1/kick", {"operator_id": "alice", "target_id": "bob"}),
    ("CloseRoom", f"{BASE}/r1/close", {"operator_id": "alice"}),
]


def _timings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "room_command_timing"]


def _metric(command: str, result: str) -> float:
    from roomservice.observability.metrics import REGISTRY

    value = REGISTRY.get_sample_value("room_commands_total", {"command": command, "result": result})
    return value or 0.0


@pytest.mark.parametrize(("command", "path", "fields"), COMMANDS, ids=[c for c, _, _ in COMMANDS])
@pytest.mark.parametrize(
    ("variant", "code"),
    [
        ("bad-json", "invalid_argument"),
        ("missing-field", "invalid_argument"),
        ("extra-field", "invalid_argument"),
        ("out-of-range", "invalid_argument"),
        ("duplicate-key", "invalid_argument"),
        ("media-type", "invalid_argument"),
        ("too-large", "payload_too_large"),
    ],
)
async def test_a_command_rejected_at_the_edge_logs_one_line(
    client: httpx.AsyncClient, room: str, command: str, path: str, fields: dict[str, Any], variant: str, code: str
) -> None:
    body: dict[str, Any] = {"command_id": "e1", **fields}
    headers = dict(JSON)
    if variant == "bad-json":
        content = b'{"command_id": "e1",'
    elif variant == "missing-field":
        content = json.dumps({"command_id": "e1"}).encode()
    elif variant == "extra-field":
        content = json.dumps({**body, "surprise": 1}).encode()
    elif variant == "out-of-range":
        content = json.dumps({**body, "seat": 2**64, "count": 2**64, "seat_count": 2**64, "ban_seconds": 2**64})
        content = content.encode()
    elif variant == "duplicate-key":
        content = json.dumps(body).encode()[:-1] + b', "command_id": "e1"}'
    elif variant == "media-type":
        content, headers = json.dumps(body).encode(), {"content-type": "application/json-patch+json"}
    else:
        content = json.dumps({**body, "pad": "x" * 70_000}).encode()
    before = _metric(command, code)
    with capture_logs() as logs:
        resp = await client.post(path, content=content, headers=headers)
    assert_error(resp, 413 if code == "payload_too_large" else 400, code)
    [line] = _timings(logs)
    assert set(line) >= TIMING_FIELDS
    assert line["command"] == command
    assert line["result"] == code
    assert line["app_code"] == "demo"
    if command == "CreateRoom":  # its room_id is in the body: logged when the body gave a valid one
        assert line["room_id"] in ("", "r9")
    else:
        assert line["room_id"] == "r1"
    assert line["command_id"] in ("", "e1")
    assert line["version"] == 0
    assert line["total_ms"] >= 0
    assert _metric(command, code) == before + 1


async def test_edge_rejections_take_ids_from_the_path_only_when_valid(client: httpx.AsyncClient) -> None:
    with capture_logs() as logs:
        resp = await client.post("/v1/apps/Bad-App/rooms/bad%20room/join", content=b"{", headers=JSON)
        assert_error(resp, 400, "invalid_argument")
        resp = await client.post(f"{BASE}/r1/join", json={"command_id": "ok-id", "user_id": "bad user"})
        assert_error(resp, 400, "invalid_argument")
    first, second = _timings(logs)
    assert (first["command"], first["app_code"], first["room_id"], first["command_id"]) == ("JoinRoom", "", "", "")
    assert (second["app_code"], second["room_id"], second["command_id"]) == ("demo", "r1", "ok-id")


async def test_commands_that_reach_the_pipeline_still_log_exactly_one_line(client: httpx.AsyncClient) -> None:
    with capture_logs() as logs:
        assert (await client.post(BASE, json=CREATE)).status_code == 200
        assert_error(await client.post(BASE, json={**CREATE, "command_id": "c2"}), 409, "room_exists")
        assert_error(
            await client.post(f"{BASE}/nope/join", json={"command_id": "j", "user_id": "b"}), 404, "room_not_found"
        )
    assert [(e["command"], e["result"]) for e in _timings(logs)] == [
        ("CreateRoom", "ok"),
        ("CreateRoom", "room_exists"),
        ("JoinRoom", "room_not_found"),
    ]


async def test_non_command_requests_log_no_timing_line(client: httpx.AsyncClient) -> None:
    with capture_logs() as logs:
        await client.get(f"{BASE}/r1")
        await client.get(f"{BASE}/r1/join")  # 405: not a command request
        await client.post(f"{BASE}/r1/dance", json={})  # 404
        await client.post(f"{BASE}/r1/", json={})  # 404
        await client.post(f"{BASE}/r1%2Fjoin", json={})  # 404
    assert _timings(logs) == []


# --------------------------------------------------------------------------- OpenAPI


async def test_openapi_documents_the_real_error_responses(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    text = json.dumps(spec)
    assert "HTTPValidationError" not in text and "ValidationError" not in text
    assert '"422"' not in text
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    commands = [
        (path, op) for path, ops in spec["paths"].items() for method, op in ops.items() if "commands" in op["tags"]
    ]
    assert len(commands) == 8
    for path, op in commands:
        statuses = set(op["responses"])
        assert {"200", "400", "409", "413", "503"} <= statuses, path
        assert ("404" in statuses) == (path != BASE.replace("demo", "{app_code}")), path
        assert statuses <= {"200", "400", "402", "403", "404", "409", "413", "503"}, path
        for status in statuses - {"200"}:
            assert op["responses"][status]["content"]["application/json"]["schema"] == error_ref, (path, status)
            assert op["responses"][status]["description"]
    gifts = spec["paths"]["/v1/apps/{app_code}/rooms/{room_id}/gifts"]["post"]["responses"]
    assert "402" in gifts and "403" in gifts
    for path, ops in spec["paths"].items():
        if path.startswith("/admin/"):
            for op in ops.values():
                assert "401" in op["responses"], path
    assert set(spec["components"]["schemas"]["ErrorDetail"]["required"]) == {"code", "message"}
