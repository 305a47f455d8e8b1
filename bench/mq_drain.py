"""Benchmark of mq mode on NATS JetStream (issue 8).

Prints, for SQLite and MariaDB:
  * mq-mode drain: events/s from ``pending`` to broker-acknowledged ``delivered``:
    N pre-inserted pending rows (real events, ``encode_event``) drained by the real
    outbox worker (``Process.running(roles={"outbox"})``, publish_mode mq,
    broker.driver nats), timed from the worker's start until every row is finished;
  * beside it, in the same run, the raw baseline: a bare loop with the bare drivers
    (sqlite3 or asyncmy, nats-py; no SQLAlchemy, no roomservice code on the hot path)
    doing the worker's claim statement, one awaited JetStream publish per row
    (``Nats-Msg-Id`` = event_id) with the worker's publish concurrency, and the
    worker's guarded finish, at the same batch size and payload size; ratio = ours / raw;
  * commit -> broker-acknowledged latency p50/p99: JoinRoom commands through
    RoomService (roles api + outbox in one process, mq on NATS) paced at 200 events/s,
    latency = from the command's commit notification to the return of the worker's transaction
    with the row's finish (``bench.timeline``, perf_counter; the rows' whole-millisecond
    created_at_ms -> delivered_at_ms beside it), over ``--rooms`` rooms; beside it
    the p50/p99 of one bare cycle (claim one row, publish it with acknowledgement, finish
    it) and of one bare claim + finish cycle (two transactions with the bare driver,
    issue 12's baseline: 200 back to back, and as many as the run's events paced at its
    rate, whose p99 samples as long a stretch of the machine's time), all in the same run;
    and the process's CPU per event over the run (commands and worker, all threads), which a
    loaded machine disturbs far less than a p99.

Every run uses its own database (dropped afterwards) and its own JetStream stream
and topic on the shared NATS (deleted afterwards).

    .venv/bin/python -m bench.mq_drain [--backend sqlite|mariadb|both] [--rows N] [--rounds R]
        [--batch B] [--concurrency C] [--rate EV_PER_S] [--seconds S] [--rooms N] [--drain-rooms N]
        [--skip-latency]

``--rounds 0`` skips the drain (latency only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
from nats.js import api

from bench.bare import claim_finish_cycles, open_raw
from bench.common import fresh_database, percentile
from bench.timeline import Timeline
from roomservice.bootstrap import API, OUTBOX, Process
from roomservice.bootstrap.broker import retry_horizon_ms
from roomservice.bootstrap.outbox import start_outbox_worker
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.observability.logging import configure_logging
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

NATS_URL = os.environ.get("ROOMSERVICE_BENCH_NATS_URL", "nats://127.0.0.1:4222")
APP = "hyapp"
ROOMS = 1_000  # rows spread over many rooms: the worker's per-room lanes never defer a row
DRAIN_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- rows


def realistic_event(i: int, now_ms: int, rooms: int = ROOMS) -> e.Event:
    """One of the events a voice room emits most, with ids of production-like length."""
    room = f"room_{100_000 + i % rooms}"
    user = f"user_{10_000_000 + i}"
    kinds: list[e.EventPayload] = [
        e.RoomUserJoined(user_id=user, role="audience"),
        e.RoomMicTaken(user_id=user, seat=i % 8),
        e.RoomGiftSent(
            sender_id=user,
            receiver_id=f"user_{20_000_000 + i % 97}",
            gift_id="rose",
            count=1 + i % 5,
            unit_price=10,
            total_value=10 * (1 + i % 5),
        ),
        e.RoomMicLeft(user_id=user, seat=i % 8),
        e.RoomUserLeft(user_id=user),
    ]
    return e.Event(uuid.uuid4().hex, APP, room, i // rooms + 2, now_ms, kinds[i % len(kinds)])


async def seed(url: str, rows: int, rooms: int = ROOMS) -> int:
    """``rows`` pending outbox rows; returns the mean payload size in bytes."""
    db = Database.from_url(url)
    try:
        await upgrade(db)
        now = time.time_ns() // 1_000_000
        values = []
        payload_bytes = 0
        for i in range(rows):
            ev = realistic_event(i, now, rooms)
            payload = encode_event(ev)
            payload_bytes += len(payload)
            values.append(
                dict(
                    event_id=ev.event_id,
                    app_code=APP,
                    room_id=ev.room_id,
                    room_version=ev.room_version,
                    event_type=ev.type,
                    payload=payload,
                    status="pending",
                    retry_count=0,
                    targets_done="",
                    due_at_ms=now,
                    created_at_ms=now,
                    updated_at_ms=now,
                )
            )
        async with db.write() as conn:
            for start in range(0, rows, 2_000):
                await conn.execute(sa.insert(t.room_outbox), values[start : start + 2_000])
        return payload_bytes // max(1, rows)
    finally:
        await db.dispose()


async def outbox_statuses(url: str) -> dict[str, int]:
    db = Database.from_url(url)
    try:
        async with db.read() as conn:
            result = await conn.execute(
                sa.select(t.room_outbox.c.status, sa.func.count()).group_by(t.room_outbox.c.status)
            )
            return {status: int(n) for status, n in result.all()}
    finally:
        await db.dispose()


# --------------------------------------------------------------------------- NATS


@dataclass(frozen=True, slots=True)
class Names:
    """This run's stream and topic (subject): unique, so nothing else on the shared server overlaps."""

    stream: str
    topic: str

    @classmethod
    def fresh(cls, what: str) -> Names:
        token = secrets.token_hex(4)
        return cls(stream=f"bench_{what}_{token}", topic=f"bench_{what}_{token}_room_outbox")


