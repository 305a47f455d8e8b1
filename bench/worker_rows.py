"""The outbox worker's own cost a row, without a database (issue 12, stop 28).

``bench.outbox_drain`` puts the worker beside the bare claim + finish loop on a real database; what
the worker spends a row above that loop is its own: the route, the publish attempt, its outcome, the
decision, the metrics. Here one worker drains ``--rows`` rows claimed from an in-memory repository (a
claim is a slice of a prepared list, a finish a count) in batches of 200 to an instant publisher of
each shape the drain uses -- "direct": a publisher taking the decoded Event, row after row per room;
"mq": the broker target's pipelined sends of the claimed row's own fields -- and "direct-2": direct mode
as configured by default, a join's row to its two targets (IM and activity), each a publisher taking the
decoded Event. Printed per row:

  * by default, microseconds of CPU (best of three drains; moves with the machine);
  * with ``--instructions``, instructions counted by callgrind (this script re-runs itself under
    valgrind, instrumentation on for each drain only; the same count for the same code however busy
    the machine is: for comparing two versions).

    .venv/bin/python -m bench.worker_rows [--rows 20000] [--instructions]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.e2e.worker_proc import PipeliningPublisher, RecordingPublisher, two_target_publishers

from bench import callgrind
from roomservice.domain import events as e
from roomservice.observability.logging import configure_logging
from roomservice.outbox.model import BROKER, ClaimedRow, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.repository import Delivered, RetryDecision
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.port import PublisherSet
from roomservice.wire import encode_event

BATCH = 200
OWNER = "worker-b00000000000"
LOCK_MS = 30_000
SHAPES = {"direct": RecordingPublisher, "mq": PipeliningPublisher}  # as bench.outbox_drain's worker processes
TWO_TARGETS = "direct-2"  # direct mode: a join's row to IM and activity
_UNDER_CALLGRIND = "ROOMBENCH_WORKER_ROWS_UNDER_CALLGRIND"  # set by the parent for the re-run under valgrind


def claimed_rows(count: int, *, joins: bool = False) -> list[ClaimedRow]:
    """``count`` rows as a claim returns them (held by OWNER), over 100 rooms as the drain's seed
    (``joins``: RoomUserJoined, which direct mode publishes to IM and activity)."""
    now = time.time_ns() // 1_000_000
    rows = []
    for i in range(count):
        payload = e.RoomUserJoined(user_id=f"u{i}", role="member") if joins else e.RoomMicLeft(user_id=f"u{i}", seat=1)
        ev = e.Event(uuid.uuid4().hex, "bench", f"r{i % 100}", i + 1, now, payload)
        rows.append(ClaimedRow(i + 1, ev.event_id, "bench", ev.room_id, i + 1, ev.type, encode_event(ev), 0,
                               frozenset(), OWNER, now + LOCK_MS, now))
    return rows


class InMemoryRepository:
    """Claims hand out the prepared rows in order; finishes count them; ``drained`` is set at the last."""

    def __init__(self, rows: list[ClaimedRow]) -> None:
        self.rows, self.taken, self.finished = rows, 0, 0
        self.drained = asyncio.Event()

    def _claim(self, limit: int) -> list[ClaimedRow]:
        batch = self.rows[self.taken : self.taken + limit]
        self.taken += len(batch)
        return batch

    def _finish(self, delivered: list[Delivered], retries: list[RetryDecision]) -> int:
        if retries:
            raise AssertionError(f"an instant publisher's row was not delivered: {retries[0]}")
        self.finished += len(delivered)
        if self.finished >= len(self.rows):
            self.drained.set()
        return len(delivered)

    async def claim_due(self, *, owner: str, now_ms: int, lock_ms: int, limit: int,
                        pending_only: bool = False) -> list[ClaimedRow]:
        return self._claim(limit)

    async def finish(self, *, owner: str, now_ms: int, delivered: list[Delivered],
                     retries: list[RetryDecision]) -> int:
        return self._finish(delivered, retries)

    async def finish_and_claim(self, *, owner: str, now_ms: int, delivered: list[Delivered],
                               retries: list[RetryDecision], lock_ms: int, limit: int,
                               pending_only: bool = False) -> tuple[int, list[ClaimedRow]]:
        return self._finish(delivered, retries), self._claim(limit)

    async def extend(self, *, owner: str, row_ids: list[int], now_ms: int, lock_ms: int) -> int:
        return len(row_ids)

    async def release(self, *, owner: str, row_ids: list[int] | None, now_ms: int) -> int:
        return 0

    async def defer(self, *, owner: str, row_ids: list[int], now_ms: int) -> int:
        raise AssertionError("an instant publisher's batch left rows untried")

    async def delete_delivered(self, *, before_ms: int, limit: int) -> int:
        return 0


async def drain(shape: str, rows: list[ClaimedRow]) -> None:
    """One worker drains ``rows`` to an instant publisher of ``shape``, as bench.outbox_drain's workers run."""
    repository = InMemoryRepository(rows)
    if shape == TWO_TARGETS:
        mode, publishers = PublishMode.DIRECT, two_target_publishers(0.0)
    else:
        mode, publishers = PublishMode.MQ, {BROKER: SHAPES[shape](0.0)}
    worker = OutboxWorker(
        repository=repository,
        publishers=PublisherSet(publishers),
        policy=RetryPolicy(initial_backoff_ms=100, max_backoff_ms=1_000, max_retry_count=10),
        options=WorkerOptions(mode=mode, batch_size=BATCH, poll_interval_s=0.05, publish_timeout_s=0.5,
                              lock_timeout_s=LOCK_MS / 1000, publish_concurrency=BATCH),
        clock=lambda: time.time_ns() // 1_000_000,
        owner=OWNER,
    )
    async with worker:
        async with asyncio.timeout(300):
            await repository.drained.wait()


