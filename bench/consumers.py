"""Benchmark of the consumer groups in mq mode (issue 9), on NATS JetStream and on the embedded broker.

Prints, per broker (database: SQLite; ``--backend mariadb`` for MariaDB):

  * commit -> effect latency p50/p99 per group at ``--rate`` events/s: one Process with roles
    api + outbox + consumers in mq mode running the four groups (activity, notice, IM bridge,
    treasure open), paced commands (joins, gifts, leaves over 50 rooms; one leave in ten is a
    kick by the owner, for the notice group) for ``--seconds``. Commit time = the event's
    ``room_outbox.created_at_ms``. Effect time = when the group's handler returned APPLIED
    (each handler's ``handle`` is wrapped in this process to record (event_id, done time));
    cross-checks from the database: ``activity_processed_event.processed_at_ms`` and
    ``notice_delivery_events.sent_at_ms``. Beside them: commit -> broker-acknowledged
    (``delivered_at_ms``), the outbox relay's share.
  * consumer throughput per group beside a raw baseline, in the same run: N real encoded events
    (``encode_event``; half gifts, one in twenty a kick, the rest joins/leaves) published to the topic
    through the broker adapter, then each group alone (a ConsumerRuntime with the handler ``serve``
    builds for it: activity, notice, IM bridge against the in-process IM sandbox with its rate limit
    lifted; then one with a no-op handler: the runtime's own floor) timed from its start until its
    lag is 0. The raw
    baseline (NATS only): a bare nats-py pull-subscribe loop (durable consumer, fetch a batch,
    ack each, no handler work) over the same N messages, once with ``msg.ack()`` and once with
    ``msg.ack_sync()`` (the adapter's confirmed ack) gathered per batch.

Every run uses its own database and, on NATS, its own stream and subject namespace (deleted afterwards).

    .venv/bin/python -m bench.consumers [--brokers nats,embedded] [--backend sqlite|mariadb]
        [--rate EV_PER_S] [--seconds S] [--messages N] [--raw-batch B] [--skip-latency] [--skip-throughput]
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
from nats.js import api

from bench.common import fresh_database, percentile
from roomservice.bootstrap import API, CONSUMERS, OUTBOX, Process
from roomservice.brokers.port import Broker, Delivery, OutgoingMessage
from roomservice.config import Settings, load_settings
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Handler, Outcome
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.observability.logging import configure_logging
from roomservice.store import tables as t
from roomservice.wire import encode_event

NATS_URL = os.environ.get("ROOMSERVICE_BENCH_NATS_URL", "nats://127.0.0.1:4222")
APP = "hyapp"
ROOMS = 50
TOPOLOGY: dict[str, object] = {
    "outbox_worker.publish_mode": "mq",
    "rocketmq.room_outbox.enabled": True,
    "rocketmq.room_outbox.tencent_im_consumer_enabled": True,
    "rocketmq.treasure_open.enabled": True,
    "consumers.activity.enabled": True,
    "consumers.notice.enabled": True,
}
ACTIVITY = "hyapp-activity-room-outbox"
NOTICE = "hyapp-notice-room-outbox"
IM_BRIDGE = "hyapp-room-im-bridge"
TREASURE = "hyapp-room-treasure-open"
WAIT_S = 60.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- brokers


@asynccontextmanager
async def broker_overrides(driver: str) -> AsyncIterator[dict[str, object]]:
    """The embedded broker, or the shared NATS under a stream and subject namespace of this run alone."""
    if driver == "embedded":
        yield {"broker.driver": "embedded"}
        return
    tag = secrets.token_hex(4)
    stream = f"bench_cg_{tag}"
    try:
        yield {
            "broker.driver": "nats",
            "broker.nats.url": NATS_URL,
            "broker.nats.stream": stream,
            "rocketmq.namespace": f"benchcg{tag}",
        }
    finally:
        await drop_streams(stream)


async def drop_streams(stream: str) -> None:
    nc = await nats.connect(NATS_URL)
    try:
        for name in (stream, f"{stream}_dlq"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


def bench_settings(url: str, data_dir: str, overrides: dict[str, object]) -> Settings:
    return load_settings().with_data_dir(Path(data_dir)).with_overrides({"database.url": url, **TOPOLOGY, **overrides})


# --------------------------------------------------------------------------- 1. commit -> effect


def command_for(i: int) -> tuple[str, str, c.Command]:
    """The i-th paced command: per room, join -> gift -> leave of one user (one leave in ten is a kick)."""
    room = i % ROOMS
    step, turn = divmod(i // ROOMS, 3)
    user = f"user_{room}_{step}"
    owner = f"owner_{room}"
    command: c.Command
    if turn == 0:
        command = c.JoinRoom(user_id=user)
    elif turn == 1:
        command = c.SendGift(sender_id=user, receiver_id=owner, gift_id="rose", count=1)
    elif (room + step) % 10 == 3:
        command = c.KickUser(operator_id=owner, target_id=user)
    else:
        command = c.LeaveRoom(user_id=user)
    return f"room_{room}", f"cmd-{i}", command


def record_applied(rt: Process) -> dict[str, dict[str, int]]:
    """Wrap every group's handler: (event_id -> wall ms) of its first APPLIED outcome."""
    assert rt.consumers is not None
    done: dict[str, dict[str, int]] = {}
    for runner in rt.consumers.runners:
        handler = runner.handler
        seen = done.setdefault(runner.group, {})
        inner = handler.handle

        async def handle(delivery: Delivery, inner: Any = inner, seen: dict[str, int] = seen) -> Outcome:
            outcome: Outcome = await inner(delivery)
            if outcome is Outcome.APPLIED:
                seen.setdefault(delivery.key, now_ms())
            return outcome

        handler.handle = handle  # type: ignore[method-assign]
    return done