async def stream_messages(stream: str) -> int:
    nc = await nats.connect(NATS_URL)
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


async def delete_stream(stream: str) -> None:
    nc = await nats.connect(NATS_URL)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


# --------------------------------------------------------------------------- ours


def mq_settings(url: str, data_dir: str, names: Names, *, batch: int | None, concurrency: int | None) -> Settings:
    overrides: dict[str, object] = {
        "database.url": url,
        "outbox_worker.publish_mode": "mq",
        "rocketmq.room_outbox.enabled": True,
        "rocketmq.room_outbox.topic": names.topic,
        "broker.driver": "nats",
        "broker.nats.url": NATS_URL,
        "broker.nats.stream": names.stream,
    }
    if batch is not None:
        overrides["outbox_worker.batch_size"] = batch
    if concurrency is not None:
        overrides["outbox_worker.publish_concurrency"] = concurrency
    return load_settings().with_data_dir(Path(data_dir)).with_overrides(overrides)


async def ours_drain(
    backend: str, rows: int, batch: int | None, concurrency: int | None, rooms: int = ROOMS
) -> dict[str, float]:
    names = Names.fresh("ours")
    async with fresh_database(backend) as url:
        payload = await seed(url, rows, rooms)
        try:
            with tempfile.TemporaryDirectory() as data_dir:
                settings = mq_settings(url, data_dir, names, batch=batch, concurrency=concurrency)
                async with Process.running(settings, roles={OUTBOX}, loops=False) as rt:
                    worker = rt.worker
                    assert worker is not None
                    # The end of the drain is the commit of the finish that reaches N rows: count
                    # what the repository's finishes report changed (no polling on the hot path);
                    # the worker finishes alone or together with its next claim (finish_and_claim).
                    repo = worker.repository
                    finish, finish_and_claim = repo.finish, repo.finish_and_claim
                    finished = 0
                    all_done = asyncio.Event()

                    def count(changed: int) -> None:
                        nonlocal finished
                        finished += changed
                        if finished >= rows:
                            all_done.set()

                    async def counting_finish(**kwargs: Any) -> int:
                        changed = await finish(**kwargs)
                        count(changed)
                        return changed

                    async def counting_finish_and_claim(**kwargs: Any) -> Any:
                        changed, claimed = await finish_and_claim(**kwargs)
                        count(changed)
                        return changed, claimed

                    repo.finish = counting_finish  # type: ignore[method-assign]
                    repo.finish_and_claim = counting_finish_and_claim  # type: ignore[method-assign]
                    started, cpu_started = time.perf_counter(), time.process_time()
                    start_outbox_worker(rt.core, worker)
                    await asyncio.wait_for(all_done.wait(), timeout=DRAIN_TIMEOUT_S)
                    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
                    options = worker.options
            statuses = await outbox_statuses(url)
            stored = await stream_messages(names.stream)
        finally:
            await delete_stream(names.stream)
    if statuses != {"delivered": rows} or stored != rows:
        raise AssertionError(f"ours: statuses {statuses}, {stored} messages in the stream, expected {rows}")
    return {
        "rate": rows / elapsed,
        "seconds": elapsed,
        "batch": options.batch_size,
        "concurrency": options.publish_concurrency,
        "payload": payload,
        "cpu_us": cpu / rows * 1e6,
    }


