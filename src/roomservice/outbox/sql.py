"""``SqlOutboxRepository``: the :class:`OutboxRepository` port on SQLite and MySQL/MariaDB.

Every operation is one short write transaction run as one unit: through
:meth:`Database.run_write` (a synchronous unit; inline on the event loop's thread
on SQLite), or, for the worker's claim and finish on MySQL/MariaDB, through
:meth:`Database.run_driver_write` (an async unit). The worker's claim and finish
statements go to the driver's cursor without SQLAlchemy's execution per statement
on both (:mod:`roomservice.store.driver`); statements are built once, at import.

Claiming (SPEC §4, §10). ``due_at_ms`` is the claim key of every claimable
status, indexed with ``status``: ``retryable`` -> ``next_retry_at_ms``,
``delivering`` -> ``lock_until_ms``, ``pending`` -> ``created_at_ms``; a finished
(``delivered`` or ``failed``) row keeps the time it finished there. A
pending row is claimable whatever its ``due_at_ms`` (it only orders them,
oldest first): a worker whose clock lags the writer's must not leave fresh
rows behind. Pending rows go first, then due retryable rows, then delivering
rows whose lock expired.

* MySQL/MariaDB (READ COMMITTED): one indexed ``SELECT … WHERE status = :s
  [AND due_at_ms <= :now] ORDER BY due_at_ms LIMIT :n FOR UPDATE SKIP LOCKED``
  per status, for the count still missing and only while it is missing (never
  an OR across statuses: it defeats the index and locks what it scans), then
  one ``UPDATE … WHERE id IN (…)``. Rows another worker is claiming are
  skipped, not waited for.
* SQLite: one ``UPDATE … WHERE id IN (<pending> UNION ALL <retryable> UNION ALL
  <delivering> … LIMIT :n) RETURNING …`` in a ``BEGIN IMMEDIATE`` transaction.
  SQLite has one writer at a time, across processes too, so the statement
  reads and marks its rows atomically.

Every finishing write is guarded by the claim (``status = 'delivering' AND
lock_owner = :owner``): a worker whose lock expired and was taken over changes
nothing, and the returned row counts say so.

Retention runs in one process at a time, under
:class:`roomservice.leases.maintenance.DatabaseMaintenanceLock`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import (
    Connection,
    Select,
    bindparam,
    case,
    delete,
    func,
    literal_column,
    null,
    select,
    text,
    union_all,
    update,
)

from roomservice.outbox.model import ClaimedRow, Status, parse_targets
from roomservice.outbox.repository import Delivered, RetryDecision
from roomservice.store.database import Database
from roomservice.store.driver import DriverCursor, SqliteCursor
from roomservice.store.tables import room_outbox

LAST_ERROR_MAX_CHARS: Final = 2000
# MySQL refuses user-lock names longer than 64 characters.

_o = room_outbox
_c = room_outbox.c

_PENDING: Final = Status.PENDING.value
_RETRYABLE: Final = Status.RETRYABLE.value
_DELIVERING: Final = Status.DELIVERING.value
_DELIVERED: Final = Status.DELIVERED.value
_FAILED: Final = Status.FAILED.value
_PUBLISHED: Final = Status.PUBLISHED.value

# What a ClaimedRow needs besides the claim itself (owner and lock_until_ms are known).
_CLAIM_COLUMNS: Final = (
    _c.id,
    _c.event_id,
    _c.app_code,
    _c.room_id,
    _c.room_version,
    _c.event_type,
    _c.payload,
    _c.retry_count,
    _c.targets_done,
    _c.created_at_ms,
    _c.trace_context,
)

_IS_OURS: Final = (_c.status == _DELIVERING) & (_c.lock_owner == bindparam("b_owner"))

# --------------------------------------------------------------------------- claim: MySQL/MariaDB


def _mysql_claim_select(*, due: bool) -> Select[Any]:
    """Rows of one status (``b_status``), oldest ``due_at_ms`` first, locked, skipping locked ones."""
    where = [_c.status == bindparam("b_status")]
    if due:
        where.append(_c.due_at_ms <= bindparam("b_due"))
    return (
        select(*_CLAIM_COLUMNS)
        .where(*where)
        .order_by(_c.due_at_ms)
        .limit(bindparam("b_limit"))
        .with_for_update(skip_locked=True)
    )


MYSQL_CLAIM_PENDING: Final = _mysql_claim_select(due=False)
MYSQL_CLAIM_DUE: Final = _mysql_claim_select(due=True)
_MYSQL_CLAIM_STEPS: Final = (
    (MYSQL_CLAIM_PENDING, _PENDING),
    (MYSQL_CLAIM_DUE, _RETRYABLE),
    (MYSQL_CLAIM_DUE, _DELIVERING),
)

_CLAIM_VALUES: Final = {
    "status": _DELIVERING,
    "lock_owner": bindparam("b_owner"),
    "lock_until_ms": bindparam("b_until"),
    "due_at_ms": bindparam("b_until"),
    "updated_at_ms": bindparam("b_now"),
}
_MYSQL_MARK_CLAIMED: Final = update(_o).where(_c.id.in_(bindparam("b_ids", expanding=True))).values(**_CLAIM_VALUES)

# --------------------------------------------------------------------------- claim: SQLite


def _sqlite_claim_update() -> Any:
    """``UPDATE … WHERE id IN (<the first b_limit claimable ids>) RETURNING <claim columns>``."""

    def branch(priority: int, status: str, *, due: bool) -> Select[Any]:
        where = [_c.status == status]
        if due:
            where.append(_c.due_at_ms <= bindparam("b_due"))
        # SQLite allows ORDER BY/LIMIT in a compound member only inside a subquery.
        inner = (
            select(_c.id.label("id"), literal_column(str(priority)).label("priority"), _c.due_at_ms.label("due"))
            .where(*where)
            .order_by(_c.due_at_ms)
            .limit(bindparam("b_limit"))
            .subquery()
        )
        return select(inner.c.id, inner.c.priority, inner.c.due)

    claimable = union_all(
        branch(0, _PENDING, due=False),
        branch(1, _RETRYABLE, due=True),
        branch(2, _DELIVERING, due=True),
    ).subquery("claimable")
    first_ids = select(claimable.c.id).order_by(claimable.c.priority, claimable.c.due).limit(bindparam("b_limit"))
    return update(_o).where(_c.id.in_(first_ids)).values(**_CLAIM_VALUES).returning(*_CLAIM_COLUMNS)


SQLITE_CLAIM: Final = _sqlite_claim_update()

# --------------------------------------------------------------------------- finish / release

_FINISH_DELIVERED: Final = (
    update(_o)
    .where(_c.id.in_(bindparam("b_ids", expanding=True)), _IS_OURS)
    .values(
        status=_DELIVERED,
        delivered_at_ms=bindparam("b_now"),
        due_at_ms=bindparam("b_now"),  # not the claim's lock any more: when it finished
        targets_done=bindparam("b_targets"),
        lock_owner=null(),
        lock_until_ms=null(),
        last_error=null(),
        updated_at_ms=bindparam("b_now"),
    )
)
# MySQL evaluates SET left to right with the new values: no assignment below
# reads a column that an earlier one of the same statement changes.
_FINISH_RETRY: Final = (
    update(_o)
    .where(_c.id == bindparam("b_id"), _IS_OURS)
    .values(
        status=bindparam("b_status"),
        retry_count=_c.retry_count + 1,
        next_retry_at_ms=bindparam("b_next"),
        due_at_ms=bindparam("b_due"),
        last_error=bindparam("b_error"),
        targets_done=bindparam("b_targets"),
        lock_owner=null(),
        lock_until_ms=null(),
        updated_at_ms=bindparam("b_now"),
    )
)
# A batch that runs long keeps its rows: the lease moves on for every row still ours.
_EXTEND: Final = (
    update(_o)
    .where(_c.id.in_(bindparam("b_ids", expanding=True)), _IS_OURS)
    .values(lock_until_ms=bindparam("b_until"), due_at_ms=bindparam("b_until"), updated_at_ms=bindparam("b_now"))
)
_NEVER_TRIED = _c.retry_count == 0
_RELEASE_VALUES: Final = {
    "status": case((_NEVER_TRIED, _PENDING), else_=_RETRYABLE),
    "next_retry_at_ms": case((_NEVER_TRIED, _c.next_retry_at_ms), else_=bindparam("b_now")),
    "due_at_ms": case((_NEVER_TRIED, _c.created_at_ms), else_=bindparam("b_now")),
    "lock_owner": null(),
    "lock_until_ms": null(),
    "updated_at_ms": bindparam("b_now"),
}
_RELEASE: Final = update(_o).where(_c.id.in_(bindparam("b_ids", expanding=True)), _IS_OURS).values(_RELEASE_VALUES)
# Shutdown: everything this owner still holds, including a claim that committed as the
# worker was being cancelled (its ids never reached the worker).
_RELEASE_OWNED: Final = (
    update(_o).where(_c.status == _DELIVERING, _c.lock_owner == bindparam("b_owner")).values(_RELEASE_VALUES)
)
# Rows claimed but not attempted (beyond a room's lane): back of the queue, so one busy
# room cannot keep taking the head of every claim.
_DEFER: Final = (
    update(_o)
    .where(_c.id.in_(bindparam("b_ids", expanding=True)), _IS_OURS)
    .values({**_RELEASE_VALUES, "due_at_ms": bindparam("b_now")})
)
# ... and each deferred room's first deferred version, then its later pending rows behind them: claims
# take the oldest due_at_ms first (ties by id, the status index's order), so the room stays in order.
_DEFERRED_ROOMS: Final = (
    select(_c.app_code, _c.room_id, func.min(_c.room_version))
    .where(_c.id.in_(bindparam("b_ids", expanding=True)), _IS_OURS)
    .group_by(_c.app_code, _c.room_id)
)
_BEHIND_DEFERRED: Final = (
    update(_o)
    .where(
        _c.status == _PENDING,
        _c.app_code == bindparam("b_app"),
        _c.room_id == bindparam("b_room"),
        _c.room_version > bindparam("b_version"),
        _c.due_at_ms < bindparam("b_now"),
    )
    .values(due_at_ms=bindparam("b_now"), updated_at_ms=bindparam("b_now"))
)

# --------------------------------------------------------------------------- retention
# Delivered rows by the (status, delivered_at_ms) index, oldest delivery first;
# then legacy published rows, whose delivered_at_ms may be NULL (updated_at_ms then).

_SQLITE_DELETE_DELIVERED: Final = delete(_o).where(
    _c.id.in_(
        select(_c.id)
        .where(_c.status == _DELIVERED, _c.delivered_at_ms < bindparam("b_before"))
        .order_by(_c.delivered_at_ms)
        .limit(bindparam("b_limit"))
    )
)
_SQLITE_DELETE_PUBLISHED: Final = delete(_o).where(
    _c.id.in_(
        select(_c.id)
        .where(_c.status == _PUBLISHED, func.coalesce(_c.delivered_at_ms, _c.updated_at_ms) < bindparam("b_before"))
        .order_by(_c.id)
        .limit(bindparam("b_limit"))
    )
)
# MySQL/MariaDB: no LIMIT in an IN subquery, but DELETE … ORDER BY … LIMIT (not in SQLAlchemy Core).
_MYSQL_DELETE_DELIVERED: Final = text(
    "DELETE FROM room_outbox WHERE status = 'delivered' AND delivered_at_ms < :b_before "
    "ORDER BY delivered_at_ms LIMIT :b_limit"
)
_MYSQL_DELETE_PUBLISHED: Final = text(
    "DELETE FROM room_outbox WHERE status = 'published' "
    "AND COALESCE(delivered_at_ms, updated_at_ms) < :b_before ORDER BY id LIMIT :b_limit"
)


# SQLite maintenance locks held in this process: (database URL, lock name).


# --------------------------------------------------------------------------- repository


class SqlOutboxRepository:
    """The outbox repository on a :class:`Database` (SQLite or MySQL/MariaDB)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim_due(
        self, *, owner: str, now_ms: int, lock_ms: int, limit: int, pending_only: bool = False
    ) -> list[ClaimedRow]:
        params = _claim_params(owner=owner, now_ms=now_ms, lock_ms=lock_ms, limit=limit)
        if self.db.is_sqlite:
            rows: Sequence[Any] = await self.db.run_write(_claim_sqlite, params)
        else:
            rows = await self.db.run_driver_write(_claim_mysql, params, pending_only)
        return _claimed_rows(rows, owner=owner, until=params["b_until"])

    async def finish_and_claim(
        self,
        *,
        owner: str,
        now_ms: int,
        delivered: list[Delivered],
        retries: list[RetryDecision],
        lock_ms: int,
        limit: int,
        pending_only: bool = False,
    ) -> tuple[int, list[ClaimedRow]]:
        params = _claim_params(owner=owner, now_ms=now_ms, lock_ms=lock_ms, limit=limit)
        due = [r.next_retry_at_ms - 1 for r in retries if not r.failed]  # (a dead letter is never claimed)
        if due:  # none of the rows this transaction finishes is claimed again by it (see the port)
            params["b_due"] = min(now_ms, *due)
        delivered_params, retry_params = _finish_params(owner, now_ms, delivered, retries)
        changed: int
        rows: Sequence[Any]
        if self.db.is_sqlite:
            changed, rows = await self.db.run_write(_finish_then_claim_sqlite, delivered_params, retry_params, params)
        else:
            changed, rows = await self.db.run_driver_write(
                _finish_then_claim_mysql, delivered_params, retry_params, params, pending_only
            )
        return changed, _claimed_rows(rows, owner=owner, until=params["b_until"])

    async def finish(self, *, owner: str, now_ms: int, delivered: list[Delivered], retries: list[RetryDecision]) -> int:
        if not delivered and not retries:
            return 0
        delivered_params, retry_params = _finish_params(owner, now_ms, delivered, retries)
        if self.db.is_sqlite:
            return await self.db.run_write(_finish_sqlite, delivered_params, retry_params)
        return await self.db.run_driver_write(_finish_mysql, delivered_params, retry_params)

    async def extend(self, *, owner: str, row_ids: list[int], now_ms: int, lock_ms: int) -> int:
        if not row_ids:
            return 0
        if lock_ms < 1:
            raise ValueError("lock_ms must be at least 1")
        params = {"b_owner": owner, "b_now": now_ms, "b_until": now_ms + lock_ms, "b_ids": list(row_ids)}
        return await self.db.run_write(_rowcount, _EXTEND, params)

    async def release(self, *, owner: str, row_ids: list[int] | None, now_ms: int) -> int:
        if row_ids is None:
            return await self.db.run_write(_rowcount, _RELEASE_OWNED, {"b_owner": owner, "b_now": now_ms})
        if not row_ids:
            return 0
        params = {"b_owner": owner, "b_now": now_ms, "b_ids": list(row_ids)}
        return await self.db.run_write(_rowcount, _RELEASE, params)

    async def defer(self, *, owner: str, row_ids: list[int], now_ms: int) -> int:
        if not row_ids:
            return 0
        params = {"b_owner": owner, "b_now": now_ms, "b_ids": list(row_ids)}
        return await self.db.run_write(_defer, params)

    async def delete_delivered(self, *, before_ms: int, limit: int) -> int:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        statements = (
            (_SQLITE_DELETE_DELIVERED, _SQLITE_DELETE_PUBLISHED)
            if self.db.is_sqlite
            else (_MYSQL_DELETE_DELIVERED, _MYSQL_DELETE_PUBLISHED)
        )
        return await self.db.run_long_write(_delete_delivered, statements, before_ms, limit)