async def all_caught_up(rt: Process, expected_rows: int) -> None:
    """Every row delivered to the broker and every group's lag 0 (deadline WAIT_S)."""
    assert rt.broker is not None and rt.consumers is not None
    deadline = time.monotonic() + WAIT_S
    o = t.room_outbox.c
    while time.monotonic() < deadline:
        async with rt.db.read() as conn:
            delivered = await conn.scalar(
                sa.select(sa.func.count()).select_from(t.room_outbox).where(o.status == "delivered")
            )
        if int(delivered or 0) >= expected_rows:
            lags = [(await rt.broker.group_stats(r.handler.topic, r.group)).lag for r in rt.consumers.runners]
            if not any(lags):
                return
        await asyncio.sleep(0.1)
    raise AssertionError("the groups did not catch up within the deadline")


async def commit_to_effect(driver: str, backend: str, *, rate: int, seconds: float) -> dict[str, Any]:
    async with fresh_database(backend) as url, broker_overrides(driver) as overrides:
        with tempfile.TemporaryDirectory() as data_dir:
            settings = bench_settings(url, data_dir, overrides)
            async with Process.running(settings, roles={API, OUTBOX, CONSUMERS}) as rt:
                done = record_applied(rt)
                svc = rt.service
                for r in range(ROOMS):
                    await svc.execute(APP, f"room_{r}", f"create-{r}", c.CreateRoom(owner_id=f"owner_{r}", title="b"))
                total = int(rate * seconds)
                tasks: list[asyncio.Task[Any]] = []
                start_ms = now_ms()  # the room creations before it are not measured
                cpu_start = time.process_time()
                start = time.perf_counter()
                for i in range(total):  # open loop: one command every 1/rate s, whatever the last one took
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    room, command_id, command = command_for(i)
                    tasks.append(asyncio.create_task(svc.execute(APP, room, command_id, command)))
                results = await asyncio.gather(*tasks, return_exceptions=True)
                sent_for = time.perf_counter() - start
                errors = [r for r in results if isinstance(r, BaseException)]
                async with rt.db.read() as conn:
                    rows = await conn.scalar(sa.select(sa.func.count()).select_from(t.room_outbox))
                await all_caught_up(rt, int(rows or 0))
                busy = (time.process_time() - cpu_start) / (time.perf_counter() - start)
                o, a, n = t.room_outbox.c, t.activity_processed_event.c, t.notice_delivery_events.c
                async with rt.db.read() as conn:
                    outbox = (await conn.execute(sa.select(o.event_id, o.created_at_ms, o.delivered_at_ms))).all()
                    processed = (await conn.execute(sa.select(a.event_id, a.processed_at_ms))).all()
                    sent = (await conn.execute(sa.select(n.event_id, n.sent_at_ms))).all()
                counts = {r.group: r.counts for r in rt.consumers.runners} if rt.consumers else {}
    created = {row.event_id: row.created_at_ms for row in outbox if row.created_at_ms >= start_ms}

    def since_commit(pairs: Any) -> list[tuple[int, float]]:
        """(commit ms, latency ms) of each event with an effect time."""
        return [(created[key], float(at - created[key])) for key, at in pairs if at is not None and key in created]

    latencies = {group: since_commit(seen.items()) for group, seen in done.items()}
    latencies["broker-acked (outbox relay)"] = since_commit((r.event_id, r.delivered_at_ms) for r in outbox)
    latencies["activity_processed_event.processed_at_ms"] = since_commit(processed)
    latencies["notice_delivery_events.sent_at_ms"] = since_commit(sent)
    return {
        "latencies": latencies,
        "total": total,
        "errors": errors,
        "achieved_rate": total / sent_for,
        "counts": counts,
        "cpu": busy,
    }


