"""The command fast path (api/fast_path.py) answers exactly what FastAPI's routes answer, and hands on the rest.

Two kinds of check:

* the middleware alone, over a recording inner app and a recording pipeline:
  which requests it serves itself, and that a request it hands on reaches the
  app with every byte it consumed, in order, and with the body deadline it
  started;
* differential: the same requests, in the same order, to two apps over two
  fresh runtimes on the same clock — one with the fast path, one with FastAPI's
  routing only — give the same statuses, headers, bodies and
  ``room_command_timing`` results (event ids, random per runtime, aside).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message, Receive, Scope, Send
from structlog.testing import capture_logs
from tests.service.conftest import Clock, make_settings

from roomservice import errors
from roomservice.api import schemas as s
from roomservice.api.app import ApiContext, create_app
from roomservice.api.body_limit import DEADLINE_SCOPE_KEY
from roomservice.api.fast_path import CommandFastPath, FastRoute
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.domain import commands as c

BASE = "/v1/apps/demo/rooms"
JSON = [(b"content-type", b"application/json")]


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"room.test"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("room.test", 80),
    }


def _messages(body: bytes, chunks: int = 1) -> list[Message]:
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


class _Receive:
    """Hands out ``messages``, then blocks (as a client that sent everything and waits for the answer)."""

    def __init__(self, messages: list[Message], then: Message | None = None) -> None:
        self.messages = list(messages)
        self.then = then

    async def __call__(self) -> Message:
        if self.messages:
            return self.messages.pop(0)
        if self.then is not None:
            return self.then
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def _call(app: Any, scope: Scope, receive: Receive) -> tuple[int, dict[str, str], bytes]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


# --------------------------------------------------------------------------- the middleware alone


class _Inner:
    """The app behind the fast path: records what it was handed and answers 299."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Message], float | None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        self.calls.append((scope["path"], received, scope.get(DEADLINE_SCOPE_KEY)))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


class _Pipeline:
    def __init__(self, fail: errors.RoomServiceError | None = None) -> None:
        self.calls: list[tuple[str, str, str, c.Command]] = []
        self.fail = fail

    async def __call__(self, app_code: str, room_id: str, command_id: str, command: c.Command) -> dict[str, Any]:
        self.calls.append((app_code, room_id, command_id, command))
        if self.fail is not None:
            raise self.fail
        return {"version": 7, "room_id": room_id, "title": "é"}


def _fast(inner: _Inner, pipeline: _Pipeline, *, read_timeout_s: float = 5.0) -> CommandFastPath:
    routes = [FastRoute("", s.CreateRoomBody), FastRoute("join", s.JoinBody), FastRoute("mic/take", s.TakeMicBody)]
    return CommandFastPath(inner, routes=routes, execute=pipeline, max_bytes=100, read_timeout_s=read_timeout_s)


async def test_a_valid_command_is_served_without_the_app() -> None:
    inner, pipeline = _Inner(), _Pipeline()
    fast = _fast(inner, pipeline)
    body = orjson.dumps({"command_id": "j1", "user_id": "bob"})
    status, headers, answer = await _call(fast, _scope("POST", f"{BASE}/r1/join", JSON), _Receive(_messages(body, 3)))
    assert (status, json.loads(answer)) == (200, {"version": 7, "room_id": "r1", "title": "é"})
    assert headers == {"content-length": str(len(answer)), "content-type": "application/json"}
    assert pipeline.calls == [("demo", "r1", "j1", c.JoinRoom(user_id="bob"))]
    assert inner.calls == []

    create = orjson.dumps({"command_id": "c1", "room_id": "r9", "owner_id": "al", "title": "t"})
    status, _, _ = await _call(fast, _scope("POST", BASE, JSON), _Receive(_messages(create)))
    assert status == 200
    assert pipeline.calls[-1] == ("demo", "r9", "c1", c.CreateRoom(owner_id="al", title="t", seat_count=None))
    assert inner.calls == []


