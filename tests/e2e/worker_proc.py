"""A standalone outbox worker process for multi-process tests.

Runs the real OutboxWorker (mq mode) against a database with a publisher that
appends one line per publish to a file: ``event_id owner lock_until_ms published_at_ms``.
``--pipelined``: the publisher has the broker target's shape instead (the embedded broker's and
NATS's: rows sent without waiting for each other's acknowledgement, no decoded event), no log.
``--two-targets``: direct mode instead, a row to IM and activity (a join's: each publisher takes the
decoded event; a row of a type that needs IM only goes to IM only).

    python -m tests.e2e.worker_proc --url URL --owner NAME --log FILE [--delay-ms N]
    python -m tests.e2e.worker_proc --url URL --owner NAME --pipelined [--delay-ms N]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any, TextIO

import sqlalchemy as sa

from roomservice.cli.collector import settle_after_start
from roomservice.domain.events import Event
from roomservice.outbox.model import BROKER, ClaimedRow, Outcome, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.port import PermanentError, PublisherSet
from roomservice.store.database import Database


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class RecordingPublisher:
    name = BROKER

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)


class PipeliningPublisher(RecordingPublisher):
    """The shape of the broker target in mq mode (``BrokerPublisher`` on the embedded broker or
    NATS): a claimed row's own fields, sent without waiting for the acknowledgement, which is a
    future done ``delay_s`` later. A row published the serial way fails for good: every row of this
    harness needs this one target, so each must go through the pipeline."""

    pipelined = True

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        raise PermanentError("a pipelining target's row went the serial way")

    async def publish_claimed(self, **_: Any) -> None:
        raise PermanentError("a pipelining target's row went the serial way")

    async def send_claimed(
        self, *, event_id: str, event_type: str, app_code: str, room_id: str, payload: bytes
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        ack: asyncio.Future[Any] = loop.create_future()
        if self.delay_s:
            loop.call_later(self.delay_s, _acknowledge, ack, event_id)
        else:
            ack.set_result(event_id)
        return ack

    def failure(self, exc: BaseException) -> BaseException:
        return exc


def two_target_publishers(delay_s: float) -> dict[str, RecordingPublisher]:
    """Direct mode as configured by default: IM and activity, each a publisher taking the decoded Event
    (the ``direct-2`` shape of bench.worker_rows and bench.outbox_drain)."""
    return {"im": RecordingPublisher(delay_s), "activity": RecordingPublisher(delay_s)}


def _connected(conn: sa.Connection) -> None:
    conn.execute(sa.text("SELECT 1"))


def _acknowledge(ack: asyncio.Future[Any], message_id: str) -> None:
    if not ack.done():  # the worker gave up on it (cancelled)
        ack.set_result(message_id)


class RecordingWorker(OutboxWorker):
    """Writes a line when a row's publish succeeded, with the claim it held."""

    log: TextIO | None = None

    async def deliver(self, row: ClaimedRow) -> Outcome:
        outcome = await super().deliver(row)
        if outcome.delivered and self.log is not None:
            self.log.write(f"{row.event_id} {self.owner} {row.lock_until_ms} {now_ms()}\n")
        return outcome


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--owner", required=True)
    parser.add_argument("--log", default="", help="file for one line per delivery (empty: no log)")
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--lock-s", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--start-on-sigusr1", action="store_true", help="claim nothing before SIGUSR1")
    parser.add_argument("--pipelined", action="store_true", help="the broker target's pipelining shape (no --log)")
    parser.add_argument(
        "--two-targets", action="store_true", help="direct mode: rows to IM and activity (publishers taking the Event)"
    )
    args = parser.parse_args()
    if args.pipelined and args.log:  # pipelined rows are not delivered through deliver(), which logs
        parser.error("--pipelined takes no --log")
    if args.pipelined and args.two_targets:
        parser.error("--pipelined and --two-targets are two shapes: pick one")
    delay_s = args.delay_ms / 1000
    mode = PublishMode.MQ
    publishers = {BROKER: (PipeliningPublisher if args.pipelined else RecordingPublisher)(delay_s)}
    if args.two_targets:  # a join's row needs both (a row of a type routed to IM only needs IM)
        mode = PublishMode.DIRECT
        publishers = two_target_publishers(delay_s)
    db = Database.from_url(args.url, pool_size=4, max_overflow=2)
    # without a log, the worker as `room-service worker` runs it (no recording layer per row)
    worker_class = RecordingWorker if args.log else OutboxWorker
    worker = worker_class(
        repository=SqlOutboxRepository(db),
        publishers=PublisherSet(publishers),
        policy=RetryPolicy(initial_backoff_ms=100, max_backoff_ms=1_000, max_retry_count=10),
        options=WorkerOptions(
            mode=mode,
            batch_size=args.batch,
            poll_interval_s=0.05,
            publish_timeout_s=0.5,
            lock_timeout_s=args.lock_s,
            publish_concurrency=args.concurrency,
        ),
        clock=now_ms,
        owner=args.owner,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    log = open(args.log, "a", buffering=1) if args.log else None  # noqa: SIM115 - closed below
    if isinstance(worker, RecordingWorker):
        worker.log = log
    go = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    settle_after_start()  # the collector as `room-service worker` sets it once started
    try:
        if args.start_on_sigusr1:  # several workers can then start claiming at one instant
            # started up as a bare loop is when it says ready: connected, on the connection its claims
            # take (SQLite: the inline units' own; MariaDB: the pool's, where the held session comes from)
            await db.run_write(_connected)
            print("ready", flush=True)
            await go.wait()
        async with worker:
            if not args.start_on_sigusr1:
                print("ready", flush=True)
            await stop.wait()
    finally:
        if log is not None:
            log.close()
    await db.dispose()


if __name__ == "__main__":
    asyncio.run(main())
