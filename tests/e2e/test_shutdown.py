"""SIGTERM and SIGINT on real ``serve`` and ``worker`` processes under load.

A graceful stop closes the listener, lets the requests in flight answer, hands
the outbox claims back, logs ``shutdown_complete`` and exits 0; a second
signal (or a stop past its deadline) gives up at once with exit 1.

To have requests and claims in flight at the signal, deterministically:

* gifts debit an HTTP wallet (tests/wallet_server.py) that holds every call
  until the test releases it, so the test knows which requests are in flight;
* the activity target is a gRPC server that never answers, so every publish
  waits out ``publish_timeout`` and a room's rows keep the worker's batch (and
  its claims) busy past the stop's grace.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from tests.e2e.server import ServerProcess, write_config
from tests.service.test_outbox_admin import gift_event, insert_rows, outbox_row
from tests.wallet_server import running_wallet_server

from roomservice.activity.service import SERVICE_NAME
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade

pytestmark = pytest.mark.slow

APP = "demo"
IN_FLIGHT_GIFTS = 6
PUBLISH_TIMEOUT = "2s"


@asynccontextmanager
async def hung_activity_service() -> AsyncIterator[str]:
    """An activity gRPC server whose HandleRoomEvent never answers (a hung peer): each
    publish waits out its deadline, so a room's rows keep a batch busy for long."""
    release = asyncio.Event()

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await release.wait()
        return b""

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"HandleRoomEvent": grpc.unary_unary_rpc_method_handler(handle)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        release.set()
        await server.stop(grace=None)


def log_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "event" in record:
                events.append(record)
    return events


def named(path: Path, event: str) -> list[dict[str, Any]]:
    return [r for r in log_events(path) if r["event"] == event]