async def test_a_pipeline_error_is_answered_in_the_error_shape() -> None:
    inner, pipeline = _Inner(), _Pipeline(fail=errors.RoomNotFound())
    fast = _fast(inner, pipeline)
    body = orjson.dumps({"command_id": "j1", "user_id": "bob"})
    status, _, answer = await _call(fast, _scope("POST", f"{BASE}/r1/join", JSON), _Receive(_messages(body)))
    assert status == 404
    assert json.loads(answer)["error"]["code"] == "room_not_found"
    assert inner.calls == []


HANDED_ON = [
    pytest.param("GET", f"{BASE}/r1/join", JSON, b"", id="another method"),
    pytest.param("POST", f"{BASE}/r1/join/", JSON, b'{"command_id":"j","user_id":"b"}', id="trailing slash"),
    pytest.param("POST", f"{BASE}/r1/leave", JSON, b'{"command_id":"j","user_id":"b"}', id="a route it does not serve"),
    pytest.param("POST", "/v1/apps/Bad/rooms/r1/join", JSON, b'{"command_id":"j","user_id":"b"}', id="bad app code"),
    pytest.param("POST", f"{BASE}/{'r' * 49}/join", JSON, b'{"command_id":"j","user_id":"b"}', id="room id too long"),
    pytest.param("POST", f"{BASE}/r1/join", [], b'{"command_id":"j","user_id":"b"}', id="no content type"),
    pytest.param("POST", f"{BASE}/r1/join", [(b"content-type", b"text/plain")], b"{}", id="text/plain"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b'{"command_id":"j","user_id":"b"', id="not JSON"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b'{"command_id":"j","command_id":"k","user_id":"b"}', id="dup key"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b'{"command_id":"j","user_id":"b","x":1}', id="extra field"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b"null", id="null"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b'[{"command_id":"j","user_id":"b"}]', id="an array"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b"\xff\xfe{}", id="not UTF-8"),
    pytest.param("POST", f"{BASE}/r1/join", JSON, b'{"command_id":"j","user_id":"' + b"b" * 100 + b'"}', id="large"),
    pytest.param("POST", f"{BASE}/r1/join", [*JSON, (b"content-length", b"101")], b"{}", id="declared too large"),
]