# --------------------------------------------------------------------------- 2. throughput


BENCH_ROOMS = 1_000


def bench_room(i: int) -> str:
    return f"room_{100_000 + i % BENCH_ROOMS}"


def owner(i: int) -> str:
    return f"owner_{i % BENCH_ROOMS}"


def bench_event(i: int, at_ms: int) -> e.Event:
    room = bench_room(i)
    user = f"user_{10_000_000 + i}"
    payload: e.EventPayload
    if i % 2 == 0:
        payload = e.RoomGiftSent(
            sender_id=user, receiver_id=f"user_{20_000_000 + i % 97}", gift_id="rose", count=1, unit_price=10,
            total_value=10,
        )  # fmt: skip
    elif i % 4 == 1:
        payload = e.RoomUserJoined(user_id=user, role="audience")
    elif i % 20 == 3:  # one event in twenty is a kick: the notice group's work (a row, then a C2C send)
        until = at_ms + 600_000
        payload = e.RoomUserKicked(operator_id=owner(i), target_id=user, ban_seconds=600, banned_until_ms=until)
    else:
        payload = e.RoomUserLeft(user_id=user)
    return e.Event(uuid.uuid4().hex, APP, room, i // 1_000 + 2, at_ms, payload)


async def publish_events(broker: Broker, topic: str, n: int, *, concurrency: int = 64) -> int:
    """``n`` encoded events on ``topic`` through the adapter; returns the mean body size."""
    at = now_ms()
    semaphore = asyncio.Semaphore(concurrency)
    size = 0

    async def one(i: int) -> None:
        nonlocal size
        ev = bench_event(i, at)
        body = encode_event(ev)
        size += len(body)
        async with semaphore:
            await broker.publish(
                OutgoingMessage(topic=topic, body=body, key=ev.event_id, tag=ev.type, sharding_key=ev.room_id),
                timeout_s=10.0,
            )

    await asyncio.gather(*(one(i) for i in range(n)))
    return size // max(1, n)


class NoopHandler:
    def __init__(self, group: str, topic: str) -> None:
        self.group = group
        self.topic = topic

    async def handle(self, delivery: Delivery) -> Outcome:
        return Outcome.APPLIED


async def time_group(broker: Broker, handler: Handler, n: int, max_deliveries: int) -> float:
    """Seconds from the group's start until it has acknowledged all ``n`` messages (lag 0)."""
    handled = 0
    enough = asyncio.Event()
    inner = handler.handle

    async def counting(delivery: Delivery) -> Outcome:
        nonlocal handled
        outcome = await inner(delivery)
        handled += 1
        if handled >= n:
            enough.set()
        return outcome

    handler.handle = counting  # type: ignore[method-assign]
    runtime = ConsumerRuntime(broker, [(handler, GroupOptions(max_deliveries=max_deliveries, visibility_s=30.0))])
    started = time.perf_counter()
    runtime.start()
    try:
        await asyncio.wait_for(enough.wait(), timeout=WAIT_S * 2)
        deadline = time.monotonic() + WAIT_S
        while (await broker.group_stats(handler.topic, handler.group)).lag:
            if time.monotonic() > deadline:
                raise AssertionError(f"{handler.group}: lag not 0")
            await asyncio.sleep(0.005)
        return time.perf_counter() - started
    finally:
        await runtime.shutdown(grace_s=5.0)
        if handled != n:
            raise AssertionError(f"{handler.group}: handled {handled} deliveries, expected {n}")


async def raw_pull(stream: str, subject: str, n: int, batch: int, *, sync_ack: bool) -> float:
    """A bare nats-py pull loop: durable consumer, fetch ``batch``, ack each, no handler work."""
    nc = await nats.connect(NATS_URL)
    try:
        js = nc.jetstream()
        durable = f"raw_{secrets.token_hex(3)}"
        sub = await js.pull_subscribe(
            subject,
            durable=durable,
            stream=stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL, ack_wait=30.0
            ),
        )
        got = 0
        started = time.perf_counter()
        while got < n:
            msgs = await sub.fetch(batch, timeout=5.0)
            if sync_ack:
                await asyncio.gather(*(m.ack_sync() for m in msgs))
            else:
                for m in msgs:
                    await m.ack()
            got += len(msgs)
        await nc.flush()
        elapsed = time.perf_counter() - started
        info = await js.consumer_info(stream, durable)
        if got != n or info.num_pending or info.num_ack_pending:
            raise AssertionError(f"raw: got {got}, pending {info.num_pending}, ack pending {info.num_ack_pending}")
        return elapsed
    finally:
        await nc.close()


