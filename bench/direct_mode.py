"""Benchmark of direct-mode delivery (issue 4): events per second the outbox worker delivers
to Tencent IM (the in-process IM sandbox) and the activity service (gRPC), both on loopback.

Worker run: N pending ``room_outbox`` rows of ``RoomUserJoined`` spread over 100 rooms whose
IM groups exist, on a fresh database; ONE ``OutboxWorker`` in direct mode (the real
``TencentImPublisher`` with its ``im_sent_event`` record, and the real ``ActivityPublisher``),
batch 100, concurrency 32, until every row is delivered.

Raw baseline, same run, same sandbox and activity service: a minimal client issuing the
same calls per event — one ``send_group_msg`` HTTP POST with a valid, reused UserSig and one
``HandleRoomEvent`` gRPC call, concurrently like the worker does — 32 at a time, with no
outbox database and no worker.

The activity service keeps its own database (a separate service in production), so its
cost is the same on both sides and the ratio measures what the outbox, the worker and our
IM sent-record add on top of the raw calls.

    .venv/bin/python -m bench.direct_mode [--backend sqlite|mariadb|both] [--events N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import httpx
import sqlalchemy as sa

from bench.common import fresh_database, percentile, run_concurrently
from roomservice.activity.service import start_activity_service
from roomservice.domain import events as e
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient, group_id_for, random_for
from roomservice.integrations.tencent_im.usersig import gen_usersig
from roomservice.observability.logging import configure_logging
from roomservice.outbox.model import ClaimedRow, Outcome, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.proto import activity_pb2 as apb
from roomservice.publishers.activity import HANDLE_ROOM_EVENT, ActivityPublisher
from roomservice.publishers.port import PublisherSet
from roomservice.publishers.tencent_im import AVCHATROOM, SentSteps, TencentImPublisher, message_data
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wire import encode_event

APP = "bench"
ROOMS = 100
BATCH = 100
CONCURRENCY = 32
SDK_APP_ID = 1_400_000_777
ADMIN = "administrator"
OWNER = "owner"
CLIENT_RATE_LIMIT = 1_000_000.0  # per API and second: far above anything loopback reaches
DRAIN_TIMEOUT_S = 300.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def room_of(i: int) -> str:
    return f"r{i % ROOMS}"


def joined_event(i: int, tag: str) -> e.Event:
    # versions grow per room, as a room would have committed them (CreateRoom is version 1)
    return e.Event(
        uuid.uuid4().hex,
        APP,
        room_of(i),
        i // ROOMS + 2,
        now_ms(),
        e.RoomUserJoined(user_id=f"{tag}{i}", role="member"),
    )


@dataclass
class Figures:
    rate: float
    latencies_ms: list[float]
    seconds: float

    def line(self) -> str:
        p50, p99 = percentile(self.latencies_ms, 0.5), percentile(self.latencies_ms, 0.99)
        return f"{self.rate:7.0f}/s  per event p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({self.seconds:.1f} s)"


# --------------------------------------------------------------------------- setup


async def seed_outbox(db: Database, events: int) -> None:
    now = now_ms()
    values = []
    for i in range(events):
        ev = joined_event(i, "u")
        values.append(
            {
                "event_id": ev.event_id,
                "app_code": APP,
                "room_id": ev.room_id,
                "room_version": ev.room_version,
                "event_type": ev.type,
                "payload": encode_event(ev),
                "status": "pending",
                "retry_count": 0,
                "targets_done": "",
                "due_at_ms": now,
                "created_at_ms": now,
                "updated_at_ms": now,
            }
        )
    async with db.write() as conn:
        for start in range(0, events, 2_000):
            await conn.execute(sa.insert(t.room_outbox), values[start : start + 2_000])


async def create_groups(client: TencentImClient) -> None:
    await client.account_import(OWNER)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def create(room: str) -> None:
        async with sem:
            await client.create_group(group_id_for(APP, room), OWNER, f"bench {room}", AVCHATROOM)

    await asyncio.gather(*(create(f"r{r}") for r in range(ROOMS)))


async def count_rows(db: Database, table: sa.Table, where: Any = None) -> int:
    query = sa.select(sa.func.count()).select_from(table)
    if where is not None:
        query = query.where(where)
    async with db.read() as conn:
        return int(await conn.scalar(query) or 0)


# --------------------------------------------------------------------------- worker run


class TimedWorker(OutboxWorker):
    """The real worker, timing each row's delivery (both targets, our IM record included) and
    counting outcomes, so the drain is watched without polling the database under load."""

    def watch(self, expected: int) -> None:
        self.latencies_ms: list[float] = []
        self.expected = expected
        self.delivered = 0
        self.errors: list[str] = []
        self.all_published = asyncio.Event()

    async def deliver(self, row: ClaimedRow) -> Outcome:
        started = time.perf_counter()
        outcome = await super().deliver(row)
        self.latencies_ms.append((time.perf_counter() - started) * 1000)
        if outcome.delivered:
            self.delivered += 1
            if self.delivered >= self.expected:
                self.all_published.set()
        else:
            self.errors.append(outcome.error or "unknown error")
            self.all_published.set()  # stop early: a benchmark with failures measures nothing
        return outcome


async def worker_run(db: Database, events: int, sandbox: RunningSandbox, activity_target: str, secret: str) -> Figures:
    client = TencentImClient(
        base_url=sandbox.base_url,
        sdk_app_id=SDK_APP_ID,
        admin_identifier=ADMIN,
        secret_key=secret,
        request_timeout=10.0,
        rate_limit_per_second=CLIENT_RATE_LIMIT,
        transport=sandbox.transport(),
    )
    activity = ActivityPublisher(activity_target)
    try:
        await create_groups(client)
        await seed_outbox(db, events)
        worker = TimedWorker(
            repository=SqlOutboxRepository(db),
            publishers=PublisherSet(
                {"im": TencentImPublisher(client, SentSteps(db, clock=now_ms)), "activity": activity}
            ),
            policy=RetryPolicy(initial_backoff_ms=100, max_backoff_ms=1_000, max_retry_count=10),
            options=WorkerOptions(
                mode=PublishMode.DIRECT,
                batch_size=BATCH,
                publish_concurrency=CONCURRENCY,
                poll_interval_s=0.05,
                publish_timeout_s=10.0,
            ),
            clock=now_ms,
        )
        worker.watch(events)
        started = time.perf_counter()
        async with worker:
            try:
                await asyncio.wait_for(worker.all_published.wait(), DRAIN_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(f"drain too slow: {worker.delivered}/{events} published") from None
            if worker.errors:
                raise RuntimeError(f"{len(worker.errors)} failed deliveries, first: {worker.errors[0]}")
            # the last batch's finish commits right after its publishes: wait for the rows themselves
            while await count_rows(db, t.room_outbox, t.room_outbox.c.status == "delivered") < events:
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
        return Figures(events / elapsed, worker.latencies_ms, elapsed)
    finally:
        await activity.close()
        await client.aclose()


# --------------------------------------------------------------------------- raw baseline


async def raw_run(events: int, sandbox: RunningSandbox, activity_target: str, secret: str) -> Figures:
    """The same two calls per event, issued by a minimal client: no database, no worker."""
    usersig = gen_usersig(SDK_APP_ID, secret, ADMIN, 86_400, int(time.time()))
    url = f"{sandbox.base_url}/v4/group_open_http_svc/send_group_msg"
    params = {"sdkappid": str(SDK_APP_ID), "identifier": ADMIN, "usersig": usersig, "contenttype": "json"}
    channel = grpc.aio.insecure_channel(activity_target)
    handle: Callable[..., Any] = channel.unary_unary(
        HANDLE_ROOM_EVENT,
        request_serializer=lambda payload: payload,
        response_deserializer=apb.HandleRoomEventReply.FromString,
    )
    jobs: list[object] = [joined_event(i, "raw") for i in range(events)]
    async with httpx.AsyncClient(transport=sandbox.transport(), timeout=10.0) as http:

        async def send(ev: e.Event) -> None:
            body = {
                "GroupId": group_id_for(APP, ev.room_id),
                "Random": random_for(ev.event_id),
                "MsgBody": [
                    {"MsgType": "TIMCustomElem", "MsgContent": {"Data": message_data(ev), "Desc": "", "Ext": ""}}
                ],
            }
            response = await http.post(
                url,
                params={**params, "random": str(secrets.randbits(32))},
                content=json.dumps(body, separators=(",", ":")).encode(),
                headers={"content-type": "application/json"},
            )
            answer = response.json()
            if answer.get("ActionStatus") != "OK":
                raise RuntimeError(f"raw send_group_msg failed: {answer}")

        async def one(job: object) -> None:
            ev = job if isinstance(job, e.Event) else None
            assert ev is not None
            await asyncio.gather(send(ev), handle(encode_event(ev), timeout=10.0))

        try:
            started = time.perf_counter()
            latencies = await run_concurrently(CONCURRENCY, jobs, one)
            elapsed = time.perf_counter() - started
        finally:
            await channel.close()
    return Figures(events / elapsed, latencies, elapsed)


# --------------------------------------------------------------------------- one backend


async def run_backend(backend: str, events: int) -> None:
    secret = secrets.token_hex(32)
    async with fresh_database(backend) as url, fresh_database(backend) as activity_url:
        db = Database.from_url(url)
        activity_db = Database.from_url(activity_url)
        try:
            await upgrade(db)
            await upgrade(activity_db)
            service = await start_activity_service(activity_db, port=0)
            try:
                async with running_sandbox(SDK_APP_ID, secret, rate_limit_per_second=None) as sandbox:
                    worker = await worker_run(db, events, sandbox, service.target, secret)
                    im_messages = sum(len(g.messages) for g in sandbox.state.groups.values())
                    activity_seen = await count_rows(activity_db, t.activity_processed_event)
                    raw = await raw_run(events, sandbox, service.target, secret)
                    raw_messages = sum(len(g.messages) for g in sandbox.state.groups.values()) - im_messages
            finally:
                await service.stop()
        finally:
            await db.dispose()
            await activity_db.dispose()
    print(f"[{backend}] worker (direct mode): {worker.line()}", flush=True)
    print(f"[{backend}] raw HTTP+gRPC pairs:  {raw.line()}", flush=True)
    print(
        f"[{backend}] ratio worker/raw {worker.rate / raw.rate:.2f}x   p50 {_ratio(worker, raw, 0.5)}  "
        f"p99 {_ratio(worker, raw, 0.99)}   (check: worker run left {im_messages}/{events} IM messages, "
        f"{activity_seen}/{events} activity events; raw run {raw_messages}/{events} IM messages)",
        flush=True,
    )


def _ratio(a: Figures, b: Figures, q: float) -> str:
    low = percentile(b.latencies_ms, q)
    return f"{percentile(a.latencies_ms, q) / low:.2f}x" if low else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "mariadb", "both"], default="sqlite")
    parser.add_argument("--events", type=int, default=5_000)
    args = parser.parse_args()
    if args.events < 1:
        parser.error("--events must be at least 1")
    configure_logging(level="warning", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    backends = ["sqlite", "mariadb"] if args.backend == "both" else [args.backend]
    print(
        f"direct-mode benchmark: {args.events} RoomUserJoined over {ROOMS} rooms, 1 worker, batch {BATCH}, "
        f"concurrency {CONCURRENCY}; {os.cpu_count()} cpus; sandbox, activity service and clients in this process",
        flush=True,
    )
    print(
        "rate limits off: sandbox rate_limit_per_second=None and client limit "
        f"{CLIENT_RATE_LIMIT:g}/s per API, so Tencent's 200 requests/s (a quota, not our cost) does not cap "
        "both figures at 200/s and hide the overhead being measured",
        flush=True,
    )
    if importlib.util.find_spec("sniffio") is None:
        print(
            "note: sniffio is not installed, so httpcore retries a failed `import sniffio` on every request "
            "(encode/httpcore#1103): every HTTP call here, on both sides, pays for it",
            flush=True,
        )
    for backend in backends:
        asyncio.run(run_backend(backend, args.events))


if __name__ == "__main__":
    main()
