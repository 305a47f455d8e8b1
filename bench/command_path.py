"""Benchmark of the room write path (issues: write path, 12).

Prints, for SQLite and MariaDB:
  * commands/s of the in-process command path (JoinRoom, concurrency 64, 1,000 rooms)
    beside the bare-driver baseline measured in the same run (bench.bare: asyncmy or
    sqlite3 doing the same transaction — guarded room_meta update + command log insert
    + outbox insert, rows of the sizes the real run wrote — one per command, same
    concurrency), and, labelled, the same transaction through SQLAlchemy;
  * p50/p99 command latency; Room Cell load time (snapshot + snapshot_every_n - 1 log rows);
  * memory per room for 10,000 rooms of 10 members;
  * with --gifts: after the joins, as many SendGift commands (each joined user sends one
    rose to the owner: a debit of the embedded wallet per gift), their rate and CPU
    beside the joins' (the gift path of issue 12; no bare baseline of its own);
  * with --sweep: throughput and p99 against concurrency, drawn to an SVG (--plot).

HTTP is measured by bench.http_commands.

    .venv/bin/python -m bench.command_path [--backend sqlite|mariadb|both] [--commands N] [--rounds R] [--gifts]
    .venv/bin/python -m bench.command_path --sweep 1,2,4,8,16,32,64,128,256 [--plot docs/bench-concurrency.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import bare, plot
from bench.bare import WriteShape
from bench.common import describe, fresh_database, percentile, run_concurrently
from roomservice import errors
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.cell.cell import RoomCell
from roomservice.cli.collector import settle_after_start
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
    # 64 + 8 connections at every concurrency (beyond it callers queue): MariaDB's max_connections is shared
    return (
        load_settings()
        .with_data_dir(Path(data_dir))
        .with_overrides({"database.url": url, "database.pool_size": CONCURRENCY, "database.max_overflow": 8})
    )


RETRIES = 5


async def execute_retrying(svc: Any, app: str, room: str, command_id: str, command: c.Command,
                           retried: list[int]) -> None:
    """``svc.execute`` as a client would call it: a retryable answer (503 unavailable / retry: a database
    deadline on a loaded machine, a lease race) is retried with the same command_id, and counted."""
    for attempt in range(RETRIES):
        try:
            await svc.execute(app, room, command_id, command)
            return
        except (errors.Unavailable, errors.Retry):
            if attempt == RETRIES - 1:
                raise
            retried[0] += 1
            await asyncio.sleep(0.05 * (attempt + 1))


async def service_run(
    url: str, commands: int, *, concurrency: int = CONCURRENCY, load: bool = True, gifts: bool = False
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data_dir:
        async with Process.running(_settings(url, data_dir), roles=(API, MAINTENANCE), loops=False) as rt:
            settle_after_start()  # the collector as `serve` runs it (cli/collector.py)
            svc = rt.service
            retried = [0]
            await run_concurrently(
                CONCURRENCY,
                list(range(ROOMS)),
                lambda r: execute_retrying(svc, APP, f"room{r}", f"create-{r}",
                                           c.CreateRoom(owner_id="owner", title="bench"), retried),
            )
            retried = [0]
            jobs = list(range(commands))
            start, cpu = time.perf_counter(), time.process_time()
            latencies = await run_concurrently(
                concurrency,
                jobs,
                lambda i: execute_retrying(svc, APP, f"room{i % ROOMS}", f"join-{i}", c.JoinRoom(user_id=f"user{i}"),
                                           retried),
            )
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            gift = await gift_run(svc, commands, concurrency) if gifts else None
            async with rt.db.read() as conn:
                sizes = await stored_join_sizes(conn)
            loaded = await cell_load_time(rt) if load else None
    return {
        "cps": commands / elapsed,
        "cpu_us": cpu / commands * 1e6,  # this process, every thread
        "retried": retried[0],
        "latencies": latencies,
        "sizes": sizes,
        "load": loaded,
        "gift": gift,
    }


async def gift_run(svc: Any, commands: int, concurrency: int) -> dict[str, Any]:
    """SendGift by each user the join phase joined: one rose to the room's owner."""
    retried = [0]
    start, cpu = time.perf_counter(), time.process_time()
    latencies = await run_concurrently(
        concurrency,
        list(range(commands)),
        lambda i: execute_retrying(svc, APP, f"room{i % ROOMS}", f"gift-{i}",
                                   c.SendGift(sender_id=f"user{i}", receiver_id="owner", gift_id="rose", count=1),
                                   retried),
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"cps": commands / elapsed, "cpu_us": cpu / commands * 1e6, "retried": retried[0], "latencies": latencies}


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


