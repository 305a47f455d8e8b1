"""Store write path and group commit beside the bare driver (issue 12).

    python -m bench.group_commit [--backend sqlite|mariadb|both] [--commands N]

Three figures per backend, measured in the same run, concurrency 64 over 1,000 rooms:

* **bare driver**: asyncmy (MariaDB) or sqlite3 (SQLite, WAL, synchronous=NORMAL,
  one writer, a plain loop) doing the seed's shape, one transaction per command:
  guarded room_meta UPDATE + command log INSERT + outbox INSERT + COMMIT, with the
  rows the store writes for the same commands (built before the clock starts).
* **store**: ``SqlRoomStore.save_mutation`` for the same mutations (its row
  building included), and how many transactions it committed for them.
* **command path**: ``RoomService.execute(JoinRoom)`` in process, as
  ``bench.command_path`` runs it.

``--latency``: commit -> delivered (from the command's commit notification to the return of the
worker's transaction with the row's finish, ``bench.timeline``, perf_counter; the rows'
whole-millisecond created_at_ms -> delivered_at_ms beside it, and the timeline's steps) at
200 events/s in direct mode with instant publishers, the worker in the same process as
the commands, beside the p99 of one bare claim + finish cycle (bench.bare) in the same run: 200
cycles back to back, and as many cycles as events paced at the same rate (the p99 then samples
as long a stretch of the machine's time as the latency run does), and the process's CPU per
event over the run (commands and worker, all threads).

Ratios are against the bare driver of the same run. The store's transaction count
comes from its group-commit counters.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sqlite3
import sys
import tempfile
import time
from typing import Any

from bench.command_path import service_run
from bench.common import DIRECT_MODE, describe, fresh_database, run_concurrently
from roomservice.config import load_settings
from roomservice.domain import commands as c
from roomservice.domain.decider import decide, replay, stamp
from roomservice.domain.state import RoomState
from roomservice.observability.logging import configure_logging
from roomservice.store import sql as store_sql
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.store.port import Mutation
from roomservice.store.sql import SqlRoomStore

APP = "bench"
CONCURRENCY = 64
ROOMS = 1_000


# --------------------------------------------------------------------------- workload


def build_mutations(commands: int) -> tuple[list[Mutation], list[Mutation]]:
    """(creates, joins): one CreateRoom per room, then ``commands`` JoinRooms round-robin."""
    rules = load_settings().room_rules()
    now = 1_780_000_000_000
    states: dict[int, RoomState | None] = {}
    counter = iter(range(10**9))

    def mutation(room: int, command_id: str, command: c.Command) -> Mutation:
        before = states.get(room)
        payloads = decide(before, command, now_ms=now, rules=rules)
        events = stamp(
            payloads,
            state=before,
            app_code=APP,
            room_id=f"room{room}",
            now_ms=now,
            new_event_id=lambda: f"ev-{next(counter)}",
        )
        after = replay(before, events)
        states[room] = after
        assert after is not None
        return Mutation(
            app_code=APP,
            room_id=f"room{room}",
            command_id=command_id,
            command_type=command.name,
            fingerprint="f" * 64,
            command=command.to_dict(),
            events=tuple(events),
            response={"version": after.version, "events": [ev.event_id for ev in events]},
            now_ms=now,
            expected_version=0 if before is None else before.version,
            epoch=1,
            state_after=after,
        )

    creates = [mutation(r, f"create-{r}", c.CreateRoom(owner_id="owner", title="bench")) for r in range(ROOMS)]
    joins = [mutation(i % ROOMS, f"join-{i}", c.JoinRoom(user_id=f"user{i}")) for i in range(commands)]
    return creates, joins


def by_room(mutations: list[Mutation]) -> list[list[Mutation]]:
    """Each room's mutations in order: one lane per room, as a cell submits them."""
    lanes: dict[str, list[Mutation]] = {}
    for m in mutations:
        lanes.setdefault(m.room_id, []).append(m)
    return list(lanes.values())


