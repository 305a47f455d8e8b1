"""Benchmark of the room write path (issue: write path).

Prints, for SQLite and MariaDB:
  * commands/s of the in-process command path (JoinRoom, concurrency 64, 1,000 rooms)
    beside a raw baseline: the same transaction (guarded room_meta update + command
    log insert + outbox insert, rows of the same sizes) issued by a minimal loop with
    the same driver and concurrency, measured in the same run;
  * p50/p99 command latency; HTTP commands/s against a real server process;
  * Room Cell load time (snapshot + up to snapshot_every_n log rows);
  * resident memory per room for 10,000 rooms of 10 members.

    .venv/bin/python -m bench.command_path [--backend sqlite|mariadb|both] [--commands N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import describe, fresh_database, percentile, run_concurrently
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.cell.cell import RoomCell
from roomservice.config import load_settings
from roomservice.domain import commands as c
from roomservice.domain.decider import decide, replay, stamp
from roomservice.leases.port import Lease
from roomservice.observability.logging import configure_logging
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade

APP = "bench"
CONCURRENCY = 64
ROOMS = 1_000


def _settings(url: str, data_dir: str) -> Any:
    return (
        load_settings()
        .with_data_dir(Path(data_dir))
        .with_overrides({"database.url": url, "database.pool_size": CONCURRENCY, "database.max_overflow": 8})
    )


async def service_run(url: str, commands: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data_dir:
        async with Process.running(_settings(url, data_dir), roles=(API, MAINTENANCE), loops=False) as rt:
            svc = rt.service
            await run_concurrently(
                CONCURRENCY,
                list(range(ROOMS)),
                lambda r: svc.execute(APP, f"room{r}", f"create-{r}", c.CreateRoom(owner_id="owner", title="bench")),
            )
            jobs = list(range(commands))
            start = time.perf_counter()
            latencies = await run_concurrently(
                CONCURRENCY,
                jobs,
                lambda i: svc.execute(APP, f"room{i % ROOMS}", f"join-{i}", c.JoinRoom(user_id=f"user{i}")),
            )
            elapsed = time.perf_counter() - start
            async with rt.db.read() as conn:
                sizes = (
                    await conn.execute(
                        sa.select(
                            sa.func.avg(sa.func.length(t.room_command_log.c.command)),
                            sa.func.avg(sa.func.length(t.room_command_log.c.events)),
                            sa.func.avg(sa.func.length(t.room_command_log.c.response)),
                            sa.select(sa.func.avg(sa.func.length(t.room_outbox.c.payload))).scalar_subquery(),
                        ).where(t.room_command_log.c.command_type == "JoinRoom")
                    )
                ).one()
            load = await cell_load_time(rt)
    return {
        "cps": commands / elapsed,
        "latencies": latencies,
        "sizes": [int(float(x)) for x in sizes],
        "load": load,
    }


async def cell_load_time(rt: Process) -> dict[str, float]:
    """Time store.load_room for a room with a snapshot and snapshot_every_n - 1 log rows after it."""
    n = rt.settings.room.snapshot_every_n
    svc = rt.service
    await svc.execute(APP, "loadroom", "create", c.CreateRoom(owner_id="owner", title="load"))
    for i in range(2 * n - 2):  # versions 2 .. 2n-1: snapshot at n, n-1 rows after it
        await svc.execute(APP, "loadroom", f"j{i}", c.JoinRoom(user_id=f"member{i}"))
    times = []
    for _ in range(200):
        start = time.perf_counter()
        loaded = await rt.store.load_room(APP, "loadroom")
        times.append((time.perf_counter() - start) * 1000)
    assert loaded.snapshot_version == n and loaded.replayed_events == n - 1, loaded
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "log_rows": float(loaded.replayed_events)}


async def raw_run(url: str, commands: int, sizes: list[int], via: str = "async") -> dict[str, Any]:
    """The same transaction, minimal: no domain, no cell, no JSON building, no idempotency lookup."""
    command_len, events_len, response_len, payload_len = sizes
    db = Database.from_url(url, pool_size=CONCURRENCY, max_overflow=8)
    try:
        await upgrade(db)
        async with db.write() as conn:
            await conn.execute(
                sa.insert(t.room_meta),
                [
                    dict(app_code=APP, room_id=f"room{r}", version=1, lease_epoch=0, owner_id="owner", title="b",
                         status="open", seat_count=8, member_count=1, heat=0, created_at_ms=0, updated_at_ms=0)
                    for r in range(ROOMS)
                ],
            )
        versions = dict.fromkeys(range(ROOMS), 1)
        update = (
            sa.update(t.room_meta)
            .where(
                t.room_meta.c.app_code == sa.bindparam("b_app"),
                t.room_meta.c.room_id == sa.bindparam("b_room"),
                t.room_meta.c.version == sa.bindparam("b_version"),
                t.room_meta.c.lease_epoch == sa.bindparam("b_epoch"),
            )
            .values(version=sa.bindparam("version"), member_count=sa.bindparam("member_count"),
                    heat=sa.bindparam("heat"), status=sa.bindparam("status"), title=sa.bindparam("title"),
                    updated_at_ms=sa.bindparam("updated_at_ms"))
        )
        insert_log = sa.insert(t.room_command_log)
        insert_outbox = sa.insert(t.room_outbox)
        blob_command, blob_events, blob_response = "c" * command_len, "e" * events_len, "r" * response_len
        payload = b"p" * payload_len

        def statements(i: int) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
            room = i % ROOMS
            version = versions[room]
            versions[room] = version + 1
            now = time.time_ns() // 1_000_000
            meta = dict(b_app=APP, b_room=f"room{room}", b_version=version, b_epoch=0, version=version + 1,
                        member_count=version, heat=0, status="open", title="b", updated_at_ms=now)
            log = dict(app_code=APP, room_id=f"room{room}", command_id=f"join-{i}", command_type="JoinRoom",
                       fingerprint="f" * 64, command=blob_command, events=blob_events, response=blob_response,
                       version=version + 1, now_ms=now, created_at_ms=now)
            outbox = [dict(event_id=f"ev-{i}", app_code=APP, room_id=f"room{room}", room_version=version + 1,
                           event_type="RoomUserJoined", payload=payload, status="pending", targets_done="",
                           due_at_ms=now, created_at_ms=now, updated_at_ms=now)]
            return meta, log, outbox

        def write_sync(conn: Any, meta: dict[str, Any], log: dict[str, Any], outbox: list[dict[str, Any]]) -> None:
            assert conn.execute(update, meta).rowcount == 1
            conn.execute(insert_log, log)
            conn.execute(insert_outbox, outbox)

        async def one(i: int) -> None:
            meta, log, outbox = statements(i)
            if via == "thread":  # the store's own path: one hop to a worker thread per transaction
                await db.run_write(write_sync, meta, log, outbox)
                return
            async with db.write() as conn:  # the configured async driver, statement by statement
                assert (await conn.execute(update, meta)).rowcount == 1
                await conn.execute(insert_log, log)
                await conn.execute(insert_outbox, outbox)

        start = time.perf_counter()
        latencies = await run_concurrently(CONCURRENCY, list(range(commands)), one)
        elapsed = time.perf_counter() - start
    finally:
        await db.dispose()
    return {"cps": commands / elapsed, "latencies": latencies}


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client on one connection: httpx's pool, shared by 64
    concurrent requests, costs more CPU than the server it measures (measured: /healthz at
    concurrency 64 gave 190 req/s through httpx and 3,087 req/s through this)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> KeepAliveClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode() + data
        )
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def http_run(commands: int) -> dict[str, float]:
    """HTTP commands/s: a real `room-service serve` process on SQLite, clients in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.e2e.server import ServerProcess, write_config

    with tempfile.TemporaryDirectory() as tmp:
        # the outbox worker off: this measures HTTP + the command path, not IM/activity delivery
        config = write_config(Path(tmp) / "c.yaml", extra="outbox_worker: {enabled: false}\n")
        server = ServerProcess(config=config, data_dir=Path(tmp) / "data")
        server.start()
        try:

            async def drive() -> tuple[float, list[float]]:
                clients = [await KeepAliveClient.connect(server.port) for _ in range(CONCURRENCY)]
                rooms = 100
                for r in range(rooms):
                    body = {"command_id": f"c{r}", "room_id": f"h{r}", "owner_id": "o", "title": "t"}
                    await clients[0].post(f"/v1/apps/{APP}/rooms", body)
                jobs = iter(range(commands))
                latencies: list[float] = []

                async def lane(client: KeepAliveClient) -> None:
                    for i in jobs:
                        started = time.perf_counter()
                        body = {"command_id": f"j{i}", "user_id": f"u{i}"}
                        status, answer = await client.post(f"/v1/apps/{APP}/rooms/h{i % rooms}/join", body)
                        assert status == 200, answer
                        latencies.append((time.perf_counter() - started) * 1000)

                start = time.perf_counter()
                await asyncio.gather(*(lane(client) for client in clients))
                elapsed = time.perf_counter() - start
                for client in clients:
                    client.close()
                return commands / elapsed, latencies

            cps, lat = asyncio.run(drive())
        finally:
            server.stop()
    return {"cps": cps, "p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}


def memory_per_room(rooms: int = 10_000, members: int = 10) -> dict[str, float]:
    """Resident memory of active cells: 10,000 rooms of 10 members held as RoomCells."""
    rules = load_settings().room_rules()
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    snap_before = tracemalloc.take_snapshot()
    cells: dict[tuple[str, str], RoomCell] = {}
    now = 1_780_000_000_000
    for r in range(rooms):
        state = None
        events = []
        cmds: list[c.Command] = [c.CreateRoom(owner_id="owner0", title=f"room {r}")]
        cmds += [c.JoinRoom(user_id=f"user{r}-{m}") for m in range(1, members)]
        for n, cmd in enumerate(cmds):
            payloads = decide(state, cmd, now_ms=now, rules=rules)
            events = stamp(payloads, state=state, app_code=APP, room_id=f"room{r}", now_ms=now,
                           new_event_id=lambda r=r, n=n: f"{r}-{n}")
            state = replay(state, events)
        cells[(APP, f"room{r}")] = RoomCell(app_code=APP, room_id=f"room{r}", state=state, epoch=1,
                                            lease=Lease(APP, f"room{r}", "t", float("inf")))
    gc.collect()
    traced = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap_before, "filename"))
    tracemalloc.stop()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert len(cells) == rooms
    return {"traced_bytes_per_room": traced / rooms, "rss_kib_per_room": (rss_after - rss_before) / rooms}