async def stored_join_sizes(conn: Any) -> list[int]:
    """Average bytes of a JoinRoom's command, events, response, timing and outbox payload, as stored:
    the bare baseline writes rows of these sizes."""
    sizes = (
        await conn.execute(
            sa.select(
                sa.func.avg(sa.func.length(t.room_command_log.c.command)),
                sa.func.avg(sa.func.length(t.room_command_log.c.events)),
                sa.func.avg(sa.func.length(t.room_command_log.c.response)),
                sa.func.avg(sa.func.length(t.room_command_log.c.timing)),
                sa.select(sa.func.avg(sa.func.length(t.room_outbox.c.payload))).scalar_subquery(),
            ).where(t.room_command_log.c.command_type == "JoinRoom")
        )
    ).one()
    return [int(float(x or 0)) for x in sizes]


async def sqlalchemy_run(url: str, commands: int, sizes: list[int]) -> dict[str, Any]:
    """The same transaction through SQLAlchemy and the store's one-hop path (``Database.run_write``):
    a second, labelled figure beside the bare driver, showing what SQLAlchemy and the hop cost."""
    db = Database.from_url(url, pool_size=CONCURRENCY, max_overflow=8)
    try:
        await upgrade(db)
        shape = WriteShape(ROOMS, (sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]))
        meta_keys = ("version", "status", "title", "member_count", "heat", "updated_at_ms",
                     "b_app", "b_room", "b_version", "b_epoch")
        log_keys = [col.name for col in t.room_command_log.c if col.name != "id"]
        outbox_keys = ("event_id", "app_code", "room_id", "room_version", "event_type", "payload", "status",
                       "targets_done", "due_at_ms", "created_at_ms", "updated_at_ms")
        meta_columns = [col.name for col in t.room_meta.c]
        async with db.write() as conn:
            await conn.execute(sa.insert(t.room_meta), [dict(zip(meta_columns, row, strict=True))
                                                          for row in shape.meta_seed()])
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
        insert_log, insert_outbox = sa.insert(t.room_command_log), sa.insert(t.room_outbox)

        def write_sync(conn: Any, meta: dict[str, Any], log: dict[str, Any], outbox: dict[str, Any]) -> None:
            assert conn.execute(update, meta).rowcount == 1
            conn.execute(insert_log, log)
            conn.execute(insert_outbox, [outbox])

        async def one(i: object) -> None:
            meta, log, outbox = shape.rows(int(i))  # type: ignore[call-overload]
            await db.run_write(write_sync, dict(zip(meta_keys, meta, strict=True)),
                               dict(zip(log_keys, log, strict=True)), dict(zip(outbox_keys, outbox, strict=True)))

        start = time.perf_counter()
        latencies = await run_concurrently(CONCURRENCY, list(range(commands)), one)
        elapsed = time.perf_counter() - start
    finally:
        await db.dispose()
    return {"cps": commands / elapsed, "latencies": latencies}


async def bare_run(url: str, commands: int, sizes: list[int], concurrency: int = CONCURRENCY) -> dict[str, Any]:
    """The bare driver (asyncmy / sqlite3) on the migrated schema: see :mod:`bench.bare`."""
    db = Database.from_url(url)
    try:
        await upgrade(db)
    finally:
        await db.dispose()
    return await bare.write_rate(url, commands=commands, sizes=(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]),
                                 concurrency=concurrency, rooms=ROOMS)


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


def report(backend: str, svc: dict[str, Any], bare_: dict[str, Any], orm: dict[str, Any] | None) -> None:
    ratio = svc["cps"] / bare_["cps"]
    label = "bare sqlite3, one writer" if backend == "sqlite" else "bare asyncmy, a connection per caller"
    print(f"[{backend}] command path: {svc['cps']:8.0f} cmd/s   baseline ({label}): {bare_['cps']:8.0f} tx/s   "
          f"ratio {ratio:.2f}x (target >= 0.50)", flush=True)
    if orm is not None:
        print(f"[{backend}]   beside it, the same transaction through SQLAlchemy + Database.run_write: "
              f"{orm['cps']:8.0f} tx/s ({orm['cps'] / bare_['cps']:.2f}x bare; command path "
              f"{svc['cps'] / orm['cps']:.2f}x of it)", flush=True)
    print(f"[{backend}] CPU per command (the process, every thread): {svc['cpu_us']:.0f} us; bare driver "
          f"{bare_['cpu_us']:.0f} us per transaction (the client side only on MariaDB)")
    if svc["retried"]:
        print(f"[{backend}] {svc['retried']} retryable answers (unavailable / retry) retried with the same command_id")
    print(f"[{backend}] command latency: {describe(svc['latencies'])}")
    print(f"[{backend}] bare latency: {describe(bare_['latencies'])}")
    print(f"[{backend}] row sizes (command, events, response, timing, outbox payload bytes): {svc['sizes']}")
    gift = svc.get("gift")
    if gift:
        print(f"[{backend}] gifts: {gift['cps']:8.0f} cmd/s ({gift['cps'] / svc['cps']:.2f}x the joins'), "
              f"CPU {gift['cpu_us']:.0f} us per gift ({gift['cpu_us'] / svc['cpu_us']:.2f}x a join's), "
              f"{gift['retried']} retried; latency {describe(gift['latencies'])}", flush=True)
    load = svc.get("load")
    if load:
        print(f"[{backend}] Room Cell load (snapshot + {int(load['log_rows'])} log rows): "
              f"p50 {load['p50']:.2f} ms, p99 {load['p99']:.2f} ms", flush=True)