# --------------------------------------------------------------------------- raw: the bare drivers


class RawPublisher:
    """nats-py: one awaited JetStream publish per row (Nats-Msg-Id = event_id), ``concurrency`` at a time."""

    def __init__(self, nc: Any, names: Names, concurrency: int) -> None:
        self.js = nc.jetstream()
        self.names = names
        self.concurrency = concurrency

    @classmethod
    async def open(cls, names: Names, settings: Settings, concurrency: int) -> tuple[Any, RawPublisher]:
        """A connection and the stream, configured as the NATS broker configures its own."""
        nc = await nats.connect(NATS_URL)
        nats_config = settings.broker.nats
        window_s = max(nats_config.duplicate_window.total_seconds(), retry_horizon_ms(settings) / 1000)
        await nc.jetstream().add_stream(
            api.StreamConfig(
                name=names.stream,
                subjects=[names.topic],
                retention=api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                discard=api.DiscardPolicy.OLD,
                max_age=nats_config.max_age.total_seconds(),
                duplicate_window=window_s,
                num_replicas=nats_config.replicas,
            )
        )
        return nc, cls(nc, names, concurrency)

    async def publish_all(self, rows: list[tuple[Any, ...]]) -> None:
        semaphore = asyncio.Semaphore(self.concurrency)
        topic, stream = self.names.topic, self.names.stream

        async def one(row: tuple[Any, ...]) -> None:
            async with semaphore:
                await self.js.publish(topic, bytes(row[6]), timeout=5.0, stream=stream, headers={"Nats-Msg-Id": row[1]})

        await asyncio.gather(*(one(row) for row in rows))