# --------------------------------------------------------------------------- parameters and rows


def _claim_params(*, owner: str, now_ms: int, lock_ms: int, limit: int) -> dict[str, Any]:
    if limit < 1:
        raise ValueError("limit must be at least 1")
    if lock_ms < 1:
        raise ValueError("lock_ms must be at least 1")
    # b_due: retryable and expired rows due by then are claimable (now, unless a finish in the same
    # transaction says otherwise: finish_and_claim)
    return {"b_owner": owner, "b_now": now_ms, "b_due": now_ms, "b_until": now_ms + lock_ms, "b_limit": limit}


def _claimed_rows(rows: Sequence[Any], *, owner: str, until: int) -> list[ClaimedRow]:
    # Per row this runs for every claim: the driver's tuple unpacked in _CLAIM_COLUMNS' order
    # (no attribute lookups by name), targets_done parsed once per distinct text (a batch has
    # one or two), the payload copied only when the driver did not hand over bytes.
    targets: dict[str, frozenset[str]] = {}
    claimed = []
    for (
        row_id,
        event_id,
        app_code,
        room_id,
        room_version,
        event_type,
        payload,
        retry_count,
        done,
        created_at_ms,
        trace_context,
    ) in rows:
        parsed = targets.get(done)
        if parsed is None:
            parsed = targets[done] = parse_targets(done)
        claimed.append(
            ClaimedRow(
                row_id,
                event_id,
                app_code,
                room_id,
                room_version,
                event_type,
                payload if type(payload) is bytes else bytes(payload),
                retry_count,
                parsed,
                owner,
                until,
                created_at_ms,
                trace_context,
            )
        )
    claimed.sort(key=_row_id)
    return claimed