async def cpu_a_row(shape: str, rows: list[ClaimedRow]) -> str:
    best = float("inf")
    for _ in range(3):
        cpu = time.process_time()
        await drain(shape, rows)
        best = min(best, time.process_time() - cpu)
    return f"{best / len(rows) * 1e6:6.2f} us of CPU a row"


async def instructions_a_row(shape: str, rows: list[ClaimedRow], counter: callgrind.PhaseCounter) -> str:
    counter.phase(shape)
    await drain(shape, rows)
    counter.phase("done")
    return f"{counter.totals()[shape] / len(rows) / 1e3:6.1f}k instructions a row"


async def run(rows: int, counter: callgrind.PhaseCounter | None) -> None:
    prepared = {shape: claimed_rows(rows) for shape in SHAPES}
    prepared[TWO_TARGETS] = claimed_rows(rows, joins=True)
    for shape, shape_rows in prepared.items():
        await drain(shape, shape_rows[: 2 * BATCH])  # first drain outside the count: routes and metric children made
        figure = await (
            cpu_a_row(shape, shape_rows) if counter is None else instructions_a_row(shape, shape_rows, counter)
        )
        print(f"  {shape:8} {figure}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    configure_logging(level="warning", json=True, file=open(os.devnull, "w"))  # noqa: SIM115
    counts_dir = os.environ.get(_UNDER_CALLGRIND)
    if counts_dir is not None:  # the re-run under valgrind
        asyncio.run(run(args.rows, callgrind.PhaseCounter(os.getpid(), Path(counts_dir))))
        return
    print(f"The outbox worker alone, {args.rows} rows from an in-memory repository in batches of {BATCH} "
          f"({'instructions under callgrind' if args.instructions else 'CPU, best of 3'}); "
          f"python {sys.version.split()[0]}", flush=True)
    if not args.instructions:
        asyncio.run(run(args.rows, None))
        return
    if missing := callgrind.available():
        parser.error(f"--instructions needs valgrind: missing {missing}")
    with tempfile.TemporaryDirectory(prefix="roombench-callgrind-") as counts:
        subprocess.run([*callgrind.callgrind_prefix(Path(counts)), sys.executable, "-m", "bench.worker_rows",
                        "--rows", str(args.rows)], env={**os.environ, _UNDER_CALLGRIND: counts}, check=True)


if __name__ == "__main__":
    main()
