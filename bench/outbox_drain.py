"""Benchmark of the outbox worker (issue: outbox worker).

Prints, for SQLite and MariaDB:
  * drain rate (events/s) of 1, 2 and 4 worker processes with instantly-accepting publishers
    of each of the shapes the worker delivers to -- "direct": a publisher taking the decoded
    event, one row after another per room (the IM and activity publishers' shape, one target);
    "mq": the broker target's pipelined sends of the claimed row's own fields (the embedded
    broker, NATS); "direct-2": direct mode as it runs, each row (a join) to both IM and activity --
    beside the bare-driver baseline in the same run: the worker's claim and
    guarded finish statements issued through sqlite3 / asyncmy (bench.bare) by minimal
    loops in the same number of processes; every process starts up first, then all start
    draining at one instant (SIGUSR1), and the time runs from that instant to the last
    delivered row; beside each rate, the processes' CPU per row over the drain; --rounds such
    rounds (3), the shapes' order turned each round, then each shape's median ratio over them;
    beside them, the "floor": the bare loop plus the least the specification asks of every row
    (refuse a payload that does not decode; hand the row to a publisher, here one that takes it at
    once), in as many processes -- what the bare loop's rate leaves a worker written as tightly as
    Python allows, so that a ratio is read against it (floor / bare, worker / floor);
  * commit-to-delivered latency p50/p99 at a steady 200 events/s over 50 rooms (--rooms) with poll_interval 1s
    (the commit's wake-up, not the poll, must carry it), beside the p99 of one bare
    claim + finish cycle (two transactions with the bare driver) in the same run.

With ``--instructions``, instead: one process of each kind (the bare loop, the floor, a worker of each shape) drains
``--rows`` rows under valgrind's callgrind, counted from the start signal to the last delivered row:
instructions a row in user space (the process's own: not the kernel's, nor the database server's), the
same count for the same code however busy the machine is. On SQLite one process draining is bound by
its CPU, and the bare loop's count over the worker's is the rate ratio were user-space instructions all
there is; on MariaDB it is the client's share only.

    .venv/bin/python -m bench.outbox_drain [--backend sqlite|mariadb|both] [--rows N] [--rounds N]
    .venv/bin/python -m bench.outbox_drain --instructions [--backend ...] [--rows N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import callgrind
from bench.bare import DrainWatch, claim_finish_cycles, open_raw, owner_name
from bench.common import DIRECT_MODE, fresh_database, percentile
from roomservice.bootstrap import Process
from roomservice.cli.collector import settle_after_start
from roomservice.config import load_settings
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.events import Event
from roomservice.observability.logging import configure_logging
from roomservice.proto import room_outbox_event_pb2 as pb
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

ROOT = Path(__file__).resolve().parent.parent
BATCH = 200


async def seed(url: str, rows: int) -> None:
    db = Database.from_url(url)
    try:
        await upgrade(db)
        now = time.time_ns() // 1_000_000
        values = []
        for i in range(rows):
            # a join: direct mode publishes it to IM and activity (the direct-2 shape); mq mode to the broker
            joined = e.RoomUserJoined(user_id=f"u{i}", role="member")
            ev = e.Event(uuid.uuid4().hex, "bench", f"r{i % 100}", i + 1, now, joined)
            values.append(dict(event_id=ev.event_id, app_code="bench", room_id=ev.room_id, room_version=i + 1,
                               event_type=ev.type, payload=encode_event(ev), status="pending", retry_count=0,
                               targets_done="", due_at_ms=now, created_at_ms=now, updated_at_ms=now))
        async with db.write() as conn:
            for start in range(0, rows, 2_000):
                await conn.execute(sa.insert(t.room_outbox), values[start : start + 2_000])
    finally:
        await db.dispose()


def _spawn(args: list[str], prefix: list[str] | None = None) -> subprocess.Popen[str]:
    # this checkout's src first: a second worktree (an A/B) shares the venv, whose editable install points
    # at another checkout's src; with only ROOT on the path its worker processes ran that other code
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    proc = subprocess.Popen([*(prefix or []), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# How often the end of a drain is looked for: a SQLite drain of 20,000 rows lasts 0.3-0.7 s, and at
# the 50 ms this was a ratio moved by up to 15 % with where the last row fell between two looks (the
# medians came out as 0.57, 0.67, 0.72: 4/7, 4/6, 5/7 of 50 ms steps); a look is one indexed query
# (200 a second: ~1 % of a core in all).
POLL_S = 0.005


async def timed_drain(url: str, rows: int, procs: list[subprocess.Popen[str]]) -> tuple[float, float]:
    """Start every process at one instant (SIGUSR1: each has started up and said ready, none has
    claimed yet) and time until every row is delivered. Returns (events/s, the processes' CPU µs per
    row over the drain, which noise on a shared machine disturbs less than the rate)."""
    watch = await DrainWatch.open(url)
    cpu_before = sum(process_cpu_s(p.pid) for p in procs)
    started = time.perf_counter()
    for proc in procs:
        proc.send_signal(signal.SIGUSR1)
    try:
        await drained(watch, rows, POLL_S)
        rate = rows / (time.perf_counter() - started)
        cpu = sum(process_cpu_s(p.pid) for p in procs) - cpu_before
        return rate, cpu / rows * 1e6
    finally:
        await watch.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


async def drained(watch: DrainWatch, rows: int, every_s: float) -> None:
    """Return once no row is left to deliver, having checked that all ``rows`` were delivered."""
    while await watch.rows_left():
        await asyncio.sleep(every_s)
    delivered = await watch.delivered()
    if delivered != rows:
        raise RuntimeError(f"the drain ended with {delivered} of {rows} rows delivered")


FLOOR = "floor"  # the bare loop plus the least a row needs (raw_loop's floor)

# the publisher's shape: worker_proc's arguments ("direct-2": direct mode, each row to IM and activity)
SHAPES = {"direct": [], "mq": ["--pipelined"], "direct-2": ["--two-targets"]}


def drain_command(kind: str, url: str, i: int) -> list[str]:
    """The command line of drain process ``i`` of ``kind``: "raw" (the bare loop), "floor" (the bare loop
    plus the least a row needs) or a worker shape."""
    if kind in ("raw", FLOOR):
        return [sys.executable, "-m", "bench.outbox_drain", "--raw-loop", url, owner_name("r", i),
                *(["--floor"] if kind == FLOOR else [])]
    return [sys.executable, "-m", "tests.e2e.worker_proc", "--url", url, "--owner", owner_name("w", i),
            "--batch", str(BATCH), "--concurrency", str(BATCH), "--start-on-sigusr1", *SHAPES[kind]]


async def worker_drain(backend: str, workers: int, rows: int, kind: str) -> tuple[float, float]:
    """``workers`` processes of ``kind`` (a worker shape, or "raw": the bare loop) drain ``rows`` fresh rows."""
    async with fresh_database(backend) as url:
        await seed(url, rows)
        return await timed_drain(url, rows, [_spawn(drain_command(kind, url, i)) for i in range(workers)])


async def raw_drain(backend: str, workers: int, rows: int) -> tuple[float, float]:
    return await worker_drain(backend, workers, rows, "raw")


async def counted_drain(backend: str, rows: int, kind: str) -> float:
    """Instructions a row of one process of ``kind`` draining ``rows`` rows under callgrind, counted from
    the start signal to the last delivered row."""
    async with fresh_database(backend) as url:
        await seed(url, rows)
        with tempfile.TemporaryDirectory(prefix="roombench-callgrind-") as counts:
            proc = _spawn(drain_command(kind, url, 0), prefix=callgrind.callgrind_prefix(Path(counts)))
            counter = callgrind.PhaseCounter(proc.pid, Path(counts))
            watch = await DrainWatch.open(url)
            try:
                counter.phase("drain")
                proc.send_signal(signal.SIGUSR1)
                await drained(watch, rows, 0.2)
                counter.phase("done")
            finally:
                await watch.close()
                proc.terminate()
                proc.wait(timeout=120)
            return counter.totals()["drain"] / rows


async def instructions(backends: list[str], rows: int) -> None:
    for backend in backends:
        counted = {kind: await counted_drain(backend, rows, kind) for kind in ("raw", FLOOR, *SHAPES)}
        raw = counted["raw"]
        print(f"[{backend}] one process, floor: {counted[FLOOR] / 1e3:6.1f}k instructions a row   "
              f"bare loop: {raw / 1e3:6.1f}k   bare / floor {raw / counted[FLOOR]:.2f}x", flush=True)
        for shape in SHAPES:
            print(f"[{backend}] one process, {shape:8} publisher: {counted[shape] / 1e3:6.1f}k instructions a row   "
                  f"bare loop: {raw / 1e3:6.1f}k   bare / worker {raw / counted[shape]:.2f}x"
                  f"{' (the CPU-bound rate ratio, user space only)' if backend == 'sqlite' else ' (the client only)'}",
                  flush=True)


async def raw_loop(url: str, owner: str, *, floor: bool = False) -> None:
    """The baseline process: the bare driver (sqlite3 / asyncmy, bench.bare) claims a batch with the
    worker's claim statement and finishes it as delivered with the worker's guarded finish, nothing else.
    ``floor``: and in between, each row as :func:`floor_row` takes it."""
    store = await open_raw(url)
    go = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
    print("ready", flush=True)
    await go.wait()  # started together with the other processes, as the workers are
    publisher = FloorPublisher()
    while True:
        now = time.time_ns() // 1_000_000
        rows = await store.claim(owner, now, BATCH)
        if not rows:
            await asyncio.sleep(0.05)
            continue
        ids = [await floor_row(row, publisher) for row in rows] if floor else [r[0] for r in rows]
        await store.finish(owner, now, ids)


class FloorPublisher:
    """A publisher of the claimed row's fields that takes it at once (the worker's port, nothing behind it)."""

    async def publish_claimed(self, *, event_id: str, event_type: str, app_code: str, room_id: str,
                              payload: bytes) -> None:
        return None


async def floor_row(row: tuple[Any, ...], publisher: FloorPublisher) -> int:
    """The least the specification asks of a claimed row (bench.bare's columns): its payload decodes
    as an event envelope of a known type (the worker's check: raises here, where the seed has no such
    row), and a publisher takes it. Its id, to finish as delivered."""
    row_id, event_id, app_code, room_id, _, event_type, payload = row[:7]
    e.PAYLOAD_TYPES[pb.RoomOutboxEvent.FromString(payload).type]
    await publisher.publish_claimed(event_id=event_id, event_type=event_type, app_code=app_code,
                                    room_id=room_id, payload=payload)
    return int(row_id)


class InstantPublisher:
    def __init__(self, name: str) -> None:
        self.name = name

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        return None


async def commit_to_delivered(backend: str, *, rate: int = 200, seconds: float = 10.0,
                              rooms: int = 50) -> dict[str, float]:
    """Commit -> delivered of JoinRoom commands paced at ``rate`` over ``rooms`` rooms (one room would hit
    the worker's per-room lane: MAX_ROOM_LANE rows of a room per batch)."""
    async with fresh_database(backend) as url:
        with tempfile.TemporaryDirectory() as data_dir:
            settings = (
                load_settings()
                .with_data_dir(Path(data_dir))
                .with_overrides({"database.url": url, **DIRECT_MODE})  # not local.yaml's mq topology
            )
            publishers: dict[str, Any] = {"im": InstantPublisher("im"), "activity": InstantPublisher("activity")}
            async with Process.running(settings, publishers=publishers) as rt:
                svc = rt.service
                for r in range(rooms):
                    await svc.execute("bench", f"lat{r}", f"create{r}", c.CreateRoom(owner_id="o", title="latency"))
                settle_after_start()  # the collector as `room-service serve` sets it once started
                total = int(rate * seconds)
                start = time.perf_counter()
                for i in range(total):  # open loop: one command every 1/rate s
                    target = start + i / rate
                    delay = target - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await svc.execute("bench", f"lat{i % rooms}", f"j{i}", c.JoinRoom(user_id=f"u{i}"))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    async with rt.db.read() as conn:
                        pending = await conn.scalar(
                            sa.select(sa.func.count()).select_from(t.room_outbox)
                            .where(t.room_outbox.c.status != "delivered")
                        )
                    if not pending:
                        break
                    await asyncio.sleep(0.1)
                async with rt.db.read() as conn:
                    result = await conn.execute(
                        sa.select(t.room_outbox.c.created_at_ms, t.room_outbox.c.delivered_at_ms)
                        .where(t.room_outbox.c.event_type == "RoomUserJoined")
                    )
                    lat = [float(d - c_) for c_, d in result.all() if d is not None]
    return {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "n": float(len(lat)),
            "expected": float(total)}


async def idle_cost(backend: str, *, seconds: float = 10.0) -> dict[str, float]:
    """CPU used by an idle serve-like process (worker, treasure timer, sweepers) over ``seconds``."""
    import resource

    async with fresh_database(backend) as url:
        with tempfile.TemporaryDirectory() as data_dir:
            settings = load_settings().with_data_dir(Path(data_dir)).with_overrides({"database.url": url})
            async with Process.running(settings) as rt:
                await asyncio.sleep(1.0)  # let start-up settle
                assert rt.worker is not None
                batches_before = rt.worker.batches
                before = resource.getrusage(resource.RUSAGE_SELF)
                await asyncio.sleep(seconds)
                after = resource.getrusage(resource.RUSAGE_SELF)
                claimed = rt.worker.batches - batches_before
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_pct": 100 * cpu / seconds, "batches": float(claimed)}


def allowance(raw_cpu_us: float, target: float = 0.9) -> str:
    """What ``target`` x the bare loop's rate leaves the worker, when the drain is CPU-bound (SQLite, one
    process): the CPU a row it may spend beyond the bare loop's own statements."""
    return f"at {target:.1f}x a row may cost {raw_cpu_us * (1 / target - 1):.1f} us of CPU above the bare loop's"


async def drain_rounds(backend: str, workers: int, rows: int, rounds: int) -> None:
    """``rounds`` rounds of the shapes and the bare loop, the baseline after the first shape and the
    shapes' order turned by one each round (a drain of 20,000 rows lasts about a second: one pair's
    ratio moved by +-20 % between runs minutes apart, 0.68-1.09x for the same code); each round's
    lines, then the median of the rounds' ratios and CPU a row."""
    # by shape (and FLOOR): (ratio to the bare loop, ratio to the floor, CPU a row, the bare loop's CPU a row)
    seen: dict[str, list[tuple[float, float, float, float]]] = {shape: [] for shape in (FLOOR, *SHAPES)}
    shapes = list(SHAPES)
    for n in range(rounds):
        order = shapes[n % len(shapes) :] + shapes[: n % len(shapes)]
        drained = {order[0]: await worker_drain(backend, workers, rows, order[0])}
        raw_rate, raw_cpu = await raw_drain(backend, workers, rows)
        drained[FLOOR] = await worker_drain(backend, workers, rows, FLOOR)
        for shape in order[1:]:
            drained[shape] = await worker_drain(backend, workers, rows, shape)
        floor_rate = drained[FLOOR][0]
        for shape in (FLOOR, *shapes):
            worker_rate, worker_cpu = drained[shape]
            seen[shape].append((worker_rate / raw_rate, worker_rate / floor_rate, worker_cpu, raw_cpu))
            if shape == FLOOR:
                print(f"[{backend}] {workers} worker(s), floor (the bare loop + each row's envelope check and an "
                      f"instant publish): {worker_rate:7.0f} events/s   ratio {worker_rate / raw_rate:.2f}x the bare "
                      f"loop's   CPU over the drain {worker_cpu:.1f} / {raw_cpu:.1f} us a row", flush=True)
                continue
            print(f"[{backend}] {workers} worker(s), {shape:8} publisher: {worker_rate:7.0f} events/s   "
                  f"raw claim+finish: {raw_rate:7.0f} events/s (bare driver)   ratio "
                  f"{worker_rate / raw_rate:.2f}x (target >= 0.90), {worker_rate / floor_rate:.2f}x the floor   "
                  f"CPU over the drain {worker_cpu:.1f} / {raw_cpu:.1f} us a row; {allowance(raw_cpu)}", flush=True)
    for shape, got in seen.items():
        ratios = sorted(ratio for ratio, _, _, _ in got)
        if shape == FLOOR:
            name, target = "floor   ", ""
        else:
            name, target = f"{shape:8}", "; target >= 0.90"
        against_floor = "" if shape == FLOOR else (
            f", {statistics.median(of_floor for _, of_floor, _, _ in got):.2f}x the floor")
        print(f"[{backend}] {workers} worker(s), {name} over {rounds} round(s): median ratio "
              f"{statistics.median(ratios):.2f}x (min {ratios[0]:.2f}, max {ratios[-1]:.2f}{target})"
              f"{against_floor}   CPU a row, median {statistics.median(cpu for _, _, cpu, _ in got):.1f} / "
              f"{statistics.median(raw for _, _, _, raw in got):.1f} us (bare)", flush=True)


async def run(backends: list[str], rows: int, *, workers_list: list[int], rate: int, seconds: float,
              idle_s: float, rooms: int = 50, rounds: int = 3) -> None:
    for backend in backends:
        for workers in workers_list:
            await drain_rounds(backend, workers, rows, rounds)
        lat = await commit_to_delivered(backend, rate=rate, seconds=seconds, rooms=rooms)
        async with fresh_database(backend) as url:
            await seed(url, 200)
            cycle = await claim_finish_cycles(url, 200)
        cycle_p99 = percentile(cycle, 0.99)
        print(f"[{backend}] commit-to-delivered at {rate} events/s over {rooms} room(s), poll_interval 1s: "
              f"p50 {lat['p50']:.0f} ms, "
              f"p99 {lat['p99']:.0f} ms over {lat['n']:.0f}/{lat['expected']:.0f} events;   bare claim+finish "
              f"cycle p50 {percentile(cycle, 0.5):.1f} ms, p99 {cycle_p99:.1f} ms;   p99 ratio "
              f"{lat['p99'] / max(cycle_p99, 1e-9):.1f}x (issue 12 target <= 3x)", flush=True)
        if not idle_s:
            continue
        idle = await idle_cost(backend, seconds=idle_s)
        print(f"[{backend}] idle process (worker polling every 1s, IM sandbox and activity service up): "
              f"{idle['cpu_pct']:.2f}% of one core, {idle['batches']:.0f} batches claimed", flush=True)


def main() -> None:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--raw-loop":
        asyncio.run(raw_loop(sys.argv[2], sys.argv[3], floor=sys.argv[4:] == ["--floor"]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="both")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", default="1,2,4", help="worker process counts of the drain (\"\": skip the drain)")
    parser.add_argument("--rate", type=int, default=200, help="events/s of the latency run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    parser.add_argument("--rooms", type=int, default=50, help="rooms of the latency run (1: one busy room)")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="length of the idle run (0: skip)")
    parser.add_argument("--rounds", type=int, default=3, help="drains of each shape and of the bare loop, alternating")
    parser.add_argument("--instructions", action="store_true",
                        help="count one process of each kind under callgrind instead (--rows, --backend only)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    configure_logging(level="warning", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    backends = ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]
    if args.instructions:
        if missing := callgrind.available():
            parser.error(f"--instructions needs valgrind: missing {missing}")
        print(f"outbox drain, instructions under callgrind: {args.rows} rows, batch {BATCH}, one process", flush=True)
        asyncio.run(instructions(backends, args.rows))
        return
    print(f"outbox drain benchmark: {args.rows} rows, batch {BATCH}; {os.cpu_count()} cpus", flush=True)
    workers_list = [int(n) for n in args.workers.split(",") if n.strip()]  # "": the latency run only
    asyncio.run(run(backends, args.rows, workers_list=workers_list, rate=args.rate,
                    seconds=args.seconds, idle_s=args.idle_seconds, rooms=args.rooms, rounds=args.rounds))


if __name__ == "__main__":
    main()