@pytest.mark.parametrize(("method", "path", "headers", "body"), HANDED_ON)
async def test_anything_unusual_is_handed_on_with_every_byte_it_read(
    method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    inner, pipeline = _Inner(), _Pipeline()
    fast = _fast(inner, pipeline)
    messages = _messages(body, 4)
    status, _, _ = await _call(fast, _scope(method, path, headers), _Receive(messages))
    assert status == 299
    assert pipeline.calls == []
    [(seen_path, received, _deadline)] = inner.calls
    assert seen_path == path
    assert received == messages  # the app reads the request as the client sent it


async def test_a_client_that_went_away_is_handed_on_with_its_disconnect() -> None:
    inner, pipeline = _Inner(), _Pipeline()
    fast = _fast(inner, pipeline)
    first = {"type": "http.request", "body": b'{"command_id":', "more_body": True}
    gone = {"type": "http.disconnect"}
    await _call(fast, _scope("POST", f"{BASE}/r1/join", JSON), _Receive([first], then=gone))
    assert pipeline.calls == []
    [(_, received, _)] = inner.calls
    assert received == [first, gone]


async def test_a_late_body_is_handed_on_with_the_deadline_it_started_with() -> None:
    inner, pipeline = _Inner(), _Pipeline()
    fast = _fast(inner, pipeline, read_timeout_s=0.2)
    first = {"type": "http.request", "body": b'{"command_id":', "more_body": True}
    rest = {"type": "http.request", "body": b'"j","user_id":"b"}', "more_body": False}
    loop = asyncio.get_running_loop()
    started = loop.time()

    class _Late(_Receive):
        async def __call__(self) -> Message:
            if self.messages:
                return self.messages.pop(0)
            await asyncio.sleep(0.5)  # the rest of the body comes after the deadline
            return rest

    await _call(fast, _scope("POST", f"{BASE}/r1/join", JSON), _Late([first]))
    assert pipeline.calls == []
    [(_, received, deadline)] = inner.calls
    assert received == [first, rest]
    assert deadline is not None and started + 0.2 <= deadline < started + 0.4  # the fast path's, not a new one


# --------------------------------------------------------------------------- differential


@asynccontextmanager
async def _app(tmp: Path, clock: Clock, *, fast: bool, read_timeout_s: float = 10.0) -> AsyncIterator[Any]:
    settings_ = make_settings(f"sqlite+aiosqlite:///{tmp}/room.db", tmp)
    async with Process.running(settings_, clock=clock, roles=(API, MAINTENANCE), loops=False) as rt:
        yield create_app(
            ApiContext(
                service=rt.service,
                health=rt.health,
                admin_token="t",
                fast_commands=fast,
                body_read_timeout_s=read_timeout_s,
            )
        )


def _normalised(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except ValueError:
        return body
    if isinstance(value, dict):
        for event in value.get("events", []):
            event["event_id"] = "<id>"
    return value


async def _both(apps: tuple[Any, Any], method: str, path: str, headers: list[tuple[bytes, bytes]],
                body: bytes) -> None:
    answers = []
    for app in apps:
        with capture_logs() as logs:
            status, answer_headers, answer = await _call(app, _scope(method, path, headers), _Receive(_messages(body)))
        timing = [(e["command"], e["result"], e.get("app_code"), e.get("room_id"), e.get("command_id"))
                  for e in logs if e["event"] == "room_command_timing"]
        answers.append((status, answer_headers, _normalised(answer), timing))
    fast, framework = answers
    assert fast == framework, (method, path, body)


SCRIPT: list[tuple[str, str, list[tuple[bytes, bytes]], dict[str, Any] | bytes]] = [
    ("POST", BASE, JSON, {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x", "seat_count": 4}),
    ("POST", BASE, JSON, {"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x", "seat_count": 4}),
    ("POST", BASE, JSON, {"command_id": "c2", "room_id": "r1", "owner_id": "bob", "title": "y"}),
    ("POST", BASE, JSON, {"command_id": "c3", "room_id": "bad room", "owner_id": "bob", "title": "y"}),
    ("POST", BASE, JSON, {"command_id": "c4", "room_id": "r2", "owner_id": "bob", "title": "\u202e"}),
    ("POST", f"{BASE}/r1/join", JSON, {"command_id": "j1", "user_id": "bob"}),
    ("POST", f"{BASE}/r1/join", JSON, {"command_id": "j1", "user_id": "carol"}),
    ("POST", f"{BASE}/r1/join", [(b"content-type", b"application/json; charset=UTF-8")],
     {"command_id": "j2", "user_id": "carol"}),
    ("POST", f"{BASE}/r1/join", [(b"content-type", b"application/json; charset=latin-1")],
     {"command_id": "j3", "user_id": "dave"}),
    ("POST", f"{BASE}/nope/join", JSON, {"command_id": "j4", "user_id": "dave"}),
    ("POST", f"{BASE}/r1/mic/take", JSON, {"command_id": "m1", "user_id": "bob", "seat": 1}),
    ("POST", f"{BASE}/r1/mic/take", JSON, {"command_id": "m2", "user_id": "carol", "seat": 1}),
    ("POST", f"{BASE}/r1/mic/take", JSON, {"command_id": "m3", "user_id": "carol", "seat": 9}),
    ("POST", f"{BASE}/r1/mic/take", JSON, {"command_id": "m4", "user_id": "carol", "seat": "2"}),
    ("POST", f"{BASE}/r1/mic/leave", JSON, {"command_id": "m5", "user_id": "bob"}),
    ("POST", f"{BASE}/r1/gifts", JSON,
     {"command_id": "g1", "sender_id": "carol", "receiver_id": "alice", "gift_id": "rose", "count": 2}),
    ("POST", f"{BASE}/r1/gifts", JSON,
     {"command_id": "g2", "sender_id": "carol", "receiver_id": "alice", "gift_id": "no-such", "count": 1}),
    ("POST", f"{BASE}/r1/kick", JSON, {"command_id": "k1", "operator_id": "bob", "target_id": "carol"}),
    ("POST", f"{BASE}/r1/kick", JSON, {"command_id": "k2", "operator_id": "alice", "target_id": "carol",
                                        "ban_seconds": 60}),
    ("POST", f"{BASE}/r1/join", JSON, {"command_id": "j5", "user_id": "carol"}),
    ("POST", f"{BASE}/r1/leave", JSON, {"command_id": "l1", "user_id": "bob"}),
    ("POST", f"{BASE}/r1/join", JSON, b'{"command_id": "j6", "user_id": "x", "user_id": "y"}'),
    ("POST", f"{BASE}/r1/join", JSON, b'{"command_id": "j7", "user_id": "\\ud800"}'),
    ("POST", f"{BASE}/r1/join", JSON, b"null"),
    ("POST", f"{BASE}/r1/join", JSON, b"[" * 30_000 + b"]" * 30_000),
    ("POST", f"{BASE}/r1/join", JSON, b"[]"),
    ("POST", f"{BASE}/r1/join", JSON, b""),
    ("POST", f"{BASE}/r1/join", JSON, b'{"command_id": "j8", "user_id": "' + b"u" * 70_000 + b'"}'),
    ("POST", f"{BASE}/r1/join/", JSON, {"command_id": "j9", "user_id": "eve"}),
    ("GET", f"{BASE}/r1/join", [], b""),
    ("POST", f"{BASE}/r1/close", JSON, {"command_id": "x1", "operator_id": "bob"}),
    ("POST", f"{BASE}/r1/close", JSON, {"command_id": "x2", "operator_id": "alice"}),
    ("POST", f"{BASE}/r1/join", JSON, {"command_id": "j10", "user_id": "frank"}),
    ("GET", f"{BASE}/r1", [], b""),
]


async def test_the_fast_path_answers_as_the_framework_does(tmp_path: Path) -> None:
    clock = Clock()
    async with (
        _app(tmp_path / "fast", clock, fast=True) as fast,
        _app(tmp_path / "framework", clock, fast=False) as framework,
    ):
        for method, path, headers, body in SCRIPT:
            raw = body if isinstance(body, bytes) else orjson.dumps(body)
            await _both((fast, framework), method, path, headers, raw)
            clock.advance(1_000)


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**65) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = st.sampled_from(["command_id", "user_id", "seat", "extra"])
_BODIES = st.dictionaries(_FIELDS, _JSONISH | st.sampled_from(["j", "bob", "r1", 0, 3]), max_size=4) | _JSONISH


async def test_any_body_is_answered_as_the_framework_does(tmp_path: Path) -> None:
    clock = Clock()
    async with (
        _app(tmp_path / "fast", clock, fast=True) as fast,
        _app(tmp_path / "framework", clock, fast=False) as framework,
    ):
        create = orjson.dumps({"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"})
        await _both((fast, framework), "POST", BASE, JSON, create)
        loop = asyncio.get_running_loop()
        seen: list[object] = []

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body=_BODIES, route=st.sampled_from(["join", "mic/take", "leave"]))
        def check(body: object, route: str) -> None:
            seen.append(body)
            raw = json.dumps(body).encode()  # orjson refuses integers beyond 64 bits, which _JSONISH draws
            future = asyncio.run_coroutine_threadsafe(_both((fast, framework), "POST", f"{BASE}/r1/{route}", JSON,
                                                            raw), loop)
            future.result(timeout=60)

        await asyncio.to_thread(check)
        assert len(seen) >= 100


async def test_a_late_body_is_refused_after_one_deadline_not_two(tmp_path: Path) -> None:
    timeout_s = 0.5
    async with _app(tmp_path, Clock(), fast=True, read_timeout_s=timeout_s) as app:
        first: Message = {"type": "http.request", "body": b'{"command_id":', "more_body": True}
        loop = asyncio.get_running_loop()
        started = loop.time()
        with capture_logs() as logs:
            status, headers, body = await _call(app, _scope("POST", f"{BASE}/r1/join", JSON), _Receive([first]))
        elapsed = loop.time() - started
    assert status == 400
    assert json.loads(body)["error"]["message"] == f"request body not received within {timeout_s:g}s"
    assert headers["connection"] == "close"
    assert timeout_s * 0.9 <= elapsed < timeout_s * 2  # a deadline restarted by the app would take 2 × timeout_s
    [line] = [e for e in logs if e["event"] == "room_command_timing"]
    assert (line["command"], line["result"], line["room_id"]) == ("JoinRoom", "invalid_argument", "r1")
