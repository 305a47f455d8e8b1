"""``room-service serve`` over a real socket: uvicorn's own 400 is JSON, and http.body_read_timeout takes effect."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.e2e.server import ServerProcess, write_config

WITHIN_S = 15.0  # generous: the bound under test is 0.3 s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root: Path = tmp_path_factory.mktemp("edge")
    config = write_config(root / "edge.yaml", extra="http:\n  body_read_timeout: 300ms\n")
    proc = ServerProcess(config=config, data_dir=root / "data")
    proc.start()
    yield proc
    proc.stop()


def _exchange(server: ServerProcess, raw: bytes, *, trickle: bytes = b"") -> tuple[bytes, float]:
    """Send ``raw`` (then ``trickle`` a byte every 50 ms) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WITHIN_S) as sock:
        started = time.monotonic()
        sock.sendall(raw)
        sock.settimeout(0.05)
        received = b""
        deadline = started + WITHIN_S
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if trickle:
                    try:
                        sock.sendall(trickle)
                    except OSError:
                        break
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        return received, time.monotonic() - started


def _split(answer: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def test_a_malformed_request_line_answers_json(server: ServerProcess) -> None:
    answer, _ = _exchange(server, b"NOT AN HTTP REQUEST\r\n\r\n")
    status, headers, body = _split(answer)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_argument"  # type: ignore[index]


def test_the_configured_body_read_timeout_cuts_a_trickled_body_off(server: ServerProcess) -> None:
    head = (
        b"POST /v1/apps/demo/rooms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n{"
    )
    answer, elapsed = _exchange(server, head, trickle=b" ")
    status, headers, body = _split(answer)
    assert status == 400
    assert headers["connection"] == "close"
    assert body == {"error": {"code": "invalid_argument", "message": "request body not received within 0.3s"}}
    assert elapsed < WITHIN_S


def test_a_trailing_slash_is_404_not_a_redirect(server: ServerProcess) -> None:
    resp = httpx.get(f"{server.url}/v1/gifts/", follow_redirects=False)
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"
