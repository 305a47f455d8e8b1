"""OutboxWorker: claim due rows, publish each to the targets it still needs, finish the batch.

    claim (one short transaction) -> publish (rooms concurrently, each room's rows in
    version order), each attempt bounded by publish_timeout -> finish (one transaction,
    every write guarded by the claim) + the next claim, in that same transaction

Under load a batch costs one transaction, not two: the finish of one batch carries
the claim of the next (``finish_and_claim``); a claim runs alone only when the last
finish found nothing, failed, or the worker is stopping. Under a backlog (a full
batch) that transaction runs *while* the batch publishes: it writes the finish of the
batch before and claims the batch after, so publishing and the database overlap
(a round trip to MySQL/MariaDB is most of a cycle). A batch's finish is then held
until the next batch is in hand and rides with the claim after it; a short batch, a
stop or a failure writes what is held as before. Rows are claimed at most one batch
ahead, under this worker's lease (the keeper extends them, and the rows of a held
finish, too); per-room order is kept within the worker, as the next batch publishes
only after this one ended.

A short batch's finish is written as soon as its rows are published: ``finish_linger_s``
(0 by default) can make it wait for the next commit's wake-up so that the finish also
carries that claim, at the price of holding every short batch's "delivered" back by up
to that long (issue 12: at 200 events/s a 10 ms linger was most of commit -> finish
committed).

A room's rows are published in version order, each after the one before it ended —
except in rooms whose every row has one target and that target's publisher pipelines
(the broker publisher on NATS: messages queued on one connection keep their order; on
the embedded broker: messages queued for shared publish transactions that commit in
queue order). Those rooms share the batch's one pipeline (``_Pipeline``): rows sent
round robin over the rooms without waiting for each acknowledgement; every row still
gets its own outcome, retry or dead letter, within its own ``publish_timeout``, exactly
as one at a time. A room with a row of any other kind is published row after row. While
the claim ahead is in flight the pipeline gives the loop a turn every ``_TURN_S``: sends
that never suspend would otherwise hold its database replies until the batch is sent.

No transaction is open while publishing. A commit wakes the worker at once
(``wake()``); ``poll_interval`` is only the fallback for rows committed by other
processes. A wake-up that arrives mid-batch makes the worker loop again instead
of sleeping. ``shutdown()`` stops after the current publishes are cancelled and
hands the unfinished claims back.

The claim lease is ``lock_timeout`` as configured. A batch that runs longer keeps
its rows: every ``lock_timeout / 3`` the worker extends the claims it still holds
(a guarded UPDATE), so a live worker never loses rows mid-batch while a dead
worker's rows come back ``lock_timeout`` after its last extension.

The database may fail any step (every call has a deadline, see
:mod:`roomservice.store.database`); the loop survives it. A finish that failed is
retried, with the same decisions, before the next claim; a cycle that failed after
its claim may have committed hands this owner's claims back first, so no row waits
out its lease behind a worker that is alive. :meth:`OutboxWorker.check` (readiness)
fails while cycles fail or when the loop has not moved for ``stale_after_s``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from roomservice import errors
from roomservice.domain.events import PAYLOAD_TYPES, Event
from roomservice.futures import Bounds, Deadlines, Slots, Started
from roomservice.futures import started as run_to_first_wait
from roomservice.observability import tracing
from roomservice.observability.logging import context_variable, get_logger
from roomservice.observability.metrics import (
    HELD_BACK,
    OUTBOX_CLAIM_BATCH,
    OUTBOX_COMMIT_TO_DELIVERED_SECONDS,
    OUTBOX_DELIVERIES,
    OUTBOX_PUBLISH_SECONDS,
    OUTBOX_ROWS_FINISHED,
    observe_many,
)
from roomservice.outbox.model import ClaimedRow, Outcome, PublishMode, format_targets, required_targets
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.repository import Delivered, OutboxRepository, RetryDecision
from roomservice.proto import room_outbox_event_pb2 as pb
from roomservice.publishers.port import PipeliningPublisher, Publisher, PublishError, PublisherSet
from roomservice.wire import decode_event

_log = get_logger("roomservice.outbox")
_EVENT_ID = context_variable("event_id")  # every line logged while a row is delivered names its event


FULL_CLAIM_EVERY_S = 0.25
MAX_ROOM_LANE = 8  # rows of one room a batch publishes one after another, at least; the rest wait their turn
# ... and more while the batch is younger than this: fast publishes keep one busy room's rows
# flowing (every further row of it would otherwise cost a cycle of its own), slow ones still
# hand the room's backlog back after MAX_ROOM_LANE rows.
LANE_BUDGET_S = 0.05
# A short batch's finish may wait this long for the next commit to claim with it: one write
# transaction per batch instead of two at moderate rates, but every such row's finish (its
# "delivered") waits too. 0: the finish is written at once. The linger only ever applies when no
# commit came during the batch, i.e. when the writer has time to spare for a claim of its own;
# at 200 events/s a 10 ms linger was ~3.5 ms of a ~6 ms commit -> finish committed (bench.timeline).
FINISH_LINGER_S = 0.0


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    mode: PublishMode
    batch_size: int = 100
    poll_interval_s: float = 1.0
    publish_timeout_s: float = 3.0
    lock_timeout_s: float = 30.0
    publish_concurrency: int = 16
    database_timeout_s: float = 5.0  # the deadline of one database call (database.timeout)
    # a room's lane goes on past MAX_ROOM_LANE rows while its batch is younger than this
    lane_budget_s: float = LANE_BUDGET_S
    # a short batch's finish may wait this long for the next wake-up, to carry its claim (0: never)
    finish_linger_s: float = FINISH_LINGER_S

    @property
    def lock_ms(self) -> int:
        """The claim lease, exactly as configured (extended while a batch runs)."""
        return max(1, int(self.lock_timeout_s * 1000))

    @property
    def extend_every_s(self) -> float:
        """How often a running batch extends its claims: three tries per lease."""
        return self.lock_timeout_s / 3

    @property
    def stale_after_s(self) -> float:
        """No sign of progress for this long and the loop counts as stuck. Every step
        beats: a database call ends within its deadline, a publish within
        publish_timeout, an idle wait within poll_interval, an extension every
        lock_timeout / 3; three of the longest of those is stuck."""
        return 3 * max(self.database_timeout_s, self.publish_timeout_s, self.poll_interval_s, self.extend_every_s)


# Metric children, looked up once: labels() costs a lock and a dict walk per call.
_DELIVERIES: dict[tuple[str, str], Any] = {}
_PUBLISH_SECONDS: dict[str, Any] = {}
_FINISHED = {status: OUTBOX_ROWS_FINISHED.labels(status) for status in ("delivered", "failed", "retryable")}


def _deliveries(target: str, outcome: str) -> Any:
    child = _DELIVERIES.get((target, outcome))
    if child is None:
        child = _DELIVERIES[(target, outcome)] = OUTBOX_DELIVERIES.labels(target, outcome)
    return child


def _attempted(target: str, outcome: str, seconds: float) -> None:
    """Count and time one publish attempt; held back and applied once per turn of the loop
    (``HELD_BACK``: a counter and a histogram update per attempt were a lock and a bisect each)."""
    HELD_BACK.inc_and_observe(_deliveries(target, outcome), _publish_seconds(target), seconds)


def _publish_seconds(target: str) -> Any:
    child = _PUBLISH_SECONDS.get(target)
    if child is None:
        child = _PUBLISH_SECONDS[target] = OUTBOX_PUBLISH_SECONDS.labels(target)
    return child


# Delivered((row_id, targets_done)) without the named tuple's generated __new__ (a Python function:
# ~0.2 us of a row's decision); both fields always given.
_delivered = partial(tuple.__new__, Delivered)

# A target's (deliveries "ok", publish seconds) children: what an attempt that succeeded counts, found
# with one lookup by the target's name.
_SUCCEEDED: dict[str, tuple[Any, Any]] = {}


def _succeeded(target: str) -> tuple[Any, Any]:
    children = _SUCCEEDED.get(target)
    if children is None:
        children = _SUCCEEDED[target] = (_deliveries(target, "ok"), _publish_seconds(target))
    return children


# Target sets are few (subsets of four targets): their text and their unions with one more target are
# worked out once, not for every row of every batch (a sort and a join, a set built: ~0.2 µs a row).
_TARGETS_TEXT: dict[frozenset[str], str] = {}
_WITH_TARGET: dict[tuple[frozenset[str], str], frozenset[str]] = {}


def _targets_text(targets: frozenset[str]) -> str:
    text = _TARGETS_TEXT.get(targets)
    if text is None:
        if len(_TARGETS_TEXT) >= 1024:  # a bound against odd rows' targets_done, as the routes have
            _TARGETS_TEXT.clear()
        text = _TARGETS_TEXT[targets] = format_targets(targets)
    return text


def _with_target(done: frozenset[str], target: str) -> frozenset[str]:
    key = (done, target)
    union = _WITH_TARGET.get(key)
    if union is None:
        if len(_WITH_TARGET) >= 1024:
            _WITH_TARGET.clear()
        union = _WITH_TARGET[key] = done | {target}
    return union


def _with_targets(done: frozenset[str], targets: tuple[str, ...]) -> frozenset[str]:
    return _with_target(done, targets[0]) if len(targets) == 1 else done | frozenset(targets)


def _check_envelope(payload: bytes) -> None:
    """Raise as :func:`decode_event` would for a payload it cannot decode (bad bytes, an unknown
    type), without building the Event: for rows whose targets do not need it."""
    PAYLOAD_TYPES[pb.RoomOutboxEvent.FromString(payload).type]


@dataclass(frozen=True, slots=True)
class _Route:
    """How the rows of one event type with one set of targets done are published: worked out once
    per such pair (the publishers are fixed when the worker is built), not per row."""

    needed: tuple[str, ...]  # the targets still to reach, sorted
    publishers: tuple[Publisher | None, ...]  # by target, None where this process has none
    decode: bool  # a publisher takes the decoded Event (the broker target takes the row's own fields)
    piped: tuple[str, PipeliningPublisher] | None  # the one target, when its publisher pipelines


class WorkerNotReady(errors.Unavailable):
    """The readiness check's answer: the worker is stopped, stuck, or its cycles fail."""