async def raw_drain(backend: str, rows: int, batch: int, concurrency: int, rooms: int = ROOMS) -> dict[str, float]:
    names = Names.fresh("raw")
    async with fresh_database(backend) as url:
        payload = await seed(url, rows, rooms)
        with tempfile.TemporaryDirectory() as data_dir:
            settings = mq_settings(url, data_dir, names, batch=batch, concurrency=concurrency)
        nc, publisher = await RawPublisher.open(names, settings, concurrency)
        store = await open_raw(url)
        try:
            owner = f"raw-{uuid.uuid4().hex[:12]}"
            finished = 0
            started, cpu_started = time.perf_counter(), time.process_time()
            while finished < rows:
                claimed = await store.claim(owner, time.time_ns() // 1_000_000, batch)
                if not claimed:
                    raise AssertionError(f"raw: nothing left to claim after {finished} of {rows} rows")
                await publisher.publish_all(claimed)
                finished += await store.finish(owner, time.time_ns() // 1_000_000, [r[0] for r in claimed])
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            await store.close()
            statuses = await outbox_statuses(url)
            stored = await stream_messages(names.stream)
        finally:
            await nc.close()
            await delete_stream(names.stream)
    if statuses != {"delivered": rows} or stored != rows:
        raise AssertionError(f"raw: statuses {statuses}, {stored} messages in the stream, expected {rows}")
    return {"rate": rows / elapsed, "seconds": elapsed, "payload": payload, "cpu_us": cpu / rows * 1e6}


async def raw_cycle(backend: str, cycles: int) -> list[float]:
    """Latency (ms) of one bare cycle: claim one row, publish it with acknowledgement, finish it."""
    names = Names.fresh("cycle")
    async with fresh_database(backend) as url:
        await seed(url, cycles)
        with tempfile.TemporaryDirectory() as data_dir:
            settings = mq_settings(url, data_dir, names, batch=None, concurrency=None)
        nc, publisher = await RawPublisher.open(names, settings, 1)
        store = await open_raw(url)
        latencies = []
        try:
            for _ in range(cycles):
                start = time.perf_counter()
                claimed = await store.claim("cycle", time.time_ns() // 1_000_000, 1)
                await publisher.publish_all(claimed)
                await store.finish("cycle", time.time_ns() // 1_000_000, [r[0] for r in claimed])
                latencies.append((time.perf_counter() - start) * 1000)
        finally:
            await store.close()
            await nc.close()
            await delete_stream(names.stream)
    return latencies


# --------------------------------------------------------------------------- latency through RoomService


async def commit_to_acked(backend: str, *, rate: int, seconds: float, rooms: int) -> dict[str, Any]:
    names = Names.fresh("lat")
    async with fresh_database(backend) as url:
        try:
            with tempfile.TemporaryDirectory() as data_dir:
                settings = mq_settings(url, data_dir, names, batch=None, concurrency=None)
                async with Process.running(settings, roles={API, OUTBOX}) as rt:
                    svc = rt.service
                    timeline = Timeline()
                    timeline.attach(rt)
                    for r in range(rooms):
                        await svc.execute(
                            APP, f"room_{r}", f"create-{r}", c.CreateRoom(owner_id=f"owner_{r}", title="latency")
                        )
                    total = int(rate * seconds)
                    tasks: list[asyncio.Task[Any]] = []
                    start, cpu_start = time.perf_counter(), time.process_time()
                    for i in range(total):  # open loop: one command every 1/rate s, whatever the last one took
                        delay = start + i / rate - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        join = c.JoinRoom(user_id=f"user_{i}")
                        tasks.append(
                            asyncio.create_task(timeline.execute(svc, i, APP, f"room_{i % rooms}", f"join-{i}", join))
                        )
                    await asyncio.gather(*tasks)
                    sent_for = time.perf_counter() - start
                    latencies = await _delivered_latencies(rt, total)
                    cpu_ms = (time.process_time() - cpu_start) * 1000 / total
        finally:
            await delete_stream(names.stream)
    precise = timeline.total()
    return {
        "p50": percentile(precise, 0.5),
        "p99": percentile(precise, 0.99),
        "rows_p50": percentile(latencies, 0.5),
        "rows_p99": percentile(latencies, 0.99),
        "timeline": timeline.report(f"[{backend}]"),
        "max": max(precise, default=0.0),
        "n": float(len(precise)),
        "expected": float(total),
        "achieved_rate": total / sent_for,
        "cpu_ms": cpu_ms,
    }


async def _delivered_latencies(rt: Process, expected: int) -> list[float]:
    o = t.room_outbox.c
    deadline = time.monotonic() + 60
    while True:
        async with rt.db.read() as conn:
            result = await conn.execute(
                sa.select(o.created_at_ms, o.delivered_at_ms).where(o.event_type == "RoomUserJoined")
            )
            pairs = result.all()
        delivered = [float(d - created) for created, d in pairs if d is not None]
        if len(delivered) >= expected or time.monotonic() > deadline:
            return delivered
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> None:
    backends = ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]
    defaults = load_settings().outbox_worker
    batch = args.batch or defaults.batch_size
    concurrency = args.concurrency or defaults.publish_concurrency
    for backend in backends:
        ratios = []
        for round_ in range(1, args.rounds + 1):
            # alternate the order so neither side always runs on a warmer machine
            steps: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
                ("ours", lambda b=backend: ours_drain(b, args.rows, batch, concurrency, args.drain_rooms)),  # type: ignore[misc]
                ("raw", lambda b=backend: raw_drain(b, args.rows, batch, concurrency, args.drain_rooms)),  # type: ignore[misc]
            ]
            if round_ % 2 == 0:
                steps.reverse()
            results = {name: await step() for name, step in steps}
            ours, raw = results["ours"], results["raw"]
            ratio = ours["rate"] / raw["rate"]
            ratios.append(ratio)
            print(
                f"[{backend}] round {round_}: mq drain {ours['rate']:7.0f} events/s ({ours['seconds']:.2f} s)   "
                f"raw claim+js.publish+finish {raw['rate']:7.0f} events/s ({raw['seconds']:.2f} s)   "
                f"ratio {ratio:.2f}x (target >= 0.80)   "
                f"process CPU {ours['cpu_us']:.0f} / {raw['cpu_us']:.0f} us a row   "
                f"[{args.rows} rows, batch {ours['batch']:.0f}, "
                f"publish concurrency {ours['concurrency']:.0f}, payload {ours['payload']:.0f} B, "
                f"{args.drain_rooms} rooms]",
                flush=True,
            )
        if len(ratios) > 1:
            print(f"[{backend}] ratio over {len(ratios)} rounds: {min(ratios):.2f}-{max(ratios):.2f}x", flush=True)
        if args.skip_latency:
            continue
        lat = await commit_to_acked(backend, rate=args.rate, seconds=args.seconds, rooms=args.rooms)
        cycle = await raw_cycle(backend, 200)
        async with fresh_database(backend) as url:
            await seed(url, 200)
            claim_finish = await claim_finish_cycles(url, 200)
        async with fresh_database(backend) as url:
            events = int(args.rate * args.seconds)
            await seed(url, events)
            paced = await claim_finish_cycles(url, events, rate=args.rate)
        print(
            f"[{backend}] commit -> broker-acked at {args.rate} events/s for {args.seconds:g} s "
            f"over {args.rooms} rooms "
            f"(achieved {lat['achieved_rate']:.0f}/s), from the command's commit notification to the return of the "
            f"transaction with its row's finish (perf_counter): p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, "
            f"max {lat['max']:.2f} ms over {lat['n']:.0f}/{lat['expected']:.0f} events, "
            f"process CPU {lat['cpu_ms']:.2f} ms per event (commands and worker, until all acknowledged);   "
            f"bare cycle (claim 1 + js.publish + finish): p50 {percentile(cycle, 0.5):.1f} ms, "
            f"p99 {percentile(cycle, 0.99):.1f} ms; "
            f"p99 ratio {lat['p99'] / max(percentile(cycle, 0.99), 1e-9):.1f}x;   "
            f"bare claim+finish cycle: p50 {percentile(claim_finish, 0.5):.2f} ms, "
            f"p99 {percentile(claim_finish, 0.99):.2f} ms (200 back to back), p50 {percentile(paced, 0.5):.2f} ms, "
            f"p99 {percentile(paced, 0.99):.2f} ms ({len(paced)} paced at {args.rate}/s); p99 ratio "
            f"{lat['p99'] / max(percentile(claim_finish, 0.99), 1e-9):.1f}x / "
            f"{lat['p99'] / max(percentile(paced, 0.99), 1e-9):.1f}x (issue 12 target <= 3x)\n"
            f"[{backend}]   rows' created_at_ms -> delivered_at_ms (decided, before the commit -> acknowledgement "
            f"decided, whole ms): p50 {lat['rows_p50']:.0f} ms, p99 {lat['rows_p99']:.0f} ms\n"
            f"[{backend}]   timeline, per event:\n{lat['timeline']}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="both")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2, help="ours/raw pairs per backend, order alternating")
    parser.add_argument("--batch", type=int, default=0, help="outbox_worker.batch_size (default: the configured)")
    parser.add_argument(
        "--concurrency", type=int, default=0, help="outbox_worker.publish_concurrency (default: the configured)"
    )
    parser.add_argument("--rate", type=int, default=200, help="events/s of the latency run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    parser.add_argument("--rooms", type=int, default=50, help="rooms of the latency run (1: one busy room)")
    parser.add_argument(
        "--drain-rooms", type=int, default=ROOMS, help="rooms the drain's rows are spread over (1: one busy room)"
    )
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    configure_logging(level="warning", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print(
        f"mq drain benchmark (NATS at {NATS_URL}); {os.cpu_count()} cpus; python {sys.version.split()[0]}", flush=True
    )
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