# The groups the throughput run times one at a time, in this order, then the runtime's own floor.
TIMED_GROUPS = (ACTIVITY, NOTICE, IM_BRIDGE)
# The throughput run lifts the IM client's rate limit (200/s by default, Tencent's quota, shared by the
# bridge's sends and the notice group's C2C): it times the groups' own work, not the quota.
UNLIMITED_IM = {"tencent_im.rate_limit_per_second": 1_000_000}


async def throughput(driver: str, backend: str, *, n: int, raw_batch: int) -> dict[str, Any]:
    """Each group alone over the same ``n`` published messages, with the handler ``serve`` builds for
    it (the notice and IM-bridge groups talk to the in-process IM sandbox), then a no-op handler."""
    results: dict[str, float] = {}
    async with fresh_database(backend) as url, broker_overrides(driver) as overrides:
        with tempfile.TemporaryDirectory() as data_dir:
            settings = bench_settings(url, data_dir, {**overrides, **UNLIMITED_IM})
            # built as serve builds them, none of its loops started: each group runs alone below
            async with Process.running(settings, roles={CONSUMERS}, loops=False) as rt:
                broker, runtime = rt.broker, rt.consumers
                assert broker is not None and runtime is not None
                topic = settings.rocketmq.room_outbox.topic
                max_deliveries = 1 + settings.rocketmq.room_outbox.consumer_max_reconsume_times
                im = rt.im
                assert im is not None and im.sandbox is not None
                im.sandbox.state.set_rate_limit(None)  # the sandbox's own emulation of the quota, lifted too
                for i in range(BENCH_ROOMS):  # the rooms' IM groups, as their CreateRoom made them
                    await im.publisher.ensure_group(app_code=APP, room_id=bench_room(i), owner_id=owner(i), title="b")
                handlers: list[Handler] = [runtime.runner(group).handler for group in TIMED_GROUPS]
                handlers.append(NoopHandler("bench-noop", topic))
                for handler in handlers:  # declared first: each sees every message
                    await broker.declare_group(topic, handler.group, max_deliveries=max_deliveries)
                started = time.perf_counter()
                size = await publish_events(broker, topic, n)
                results["publish"] = n / (time.perf_counter() - started)
                for handler in handlers:
                    results[handler.group] = n / await time_group(broker, handler, n, max_deliveries)
                if driver == "nats":
                    stream = str(overrides["broker.nats.stream"])
                    subject = f"{overrides['rocketmq.namespace']}.{topic}"
                    results["raw ack"] = n / await raw_pull(stream, subject, n, raw_batch, sync_ack=False)
                    results["raw ack_sync"] = n / await raw_pull(stream, subject, n, raw_batch, sync_ack=True)
    return {"rates": results, "size": size}