async def eventually(check: Callable[[], bool], what: str, *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def outbox_counts(db_path: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM room_outbox GROUP BY status").fetchall())


def delivering_rows(db_path: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10) as conn:
        query = "SELECT event_id, lock_owner FROM room_outbox WHERE status = 'delivering'"
        return [(row[0], row[1]) for row in conn.execute(query).fetchall()]


async def post(http: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(f"{url}/v1/apps/{APP}/rooms{path}", json=body, headers={"Connection": "close"})


async def room_with_giver(http: httpx.AsyncClient, url: str, room: str) -> None:
    body = {"command_id": f"create-{room}", "room_id": room, "owner_id": "owner", "title": "t"}
    (await post(http, url, "", body)).raise_for_status()
    (await post(http, url, f"/{room}/join", {"command_id": f"join-{room}", "user_id": "giver"})).raise_for_status()


def send_gift(http: httpx.AsyncClient, url: str, room: str) -> asyncio.Task[httpx.Response]:
    body = {"command_id": f"gift-{room}", "sender_id": "giver", "receiver_id": "owner", "gift_id": "rose", "count": 1}
    return asyncio.create_task(post(http, url, f"/{room}/gifts", body))


@asynccontextmanager
async def serving(config: Path, data_dir: Path) -> AsyncIterator[tuple[subprocess.Popen[bytes], Path, str]]:
    """A ``serve`` child (tests/e2e/server.py): its process, log file and base URL; killed after."""
    server = ServerProcess(config=config, data_dir=data_dir)
    server.start()
    assert server.proc is not None
    try:
        yield server.proc, server.log, server.url
    finally:
        server.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_serve_stops_gracefully_under_load(tmp_path: Path, sig: signal.Signals) -> None:
    db_path = tmp_path / "room.db"
    async with (
        running_wallet_server(starting_balance=10**9, slow_ms=60_000) as wallet,
        hung_activity_service() as activity,
    ):
        config = info_config(
            tmp_path / "serve.yaml",
            database_url=f"sqlite+aiosqlite:///{db_path}",
            extra=(
                f'wallet: {{driver: http, url: "{wallet.base_url}", timeout: "30s"}}\n'
                f'activity: {{target: "{activity}"}}\n'
                f'outbox_worker: {{publish_timeout: "{PUBLISH_TIMEOUT}", lock_timeout: "60s", batch_size: 50}}\n'
            ),
        )
        async with serving(config, tmp_path / "data") as (proc, log_path, url), httpx.AsyncClient(timeout=30.0) as http:
            # a room runs one command at a time: one room per gift puts every gift at the wallet
            gift_rooms = [f"gift-{i}" for i in range(IN_FLIGHT_GIFTS)]
            for room in ["r1", "r2", *gift_rooms]:
                await room_with_giver(http, url, room)

            answered: list[int] = []
            load_errors: list[BaseException] = []
            signalled = asyncio.Event()

            async def load(n: int) -> None:
                i = 0
                while True:
                    i += 1
                    body = {"command_id": f"load-{n}-{i}", "user_id": f"u-{n}-{i}"}
                    try:
                        response = await post(http, url, f"/r{1 + n % 2}/join", body)
                    except httpx.HTTPError as exc:
                        # once the listener closes, new connections are refused (or, for a
                        # connection caught in the accept backlog, reset): that is the stop
                        if not signalled.is_set():
                            load_errors.append(exc)
                        return
                    answered.append(response.status_code)

            loaders = [asyncio.create_task(load(n)) for n in range(8)]
            gifts = [send_gift(http, url, room) for room in gift_rooms]
            # every gift is inside the service (held at the wallet), and claims are out
            await wallet.counters.wait_for("debit", IN_FLIGHT_GIFTS, timeout_s=20)
            await eventually(lambda: len(answered) >= 50, "the load never got going")
            # a batch holding several rows of one room outlasts the stop's grace
            await eventually(lambda: outbox_counts(db_path).get("delivering", 0) >= 10, "few rows delivering")

            signalled.set()
            proc.send_signal(sig)
            await eventually(lambda: bool(named(log_path, "shutdown_requested")), "no shutdown_requested")
            # the listener is closing: the held gifts may now finish
            wallet.switches.slow_ms = 0
            wallet.release()
            responses = await asyncio.gather(*gifts, return_exceptions=True)
            await asyncio.gather(*loaders)
            code = await asyncio.to_thread(proc.wait, 60)

    assert code == 0, log_path.read_text(errors="replace")[-3000:]
    # in-flight requests were answered, not reset
    assert [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in responses] == [200] * IN_FLIGHT_GIFTS
    assert load_errors == []
    assert answered and set(answered) <= {200}, sorted(set(answered))
    # claims handed back: nothing left delivering (only this process claimed)
    assert delivering_rows(db_path) == []
    (started,) = named(log_path, "outbox_worker_started")
    (released,) = named(log_path, "outbox_claims_released")
    assert released["owner"] == started["owner"] and released["rows"] > 0
    (complete,) = named(log_path, "shutdown_complete")
    assert complete["signal"] == sig.name
    assert 0 < complete["elapsed_ms"] < 30_000
    events = [r["event"] for r in log_events(log_path)]
    assert (
        events.index("shutdown_requested") < events.index("outbox_claims_released") < events.index("shutdown_complete")
    )
    assert events[-1] == "shutdown_complete"


async def test_a_second_signal_gives_up_at_once(tmp_path: Path) -> None:
    db_path = tmp_path / "room.db"
    async with running_wallet_server(starting_balance=10**9, slow_ms=60_000) as wallet:
        config = info_config(
            tmp_path / "serve.yaml",
            database_url=f"sqlite+aiosqlite:///{db_path}",
            extra=f'wallet: {{driver: http, url: "{wallet.base_url}", timeout: "30s"}}\n',
        )
        async with serving(config, tmp_path / "data") as (proc, log_path, url), httpx.AsyncClient(timeout=30.0) as http:
            await room_with_giver(http, url, "r0")
            gift = send_gift(http, url, "r0")
            await wallet.counters.wait_for("debit", 1, timeout_s=20)
            proc.send_signal(signal.SIGTERM)  # the stop now waits for the held gift
            await eventually(lambda: bool(named(log_path, "shutdown_requested")), "no shutdown_requested")
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 20)
            wallet.release()
            with suppress(httpx.HTTPError):
                await gift
    assert code == 1, log_path.read_text()[-3000:]
    (forced,) = named(log_path, "shutdown_forced")
    assert forced["signal"] == "SIGTERM"
    assert not named(log_path, "shutdown_complete")


async def test_worker_stops_gracefully_under_load(tmp_path: Path) -> None:
    db_path = tmp_path / "room.db"
    url = f"sqlite+aiosqlite:///{db_path}"
    now = time.time_ns() // 1_000_000
    db = Database.from_url(url)
    try:
        await upgrade(db)
        # two rooms with many rows each: a room's rows are published one after another,
        # so the batch outlasts the worker's stop grace and its claims must be handed back
        rows = [
            outbox_row(gift_event(f"g-{room}-{v}", app=APP, room=room, version=v), created_at_ms=now)
            for room in ("r1", "r2")
            for v in range(1, 21)
        ]
        await insert_rows(db, rows)
    finally:
        await db.dispose()
    log_path = tmp_path / "worker.log"
    async with hung_activity_service() as activity:
        config = info_config(
            tmp_path / "worker.yaml",
            database_url=url,
            extra=(
                f'activity: {{target: "{activity}"}}\n'
                f'outbox_worker: {{publish_timeout: "{PUBLISH_TIMEOUT}", lock_timeout: "60s", batch_size: 50}}\n'
            ),
        )
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roomservice.cli",
                    "worker",
                    "--config",
                    str(config),
                    "--data-dir",
                    str(tmp_path),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            await eventually(lambda: outbox_counts(db_path).get("delivering", 0) > 0, "the worker claimed nothing")
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0, log_path.read_text()[-3000:]
    (started,) = named(log_path, "outbox_worker_started")
    (released,) = named(log_path, "outbox_claims_released")
    assert released["owner"] == started["owner"] and released["rows"] > 0
    assert delivering_rows(db_path) == []
    assert sum(outbox_counts(db_path).values()) == 40
    (complete,) = named(log_path, "shutdown_complete")
    assert complete["signal"] == "SIGTERM" and complete["elapsed_ms"] < 30_000


def info_config(path: Path, *, database_url: str, extra: str) -> Path:
    """A test config (tests/e2e/server.py's) that logs at info, where the stop lines are."""
    write_config(path, database_url=database_url, extra=extra)
    path.write_text(
        path.read_text().replace("logging: {level: warning, json: true}", "logging: {level: info, json: true}")
    )
    return path


STUCK_STOP = """
import asyncio, os, signal, time
from roomservice.cli.shutdown import GracefulStop
from roomservice.observability.logging import configure_logging

configure_logging()

async def main():
    stop = GracefulStop(deadline_s=0.5).install()
    os.kill(os.getpid(), signal.SIGTERM)
    await stop.requested.wait()
    {stuck}
    stop.complete()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "stuck",
    ["await asyncio.Event().wait()", "time.sleep(120)"],
    ids=["an await that never returns", "a blocked event loop"],
)
def test_a_stop_past_its_deadline_gives_up_with_exit_1(stuck: str) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STUCK_STOP.format(stuck=stuck)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 30  # far below the 120 s the stop would have taken
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["event"] for r in records] == ["shutdown_requested", "shutdown_deadline_exceeded"]
    assert records[1]["elapsed_ms"] >= 500 and records[1]["deadline_ms"] == 500
