"""Several worker processes against one MariaDB: everything delivered once, kill -9 recovers."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

from roomservice.domain import events as e
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

pytestmark = pytest.mark.slow


async def seed(url: str, count: int) -> None:
    db = Database.from_url(url)
    try:
        await upgrade(db)
        now = time.time_ns() // 1_000_000
        rows = []
        for i in range(count):
            ev = e.Event(uuid.uuid4().hex, "demo", f"r{i % 50}", i + 1, now, e.RoomMicTaken(user_id=f"u{i}", seat=0))
            rows.append(
                dict(event_id=ev.event_id, app_code="demo", room_id=ev.room_id, room_version=ev.room_version,
                     event_type=ev.type, payload=encode_event(ev), status="pending", retry_count=0,
                     targets_done="", due_at_ms=now, created_at_ms=now, updated_at_ms=now)
            )
        async with db.write() as conn:
            for start in range(0, count, 2_000):
                await conn.execute(sa.insert(t.room_outbox), rows[start : start + 2_000])
    finally:
        await db.dispose()


async def statuses(url: str) -> dict[str, int]:
    db = Database.from_url(url)
    try:
        async with db.read() as conn:
            result = await conn.execute(
                sa.select(t.room_outbox.c.status, sa.func.count()).group_by(t.room_outbox.c.status)
            )
            return {status: int(n) for status, n in result.all()}
    finally:
        await db.dispose()


async def owners_of_delivering(url: str) -> set[str]:
    db = Database.from_url(url)
    try:
        async with db.read() as conn:
            result = await conn.execute(
                sa.select(t.room_outbox.c.lock_owner).where(t.room_outbox.c.status == "delivering").distinct()
            )
            return {owner for (owner,) in result.all()}
    finally:
        await db.dispose()


def start_worker(url: str, owner: str, log: Path | None, *extra: str) -> subprocess.Popen[str]:
    logging = ["--log", str(log)] if log is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.worker_proc", "--url", url, "--owner", owner, *logging, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def read_log(path: Path) -> list[tuple[str, str, int, int]]:
    lines = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:  # a kill -9 may cut the last line
            lines.append((parts[0], parts[1], int(parts[2]), int(parts[3])))
    return lines


def assert_no_claim_delivered_twice(lines: list[tuple[str, str, int, int]]) -> None:
    by_event: dict[str, list[tuple[str, str, int, int]]] = defaultdict(list)
    for line in lines:
        by_event[line[0]].append(line)
    for event_id, publishes in by_event.items():
        publishes.sort(key=lambda p: p[3])
        for earlier, later in itertools.pairwise(publishes):
            # a second delivery is only allowed after the first claim's lease ran out
            assert later[3] >= earlier[2], f"{event_id} delivered twice within one valid lease: {publishes}"


async def wait_until_delivered(url: str, total: int, *, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = await statuses(url)
        if counts.get("delivered", 0) == total:
            return counts
        await asyncio.sleep(0.2)
    return await statuses(url)


async def test_four_workers_drain_twenty_thousand_rows(tmp_path: Path, fresh_mariadb_url: str) -> None:
    total = 20_000
    await seed(fresh_mariadb_url, total)
    log = tmp_path / "deliveries.log"
    # all four claim from the same instant: one started first could drain everything alone
    workers = [start_worker(fresh_mariadb_url, f"w{i}", log, "--start-on-sigusr1") for i in range(4)]
    for proc in workers:
        proc.send_signal(signal.SIGUSR1)
    try:
        counts = await wait_until_delivered(fresh_mariadb_url, total, timeout_s=240)
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=30)
    assert counts == {"delivered": total}  # no row left behind, none failed
    lines = read_log(log)
    assert {line[0] for line in lines} == set(await _all_event_ids(fresh_mariadb_url))
    assert len(lines) == total  # nobody lost a lease here, so exactly one delivery per row
    assert_no_claim_delivered_twice(lines)
    assert len({line[1] for line in lines}) == 4  # all four took part


async def test_pipelining_workers_drain_every_row(fresh_mariadb_url: str) -> None:
    """The broker target's shape (the drain benchmark's mq row): acknowledgements 2 ms after each send."""
    total = 3_000
    await seed(fresh_mariadb_url, total)
    workers = [
        start_worker(fresh_mariadb_url, f"worker-p{i:011d}", None, "--pipelined", "--delay-ms", "2",
                     "--batch", "200", "--concurrency", "200", "--start-on-sigusr1")
        for i in range(2)
    ]
    for proc in workers:
        proc.send_signal(signal.SIGUSR1)
    try:
        counts = await wait_until_delivered(fresh_mariadb_url, total, timeout_s=120)
        # every row through the pipeline: one published the serial way would be failed (worker_proc)
        assert counts == {"delivered": total}
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=30)


async def _all_event_ids(url: str) -> list[str]:
    db = Database.from_url(url)
    try:
        async with db.read() as conn:
            return [eid for (eid,) in (await conn.execute(sa.select(t.room_outbox.c.event_id))).all()]
    finally:
        await db.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "mariadb"])
async def test_kill_minus_nine_mid_batch_rows_return_after_the_lease(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/room.db" if backend == "sqlite" else request.getfixturevalue(
        "fresh_mariadb_url"
    )
    total = 400
    await seed(url, total)
    log = tmp_path / "deliveries.log"
    # slow publishes so the victim dies holding a claimed batch
    victim = start_worker(url, "victim", log, "--delay-ms", "200", "--batch", "100", "--lock-s", "1")
    deadline = time.monotonic() + 30
    while "victim" not in await owners_of_delivering(url):
        assert time.monotonic() < deadline, "the victim never claimed anything"
        await asyncio.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    held = await statuses(url)
    assert held.get("delivering", 0) > 0  # it died holding claims
    survivor = start_worker(url, "survivor", log, "--lock-s", "1")
    try:
        counts = await wait_until_delivered(url, total, timeout_s=120)
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(timeout=30)
    assert counts == {"delivered": total}
    lines = read_log(log)
    assert {line[0] for line in lines} == set(await _all_event_ids(url))
    assert any(line[1] == "survivor" for line in lines)
    assert_no_claim_delivered_twice(lines)