@dataclass(frozen=True, slots=True)
class _Finish:
    """A batch's decisions, kept until their finishing write commits."""

    now_ms: int
    delivered: list[Delivered]
    retries: list[RetryDecision]

    @property
    def rows(self) -> int:
        return len(self.delivered) + len(self.retries)

    def merged(self, later: _Finish) -> _Finish:
        """Two batches' decisions written as one (each row is in one of them)."""
        return _Finish(later.now_ms, self.delivered + later.delivered, self.retries + later.retries)


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
        self.claims_extended = 0
        self._last_beat = time.monotonic()
        self._failing: str | None = None  # why the last cycle failed; None when it did not
        self._unfinished: _Finish | None = None  # decisions not written yet: held for the next claim, or failed
        self._may_hold_claims = False  # a cycle failed after a claim may have committed
        self._routes: dict[tuple[str, frozenset[str]], _Route] = {}  # by (event type, targets done)
        self._bounds = Bounds()  # the publish attempts' publish_timeout: one timer for those in flight
        self._carried: list[ClaimedRow] | None = None  # claimed by the last finish, published next cycle
        self._deferred = False  # the last cycle handed rows back that were due: no poll sleep before the next
        # the loop run() runs on: asyncio.get_running_loop() makes a getpid system call every time (3.11),
        # once a row and target in _publish (~0.25 us here); None, or closed, outside run() (a test's deliver())
        self._loop: asyncio.AbstractEventLoop | None = None

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

    def _beat(self) -> None:
        self._last_beat = time.monotonic()

    async def check(self) -> None:
        """Readiness: raise :class:`WorkerNotReady` unless the loop runs, moves and its cycles succeed."""
        if not self.alive:
            raise WorkerNotReady("outbox worker is not running")
        quiet = time.monotonic() - self._last_beat
        if quiet > self.options.stale_after_s:
            raise WorkerNotReady(f"outbox worker loop stuck: no progress for {quiet:.1f}s")
        if self._failing is not None:
            raise WorkerNotReady(f"outbox worker cycles failing: {self._failing}")

    async def run(self) -> None:
        _log.info("outbox_worker_started", owner=self.owner, mode=self.options.mode.value)
        self._loop = asyncio.get_running_loop()
        while not self._stopping:
            woken = self._wakeup.is_set()
            self._wakeup.clear()
            # Under load wake-ups come in bursts: due retryable and expired rows are still
            # looked for at least every FULL_CLAIM_EVERY_S, far below any backoff.
            recent_full = time.monotonic() - self._last_full_claim < FULL_CLAIM_EVERY_S
            self._beat()
            try:
                taken = await self.run_once(pending_only=woken and recent_full)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database blinked: back off one poll interval
                _log.warning("outbox_worker_cycle_failed", owner=self.owner, error=repr(exc))
                self._failing = repr(exc)[:200]
                taken = 0
            else:
                self._failing = None
            self._beat()
            if self._stopping:
                break
            if taken >= self.options.batch_size or self._wakeup.is_set() or self._carried or self._deferred:
                continue  # more may be waiting or was handed back, the last finish claimed some, or someone committed
            # asyncio.timeout, not wait_for: wait_for ran the wait in a task of its own, so a wake-up
            # reached this task three turns of the loop after set() (the wait's task, wait_for's
            # waiter, this task) instead of one
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.poll_interval_s):
                    await self._wakeup.wait()
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
        if self._unfinished is not None:  # delivered rows must not be handed back for a second delivery
            self._may_hold_claims = False
            try:
                await self._settle()
            except Exception as exc:
                _log.warning("outbox_finish_not_written", owner=self.owner, error=repr(exc))
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
        rows, self._carried = self._carried, None
        self._deferred = False
        if rows is None:  # nothing claimed by the last finish: claim on its own
            await self._settle()
            if not pending_only:
                self._last_full_claim = time.monotonic()
            self._may_hold_claims = True  # until this cycle's claims are finished (or none were taken)
            rows = await self.repository.claim_due(
                owner=self.owner,
                now_ms=self.clock(),
                lock_ms=self.options.lock_ms,
                limit=self.options.batch_size,
                pending_only=pending_only,
            )
            self._beat()
            OUTBOX_CLAIM_BATCH.observe(len(rows))
        if not rows:
            self._may_hold_claims = False
            return 0
        self.batches += 1
        # Under a backlog the next batch is claimed while this one publishes, in one transaction
        # with the last batch's finish (held back for it): publishing and the database overlap.
        ahead: asyncio.Task[None] | None = None
        if not self._stopping and len(rows) >= self.options.batch_size:
            held = self._unfinished or _Finish(self.clock(), [], [])
            ahead = asyncio.create_task(self._finish(held, ahead=True), name=f"outbox-claim-ahead-{self.owner}")
        untried: list[ClaimedRow] = []
        ended: list[list[Outcome]] = []  # the attempts that ended, filled as they do (by room)
        try:
            outcomes = await self._publish_batch(rows, untried, ahead, ended)
            if ahead is not None:
                await asyncio.wait({ahead})
        except BaseException:
            if ahead is not None:  # its claim must be known; then every claim goes back next cycle
                await asyncio.wait({ahead})
                if not ahead.cancelled():
                    ahead.exception()  # retrieved: the held finish stays unwritten if it failed
                self._carried = None
                self._may_hold_claims = True
            self._keep_ended(ended)
            raise
        decided = self._decide(outcomes)
        if self._unfinished is not None:  # the last batch's, held back and not written ahead: one write
            decided = self._unfinished.merged(decided)
        # decided before the deferral is written: if that fails, the next cycle writes this
        # finish first and then hands the untried rows back (release), none delivered twice
        self._unfinished = decided
        following: list[ClaimedRow] = []
        if ahead is not None:
            # cancelled on its own (not with this task): a failed cycle like any other, not the worker's end
            failure = RuntimeError("the claim ahead was cancelled") if ahead.cancelled() else ahead.exception()
            if failure is not None:  # the next cycle writes both finishes, then hands every claim back
                self._may_hold_claims = True
                raise failure
            following, self._carried = self._carried or [], None
        if untried:  # never attempted: to the back of the queue, behind the other rooms' rows
            self._may_hold_claims = True
            if following:  # the same rooms' rows claimed ahead go back with them: a room's rows stay in order
                rooms = {(r.app_code, r.room_id) for r in untried}
                untried.extend(r for r in following if (r.app_code, r.room_id) in rooms)
                following = [r for r in following if (r.app_code, r.room_id) not in rooms]
            await self.repository.defer(owner=self.owner, row_ids=[r.id for r in untried], now_ms=self.clock())
            self._deferred = True
        if following:  # the next batch is in hand: this finish rides with the claim after it
            self._may_hold_claims = True
            self._carried = following
            return len(rows)
        # every claimed row is now deferred or decided: a failed finish is retried as it is
        self._may_hold_claims = False
        if len(rows) < self.options.batch_size and not untried:
            await self._linger()
        await self._finish(decided)
        return len(rows)

    def _keep_ended(self, ended: list[list[Outcome]]) -> None:
        """A batch cut short (cancelled by a shutdown past its grace, or failed): the rows it delivered
        are decided and held as unwritten, as a finish that failed is. Its next write (the shutdown's, or
        the next cycle's before its claims go back) keeps them from being handed back and published
        again. The others go back as before, uncounted: an attempt the cut ended is no failure of its
        target."""
        partial = [outcome for outcomes in ended for outcome in outcomes if outcome.delivered]
        if not partial:
            return
        decided = self._decide(partial)
        self._unfinished = decided if self._unfinished is None else self._unfinished.merged(decided)
        self._may_hold_claims = True

    async def _publish_batch(
        self,
        rows: list[ClaimedRow],
        untried: list[ClaimedRow],
        ahead: asyncio.Task[None] | None,
        per_room: list[list[Outcome]],
    ) -> list[Outcome]:
        """Publish a batch: rooms in parallel, each room's rows in version order. Rows a busy
        room's lane never reached go to ``untried``. ``ahead``: the claim of the next batch,
        whose rows the lease keeper extends too once it has them. ``per_room``: each room's (or
        the pipeline's) outcomes, a list added when it starts and filled as its attempts end."""
        # Rooms in parallel, each room's rows in version order: an IM group is created
        # before it gets messages and destroyed after them, as the room lived it.
        semaphore = Slots(self.options.publish_concurrency)
        lanes: dict[tuple[str, str], list[ClaimedRow]] = {}
        for row in sorted(rows, key=lambda r: (r.room_version, r.id)):
            lanes.setdefault((row.app_code, row.room_id), []).append(row)
        started = time.monotonic()
        budget = self.options.lane_budget_s
        # A room whose every row goes to one and the same pipelining publisher joins the batch's
        # one pipeline (rows sent without waiting for each other's acknowledgement, the publisher
        # keeping their order); every other room is a lane, published row after row.
        piped: list[list[tuple[ClaimedRow, str, PipeliningPublisher]]] = []
        plain: list[list[ClaimedRow]] = []
        for room_rows in lanes.values():
            first = self._pipelined(room_rows[0])
            if first is not None and all(self._pipelined(r) == first for r in room_rows[1:]):
                piped.append([(r, *first) for r in room_rows])
            else:
                plain.append(room_rows)

        async def lane(room_rows: list[ClaimedRow]) -> None:
            # a busy room's backlog must not hold the batch: past MAX_ROOM_LANE rows the lane
            # stops once the batch is lane_budget_s old
            outcomes: list[Outcome] = []
            per_room.append(outcomes)
            for n, row in enumerate(room_rows):
                if n >= MAX_ROOM_LANE and time.monotonic() - started >= budget:
                    untried.extend(room_rows[n:])
                    break
                if not semaphore.take_now():
                    await semaphore.take()
                try:
                    outcomes.append(await self.deliver(row))
                finally:
                    semaphore.give()

        async def pipeline() -> None:
            # round robin over the rooms: every room's first row, then every second row...; the
            # rows of one room keep their order, and past MAX_ROOM_LANE rows a room's backlog
            # waits for a later batch as a lane's does
            order = [
                (*room_rows[depth], depth)
                for depth in range(max(map(len, piped)))
                for room_rows in piped
                if depth < len(room_rows)
            ]
            sender = _Pipeline(self, semaphore, _Turns(ahead))
            per_room.append(sender.outcomes)
            await sender.run(order, started, untried)

        # the claims are extended only by a batch that outlives a third of the lease: no task
        # of its own for the others (almost all), only a timer
        keeper: list[asyncio.Task[None]] = []

        def held() -> list[int]:
            # this batch's rows; the rows claimed ahead, once claimed; the rows of the batch before
            # whose finish is not written yet: held for this one's, or the claim ahead that was to
            # write it failed (extending a row finished meanwhile changes nothing: the write is guarded)
            ids = [r.id for r in rows]
            ahead_ok = ahead is not None and ahead.done() and not ahead.cancelled() and ahead.exception() is None
            last = self._unfinished
            # (while the claim ahead runs, it is writing them: extending them then would only race it)
            if last is not None and (ahead is None or (ahead.done() and not ahead_ok)):
                ids.extend(d.row_id for d in last.delivered)
                ids.extend(r.row_id for r in last.retries)
            if ahead_ok:
                ids.extend(r.id for r in self._carried or ())
            return ids

        def keep() -> None:
            keeper.append(asyncio.create_task(self._keep_claims(held), name=f"outbox-claims-{self.owner}"))

        timer = asyncio.get_running_loop().call_later(self.options.extend_every_s, keep)
        try:
            if ahead is not None:
                # one turn of the loop first: the claim ahead sends its first statement (the finish)
                # before any row is published. Publishers that take a row at once never suspend, and
                # a batch of lanes used to run to its end before the claim ahead began: its round trips
                # overlapped nothing (issue 12: MariaDB, one worker, 200-row batches, publishing
                # 1.2 ms a batch against 8-11 ms for the finish + claim; drain ÷ bare, ten rounds
                # each, direct shape median 0.92 -> 0.98x; two workers overlap each other anyway: no change)
                await asyncio.sleep(0)
            if not plain:
                await pipeline()
            else:  # (the first lane runner runs in this task: one room makes no task of its own)
                lanes_run = _run_lanes(plain, lane, self.options.publish_concurrency)
                if piped:
                    await asyncio.gather(lanes_run, pipeline())
                else:
                    await lanes_run
        finally:
            timer.cancel()
            for task in keeper:
                task.cancel()
            await asyncio.gather(*keeper, return_exceptions=True)
        return [outcome for outcomes in per_room for outcome in outcomes]

    async def _linger(self) -> None:
        """Before finishing a batch that left nothing behind, wait up to ``finish_linger_s``
        for the next commit's wake-up, so that finish and the next claim are one transaction
        (not a finish now and a claim of its own a moment later). The rows were published
        and their decisions (``delivered_at_ms`` included) are taken already: only writing
        them waits. A row committed meanwhile is claimed by that same transaction as soon as
        its wake-up comes, as soon as a claim of its own would have been."""
        linger = self.options.finish_linger_s
        if linger <= 0 or self._wakeup.is_set() or self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger):
                await self._wakeup.wait()

    async def _finish(self, decided: _Finish, *, ahead: bool = False) -> None:
        """Write a batch's decisions, claiming the next batch in the same transaction;
        a write that fails is retried (finish alone) next cycle. The caller has set
        ``_unfinished`` to ``decided`` already (before any deferral), unless ``decided``
        is empty. ``ahead``: a batch is publishing meanwhile, its claims held."""
        if self._stopping:  # no new claims while stopping
            await (self._write_unfinished() if ahead else self._settle())
            return
        full = time.monotonic() - self._last_full_claim >= FULL_CLAIM_EVERY_S
        if full:
            self._last_full_claim = time.monotonic()
        # The claim may commit and its answer be lost: until it is known, rows may be held.
        self._may_hold_claims = True
        changed, rows = await self.repository.finish_and_claim(
            owner=self.owner,
            now_ms=decided.now_ms,
            delivered=decided.delivered,
            retries=decided.retries,
            lock_ms=self.options.lock_ms,
            limit=self.options.batch_size,
            pending_only=not full,
        )
        self._unfinished = None
        self._beat()
        OUTBOX_CLAIM_BATCH.observe(len(rows))
        if changed < decided.rows:
            _log.warning("outbox_claims_lost", owner=self.owner, expected=decided.rows, changed=changed)
        self._may_hold_claims = bool(rows)
        self._carried = rows or None

    async def _settle(self) -> None:
        """Write a finish that failed earlier, then hand back claims a failed cycle may have left."""
        await self._write_unfinished()
        if self._may_hold_claims:
            released = await self.repository.release(owner=self.owner, row_ids=None, now_ms=self.clock())
            self._may_hold_claims = False
            self._beat()
            if released:
                _log.info("outbox_claims_released", owner=self.owner, rows=released, reason="failed_cycle")

    async def _write_unfinished(self) -> None:
        """Write the decisions not written yet: held back for a claim, or whose write failed."""
        pending = self._unfinished
        if pending is not None:
            changed = await self.repository.finish(
                owner=self.owner, now_ms=pending.now_ms, delivered=pending.delivered, retries=pending.retries
            )
            self._unfinished = None
            self._beat()
            if changed < pending.rows:
                # our claim expired and another worker took rows over: its finish wins
                _log.warning("outbox_claims_lost", owner=self.owner, expected=pending.rows, changed=changed)

    async def _keep_claims(self, held: Callable[[], list[int]]) -> None:
        """Extend the claims ``held()`` names now and every ``lock_timeout / 3`` until cancelled
        (started ``lock_timeout / 3`` into the batch)."""
        while True:
            row_ids = held()
            try:
                kept = await self.repository.extend(
                    owner=self.owner, row_ids=row_ids, now_ms=self.clock(), lock_ms=self.options.lock_ms
                )
            except Exception as exc:  # the next try may land; the finish is guarded anyway
                _log.warning("outbox_claims_not_extended", owner=self.owner, rows=len(row_ids), error=repr(exc))
            else:
                self.claims_extended += 1
                self._beat()
                if kept < len(row_ids):
                    _log.warning("outbox_claims_lost", owner=self.owner, expected=len(row_ids), changed=kept)
            await asyncio.sleep(self.options.extend_every_s)

    def _route(self, row: ClaimedRow) -> _Route:
        key = (row.event_type, row.targets_done)
        route = self._routes.get(key)
        if route is None:
            if len(self._routes) >= 1024:  # event types are few; a bound against odd rows all the same
                self._routes.clear()
            required = required_targets(row.event_type, self.options.mode)
            needed = tuple(sorted(required - row.targets_done))
            publishers = tuple(self.publishers.get(target) for target in needed)
            piped = None
            if len(needed) == 1 and getattr(publishers[0], "pipelined", False):
                piped = needed[0], cast(PipeliningPublisher, publishers[0])
            route = self._routes[key] = _Route(
                needed,
                publishers,
                decode=any(p is not None and not hasattr(p, "publish_claimed") for p in publishers),
                piped=piped,
            )
        return route

    async def deliver(self, row: ClaimedRow) -> Outcome:
        """Publish ``row`` to every target it still needs; never raises. Lines logged meanwhile name the event."""
        named = _EVENT_ID.set(row.event_id)
        try:
            if tracing.ENABLED:  # a span continuing the trace stored with the row
                return await tracing.traced_delivery(row, self._deliver)
            return await self._deliver(row)
        finally:
            _EVENT_ID.reset(named)

    async def _deliver(self, row: ClaimedRow) -> Outcome:
        route = self._route(row)
        needed, publishers = route.needed, route.publishers
        event: Event | None = None
        try:
            # the Event is decoded only for a publisher that takes one (the broker target
            # takes the claimed row's own fields); an undecodable row is refused either way
            if route.decode:
                event = decode_event(row.payload)
            else:
                _check_envelope(row.payload)
        except Exception as exc:  # an undecodable row can never be delivered
            return Outcome(row, row.targets_done, delivered=False, permanent=True, error=f"undecodable: {exc!r}")
        if len(needed) == 1:  # the common case: awaited here, no task of its own
            return self._outcome(row, needed[0], await self._publish(needed[0], publishers[0], row, event))
        results = await self._publish_side_by_side(needed, publishers, row, event)
        if not any(results):
            return Outcome(row, _with_targets(row.targets_done, needed), True)
        done = set(row.targets_done)
        errors: list[str] = []
        permanent = False
        for target, error in zip(needed, results, strict=True):
            if error is None:
                done.add(target)
            else:
                errors.append(f"{target}: {error[1]}")
                permanent = permanent or error[0]
        return Outcome(row, frozenset(done), delivered=False, permanent=permanent, error="; ".join(errors))

    async def _publish_side_by_side(
        self, needed: tuple[str, ...], publishers: tuple[Publisher | None, ...], row: ClaimedRow, event: Event | None
    ) -> list[tuple[bool, str] | None]:
        """``row`` to several targets at once, their results in ``needed``'s order. Each attempt runs in
        this task up to its first wait, one after the other: targets that answer at once (direct mode's
        IM sandbox and activity service, in process) cost no task (issue 12: a task and an
        ``asyncio.wait`` a row were ~2/3 of the worker's CPU for a row to two such targets). Once an
        attempt waits, it goes on in this task and the targets after it start in tasks of their own
        beside it (:meth:`_beside`), in the context this began with: an attempt that waits inside a
        context it entered (its publish span, say) has left it current in this task."""
        context = contextvars.copy_context()
        results: list[tuple[bool, str] | None] = []
        for i, publisher in enumerate(publishers):
            first = run_to_first_wait(self._publish(needed[i], publisher, row, event))
            if isinstance(first, Started):  # (its bound, if any, is this task's: it goes on here)
                rest = needed[i + 1 :], publishers[i + 1 :]
                results.extend(await self._beside(first, *rest, row, event, context))
                break
            results.append(first)
        return results

    async def _beside(
        self,
        waiting: Started[tuple[bool, str] | None],
        needed: tuple[str, ...],
        publishers: tuple[Publisher | None, ...],
        row: ClaimedRow,
        event: Event | None,
        context: contextvars.Context,
    ) -> list[tuple[bool, str] | None]:
        """The rest of an attempt that waits (``waiting``, in this task) and the attempts at ``needed``
        in a task each, started beside it in a copy of ``context``; their results in that order. As
        gather did, it raises when cancelled, whatever the targets' tasks make of their own
        cancellation, and it ends only once they have."""
        loop = asyncio.get_running_loop()
        others = [
            loop.create_task(self._publish(target, publisher, row, event), context=context.copy())
            for target, publisher in zip(needed, publishers, strict=True)
        ]
        try:
            results = [await waiting]
            if others:
                # waited for, not awaited one by one: cancelled meanwhile, this raises whatever the tasks do
                # (an awaited task that made its cancellation a result would have swallowed this one's)
                await asyncio.wait(others)
                results.extend(task.result() for task in others)
        except BaseException:  # (cancelled: _publish returns every failure of a publish as its result)
            for task in others:
                task.cancel()
            # as gather did: the row's publishes have ended when this does (its claim may be handed back next)
            await asyncio.gather(*others, return_exceptions=True)
            raise
        return results

    def _pipelined(self, row: ClaimedRow) -> tuple[str, PipeliningPublisher] | None:
        """(target, publisher) when the row needs one target whose publisher pipelines, else None
        (tracing on: every row takes the traced path)."""
        return None if tracing.ENABLED else self._route(row).piped

    def _outcome(self, row: ClaimedRow, target: str, result: tuple[bool, str] | None) -> Outcome:
        """The Outcome of an attempt at ``row``'s one target that ended with ``result``."""
        if result is None:
            return Outcome(row, _with_target(row.targets_done, target), True)
        permanent, message = result
        return Outcome(row, row.targets_done, delivered=False, permanent=permanent, error=f"{target}: {message}")

    def _classify(self, error: BaseException | None) -> tuple[str, tuple[bool, str] | None]:
        """An attempt's end as (metric outcome, None on success or (permanent, message))."""
        if error is None:
            return "ok", None
        if isinstance(error, TimeoutError):
            return "timeout", (False, f"timed out after {self.options.publish_timeout_s:g}s")
        if isinstance(error, PublishError):
            return ("retryable" if error.retryable else "permanent"), (
                not error.retryable,
                str(error) or type(error).__name__,
            )
        return "retryable", (False, repr(error))  # a publisher bug is retried, like an outage

    def _failed(self, target: str, started: float, error: BaseException) -> tuple[bool, str] | None:
        """A failed attempt's end, (permanent, message); beats and counts it (a success is counted
        where it ends, in ``_publish``)."""
        outcome, result = self._classify(error)
        self._beat()
        _attempted(target, outcome, time.perf_counter() - started)
        return result

    async def _publish(
        self, target: str, publisher: Publisher | None, row: ClaimedRow, event: Event | None
    ) -> tuple[bool, str] | None:
        """None on success, else (permanent, message)."""
        if publisher is None:
            _deliveries(target, "no_publisher").inc()
            return (False, f"no publisher for target {target!r} in this process")
        started_at = time.perf_counter()
        # the attempt's one deadline: the worker's bound (a publisher may ignore it), and the same
        # instant given to the publisher
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.publish_timeout_s
        try:
            if event is None:
                call = publisher.publish_claimed(  # type: ignore[attr-defined]
                    event_id=row.event_id,
                    event_type=row.event_type,
                    app_code=row.app_code,
                    room_id=row.room_id,
                    payload=row.payload,
                    deadline=deadline,
                )
            else:
                call = publisher.publish(event, payload=row.payload, deadline=deadline)
            # run up to its first wait: one that answers at once (an in-process target: the IM sandbox,
            # the activity service) cannot have run out of time, and needs no bound (~1 µs a row); the
            # bound is entered and left as `async with` would, without its two coroutines a row
            first = run_to_first_wait(call)
            if isinstance(first, Started):
                bound = self._bounds.until(deadline).enter()
                try:
                    await first
                except BaseException as exc:
                    bound.exit(exc)
                    raise
                bound.exit(None)
        except Exception as exc:
            return self._failed(target, started_at, exc)
        # succeeded (almost every attempt): beat, count and time it as _failed does a failure, without its calls
        self._last_beat = time.monotonic()
        counter, histogram = _SUCCEEDED.get(target) or _succeeded(target)
        HELD_BACK.inc_and_observe(counter, histogram, time.perf_counter() - started_at)
        return None

    def _decide(self, outcomes: list[Outcome]) -> _Finish:
        """How each row ends (logged and counted once, however often the write is retried)."""
        now = self.clock()
        delivered: list[Delivered] = []
        retries: list[RetryDecision] = []
        ages: list[int] = []  # ms from the row's command to now, of the rows delivered
        done_before: frozenset[str] | None = None  # the row before's targets, and their text: a batch has one or two
        targets = ""
        for outcome in outcomes:
            row, done = outcome.row, outcome.targets_done
            if done is not done_before:
                done_before, targets = done, _targets_text(done)
            if outcome.delivered:
                delivered.append(_delivered((row.id, targets)))
                ages.append(now - row.created_at_ms)
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
        observe_many(OUTBOX_COMMIT_TO_DELIVERED_SECONDS, [age / 1000 if age > 0 else 0.0 for age in ages])
        _FINISHED["delivered"].inc(len(delivered))
        if retries:
            failed = sum(1 for r in retries if r.failed)
            _FINISHED["failed"].inc(failed)
            _FINISHED["retryable"].inc(len(retries) - failed)
        return _Finish(now, delivered, retries)


