"""`room-service worker` on Redis leases serves the room API its leases name (issue 10), as real processes.

A ``serve`` process (A) creates a room and starts a treasure countdown, then is
killed (-9). Its lease expires (ttl 2s) before the box is due (4s); when it is, the
worker's timers open it through the worker's forwarder, which takes the room's
lease at the worker's address. A new ``serve`` process (B) then gets a command for
the room: it forwards it to the worker in one hop and answers 200 (without the
room API on the worker it answered 503 until the worker's lease expired, which
it never did while the worker held the cell). SIGTERM then stops the worker with
exit status 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.cluster import (
    APP,
    SECRET,
    SHARED_REDIS,
    Stream,
    cluster_config,
    nats_stream,
    owner_address,
    redis_prefix,
)
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

TREASURE = "treasure: {levels: [10, 20], countdown_seconds: 4}\n"
# a row the killed process had claimed comes back soon
FAST_OUTBOX = 'poll_interval: "200ms", publish_timeout: "500ms", lock_timeout: "1s"'
ROOMS = f"/v1/apps/{APP}/rooms"


@pytest.fixture
def stream(require_service: Any) -> Iterator[Stream]:
    require_service("NATS", "127.0.0.1", 4222)
    with nats_stream() as value:
        yield value


@pytest.fixture
def prefix() -> Iterator[str]:
    with redis_prefix() as value:
        yield value


class WorkerProcess:
    """``room-service worker`` as a child; its bound room API port comes from the grpc-port file."""

    def __init__(self, config: Path, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = data_dir / "worker.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "roomservice.cli", "worker", "--config", str(config), "--data-dir", str(data_dir)],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "ROOMSERVICE_GRPC_SHARED_SECRET": SECRET},
        )

    def grpc_target(self, *, timeout_s: float = 30.0) -> str:
        port_file = self.data_dir / "grpc-port"
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never said where its room API is"
            time.sleep(0.05)
        return f"127.0.0.1:{port_file.read_text().strip()}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


async def post_ok(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await http.post(url, json=body)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def test_a_room_the_worker_took_over_is_served_through_the_worker(
    tmp_path: Path, fresh_mariadb_url: str, prefix: str, stream: Stream
) -> None:
    config = cluster_config(
        tmp_path / "c.yaml",
        database_url=fresh_mariadb_url,
        redis_url=SHARED_REDIS,
        prefix=prefix,
        stream=stream,
        outbox_worker=FAST_OUTBOX,
        extra=TREASURE,
    )
    env = {"ROOMSERVICE_GRPC_SHARED_SECRET": SECRET}
    a = ServerProcess(config=config, data_dir=tmp_path / "a", env=env)
    b = ServerProcess(config=config, data_dir=tmp_path / "b", env=env)
    worker = WorkerProcess(config, tmp_path / "w")
    try:
        worker_target = worker.grpc_target()
        a.start()
        async with httpx.AsyncClient(timeout=10) as http:
            create = {"command_id": "c1", "room_id": "t1", "owner_id": "alice", "title": "t"}
            await post_ok(http, f"{a.url}{ROOMS}", create)
            await post_ok(http, f"{a.url}{ROOMS}/t1/join", {"command_id": "c2", "user_id": "bob"})
            gift = {"command_id": "c3", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 1}
            sent = await post_ok(http, f"{a.url}{ROOMS}/t1/gifts", gift)
            open_at_ms = sent["room"]["treasure"]["open_at_ms"]
            a.kill()  # before the box is due; its lease expires before it is
            assert time.time() * 1000 < open_at_ms
            deadline = time.monotonic() + 30
            while owner_address(SHARED_REDIS, prefix, "t1") != worker_target:  # the worker's timer took the room
                assert time.monotonic() < deadline, f"the worker never took the room: {worker.log.read_text()[-2000:]}"
                await asyncio.sleep(0.1)
            b.start()
            joined = await post_ok(http, f"{b.url}{ROOMS}/t1/join", {"command_id": "c4", "user_id": "carol"})
            assert joined["version"] == sent["version"] + 2  # after the box the worker opened
            assert joined["room"]["treasure"]["level"] == 1
            assert owner_address(SHARED_REDIS, prefix, "t1") == worker_target  # answered by the worker, in one hop
            view = (await http.get(f"{b.url}{ROOMS}/t1")).json()
            assert [m["user_id"] for m in view["members"]] == ["alice", "bob", "carol"]
    finally:
        a.kill()
        b.kill()
        code = worker.stop()
    assert code == 0, worker.log.read_text()[-2000:]
