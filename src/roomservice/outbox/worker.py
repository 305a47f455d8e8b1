"""OutboxWorker: claim due rows, publish each to the targets it still needs, finish the batch.

    claim (one short transaction) -> publish (rooms concurrently, each room's rows in
    version order), each attempt bounded by publish_timeout -> finish (one transaction,
    every write guarded by the claim)

No transaction is open while publishing. A commit wakes the worker at once
(``wake()``); ``poll_interval`` is only the fallback for rows committed by other
processes. A wake-up that arrives mid-batch makes the worker loop again instead
of sleeping. ``shutdown()`` stops after the current publishes are cancelled and
hands the unfinished claims back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from roomservice.domain.events import Event
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import (
    OUTBOX_CLAIM_BATCH,
    OUTBOX_COMMIT_TO_DELIVERED_SECONDS,
    OUTBOX_DELIVERIES,
    OUTBOX_PUBLISH_SECONDS,
    OUTBOX_ROWS_FINISHED,
)
from roomservice.outbox.model import ClaimedRow, Outcome, PublishMode, format_targets, required_targets
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.repository import Delivered, OutboxRepository, RetryDecision
from roomservice.publishers.port import PublishError, PublisherSet
from roomservice.wire import decode_event

_log = get_logger("roomservice.outbox")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    mode: PublishMode
    batch_size: int = 100
    poll_interval_s: float = 1.0
    publish_timeout_s: float = 3.0
    lock_timeout_s: float = 30.0
    publish_concurrency: int = 16

    @property
    def lock_ms(self) -> int:
        """The claim lease: long enough for the whole batch, queued behind the concurrency limit
        (or, at worst, one room's rows one after another)."""
        # a lane's rows also queue on the shared concurrency limit: the worst case adds up
        rounds = math.ceil(self.batch_size / self.publish_concurrency) + MAX_ROOM_LANE
        needed = rounds * self.publish_timeout_s + 5.0
        return int(max(self.lock_timeout_s, needed) * 1000)


FULL_CLAIM_EVERY_S = 0.25
MAX_ROOM_LANE = 8  # rows of one room a batch publishes one after another before the lease must hold


def new_owner() -> str:
    return f"worker-{uuid.uuid4().hex[:12]}"


class OutboxWorker:
    def __init__(
        self,
        *,
        repository: OutboxRepository,
        publishers: PublisherSet,
        policy: RetryPolicy,
        options: WorkerOptions,
        clock: Callable[[], int],
        owner: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.repository = repository
        self.publishers = publishers
        self.policy = policy
        self.options = options
        self.clock = clock
        self.owner = owner or new_owner()
        self._rng = rng or random.Random()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._running: asyncio.Task[None] | None = None
        self._last_full_claim = float("-inf")
        self.batches = 0

    # ------------------------------------------------------------------ lifecycle

    def wake(self) -> None:
        """Signal new work (called after a commit); safe from any coroutine of this loop."""
        self._wakeup.set()

    def start(self) -> asyncio.Task[None]:
        """Run the loop in a task of the current event loop."""
        self._running = asyncio.create_task(self.run(), name=f"outbox-worker-{self.owner}")
        return self._running

    async def __aenter__(self) -> OutboxWorker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    async def run(self) -> None:
        _log.info("outbox_worker_started", owner=self.owner, mode=self.options.mode.value)
        while not self._stopping:
            woken = self._wakeup.is_set()
            self._wakeup.clear()
            # Under load wake-ups come in bursts: due retryable and expired rows are still
            # looked for at least every FULL_CLAIM_EVERY_S, far below any backoff.
            recent_full = time.monotonic() - self._last_full_claim < FULL_CLAIM_EVERY_S
            try:
                taken = await self.run_once(pending_only=woken and recent_full)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database blinked: back off one poll interval
                _log.warning("outbox_worker_cycle_failed", owner=self.owner, error=repr(exc))
                taken = 0
            if self._stopping:
                break
            if taken >= self.options.batch_size or self._wakeup.is_set():
                continue  # more may be waiting, or someone committed while we worked
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=self.options.poll_interval_s)
        _log.info("outbox_worker_stopped", owner=self.owner)

    async def shutdown(self, *, grace_s: float = 0.0) -> None:
        """Stop: let the current batch finish for up to ``grace_s``, then cancel the
        publishes still in flight and hand their claims back."""
        self._stopping = True
        self._wakeup.set()
        task, self._running = self._running, None
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # by owner, not by the ids we know: a claim can commit as the cancel lands
        released = await self.repository.release(owner=self.owner, row_ids=None, now_ms=self.clock())
        if released:
            _log.info("outbox_claims_released", owner=self.owner, rows=released)

    # ------------------------------------------------------------------ one cycle

    async def run_once(self, *, pending_only: bool = False) -> int:
        """Claim one batch and deliver it; returns how many rows were claimed.

        ``pending_only`` (a hint to the repository) skips looking for due retryable
        and expired rows: for cycles started by a commit's wake-up.
        """
        if not pending_only:
            self._last_full_claim = time.monotonic()
        rows = await self.repository.claim_due(
            owner=self.owner,
            now_ms=self.clock(),
            lock_ms=self.options.lock_ms,
            limit=self.options.batch_size,
            pending_only=pending_only,
        )
        OUTBOX_CLAIM_BATCH.observe(len(rows))
        if not rows:
            return 0
        self.batches += 1
        # Rooms in parallel, each room's rows in version order: an IM group is created
        # before it gets messages and destroyed after them, as the room lived it.
        semaphore = asyncio.Semaphore(self.options.publish_concurrency)
        lanes: dict[tuple[str, str], list[ClaimedRow]] = {}
        excess: list[ClaimedRow] = []
        for row in sorted(rows, key=lambda r: (r.room_version, r.id)):
            lane_rows = lanes.setdefault((row.app_code, row.room_id), [])
            # a lane is published row after row: more than MAX_ROOM_LANE could outlast the lease
            (lane_rows if len(lane_rows) < MAX_ROOM_LANE else excess).append(row)
        if excess:
            await self.repository.defer(owner=self.owner, row_ids=[r.id for r in excess], now_ms=self.clock())

        async def lane(room_rows: list[ClaimedRow]) -> list[Outcome]:
            outcomes = []
            for row in room_rows:
                async with semaphore:
                    outcomes.append(await self.deliver(row))
            return outcomes

        per_room = await asyncio.gather(*(lane(room_rows) for room_rows in lanes.values()))
        await self._finish([outcome for outcomes in per_room for outcome in outcomes])
        return len(rows)

    async def deliver(self, row: ClaimedRow) -> Outcome:
        """Publish ``row`` to every target it still needs; never raises."""
        try:
            event = decode_event(row.payload)
        except Exception as exc:  # an undecodable row can never be delivered
            return Outcome(row, row.targets_done, delivered=False, permanent=True, error=f"undecodable: {exc!r}")
        needed = sorted(required_targets(row.event_type, self.options.mode) - row.targets_done)
        results = await asyncio.gather(*(self._publish(target, event, row.payload) for target in needed))
        done = set(row.targets_done)
        errors: list[str] = []
        permanent = False
        for target, error in zip(needed, results, strict=True):
            if error is None:
                done.add(target)
            else:
                errors.append(f"{target}: {error[1]}")
                permanent = permanent or error[0]
        if not errors:
            return Outcome(row, frozenset(done), delivered=True)
        return Outcome(row, frozenset(done), delivered=False, permanent=permanent, error="; ".join(errors))

    async def _publish(self, target: str, event: Event, payload: bytes) -> tuple[bool, str] | None:
        """None on success, else (permanent, message)."""
        publisher = self.publishers.get(target)
        if publisher is None:
            OUTBOX_DELIVERIES.labels(target, "no_publisher").inc()
            return (False, f"no publisher for target {target!r} in this process")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        timeout = self.options.publish_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await publisher.publish(event, payload=payload, deadline=loop.time() + timeout)
        except TimeoutError:
            outcome, result = "timeout", (False, f"timed out after {timeout:g}s")
        except PublishError as exc:
            outcome = "retryable" if exc.retryable else "permanent"
            result = (not exc.retryable, str(exc) or type(exc).__name__)
        except Exception as exc:  # a publisher bug is retried, like an outage
            outcome, result = "retryable", (False, repr(exc))
        else:
            outcome, result = "ok", None  # type: ignore[assignment]
        OUTBOX_DELIVERIES.labels(target, outcome).inc()
        OUTBOX_PUBLISH_SECONDS.labels(target).observe(time.perf_counter() - started)
        return result

    async def _finish(self, outcomes: list[Outcome]) -> None:
        now = self.clock()
        delivered: list[Delivered] = []
        retries: list[RetryDecision] = []
        for outcome in outcomes:
            row = outcome.row
            targets = format_targets(outcome.targets_done)
            if outcome.delivered:
                delivered.append(Delivered(row.id, targets))
                OUTBOX_COMMIT_TO_DELIVERED_SECONDS.observe(max(0, now - row.created_at_ms) / 1000)
                continue
            attempts = row.retry_count + 1
            dead = outcome.permanent or self.policy.exhausted(attempts)
            backoff = 0 if dead else self.policy.backoff_ms(attempts, rng=self._rng)
            retries.append(RetryDecision(row.id, targets, dead, now + backoff, outcome.error or "unknown error"))
            # one line per failed attempt: a poison event cannot flood the log
            log = _log.error if dead else _log.warning
            log(
                "outbox_dead_letter" if dead else "outbox_publish_failed",
                event_id=row.event_id,
                event_type=row.event_type,
                app_code=row.app_code,
                room_id=row.room_id,
                attempt=attempts,
                permanent=outcome.permanent,
                retry_in_ms=None if dead else backoff,
                targets_done=targets,
                error=outcome.error,
            )
        changed = await self.repository.finish(owner=self.owner, now_ms=now, delivered=delivered, retries=retries)
        OUTBOX_ROWS_FINISHED.labels("delivered").inc(len(delivered))
        OUTBOX_ROWS_FINISHED.labels("failed").inc(sum(1 for r in retries if r.failed))
        OUTBOX_ROWS_FINISHED.labels("retryable").inc(sum(1 for r in retries if not r.failed))
        if changed < len(delivered) + len(retries):
            # our claim expired and another worker took rows over: its finish wins
            _log.warning(
                "outbox_claims_lost", owner=self.owner, expected=len(delivered) + len(retries), changed=changed
            )