async def in_room_order(mutations: list[Mutation], save: Any) -> list[float]:
    """``save(m)`` for every mutation, ``CONCURRENCY`` at a time, each room's in order."""
    pending = {m.room_id: asyncio.Lock() for m in mutations}

    async def one(m: Mutation) -> None:
        async with pending[m.room_id]:
            await save(m)

    return await run_concurrently(CONCURRENCY, list(mutations), one)


def bare_rows(m: Mutation) -> tuple[tuple[Any, ...], tuple[Any, ...], list[tuple[Any, ...]]]:
    """The store's own rows for ``m``, as positional parameters of the bare statements."""
    assert m.state_after is not None
    guard, values = store_sql._meta_write(m, m.state_after)
    assert guard is not None
    meta = (
        values["version"],
        values["status"],
        values["title"],
        values["member_count"],
        values["heat"],
        values["updated_at_ms"],
        guard["b_app_code"],
        guard["b_room_id"],
        guard["b_expected_version"],
        guard["b_epoch"],
    )
    log = store_sql._command_row(m, m.state_after)
    outbox = [store_sql._outbox_row(ev, m.now_ms) for ev in m.events]
    return meta, tuple(log[k] for k in LOG_COLUMNS), [tuple(o[k] for k in OUTBOX_COLUMNS) for o in outbox]


LOG_COLUMNS = (
    "app_code",
    "room_id",
    "command_id",
    "command_type",
    "fingerprint",
    "command",
    "events",
    "response",
    "version",
    "now_ms",
    "created_at_ms",
)
OUTBOX_COLUMNS = (
    "event_id",
    "app_code",
    "room_id",
    "room_version",
    "event_type",
    "payload",
    "status",
    "targets_done",
    "due_at_ms",
    "created_at_ms",
    "updated_at_ms",
)
UPDATE_META = (
    "UPDATE room_meta SET version={p}, status={p}, title={p}, member_count={p}, heat={p}, "
    "updated_at_ms={p} WHERE app_code={p} AND room_id={p} AND version={p} AND lease_epoch={p}"
)


def insert_sql(table: str, columns: tuple[str, ...], p: str) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join([p] * len(columns))})"


# --------------------------------------------------------------------------- runs


async def store_run(url: str, creates: list[Mutation], joins: list[Mutation]) -> dict[str, Any]:
    db = Database.from_url(url, pool_size=CONCURRENCY, max_overflow=8)
    try:
        await upgrade(db)
        store = SqlRoomStore(db)
        await in_room_order(creates, store.save_mutation)
        before = store.group_commit_stats()
        start = time.perf_counter()
        latencies = await in_room_order(joins, store.save_mutation)
        elapsed = time.perf_counter() - start
        after = store.group_commit_stats()
    finally:
        await db.dispose()
    return {
        "cps": len(joins) / elapsed,
        "latencies": latencies,
        "transactions": after["transactions"] - before["transactions"],
    }


async def bare_mariadb_run(url: str, creates: list[Mutation], joins: list[Mutation]) -> dict[str, Any]:
    import asyncmy
    from sqlalchemy.engine import make_url

    db = Database.from_url(url)
    try:
        await upgrade(db)
        await in_room_order(creates, SqlRoomStore(db).save_mutation)
    finally:
        await db.dispose()
    u = make_url(url)
    pool = await asyncmy.create_pool(
        minsize=CONCURRENCY,
        maxsize=CONCURRENCY,
        host=u.host,
        port=u.port or 3306,
        user=u.username,
        password=u.password or "",
        db=u.database,
        charset="utf8mb4",
        autocommit=False,
    )
    update = UPDATE_META.format(p="%s")
    log_sql = insert_sql("room_command_log", LOG_COLUMNS, "%s")
    outbox_sql = insert_sql("room_outbox", OUTBOX_COLUMNS, "%s")
    rows = {m.command_id: bare_rows(m) for m in joins}

    async def one(m: Mutation) -> None:
        meta, log, outbox = rows[m.command_id]
        async with pool.acquire() as conn:
            async with conn.cursor() as cur:
                assert await cur.execute(update, meta) == 1
                await cur.execute(log_sql, log)
                await cur.executemany(outbox_sql, outbox)
            await conn.commit()

    try:
        start = time.perf_counter()
        latencies = await in_room_order(joins, one)
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
        await pool.wait_closed()
    return {"cps": len(joins) / elapsed, "latencies": latencies, "transactions": len(joins)}