def _row_id(row: ClaimedRow) -> int:
    return row.id


def _finish_params(
    owner: str, now_ms: int, delivered: list[Delivered], retries: list[RetryDecision]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Rows of one batch mostly share their targets: one UPDATE per distinct set.
    delivered_groups: dict[str, list[int]] = {}
    for d in delivered:
        delivered_groups.setdefault(d.targets_done, []).append(d.row_id)
    delivered_params = [
        {"b_owner": owner, "b_now": now_ms, "b_targets": targets, "b_ids": ids}
        for targets, ids in delivered_groups.items()
    ]
    retry_params = [
        {
            "b_owner": owner,
            "b_now": now_ms,
            "b_id": r.row_id,
            "b_status": _FAILED if r.failed else _RETRYABLE,
            "b_next": None if r.failed else r.next_retry_at_ms,
            "b_due": now_ms if r.failed else r.next_retry_at_ms,
            "b_error": r.last_error[:LAST_ERROR_MAX_CHARS],
            "b_targets": r.targets_done,
        }
        for r in retries
    ]
    return delivered_params, retry_params


# --------------------------------------------------------------------------- transaction units
# MySQL/MariaDB: the worker's claim and finish are async units of the driver's cursor, run by
# Database.run_driver_write (roomservice.store.driver); the rest are plain synchronous functions
# of a Connection, run by Database.run_write.


async def _claim_mysql(cur: DriverCursor, params: dict[str, Any], pending_only: bool) -> list[tuple[Any, ...]]:
    limit: int = params["b_limit"]
    rows: list[tuple[Any, ...]] = []
    # a wake-up cycle saves the two SELECTs for retryable and expired rows
    steps = _MYSQL_CLAIM_STEPS[:1] if pending_only else _MYSQL_CLAIM_STEPS
    for statement, status in steps:
        missing = limit - len(rows)
        if missing <= 0:
            break
        rows.extend(await cur.rows(statement, {"b_status": status, "b_due": params["b_due"], "b_limit": missing}))
    if rows:
        await cur.execute(_MYSQL_MARK_CLAIMED, {**params, "b_ids": [r[0] for r in rows]})
    return rows


async def _finish_mysql(cur: DriverCursor, delivered: list[dict[str, Any]], retries: list[dict[str, Any]]) -> int:
    changed = 0
    for params in delivered:
        changed += await cur.execute(_FINISH_DELIVERED, params)
    if retries:
        changed += await cur.executemany(_FINISH_RETRY, retries)
    return changed


async def _finish_then_claim_mysql(
    cur: DriverCursor,
    delivered: list[dict[str, Any]],
    retries: list[dict[str, Any]],
    params: dict[str, Any],
    pending_only: bool,
) -> tuple[int, list[tuple[Any, ...]]]:
    changed = await _finish_mysql(cur, delivered, retries)
    return changed, await _claim_mysql(cur, params, pending_only)


# SQLite: one statement claims every kind; each unit runs inline on the loop's thread (Database.run_write), its
# statements on the sqlite3 cursor of its transaction (roomservice.store.driver).


def _claim_sqlite(conn: Connection, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    return SqliteCursor(conn).rows(SQLITE_CLAIM, params)


def _finish_sqlite(conn: Connection, delivered: list[dict[str, Any]], retries: list[dict[str, Any]]) -> int:
    return _finish_on(SqliteCursor(conn), delivered, retries)


def _finish_on(cur: SqliteCursor, delivered: list[dict[str, Any]], retries: list[dict[str, Any]]) -> int:
    changed = 0
    for params in delivered:
        changed += cur.execute(_FINISH_DELIVERED, params)
    if retries:
        changed += cur.executemany(_FINISH_RETRY, retries)
    return changed


def _finish_then_claim_sqlite(
    conn: Connection, delivered: list[dict[str, Any]], retries: list[dict[str, Any]], params: dict[str, Any]
) -> tuple[int, list[tuple[Any, ...]]]:
    cur = SqliteCursor(conn)
    return _finish_on(cur, delivered, retries), cur.rows(SQLITE_CLAIM, params)


def _defer(conn: Connection, params: dict[str, Any]) -> int:
    rooms = conn.execute(_DEFERRED_ROOMS, params).all()
    deferred = int(conn.execute(_DEFER, params).rowcount)
    now = params["b_now"]
    for app_code, room_id, version in rooms:
        conn.execute(_BEHIND_DEFERRED, {"b_app": app_code, "b_room": room_id, "b_version": version, "b_now": now})
    return deferred


def _rowcount(conn: Connection, statement: Any, params: dict[str, Any]) -> int:
    return conn.execute(statement, params).rowcount


def _delete_delivered(conn: Connection, statements: tuple[Any, Any], before_ms: int, limit: int) -> int:
    delivered, published = statements
    deleted: int = conn.execute(delivered, {"b_before": before_ms, "b_limit": limit}).rowcount
    if deleted < limit:
        deleted += conn.execute(published, {"b_before": before_ms, "b_limit": limit - deleted}).rowcount
    return deleted