async def bench_backend(backend: str, commands: int, *, rounds: int, orm: bool, gifts: bool) -> None:
    for round_ in range(rounds):
        async with fresh_database(backend) as url:
            svc = await service_run(url, commands, load=round_ == 0, gifts=gifts)
        async with fresh_database(backend) as url:
            bare_ = await bare_run(url, commands, svc["sizes"])
        orm_ = None
        if orm:
            async with fresh_database(backend) as url:
                orm_ = await sqlalchemy_run(url, commands, svc["sizes"])
        report(backend, svc, bare_, orm_)


async def sweep(backend: str, commands: int, concurrencies: list[int]) -> list[dict[str, float]]:
    """Throughput and p99 of the command path and the bare driver at each concurrency (for the plot)."""
    points = []
    for n in concurrencies:
        async with fresh_database(backend) as url:
            svc = await service_run(url, commands, concurrency=n, load=False)
        async with fresh_database(backend) as url:
            bare_ = await bare_run(url, commands, svc["sizes"], concurrency=n)
        point = {"concurrency": float(n), "cps": svc["cps"], "p99": percentile(svc["latencies"], 0.99),
                 "bare_cps": bare_["cps"], "bare_p99": percentile(bare_["latencies"], 0.99)}
        print(f"[{backend}] concurrency {n:4d}: command path {point['cps']:7.0f} cmd/s p99 {point['p99']:7.1f} ms   "
              f"bare {point['bare_cps']:7.0f} tx/s p99 {point['bare_p99']:7.1f} ms   "
              f"ratio {point['cps'] / point['bare_cps']:.2f}x", flush=True)
        points.append(point)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="both")
    parser.add_argument("--commands", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=1, help="command path + baseline pairs per backend")
    parser.add_argument("--no-sqlalchemy", action="store_true", help="skip the labelled SQLAlchemy figure")
    parser.add_argument("--rooms", type=int, default=10_000, help="rooms of the memory figure (0: skip it)")
    parser.add_argument("--sweep", default="", help="concurrencies for the plot, e.g. 1,2,4,8,16,32,64,128,256")
    parser.add_argument("--sweep-commands", type=int, default=3_000)
    parser.add_argument("--plot", default="docs/bench-concurrency.svg", help="where the sweep's SVG goes")
    parser.add_argument("--gifts", action="store_true", help="also time a SendGift per joined user")
    args = parser.parse_args()
    # room_command_timing stays on (it is part of the command path) but goes nowhere.
    configure_logging(level="info", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    backends = ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]
    print(f"room-service write path benchmark: {args.commands} JoinRoom commands, concurrency {CONCURRENCY}, "
          f"{ROOMS} rooms; python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.sweep:
        concurrencies = [int(n) for n in args.sweep.split(",")]
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        load_before = os.getloadavg()[0]
        series = {backend: asyncio.run(sweep(backend, args.sweep_commands, concurrencies)) for backend in backends}
        note = (f"bench.command_path --sweep, {args.sweep_commands} JoinRoom a point, {started}, "
                f"{os.cpu_count()} cpus, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
        Path(args.plot).write_text(plot.concurrency_svg(series, note=note))
        print(f"plot: {args.plot}")
        return
    for backend in backends:
        asyncio.run(bench_backend(backend, args.commands, rounds=args.rounds, orm=not args.no_sqlalchemy,
                                  gifts=args.gifts))
    if args.rooms:
        mem = memory_per_room(rooms=args.rooms)
        print(f"[memory] {args.rooms:,} rooms x 10 members: {mem['traced_bytes_per_room'] / 1024:.1f} KiB/room "
              f"allocated (tracemalloc), {mem['rss_kib_per_room']:.1f} KiB/room resident (max RSS delta)")


if __name__ == "__main__":
    main()