# --------------------------------------------------------------------------- main


def fmt(samples: list[tuple[int, float]]) -> str:
    """p50/p99/max, and the p50 of the events committed in the run's first and last second (a backlog
    that builds up shows as a last-second p50 far above the first)."""
    if not samples:
        return "no event of this load applies here"
    values = [lat for _, lat in samples]
    first_at = min(at for at, _ in samples)
    last_at = max(at for at, _ in samples)
    first = [lat for at, lat in samples if at < first_at + 1000]
    last = [lat for at, lat in samples if at > last_at - 1000]
    return (
        f"p50 {percentile(values, 0.5):6.0f} ms  p99 {percentile(values, 0.99):6.0f} ms  "
        f"max {max(values):6.0f} ms  (n={len(values)}; p50 first s {percentile(first, 0.5):.0f} ms, "
        f"last s {percentile(last, 0.5):.0f} ms)"
    )


async def run(args: argparse.Namespace) -> None:
    for driver in args.brokers.split(","):
        label = f"[{driver} / {args.backend}]"
        if not args.skip_latency:
            lat = await commit_to_effect(driver, args.backend, rate=args.rate, seconds=args.seconds)
            print(
                f"{label} commit -> effect at {args.rate} events/s for {args.seconds:g} s "
                f"(achieved {lat['achieved_rate']:.0f}/s, {lat['total']} commands, {len(lat['errors'])} failed; "
                f"process CPU {lat['cpu']:.0%} of one core until all groups caught up"
                + (f": {lat['errors'][0]!r}" if lat["errors"] else "")
                + ")",
                flush=True,
            )
            for group, values in lat["latencies"].items():
                print(f"{label}   {group:44s} {fmt(values)}", flush=True)
            for group, counts in lat["counts"].items():
                print(
                    f"{label}   counts {group}: applied {counts.applied}, duplicates {counts.duplicates}, "
                    f"failures {counts.failures}, redelivered {counts.redelivered}",
                    flush=True,
                )
        if not args.skip_throughput:
            tp = await throughput(driver, args.backend, n=args.messages, raw_batch=args.raw_batch)
            rates = tp["rates"]
            raw = rates.get("raw ack")
            parts = [f"publish {rates['publish']:.0f}/s"]
            for name in (*TIMED_GROUPS, "bench-noop", "raw ack", "raw ack_sync"):
                if name in rates:
                    ratio = f" ({rates[name] / raw:.2f}x raw ack)" if raw and not name.startswith("raw ack") else ""
                    parts.append(f"{name} {rates[name]:.0f} msgs/s{ratio}")
            print(
                f"{label} throughput over {args.messages} messages ({tp['size']} B, half gifts): " + ";  ".join(parts),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--brokers", default="nats,embedded", help="comma-separated: nats, embedded")
    parser.add_argument("--backend", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--rate", type=int, default=200, help="events/s of the latency run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    parser.add_argument("--messages", type=int, default=10_000, help="messages of the throughput run")
    parser.add_argument("--raw-batch", type=int, default=32, help="fetch batch of the raw nats-py loop")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    configure_logging(level="warning", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    print(
        f"consumer-group benchmark (NATS at {NATS_URL}); {os.cpu_count()} cpus; python {sys.version.split()[0]}",
        flush=True,
    )
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