async def _run_lanes(
    lanes: list[list[ClaimedRow]],
    lane: Callable[[list[ClaimedRow]], Awaitable[None]],
    concurrency: int,
) -> None:
    """Publish ``lanes`` (rooms, each row after row) with at most ``concurrency`` runners taking
    them in turn (a task per runner, not per room): at most that many rows are attempted at once
    either way, so a batch of many one-row rooms parks no task per room on the semaphore.

    The first runner runs in the caller's task; each runner starts the next once it gives the loop
    a turn (a publish that waits), while lanes are left. Publishes that never wait (a target that
    takes a row at once) so leave every lane to the first runner, and no further task is made: a
    batch of 100 rooms started 99 tasks that found nothing left to do (issue 12)."""
    loop = asyncio.get_running_loop()
    taken = 0
    helpers: list[asyncio.Task[None]] = []
    closed = False  # ended (or cancelled, or failed): a runner's start_another still due starts nothing

    def start_another() -> None:
        if not closed and taken < len(lanes) and len(helpers) + 1 < concurrency:
            helpers.append(loop.create_task(runner()))

    async def runner() -> None:
        nonlocal taken
        loop.call_soon(start_another)  # runs once this runner waits (or ends)
        while taken < len(lanes):
            room_rows = lanes[taken]
            taken += 1
            await lane(room_rows)

    try:
        await runner()
        waited = 0
        while waited < len(helpers):  # helpers may start helpers while we wait
            await asyncio.gather(*helpers[waited:])
            waited = len(helpers)
    finally:
        closed = True
        running = [task for task in helpers if not task.done()]
        for task in running:  # (only when cancelled or failed: otherwise every helper is done)
            task.cancel()
        if running:  # no publish of this batch outlives it
            await asyncio.gather(*running, return_exceptions=True)