async def bare_sqlite_run(url: str, creates: list[Mutation], joins: list[Mutation]) -> dict[str, Any]:
    db = Database.from_url(url)
    try:
        await upgrade(db)
        store = SqlRoomStore(db)
        await in_room_order(creates, store.save_mutation)
    finally:
        await db.dispose()
    path = url.split("///", 1)[1]
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL", "PRAGMA foreign_keys=ON"):
        conn.execute(pragma)
    update = UPDATE_META.format(p="?")
    log_sql = insert_sql("room_command_log", LOG_COLUMNS, "?")
    outbox_sql = insert_sql("room_outbox", OUTBOX_COLUMNS, "?")
    rows = [bare_rows(m) for m in joins]
    latencies = []
    start = time.perf_counter()
    for meta, log, outbox in rows:  # one writer, one transaction per command
        began = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        assert conn.execute(update, meta).rowcount == 1
        conn.execute(log_sql, log)
        conn.executemany(outbox_sql, outbox)
        conn.execute("COMMIT")
        latencies.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - start
    conn.close()
    return {"cps": len(joins) / elapsed, "latencies": latencies, "transactions": len(joins)}


async def bench_backend(backend: str, commands: int, *, with_service: bool) -> None:
    creates, joins = build_mutations(commands)
    bare_run = bare_sqlite_run if backend == "sqlite" else bare_mariadb_run
    async with fresh_database(backend) as url:
        bare = await bare_run(url, creates, joins)
    async with fresh_database(backend) as url:
        store = await store_run(url, creates, joins)
    print(f"[{backend}] bare driver: {bare['cps']:8.0f} tx/s    {describe(bare['latencies'])}")
    print(
        f"[{backend}] store:       {store['cps']:8.0f} mut/s   {describe(store['latencies'])}   "
        f"ratio {store['cps'] / bare['cps']:.2f}x; {store['transactions']} transactions for {commands} mutations"
    )
    if with_service:
        async with fresh_database(backend) as url:
            svc = await service_run(url, commands)
        print(
            f"[{backend}] command path:{svc['cps']:8.0f} cmd/s   {describe(svc['latencies'])}   "
            f"ratio {svc['cps'] / bare['cps']:.2f}x (target >= 0.5; MariaDB with group commit > 1)"
        )


LATENCY_ROOMS = 100