def report(backend: str, svc: dict[str, Any], raws: dict[str, dict[str, Any]]) -> None:
    for via, raw in raws.items():
        ratio = svc["cps"] / raw["cps"]
        print(f"[{backend}] command path: {svc['cps']:8.0f} cmd/s   raw baseline ({via}): {raw['cps']:8.0f} tx/s   "
              f"ratio {ratio:.2f}x (target >= 0.70)")
    print(f"[{backend}] command latency: {describe(svc['latencies'])}")
    for via, raw in raws.items():
        print(f"[{backend}] raw latency ({via}): {describe(raw['latencies'])}")
    print(f"[{backend}] row sizes (command, events, response, outbox payload bytes): {svc['sizes']}")
    load = svc["load"]
    print(f"[{backend}] Room Cell load (snapshot + {int(load['log_rows'])} log rows): "
          f"p50 {load['p50']:.2f} ms, p99 {load['p99']:.2f} ms")


async def bench_backend(backend: str, commands: int) -> None:
    async with fresh_database(backend) as url:
        svc = await service_run(url, commands)
    raws = {}
    # SQLite: both the configured async driver (aiosqlite) and the store's own one-hop thread path.
    for via in ("async", "thread") if backend == "sqlite" else ("async",):
        async with fresh_database(backend) as url:
            raws[via] = await raw_run(url, commands, svc["sizes"], via)
    report(backend, svc, raws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="both")
    parser.add_argument("--commands", type=int, default=10_000)
    parser.add_argument("--http-commands", type=int, default=3_000)
    args = parser.parse_args()
    # room_command_timing stays on (it is part of the command path) but goes nowhere.
    configure_logging(level="info", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    backends = ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]
    print(f"room-service write path benchmark: {args.commands} JoinRoom commands, concurrency {CONCURRENCY}, "
          f"{ROOMS} rooms; python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    for backend in backends:
        asyncio.run(bench_backend(backend, args.commands))
    http = http_run(args.http_commands)
    print(f"[http/sqlite] {http['cps']:.0f} cmd/s over HTTP (client and server on this machine, outbox worker off), "
          f"p50 {http['p50']:.1f} ms, p99 {http['p99']:.1f} ms")
    mem = memory_per_room()
    print(f"[memory] 10,000 rooms x 10 members: {mem['traced_bytes_per_room'] / 1024:.1f} KiB/room allocated "
          f"(tracemalloc), {mem['rss_kib_per_room']:.1f} KiB/room resident (max RSS delta)")


if __name__ == "__main__":
    main()