# A pipeline's sends share one asyncio timeout, moved to the current send's deadline at most this
# often (moving it costs a timer): a send may so be cut up to this much before its own deadline.
_BOUND_GRAIN_S = 0.01

# While the claim ahead is in flight, a pipeline gives the loop a turn this often: sends to a target
# that takes a row at once (the embedded broker, a fast connection) never suspend, and the claim's
# database replies waited for the whole batch to be sent before its next statement could go (issue 12:
# MariaDB, one worker, 200-row batches to an instant pipelining target, six pairs in alternating
# order: drain median 6,166 -> 6,852 rows/s, faster in every pair). Lanes (rooms published row after
# row) do not take turns: each is a task of its own, and one giving way only lets the next lane run,
# not the loop's I/O (measured: a loss in three of four pairs); holding every lane at a gate for two
# iterations of the loop instead measured -10 to +19 % over six pairs, no gain to keep.
_TURN_S = 0.0005


class _Turns:
    """Whether a pipeline should give the loop a turn now (see ``_TURN_S``)."""

    __slots__ = ("_ahead", "_next")

    def __init__(self, ahead: asyncio.Task[None] | None) -> None:
        self._ahead = ahead
        self._next = time.perf_counter() + _TURN_S

    def due(self) -> bool:
        ahead = self._ahead
        if ahead is None or ahead.done():
            return False
        now = time.perf_counter()
        if now < self._next:
            return False
        self._next = now + _TURN_S
        return True