async def commit_to_delivered(backend: str, *, rate: int, seconds: float, linger_ms: float | None = None) -> None:
    from pathlib import Path

    import sqlalchemy as sa

    from bench.bare import claim_finish_cycles
    from bench.common import percentile
    from bench.outbox_drain import InstantPublisher, seed
    from bench.timeline import Timeline
    from roomservice.bootstrap import Process
    from roomservice.store import tables as t

    async with fresh_database(backend) as url:
        with tempfile.TemporaryDirectory() as data_dir:
            settings = (
                load_settings().with_data_dir(Path(data_dir)).with_overrides({"database.url": url, **DIRECT_MODE})
            )
            publishers: dict[str, Any] = {"im": InstantPublisher("im"), "activity": InstantPublisher("activity")}
            async with Process.running(settings, publishers=publishers) as rt:
                svc = rt.service
                timeline = Timeline()
                timeline.attach(rt)
                if linger_ms is not None and rt.worker is not None:  # to compare, in the same code
                    rt.worker.options = dataclasses.replace(rt.worker.options, finish_linger_s=linger_ms / 1000)
                # many rooms, as in production: one room of thousands of members measures its growing answer
                for r in range(LATENCY_ROOMS):
                    await svc.execute(APP, f"lat{r}", "create", c.CreateRoom(owner_id="o", title="latency"))
                total = int(rate * seconds)
                start, cpu_start = time.perf_counter(), time.process_time()
                for i in range(total):  # open loop: one command every 1/rate s
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    room = f"lat{i % LATENCY_ROOMS}"
                    await timeline.execute(svc, i, APP, room, f"j{i}", c.JoinRoom(user_id=f"u{i}"))
                rows: list[Any] = []
                for _ in range(300):  # until everything is delivered, at most 30 s
                    async with rt.db.read() as conn:
                        rows = list(
                            await conn.execute(
                                sa.select(t.room_outbox.c.created_at_ms, t.room_outbox.c.delivered_at_ms).where(
                                    t.room_outbox.c.event_type == "RoomUserJoined"
                                )
                            )
                        )
                    if len(rows) == total and all(d is not None for _, d in rows):
                        break
                    await asyncio.sleep(0.1)
                cpu_ms = (time.process_time() - cpu_start) * 1000 / total  # process, all threads, per event
                batches = rt.worker.batches if rt.worker is not None else 0
    lat = [float(d - c_) for c_, d in rows if d is not None]
    async with fresh_database(backend) as url:
        await seed(url, 200)
        cycle = await claim_finish_cycles(url, 200)
    async with fresh_database(backend) as url:
        await seed(url, total)
        paced = await claim_finish_cycles(url, total, rate=rate)
    precise = timeline.total()
    p99, bare_p99, paced_p99 = percentile(precise, 0.99), percentile(cycle, 0.99), percentile(paced, 0.99)
    print(
        f"[{backend}] commit -> delivered at {rate} events/s (direct mode, instant publishers, worker in process), "
        f"from the command's commit notification to the return of the transaction with its row's finish "
        f"(perf_counter): p50 {percentile(precise, 0.5):.2f} ms, p99 {p99:.2f} ms over {len(precise)}/{total} events "
        f"in {batches} batches; process CPU {cpu_ms:.2f} ms per event (commands and worker, until all delivered); "
        f"bare claim+finish cycle p50 {percentile(cycle, 0.5):.2f} ms, p99 {bare_p99:.2f} ms (200 back to back), "
        f"p50 {percentile(paced, 0.5):.2f} ms, p99 {paced_p99:.2f} ms ({total} paced at {rate}/s); "
        f"p99 ratio {p99 / max(bare_p99, 1e-9):.1f}x / {p99 / max(paced_p99, 1e-9):.1f}x (target <= 3x)\n"
        f"[{backend}]   rows' created_at_ms -> delivered_at_ms (decided, before the commit -> delivery decided, "
        f"whole ms): p50 {percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms over {len(lat)} rows\n"
        f"[{backend}]   timeline, per event:\n{timeline.report(f'[{backend}]')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="both")
    parser.add_argument("--commands", type=int, default=10_000)
    parser.add_argument("--no-service", action="store_true", help="skip the command-path figure")
    parser.add_argument("--latency", action="store_true", help="commit -> delivered instead of the write path")
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--finish-linger-ms", type=float, help="the worker's finish_linger_s for this run, in ms")
    args = parser.parse_args()
    configure_logging(level="info", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print(
        f"store write path: {args.commands} JoinRoom mutations, concurrency {CONCURRENCY}, {ROOMS} rooms; "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus"
    )
    for backend in ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]:
        if args.latency:
            asyncio.run(
                commit_to_delivered(backend, rate=args.rate, seconds=args.seconds, linger_ms=args.finish_linger_ms)
            )
            continue
        asyncio.run(bench_backend(backend, args.commands, with_service=not args.no_service))


if __name__ == "__main__":
    main()
