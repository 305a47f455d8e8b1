"""The app behind a real uvicorn server: what only a socket shows (malformed request lines, trickled bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from structlog.testing import capture_logs
from tests.api.conftest import ADMIN_TOKEN

from roomservice.admin.operations import OutboxAdmin
from roomservice.api.app import ApiContext, create_app
from roomservice.api.server import http_protocol
from roomservice.bootstrap import Process
from roomservice.clock import wall_clock_ms

BODY_TIMEOUT_S = 0.5
HEAD_TIMEOUT_S = 0.5
WITHIN_S = 10.0  # generous: the bound under test is BODY_TIMEOUT_S


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the test runner owns the signals
        yield


class Finished:
    """Paths whose request the app has finished with (answered, or raised), in order."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.changed = asyncio.Event()

    async def wait_for(self, path: str) -> None:
        async with asyncio.timeout(WITHIN_S):
            while path not in self.paths:
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def serving_with(rt: Process) -> AsyncIterator[tuple[int, Finished]]:
    app = create_app(
        ApiContext(
            service=rt.service,
            health=rt.health,
            admin_token=ADMIN_TOKEN,
            outbox_admin=OutboxAdmin(rt.db, clock=wall_clock_ms),
            body_read_timeout_s=BODY_TIMEOUT_S,
        )
    )
    finished = Finished()

    async def observed(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                finished.paths.append(scope["path"])
                finished.changed.set()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    protocol = http_protocol(head_timeout_s=HEAD_TIMEOUT_S)
    config = uvicorn.Config(observed, http=protocol, log_config=None, access_log=False, lifespan="off")
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        yield port, finished
    finally:
        server.should_exit = True
        await task
        sock.close()


@contextlib.asynccontextmanager
async def serving(rt: Process) -> AsyncIterator[int]:
    async with serving_with(rt) as (port, _finished):
        yield port


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def assert_error_body(headers: dict[str, str], body: bytes, code: str, *fragments: str) -> dict[str, Any]:
    assert headers["content-type"] == "application/json"
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and parsed["error"]["code"] == code
    for fragment in fragments:
        assert fragment in parsed["error"]["message"], parsed
    return parsed


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello on the plain port
    ],
    ids=["garbage", "version", "header", "tls"],
)
async def test_a_malformed_request_gets_a_json_400(api_runtime: Process, raw: bytes) -> None:
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        status, headers, body = await asyncio.wait_for(read_response(reader), WITHIN_S)
        assert status == 400
        assert headers["connection"] == "close"
        assert_error_body(headers, body, "invalid_argument", "HTTP")
        assert await asyncio.wait_for(reader.read(), WITHIN_S) == b""  # closed
        writer.close()


async def test_a_well_formed_request_still_works(api_runtime: Process) -> None:
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):  # keep-alive
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _headers, body = await asyncio.wait_for(read_response(reader), WITHIN_S)
            assert (status, json.loads(body)) == (200, {"status": "ok"})
        writer.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_trickled_body_is_cut_off_after_the_body_read_timeout(api_runtime: Process, framing: str) -> None:
    head = b"POST /v1/apps/demo/rooms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 1000\r\n\r\n" if framing == "content-length" else b"Transfer-Encoding: chunked\r\n\r\n"
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)

        async def trickle() -> None:  # a byte every 50 ms: never idle, never done
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(b"1\r\n \r\n" if framing == "chunked" else b" ")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        with capture_logs() as logs:
            trickling = asyncio.create_task(trickle())
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                status, headers, body = await asyncio.wait_for(read_response(reader), WITHIN_S)
                rest = await asyncio.wait_for(reader.read(), WITHIN_S)
            finally:
                trickling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await trickling
            elapsed = loop.time() - started
        assert status == 400
        assert_error_body(headers, body, "invalid_argument", "not received within")
        assert headers["connection"] == "close"
        assert rest == b""  # the server closed the connection
        assert elapsed >= BODY_TIMEOUT_S * 0.9
        [line] = [e for e in logs if e["event"] == "room_command_timing"]
        assert (line["command"], line["result"]) == ("CreateRoom", "invalid_argument")
        writer.close()


async def test_a_slow_but_complete_body_within_the_timeout_is_served(api_runtime: Process) -> None:
    body = json.dumps({"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "x"}).encode()
    head = b"POST /v1/apps/demo/rooms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body[:10])
        await writer.drain()
        await asyncio.sleep(BODY_TIMEOUT_S / 5)
        writer.write(body[10:])
        status, _headers, answer = await asyncio.wait_for(read_response(reader), WITHIN_S)
        assert status == 200, answer
        writer.close()


async def test_a_trickled_request_head_gets_a_json_400_after_the_head_timeout(api_runtime: Process) -> None:
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:  # a header byte every 50 ms: never idle, never done
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(b"X")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            status, headers, body = await asyncio.wait_for(read_response(reader), WITHIN_S)
            rest = await asyncio.wait_for(reader.read(), WITHIN_S)
        finally:
            trickling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trickling
        assert status == 400
        assert_error_body(headers, body, "invalid_argument", "request head not received within")
        assert rest == b""
        assert loop.time() - started >= HEAD_TIMEOUT_S * 0.9
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(api_runtime: Process) -> None:
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), WITHIN_S) == b""
        writer.close()


async def test_a_second_request_on_a_kept_alive_connection_gets_its_own_head_deadline(api_runtime: Process) -> None:
    async with serving(api_runtime) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _headers, _body = await asyncio.wait_for(read_response(reader), WITHIN_S)
        assert status == 200
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # and the rest never comes
        status, headers, body = await asyncio.wait_for(read_response(reader), WITHIN_S)
        assert status == 400
        assert_error_body(headers, body, "invalid_argument", "request head")
        writer.close()


@pytest.mark.parametrize("path", ["/v1/apps/demo/rooms/r1/join", "/admin/outbox/replay"])
async def test_a_client_that_leaves_mid_body_is_logged_as_cancelled_not_as_an_error(
    api_runtime: Process, path: str
) -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    head += f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 100\r\n\r\n{{".encode()
    with capture_logs() as logs:
        async with serving_with(api_runtime) as (port, finished):
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            await finished.wait_for(path)
    assert [e for e in logs if e.get("log_level") in ("error", "critical")] == []
    timings = [(e["command"], e["result"]) for e in logs if e["event"] == "room_command_timing"]
    assert timings == ([("JoinRoom", "cancelled")] if "join" in path else [])