def _give_up(ack: asyncio.Future[Any]) -> None:
    ack.cancel()


class _Pipeline:
    """One batch's rows to pipelining publishers (see the module doc): each row is sent once the
    one before it was (the publisher keeps their order) without waiting for its acknowledgement,
    at most ``publish_concurrency`` attempts at once with the batch's lanes, each attempt bounded
    by its own ``publish_timeout``.

    Per row this costs a send and no callback of its own: the acknowledgements are taken in send
    order (the order a pipelining target acknowledges in), as far as they are in, with one done
    callback waiting on the first that is not (a callback an acknowledgement was a ``Handle`` made
    and run by the loop a row: issue 12, ~4k instructions). An attempt is timed when it is taken in,
    so one acknowledged before the one sent ahead of it is timed with that one. The
    acknowledgements' deadlines share one timer (:class:`~roomservice.futures.Deadlines`: one past
    its own is cancelled and taken in as a timeout); the sends share one asyncio timeout
    (``_BOUND_GRAIN_S``); the attempts' latencies and outcomes go to the metrics held back
    (``HELD_BACK``). While the claim ahead is in flight the sends give the loop a turn every
    ``_TURN_S`` (``_Turns``)."""

    def __init__(self, worker: OutboxWorker, semaphore: Slots, turns: _Turns) -> None:
        self.worker = worker
        self.semaphore = semaphore
        self.turns = turns
        self.loop = asyncio.get_running_loop()
        self.timeout = worker.options.publish_timeout_s
        self.outcomes: list[Outcome] = []
        self.deadlines = Deadlines(_give_up)  # the acknowledgements not in yet
        self.acknowledged: dict[str, list[float]] = {}  # by target: latencies of the attempts that succeeded
        # the attempts sent and not taken in yet, in send order: (acknowledgement, row, target, publisher, t0)
        self.sent: collections.deque[tuple[asyncio.Future[Any], ClaimedRow, str, PipeliningPublisher, float]]
        self.sent = collections.deque()
        self.watched: asyncio.Future[Any] | None = None  # the first not in yet, which a callback waits on
        self.outstanding = 0
        self.idle: asyncio.Future[None] | None = None  # set when the last acknowledgement is in

    async def run(
        self, order: list[tuple[ClaimedRow, str, PipeliningPublisher, int]], started: float, untried: list[ClaimedRow]
    ) -> list[Outcome]:
        """``order``: (row, target, publisher, the row's place in its room), in send order."""
        try:
            await self._send_all(order, started, untried)
            if self.outstanding:
                self.idle = self.loop.create_future()
                await self.idle
        finally:
            for ack in self.deadlines.close():  # cancelled: let go of the acknowledgements still outstanding
                ack.cancel()
            self._take_in()  # every one is done now: each ends here (a let-go one as a timeout), before the count
            for target, latencies in self.acknowledged.items():  # counted once a batch, not once an attempt
                _deliveries(target, "ok").inc(len(latencies))
                observe_many(_publish_seconds(target), latencies)
            self.acknowledged.clear()
        return self.outcomes

    async def _send_all(
        self, order: list[tuple[ClaimedRow, str, PipeliningPublisher, int]], started: float, untried: list[ClaimedRow]
    ) -> None:
        worker, loop, semaphore = self.worker, self.loop, self.semaphore
        budget = worker.options.lane_budget_s
        i, n = 0, len(order)
        while i < n:
            sending = False
            t0 = 0.0
            try:
                async with asyncio.timeout(None) as bound:
                    moved = float("-inf")
                    while i < n:
                        row, target, publisher, depth = order[i]
                        if depth >= MAX_ROOM_LANE and time.monotonic() - started >= budget:
                            untried.extend(r for r, *_ in order[i:])  # sent round robin: the rest are all this deep
                            i = n
                            break
                        try:
                            _check_envelope(row.payload)
                        except Exception as exc:  # an undecodable row can never be delivered
                            self.outcomes.append(
                                Outcome(row, row.targets_done, False, permanent=True, error=f"undecodable: {exc!r}")
                            )
                            i += 1
                            continue
                        if not semaphore.take_now():
                            await semaphore.take()
                        now = loop.time()
                        if now - moved >= _BOUND_GRAIN_S:
                            bound.reschedule(now + self.timeout)
                            moved = now
                        sending, t0 = True, time.perf_counter()
                        try:
                            ack = await publisher.send_claimed(
                                event_id=row.event_id,
                                event_type=row.event_type,
                                app_code=row.app_code,
                                room_id=row.room_id,
                                payload=row.payload,
                            )
                        except Exception as exc:
                            semaphore.give()
                            self.outcomes.append(self._ended(row, target, t0, exc))
                        else:
                            self.outstanding += 1
                            sent = self.sent
                            sent.append((ack, row, target, publisher, t0))
                            if len(sent) == 1:  # the first not taken in: taken now, or a callback waits on it
                                self._take_in()
                            if not ack.done():
                                self.deadlines.watch(ack, now + self.timeout)
                        sending = False
                        i += 1
                        if self.turns.due():
                            await asyncio.sleep(0)
            except TimeoutError:
                if sending:  # the send itself ran out of time
                    semaphore.give()
                    self.outcomes.append(self._ended(order[i][0], order[i][1], t0, TimeoutError()))
                    i += 1
                # else it waited for a free place past the shared bound: the row goes again under a new one

    def _ended(self, row: ClaimedRow, target: str, t0: float, error: BaseException | None) -> Outcome:
        outcome, result = self.worker._classify(error)
        self.worker._beat()
        _attempted(target, outcome, time.perf_counter() - t0)
        return self.worker._outcome(row, target, result)

    def _take_in(self, _: object = None) -> None:
        """End the attempts whose acknowledgements are in, in send order, up to the first that is not,
        on which one done callback (this) waits. (Also the callback: its argument is that future.)"""
        sent = self.sent
        while sent:
            ack = sent[0][0]
            if not ack.done():
                if self.watched is not ack:
                    self.watched = ack
                    ack.add_done_callback(self._take_in)
                return
            _, row, target, publisher, t0 = sent.popleft()
            self._acknowledged(row, target, publisher, t0, ack)

    def _acknowledged(
        self, row: ClaimedRow, target: str, publisher: PipeliningPublisher, t0: float, ack: asyncio.Future[Any]
    ) -> None:
        self.semaphore.give()
        error = TimeoutError() if ack.cancelled() else ack.exception()
        if error is None:  # (almost every row) no classifying, metrics with the batch's (run)
            latencies = self.acknowledged.get(target)
            if latencies is None:
                latencies = self.acknowledged[target] = []
            latencies.append(time.perf_counter() - t0)
            self.worker._beat()
            self.outcomes.append(Outcome(row, _with_target(row.targets_done, target), True))
        else:
            if error is not None and not isinstance(error, TimeoutError):
                error = publisher.failure(error)
            self.outcomes.append(self._ended(row, target, t0, error))
        self.outstanding -= 1
        if not self.outstanding and self.idle is not None and not self.idle.done():
            self.idle.set_result(None)
