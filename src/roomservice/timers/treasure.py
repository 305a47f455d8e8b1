"""The treasure wake-up (SPEC §3/§4): a scheduling port and its durable local timer.

``RoomTreasureCountdownStarted`` must, at ``open_at_ms``, turn into an
``OpenTreasure`` command with the event's ``open_command_id``. The outbox
worker hands the event to a :class:`TreasureScheduler`; the default one,
:class:`DatabaseTreasureTimer`, stores a row in ``treasure_timer`` (so boxes
still open after a restart) and :class:`TreasureTimerRunner` fires due rows.
The broker delay-message path comes later behind the same port.

Row life cycle (``treasure_timer``, primary key app_code + room_id + box_id):

* ``schedule`` inserts ``scheduled`` with ``fire_at_ms = open_at_ms``; a second
  schedule of the same box changes nothing (insert ignoring duplicates).
* ``fire_due`` claims due rows in one short write transaction: status
  ``scheduled``, ``fire_at_ms <= now`` and no live lock. A claim sets
  ``lock_owner``, ``lock_until_ms = now + lock_ms`` **and moves ``fire_at_ms``
  to ``lock_until_ms``**: a claimer that dies is retried when its lease
  expires, and the (status, fire_at_ms) index alone keeps claimed rows out of
  the next scan. MySQL/MariaDB: ``SELECT ... FOR UPDATE SKIP LOCKED`` then an
  update by primary key; SQLite: the same two statements under
  ``BEGIN IMMEDIATE`` (the write lock is held from the start, so the select and
  the update cannot interleave with another claimer, in any process).
* No transaction is open while the opener runs. Each outcome is one update
  guarded by the claim (``lock_owner`` and the claimed ``lock_until_ms``): a
  claimer whose lease expired and was taken over changes nothing.

  - opened, or the room's no-op answer (stale, duplicate, closed room) -> ``fired``
  - ``TreasureTooEarly(open_at_ms)`` -> ``scheduled`` at that ``open_at_ms``, lock cleared
  - ``Retry`` / ``Unavailable`` / any 5xx or unexpected exception, here or at the room's owner ->
    ``attempts + 1``, ``fire_at_ms = now + min(1 s * 2**attempts, 60 s)``, lock
    cleared, one log line per attempt
  - a permanent error (``RoomNotFound`` and the room's other rule refusals: :func:`is_permanent`)
    -> ``fired``, logged as a warning

* A ``fired`` row's ``fire_at_ms`` holds when it fired; ``purge_fired`` deletes
  old fired rows in bounded batches on the same index.

The opener is idempotent by construction: the command id is
``treasure-open:<box_id>``, so a timer fired twice (lease overtaken, duplicate
schedule) answers the first result again and never opens a box twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import BigInteger, Connection, Executable, Select, and_, bindparam, func, or_, select, update
from sqlalchemy.sql.elements import BindParameter

from roomservice import errors
from roomservice.domain.commands import OpenTreasure
from roomservice.domain.events import Event, RoomTreasureCountdownStarted
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable
from roomservice.store.purge import OldestFirst
from roomservice.store.tables import treasure_timer

_log = get_logger("roomservice.timers.treasure")

SCHEDULED: Final = "scheduled"
FIRED: Final = "fired"

BACKOFF_BASE_MS: Final = 1_000
BACKOFF_MAX_MS: Final = 60_000
# When due rows exist but none could be claimed (another claimer holds them
# inside its claim transaction), the runner waits at least this long.
_MIN_SLEEP_S: Final = 0.01

Opener = Callable[[str, str, str, OpenTreasure], Awaitable[object]]
"""``opener(app_code, room_id, command_id, OpenTreasure(...))``: in production ``RoomService.execute``."""


@dataclass(frozen=True, slots=True)
class FireReport:
    """One ``fire_due`` pass: ``fired`` (opened, no-op or permanently dropped),
    ``rescheduled`` (too early: retried at ``open_at_ms``), ``failed`` (retried with backoff)."""

    fired: int = 0
    rescheduled: int = 0
    failed: int = 0

    @property
    def claimed(self) -> int:
        return self.fired + self.rescheduled + self.failed


@dataclass(frozen=True, slots=True)
class _Claim:
    app_code: str
    room_id: str
    box_id: str
    level: int
    open_at_ms: int
    command_id: str
    attempts: int
    lock_until_ms: int

    def key(self) -> dict[str, Any]:
        return {"b_app_code": self.app_code, "b_room_id": self.room_id, "b_box_id": self.box_id}

    def command(self) -> OpenTreasure:
        return OpenTreasure(box_id=self.box_id, level=self.level, open_at_ms=self.open_at_ms)


def backoff_ms(attempts: int) -> int:
    """Delay after the ``attempts``-th failure so far (0-based): 1 s, 2 s, 4 s ... capped at 60 s."""
    if attempts >= 6:  # 2**6 s > 60 s; also keeps 2**attempts small
        return BACKOFF_MAX_MS
    delay: int = BACKOFF_BASE_MS * 2 ** max(0, attempts)
    return min(delay, BACKOFF_MAX_MS)


def is_permanent(exc: BaseException) -> bool:
    """An answer that retrying can never change: the room refused the command by one of its rules
    (a 4xx other than too-early: the room never existed, a command id reused). Anything else is
    retried: ``internal`` (a bug, here or at the room's owner over the gRPC hop, where an
    unexpected exception comes back as that code), ``unauthorized`` from a peer (a shared secret
    being rotated), and every outage."""
    return isinstance(exc, (errors.DomainError, errors.CommandIdReused)) and not exc.retryable


# --------------------------------------------------------------------------- statements

_t = treasure_timer
_PK_MATCH = and_(
    _t.c.app_code == bindparam("b_app_code"),
    _t.c.room_id == bindparam("b_room_id"),
    _t.c.box_id == bindparam("b_box_id"),
)
# Guarded by the claim: this owner, this very lease.
_CLAIM_MATCH = and_(
    _PK_MATCH,
    _t.c.status == SCHEDULED,
    _t.c.lock_owner == bindparam("b_owner"),
    _t.c.lock_until_ms == bindparam("b_lock_until_ms"),
)


def due_select(*, skip_locked: bool) -> Select[Any]:
    """Due rows, oldest first, on the (status, fire_at_ms) index; ``FOR UPDATE SKIP LOCKED`` on MySQL."""
    now: BindParameter[int] = bindparam("b_now", type_=BigInteger())
    stmt = (
        select(
            _t.c.app_code,
            _t.c.room_id,
            _t.c.box_id,
            _t.c.level,
            _t.c.open_at_ms,
            _t.c.command_id,
            _t.c.attempts,
        )
        .where(
            _t.c.status == SCHEDULED,
            _t.c.fire_at_ms <= now,
            or_(_t.c.lock_until_ms.is_(None), _t.c.lock_until_ms <= now),
        )
        .order_by(_t.c.fire_at_ms)
        .limit(bindparam("b_limit"))
    )
    return stmt.with_for_update(skip_locked=True) if skip_locked else stmt


_TAKE = (
    update(_t)
    .where(_PK_MATCH, _t.c.status == SCHEDULED)
    .values(
        lock_owner=bindparam("b_owner"),
        lock_until_ms=bindparam("b_lock_until_ms"),
        fire_at_ms=bindparam("b_lock_until_ms"),
        updated_at_ms=bindparam("b_now"),
    )
)
_FIRED = (
    update(_t)
    .where(_CLAIM_MATCH)
    .values(
        status=FIRED,
        fire_at_ms=bindparam("b_now"),
        lock_owner=None,
        lock_until_ms=None,
        updated_at_ms=bindparam("b_now"),
    )
)
_RESCHEDULE = (
    update(_t)
    .where(_CLAIM_MATCH)
    .values(
        fire_at_ms=bindparam("b_fire_at_ms"),
        attempts=bindparam("b_attempts"),
        lock_owner=None,
        lock_until_ms=None,
        updated_at_ms=bindparam("b_now"),
    )
)
_NEXT_FIRE_AT = select(func.min(_t.c.fire_at_ms)).where(_t.c.status == SCHEDULED)


def _claim(conn: Connection, due: Select[Any], *, owner: str, now_ms: int, lock_ms: int, limit: int) -> list[_Claim]:
    rows = conn.execute(due, {"b_now": now_ms, "b_limit": limit}).all()
    if not rows:
        return []
    lock_until = now_ms + lock_ms
    params = [
        {
            "b_app_code": r.app_code,
            "b_room_id": r.room_id,
            "b_box_id": r.box_id,
            "b_owner": owner,
            "b_lock_until_ms": lock_until,
            "b_now": now_ms,
        }
        for r in rows
    ]
    conn.execute(_TAKE, params)
    return [
        _Claim(
            app_code=r.app_code,
            room_id=r.room_id,
            box_id=r.box_id,
            level=int(r.level),
            open_at_ms=int(r.open_at_ms),
            command_id=r.command_id,
            attempts=int(r.attempts),
            lock_until_ms=lock_until,
        )
        for r in rows
    ]


def _execute(conn: Connection, stmt: Executable, params: list[dict[str, Any]]) -> int:
    """One statement (executemany for several parameter sets); the rows it matched."""
    result = conn.execute(stmt, params[0] if len(params) == 1 else params)
    return int(result.rowcount)


# --------------------------------------------------------------------------- the timer


class DatabaseTreasureTimer:
    """The durable local wake-up: :class:`TreasureScheduler` plus the firing side."""

    def __init__(
        self,
        db: Database,
        *,
        clock: Callable[[], int],
        owner: str,
        on_scheduled: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self._purge_fired = OldestFirst(db, _t, _t.c.fire_at_ms, _t.c.status == FIRED)
        self.clock = clock
        self.owner = owner
        # called after a schedule committed (wire it to TreasureTimerRunner.wake)
        self.on_scheduled = on_scheduled
        self._due = due_select(skip_locked=db.dialect_name == "mysql")
        self._insert = db.insert_ignoring_duplicates(_t)

    # ---------------------------------------------------------------- scheduling

    async def schedule(self, event: Event) -> None:
        payload = event.payload
        if not isinstance(payload, RoomTreasureCountdownStarted):
            raise TypeError(f"treasure timer cannot schedule a {event.type} event")
        now = self.clock()
        row = {
            "app_code": event.app_code,
            "room_id": event.room_id,
            "box_id": payload.box_id,
            "level": payload.level,
            "open_at_ms": payload.open_at_ms,
            "command_id": payload.open_command_id,
            "status": SCHEDULED,
            "fire_at_ms": payload.open_at_ms,
            "attempts": 0,
            "lock_until_ms": None,
            "lock_owner": None,
            "created_at_ms": now,
            "updated_at_ms": now,
        }
        await self.db.run_write(_execute, self._insert, [row])
        if self.on_scheduled is not None:
            self.on_scheduled()

    # ---------------------------------------------------------------- firing

    async def fire_due(self, opener: Opener, *, limit: int = 100, lock_ms: int = 30_000) -> FireReport:
        """Claim up to ``limit`` due timers and open their boxes, one after the other."""
        claims = await self.db.run_write(
            _claim, self._due, owner=self.owner, now_ms=self.clock(), lock_ms=lock_ms, limit=limit
        )
        fired = rescheduled = failed = 0
        for i, claim in enumerate(claims):
            try:
                outcome = await self._fire_one(opener, claim)
            except asyncio.CancelledError:
                # shutting down: hand the rest back (the current one too: opening is idempotent)
                await asyncio.shield(self._release(claims[i:]))
                raise
            if outcome == "fired":
                fired += 1
            elif outcome == "rescheduled":
                rescheduled += 1
            else:
                failed += 1
        return FireReport(fired=fired, rescheduled=rescheduled, failed=failed)

    async def _fire_one(self, opener: Opener, claim: _Claim) -> str:
        log = _log.bind(
            app_code=claim.app_code,
            room_id=claim.room_id,
            box_id=claim.box_id,
            command_id=claim.command_id,
        )
        try:
            await opener(claim.app_code, claim.room_id, claim.command_id, claim.command())
        except errors.TreasureTooEarly as exc:
            await self._finish(_RESCHEDULE, claim, fire_at_ms=exc.open_at_ms, attempts=claim.attempts)
            return "rescheduled"
        except Exception as exc:
            if is_permanent(exc):
                log.warning("treasure_wakeup_dropped", error=_describe(exc))
                await self._finish(_FIRED, claim)
                return "fired"
            delay = backoff_ms(claim.attempts)
            log.warning(
                "treasure_wakeup_failed",
                attempt=claim.attempts + 1,
                retry_in_ms=delay,
                error=_describe(exc),
            )
            await self._finish(_RESCHEDULE, claim, fire_at_ms=self.clock() + delay, attempts=claim.attempts + 1)
            return "failed"
        await self._finish(_FIRED, claim)
        return "fired"

    async def _finish(
        self, stmt: Executable, claim: _Claim, *, fire_at_ms: int | None = None, attempts: int | None = None
    ) -> bool:
        """One update guarded by the claim; False if the lease was lost (someone else owns the row)."""
        params = {
            **claim.key(),
            "b_owner": self.owner,
            "b_lock_until_ms": claim.lock_until_ms,
            "b_now": self.clock(),
        }
        if fire_at_ms is not None:
            params["b_fire_at_ms"] = fire_at_ms
            params["b_attempts"] = attempts
        try:
            changed = await self.db.run_write(_execute, stmt, [params])
        except StoreUnavailable as exc:
            # the lease expires and the timer fires again (idempotently) later
            _log.warning("treasure_timer_finish_failed", box_id=claim.box_id, error=_describe(exc))
            return False
        if changed == 0:
            _log.info("treasure_timer_lease_lost", box_id=claim.box_id, room_id=claim.room_id)
        return changed > 0

    async def _release(self, claims: Sequence[_Claim]) -> None:
        """Hand claims back untouched: due again at once, attempts unchanged."""
        now = self.clock()
        params = [
            {
                **c.key(),
                "b_owner": self.owner,
                "b_lock_until_ms": c.lock_until_ms,
                "b_now": now,
                "b_fire_at_ms": now,
                "b_attempts": c.attempts,
            }
            for c in claims
        ]
        if not params:
            return
        try:
            await self.db.run_write(_execute, _RESCHEDULE, params)
        except Exception as exc:  # best effort: the leases expire anyway
            _log.warning("treasure_timer_release_failed", count=len(params), error=_describe(exc))

    # ---------------------------------------------------------------- queries and upkeep

    async def next_fire_at(self) -> int | None:
        """The earliest ``fire_at_ms`` of a scheduled timer (a claimed one counts at its lease expiry)."""
        async with self.db.read() as conn:
            value = await conn.scalar(_NEXT_FIRE_AT)
        return None if value is None else int(value)

    async def purge_fired(self, *, before_ms: int, limit: int) -> int:
        """Delete up to ``limit`` timers that fired before ``before_ms``; returns how many."""
        return await self._purge_fired(before_ms=before_ms, limit=limit)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- the runner


class TreasureTimerRunner:
    """Fires due timers until stopped: loops while a pass was full, else sleeps until the
    next ``fire_at_ms`` (at most ``idle_s``, the fallback for timers scheduled by another
    process), waking early on :meth:`wake`."""

    def __init__(
        self,
        timer: DatabaseTreasureTimer,
        opener: Opener,
        *,
        idle_s: float = 1.0,
        limit: int = 100,
        lock_ms: int = 30_000,
    ) -> None:
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.timer = timer
        self.opener = opener
        self.idle_s = idle_s
        self.limit = limit
        self.lock_ms = lock_ms
        self._wake = asyncio.Event()
        self._stopping = False

    def wake(self) -> None:
        """Something was scheduled: look again now (safe to call from the loop's thread only)."""
        self._wake.set()

    def stop(self) -> None:
        """Let :meth:`run` return after the pass in progress."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        _log.info("treasure_timer_started", owner=self.timer.owner)
        try:
            while not self._stopping:
                # cleared before the pass: a wake-up that arrives mid-pass means "loop again"
                self._wake.clear()
                try:
                    report = await self.timer.fire_due(self.opener, limit=self.limit, lock_ms=self.lock_ms)
                except Exception as exc:  # keep going: boxes must still open after a bad pass
                    _log.warning("treasure_timer_pass_failed", error=_describe(exc))
                    await self._sleep(self.idle_s)
                    continue
                if self._stopping:
                    break
                if report.claimed >= self.limit:
                    continue  # a full batch: more may be due
                await self._sleep(await self._delay_s())
        finally:
            _log.info("treasure_timer_stopped", owner=self.timer.owner)

    async def _delay_s(self) -> float:
        try:
            next_at = await self.timer.next_fire_at()
        except Exception:
            return self.idle_s
        if next_at is None:
            return self.idle_s
        delay = (next_at - self.timer.clock()) / 1000
        return min(self.idle_s, max(_MIN_SLEEP_S, delay))

    async def _sleep(self, seconds: float) -> None:
        if self._wake.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
