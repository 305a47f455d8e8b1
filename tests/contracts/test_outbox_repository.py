"""Contract suite of the OutboxRepository port, run on SQLite and MariaDB through the ``database`` fixture.

Rows are inserted directly into ``room_outbox`` in every status, so each test
states exactly what the table holds before the repository acts on it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, sqlite

from roomservice.outbox.model import ClaimedRow
from roomservice.outbox.repository import Delivered, RetryDecision
from roomservice.outbox.sql import (
    LAST_ERROR_MAX_CHARS,
    MYSQL_CLAIM_DUE,
    MYSQL_CLAIM_PENDING,
    SQLITE_CLAIM,
    SqlOutboxRepository,
)
from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable
from roomservice.store.tables import room_outbox

T0 = 1_780_000_000_000
NOW = T0 + 60_000
LOCK_MS = 30_000

_event_ids = (f"evt-{n:08d}" for n in itertools.count())


def outbox_row(
    status: str,
    *,
    due_at_ms: int,
    created_at_ms: int = T0,
    retry_count: int = 0,
    next_retry_at_ms: int | None = None,
    lock_owner: str | None = None,
    lock_until_ms: int | None = None,
    delivered_at_ms: int | None = None,
    updated_at_ms: int | None = None,
    targets_done: str = "",
    last_error: str | None = None,
    event_type: str = "RoomMemberJoined",
) -> dict[str, Any]:
    event_id = next(_event_ids)
    return {
        "event_id": event_id,
        "app_code": "app_1",
        "room_id": "room-1",
        "room_version": 1,
        "event_type": event_type,
        "payload": b"\x00payload-" + event_id.encode(),
        "status": status,
        "retry_count": retry_count,
        "next_retry_at_ms": next_retry_at_ms,
        "lock_until_ms": lock_until_ms,
        "lock_owner": lock_owner,
        "last_error": last_error,
        "targets_done": targets_done,
        "due_at_ms": due_at_ms,
        "created_at_ms": created_at_ms,
        "updated_at_ms": created_at_ms if updated_at_ms is None else updated_at_ms,
        "delivered_at_ms": delivered_at_ms,
    }


def pending(created_at_ms: int = T0, **kw: Any) -> dict[str, Any]:
    return outbox_row("pending", due_at_ms=created_at_ms, created_at_ms=created_at_ms, **kw)


def retryable(next_retry_at_ms: int, *, retry_count: int = 1, **kw: Any) -> dict[str, Any]:
    return outbox_row(
        "retryable", due_at_ms=next_retry_at_ms, next_retry_at_ms=next_retry_at_ms, retry_count=retry_count, **kw
    )


def delivering(lock_until_ms: int, *, lock_owner: str = "dead-worker", **kw: Any) -> dict[str, Any]:
    return outbox_row("delivering", due_at_ms=lock_until_ms, lock_until_ms=lock_until_ms, lock_owner=lock_owner, **kw)


async def insert(db: Database, *rows: dict[str, Any]) -> list[int]:
    """Insert rows (in order) and return their ids."""
    async with db.write() as conn:
        for row in rows:
            await conn.execute(sa.insert(room_outbox), row)
    async with db.read() as conn:
        result = await conn.execute(
            sa.select(room_outbox.c.event_id, room_outbox.c.id).where(
                room_outbox.c.event_id.in_([r["event_id"] for r in rows])
            )
        )
        ids = {event_id: row_id for event_id, row_id in result}
    return [ids[r["event_id"]] for r in rows]


async def fetch(db: Database, row_id: int) -> dict[str, Any]:
    async with db.read() as conn:
        row = (await conn.execute(sa.select(room_outbox).where(room_outbox.c.id == row_id))).mappings().one()
    return dict(row)


async def all_ids(db: Database) -> set[int]:
    async with db.read() as conn:
        return set((await conn.execute(sa.select(room_outbox.c.id))).scalars())


@asynccontextmanager
async def second_process(backend_url: str) -> AsyncIterator[Database]:
    """Another Database on the same URL: its own pool, write lock and threads, like another process."""
    db = Database.from_url(backend_url, pool_size=5, max_overflow=5)
    try:
        yield db
    finally:
        await db.dispose()


@pytest.fixture
def repo(database: Database) -> SqlOutboxRepository:
    return SqlOutboxRepository(database)


# --------------------------------------------------------------------------- claim


async def test_claim_takes_pending_due_retryable_and_expired_delivering_only(
    database: Database, repo: SqlOutboxRepository
) -> None:
    take = await insert(
        database,
        pending(T0, targets_done="im"),
        retryable(NOW, retry_count=2),  # due exactly now
        retryable(NOW - 5_000),
        delivering(NOW - 1),  # lock expired
        delivering(NOW),  # lock ends now: expired
    )
    keep = await insert(
        database,
        retryable(NOW + 1),  # not yet due
        delivering(NOW + 1, lock_owner="live-worker"),  # live lock
        outbox_row("delivered", due_at_ms=T0, delivered_at_ms=T0),
        outbox_row("failed", due_at_ms=T0, retry_count=5),
        outbox_row("published", due_at_ms=T0),
    )
    before = {row_id: await fetch(database, row_id) for row_id in keep}

    claimed = await repo.claim_due(owner="w1", now_ms=NOW, lock_ms=LOCK_MS, limit=100)

    assert [r.id for r in claimed] == sorted(take)
    first = claimed[0]
    assert first == ClaimedRow(
        id=take[0],
        event_id=first.event_id,
        app_code="app_1",
        room_id="room-1",
        room_version=1,
        event_type="RoomMemberJoined",
        payload=b"\x00payload-" + first.event_id.encode(),
        retry_count=0,
        targets_done=frozenset({"im"}),
        lock_owner="w1",
        lock_until_ms=NOW + LOCK_MS,
        created_at_ms=T0,
    )
    assert isinstance(first.payload, bytes)
    assert [r.retry_count for r in claimed][1] == 2
    for row_id in take:
        row = await fetch(database, row_id)
        assert row["status"] == "delivering"
        assert row["lock_owner"] == "w1"
        assert row["lock_until_ms"] == row["due_at_ms"] == NOW + LOCK_MS
        assert row["updated_at_ms"] == NOW
    for row_id, row in before.items():
        assert await fetch(database, row_id) == row
    # Everything claimable is now held by a live lock.
    assert await repo.claim_due(owner="w2", now_ms=NOW, lock_ms=LOCK_MS, limit=100) == []


async def test_claim_respects_the_limit_pending_first_then_retryable_then_expired(
    database: Database, repo: SqlOutboxRepository
) -> None:
    # Retryable and expired rows are older than every pending row: only the status decides.
    expired = await insert(database, delivering(T0 + 2), delivering(T0 + 1))
    retry = await insert(database, retryable(T0 + 20), retryable(T0 + 10), retryable(T0 + 30))
    pend = await insert(database, pending(T0 + 300), pending(T0 + 100), pending(T0 + 200))

    first = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=2)
    assert {r.id for r in first} == {pend[1], pend[2]}  # the two oldest pending rows
    second = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=3)
    assert {r.id for r in second} == {pend[0], retry[1], retry[0]}  # then the oldest due retryable
    third = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=2)
    assert {r.id for r in third} == {retry[2], expired[1]}  # then expired claims, oldest lock first
    fourth = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert [r.id for r in fourth] == [expired[0]]
    assert [r.id for r in third] == sorted(r.id for r in third)  # returned by id


async def test_pending_rows_are_claimable_even_when_the_writer_clock_is_ahead(
    database: Database, repo: SqlOutboxRepository
) -> None:
    (row_id,) = await insert(database, pending(NOW + 5_000))  # committed by a process whose clock runs ahead
    claimed = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert [r.id for r in claimed] == [row_id]


async def test_claim_rejects_a_non_positive_limit(repo: SqlOutboxRepository) -> None:
    with pytest.raises(ValueError, match="limit"):
        await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=0)


async def test_concurrent_claims_from_two_processes_never_share_a_row_and_take_all(
    database: Database, backend_url: str
) -> None:
    rows = [pending(T0 + n) for n in range(120)]
    rows += [retryable(NOW - n) for n in range(40)]
    rows += [delivering(NOW - 1 - n) for n in range(40)]
    expected = set(await insert(database, *rows))

    async with second_process(backend_url) as other_db:
        repos = {"w1": SqlOutboxRepository(database), "w2": SqlOutboxRepository(other_db)}
        taken: dict[str, list[int]] = {owner: [] for owner in repos}

        async def drain(owner: str) -> None:
            while True:
                claimed = await repos[owner].claim_due(owner=owner, now_ms=NOW, lock_ms=LOCK_MS, limit=7)
                if not claimed:
                    return
                assert all(r.lock_owner == owner for r in claimed)
                taken[owner].extend(r.id for r in claimed)
                await asyncio.sleep(0.002)  # room for the other process's claim (SQLite has one writer at a time)

        await asyncio.gather(drain("w1"), drain("w2"), drain("w1"), drain("w2"))

    all_taken = taken["w1"] + taken["w2"]
    assert len(all_taken) == len(set(all_taken)), "a row was claimed twice"
    assert set(all_taken) == expected
    assert taken["w1"] and taken["w2"], "both processes should have claimed something"
    for owner, ids in taken.items():
        for row_id in ids[:5]:
            row = await fetch(database, row_id)
            assert (row["status"], row["lock_owner"]) == ("delivering", owner)


async def test_mariadb_claim_skips_rows_locked_by_another_transaction_without_waiting(
    mariadb_database: Database, mariadb_url: str
) -> None:
    # row locks are MariaDB's; SQLite has one writer at a time
    database, backend_url, repo = mariadb_database, mariadb_url, SqlOutboxRepository(mariadb_database)
    locked, free = await insert(database, pending(T0 + 1), pending(T0 + 2))
    async with second_process(backend_url) as other_db, other_db.write() as conn:
        # Another worker is in the middle of claiming the oldest row.
        held = await conn.execute(
            sa.select(room_outbox.c.id).where(room_outbox.c.id == locked).with_for_update(skip_locked=True)
        )
        assert held.scalar_one() == locked
        claimed = await asyncio.wait_for(repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10), 5)
        assert [r.id for r in claimed] == [free]
    (late,) = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert late.id == locked


# --------------------------------------------------------------------------- finish


async def test_finish_by_a_stale_owner_after_a_takeover_changes_nothing(
    database: Database, repo: SqlOutboxRepository
) -> None:
    (row_id,) = await insert(database, pending())
    (stale,) = await repo.claim_due(owner="slow", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    later = NOW + LOCK_MS + 1  # the slow worker stalled past its lock
    (fresh,) = await repo.claim_due(owner="fast", now_ms=later, lock_ms=LOCK_MS, limit=10)
    assert stale.id == fresh.id == row_id
    before = await fetch(database, row_id)

    assert await repo.finish(owner="slow", now_ms=later, delivered=[Delivered(row_id, "im")], retries=[]) == 0
    retry = RetryDecision(row_id, "im", failed=False, next_retry_at_ms=later + 1_000, last_error="boom")
    assert await repo.finish(owner="slow", now_ms=later, delivered=[], retries=[retry]) == 0
    failed = RetryDecision(row_id, "", failed=True, next_retry_at_ms=later, last_error="boom")
    assert await repo.finish(owner="slow", now_ms=later, delivered=[], retries=[failed]) == 0
    assert await repo.release(owner="slow", row_ids=[row_id], now_ms=later) == 0
    assert await fetch(database, row_id) == before
    assert before["lock_owner"] == "fast"

    assert await repo.finish(owner="fast", now_ms=later, delivered=[Delivered(row_id, "im")], retries=[]) == 1
    assert (await fetch(database, row_id))["status"] == "delivered"


async def test_extend_moves_the_lease_of_rows_still_held_and_only_those(
    database: Database, repo: SqlOutboxRepository
) -> None:
    ids = await insert(database, pending(), pending(), pending())
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    await repo.release(owner="w", row_ids=[ids[2]], now_ms=NOW)  # the third row is a rival's now
    (taken,) = await repo.claim_due(owner="rival", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert taken.id == ids[2]
    later = NOW + 10_000

    assert await repo.extend(owner="w", row_ids=ids, now_ms=later, lock_ms=LOCK_MS) == 2
    for row_id in ids[:2]:
        row = await fetch(database, row_id)
        assert (row["status"], row["lock_owner"]) == ("delivering", "w")
        assert row["lock_until_ms"] == row["due_at_ms"] == later + LOCK_MS
    assert (await fetch(database, ids[2]))["lock_until_ms"] == NOW + LOCK_MS  # the rival's: untouched
    # past the first lease the extended rows are still held; only the rival's expired row is claimable
    expired = await repo.claim_due(owner="third", now_ms=NOW + LOCK_MS + 1, lock_ms=LOCK_MS, limit=10)
    assert [r.id for r in expired] == [ids[2]]
    assert await repo.extend(owner="w", row_ids=[], now_ms=later, lock_ms=LOCK_MS) == 0


async def test_finish_delivered_sets_delivered_at_and_clears_the_lock(
    database: Database, repo: SqlOutboxRepository
) -> None:
    ids = await insert(
        database,
        pending(),
        retryable(NOW, last_error="earlier failure", targets_done="im"),
        pending(),
    )
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    done = NOW + 50
    changed = await repo.finish(
        owner="w",
        now_ms=done,
        delivered=[Delivered(ids[0], "broker"), Delivered(ids[1], "activity,im"), Delivered(ids[2], "broker")],
        retries=[],
    )
    assert changed == 3
    for row_id, targets in zip(ids, ("broker", "activity,im", "broker"), strict=True):
        row = await fetch(database, row_id)
        assert row["status"] == "delivered"
        assert row["delivered_at_ms"] == row["updated_at_ms"] == done
        assert row["due_at_ms"] == done  # not the claim's lock any more: when it finished
        assert row["targets_done"] == targets
        assert row["lock_owner"] is None and row["lock_until_ms"] is None and row["last_error"] is None
    assert await repo.claim_due(owner="w2", now_ms=done + 10 * LOCK_MS, lock_ms=LOCK_MS, limit=10) == []


async def test_finish_retry_counts_the_attempt_and_schedules_the_next(
    database: Database, repo: SqlOutboxRepository
) -> None:
    a, b = await insert(database, pending(), retryable(NOW, retry_count=2))
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    done = NOW + 10
    long_error = "x" * (LAST_ERROR_MAX_CHARS + 500)
    changed = await repo.finish(
        owner="w",
        now_ms=done,
        delivered=[Delivered(a, "broker")],
        retries=[RetryDecision(b, "im", failed=False, next_retry_at_ms=done + 4_000, last_error=long_error)],
    )
    assert changed == 2
    row = await fetch(database, b)
    assert row["status"] == "retryable"
    assert row["retry_count"] == 3
    assert row["next_retry_at_ms"] == row["due_at_ms"] == done + 4_000
    assert row["last_error"] == "x" * LAST_ERROR_MAX_CHARS
    assert row["targets_done"] == "im"
    assert row["lock_owner"] is None and row["lock_until_ms"] is None
    assert row["updated_at_ms"] == done

    assert await repo.claim_due(owner="w", now_ms=done + 3_999, lock_ms=LOCK_MS, limit=10) == []
    (again,) = await repo.claim_due(owner="w", now_ms=done + 4_000, lock_ms=LOCK_MS, limit=10)
    assert again.id == b
    assert again.retry_count == 3
    assert again.targets_done == frozenset({"im"})


async def test_finish_several_retries_in_one_call_counts_each(database: Database, repo: SqlOutboxRepository) -> None:
    ids = await insert(database, pending(), pending(), pending())
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    retries = [
        RetryDecision(row_id, "", failed=False, next_retry_at_ms=NOW + 1_000 + n, last_error=f"e{n}")
        for n, row_id in enumerate(ids)
    ]
    assert await repo.finish(owner="w", now_ms=NOW, delivered=[], retries=retries) == 3
    rows = [await fetch(database, row_id) for row_id in ids]
    assert [(r["status"], r["retry_count"], r["due_at_ms"], r["last_error"]) for r in rows] == [
        ("retryable", 1, NOW + 1_000 + n, f"e{n}") for n in range(3)
    ]


async def test_finish_failed_keeps_the_row_as_a_dead_letter(database: Database, repo: SqlOutboxRepository) -> None:
    (row_id,) = await insert(database, retryable(NOW, retry_count=4))
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    decision = RetryDecision(row_id, "im", failed=True, next_retry_at_ms=NOW + 9_999, last_error="permanent: 400")
    assert await repo.finish(owner="w", now_ms=NOW + 5, delivered=[], retries=[decision]) == 1
    row = await fetch(database, row_id)
    assert row["status"] == "failed"
    assert row["retry_count"] == 5
    assert row["due_at_ms"] == NOW + 5
    assert row["next_retry_at_ms"] is None
    assert row["last_error"] == "permanent: 400"
    assert row["lock_owner"] is None and row["lock_until_ms"] is None
    assert await repo.claim_due(owner="w", now_ms=NOW + 10**9, lock_ms=LOCK_MS, limit=10) == []
    assert await repo.delete_delivered(before_ms=NOW + 10**9, limit=10) == 0
    assert await all_ids(database) == {row_id}


async def test_finish_with_nothing_to_do_returns_zero(repo: SqlOutboxRepository) -> None:
    assert await repo.finish(owner="w", now_ms=NOW, delivered=[], retries=[]) == 0


# --------------------------------------------------------------------------- release


async def test_release_hands_claims_back_and_they_are_claimable_at_once(
    database: Database, repo: SqlOutboxRepository
) -> None:
    fresh, retried = await insert(database, pending(T0 + 7), retryable(NOW, retry_count=2))
    (other,) = await insert(database, pending(T0 + 1))
    await repo.claim_due(owner="x", now_ms=NOW, lock_ms=LOCK_MS, limit=1)
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert (await fetch(database, other))["lock_owner"] == "x"

    released = await repo.release(owner="w", row_ids=[fresh, retried, other], now_ms=NOW + 3)
    assert released == 2  # "other" belongs to x: untouched

    row = await fetch(database, fresh)
    assert (row["status"], row["due_at_ms"], row["retry_count"]) == ("pending", T0 + 7, 0)
    assert row["lock_owner"] is None and row["lock_until_ms"] is None
    row = await fetch(database, retried)
    assert (row["status"], row["retry_count"]) == ("retryable", 2)
    assert row["next_retry_at_ms"] == row["due_at_ms"] == NOW + 3
    assert row["lock_owner"] is None and row["lock_until_ms"] is None
    assert (await fetch(database, other))["status"] == "delivering"

    again = await repo.claim_due(owner="y", now_ms=NOW + 3, lock_ms=LOCK_MS, limit=10)
    assert [r.id for r in again] == sorted([fresh, retried])
    assert await repo.release(owner="w", row_ids=[], now_ms=NOW) == 0


# --------------------------------------------------------------------------- retention


async def test_delete_delivered_is_bounded_and_only_takes_old_delivered_or_published(
    database: Database, repo: SqlOutboxRepository
) -> None:
    cutoff = NOW
    old_delivered = await insert(
        database,
        *[outbox_row("delivered", due_at_ms=T0, delivered_at_ms=cutoff - 100 + n) for n in (3, 1, 4, 2)],
    )
    old_published = await insert(
        database,
        outbox_row("published", due_at_ms=T0, updated_at_ms=cutoff - 50),  # legacy: no delivered_at_ms
        outbox_row("published", due_at_ms=T0, delivered_at_ms=cutoff - 60, updated_at_ms=cutoff + 1),
    )
    kept = await insert(
        database,
        outbox_row("delivered", due_at_ms=T0, delivered_at_ms=cutoff),  # not older than the cutoff
        outbox_row("published", due_at_ms=T0, updated_at_ms=cutoff + 5),
        outbox_row("published", due_at_ms=T0, delivered_at_ms=cutoff + 5, updated_at_ms=T0),
        outbox_row("failed", due_at_ms=T0, updated_at_ms=T0, delivered_at_ms=T0),
        pending(T0),
        retryable(T0),
        delivering(T0),
    )

    assert await repo.delete_delivered(before_ms=cutoff, limit=2) == 2
    # Oldest delivery first: delivered_at_ms cutoff-99 and cutoff-98.
    assert await all_ids(database) == set(old_delivered + old_published + kept) - {old_delivered[1], old_delivered[3]}
    assert await repo.delete_delivered(before_ms=cutoff, limit=3) == 3
    # The two other delivered rows, then the legacy published row with the lower id.
    assert await all_ids(database) == set(kept) | {old_published[1]}
    assert await repo.delete_delivered(before_ms=cutoff, limit=3) == 1
    assert await all_ids(database) == set(kept)
    assert await repo.delete_delivered(before_ms=cutoff, limit=3) == 0


# --------------------------------------------------------------------------- emitted SQL


@contextmanager
def captured_statements(db: Database) -> Iterator[list[str]]:
    statements: list[str] = []
    engine = db.engine.sync_engine

    def capture(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)


async def test_mariadb_claim_emits_skip_locked_selects_per_status_then_one_update(mariadb_database: Database) -> None:
    database, repo = mariadb_database, SqlOutboxRepository(mariadb_database)
    await insert(database, pending(), pending(), retryable(NOW), delivering(NOW - 1))

    with captured_statements(database) as full_batch:
        assert len(await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=2)) == 2
    selects = [s for s in full_batch if s.lstrip().upper().startswith("SELECT")]
    updates = [s for s in full_batch if s.lstrip().upper().startswith("UPDATE")]
    assert len(selects) == 1, "pending rows filled the batch: no further SELECT"
    assert all(s.rstrip().endswith("FOR UPDATE SKIP LOCKED") for s in selects)
    assert len(updates) == 1

    with captured_statements(database) as rest:
        assert len(await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)) == 2
    selects = [s for s in rest if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 3
    assert all("FOR UPDATE SKIP LOCKED" in s and " OR " not in s.upper() for s in selects)
    assert sum(s.lstrip().upper().startswith("UPDATE") for s in rest) == 1


async def test_sqlite_claim_is_one_indexed_statement(sqlite_database: Database) -> None:
    database = sqlite_database
    compiled = SQLITE_CLAIM.compile(dialect=sqlite.dialect())
    sql = str(compiled).replace("\n", " ")
    assert sql.startswith("UPDATE room_outbox")
    assert "RETURNING" in sql
    assert " OR " not in sql.upper()
    params = compiled.construct_params(
        {"b_limit": 10, "b_now": NOW, "b_due": NOW, "b_owner": "w", "b_until": NOW + LOCK_MS}
    )
    assert compiled.positiontup is not None
    args = tuple(params[name] for name in compiled.positiontup)
    async with database.read() as conn:
        plan = (await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, args)).all()
    details = [str(row[-1]) for row in plan]
    assert sum("ix_room_outbox_status_due_at_ms" in d for d in details) == 3, details
    assert not any(d.startswith("SCAN room_outbox") for d in details), details


@pytest.mark.parametrize("dialect", [mysql.dialect(), mysql.dialect(is_mariadb=True)], ids=["mysql", "mariadb"])
@pytest.mark.parametrize("statement", [MYSQL_CLAIM_PENDING, MYSQL_CLAIM_DUE], ids=["pending", "due"])
def test_mysql_claim_select_compiles_with_skip_locked(dialect: sa.Dialect, statement: sa.Select[Any]) -> None:
    sql = " ".join(str(statement.compile(dialect=dialect)).split())
    assert sql.endswith("FOR UPDATE SKIP LOCKED"), sql
    assert "WHERE room_outbox.status = %s" in sql
    assert "ORDER BY room_outbox.due_at_ms LIMIT %s" in sql
    assert " OR " not in sql.upper()


async def test_finish_and_claim_finishes_then_claims_the_next_rows_in_one_transaction(
    database: Database, repo: SqlOutboxRepository
) -> None:
    first = await insert(database, pending(), pending())
    claimed = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    assert [r.id for r in claimed] == first
    later = await insert(database, pending(), pending(), pending())
    retry = RetryDecision(first[1], "", failed=False, next_retry_at_ms=NOW + 5_000, last_error="boom")

    changed, nxt = await repo.finish_and_claim(
        owner="w",
        now_ms=NOW + 10,
        delivered=[Delivered(first[0], "im")],
        retries=[retry],
        lock_ms=LOCK_MS,
        limit=2,
    )

    assert changed == 2
    assert [r.id for r in nxt] == later[:2]  # the new rows, not the ones it just finished
    assert {(r.lock_owner, r.lock_until_ms) for r in nxt} == {("w", NOW + 10 + LOCK_MS)}
    assert (await fetch(database, first[0]))["status"] == "delivered"
    assert (await fetch(database, first[1]))["status"] == "retryable"
    assert [(await fetch(database, i))["status"] for i in later] == ["delivering", "delivering", "pending"]


async def test_finish_and_claim_never_claims_a_row_it_finishes_even_when_its_retry_is_due(
    database: Database, repo: SqlOutboxRepository
) -> None:
    # a retry decided a while ago (a finish held for the next batch's) may be due by the time it is
    # written: claimed again by the same owner in the same transaction, the row would match this
    # finish's guard when it is written again after a lost answer
    first = await insert(database, pending(), pending())
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    retry = RetryDecision(first[0], "", failed=False, next_retry_at_ms=NOW + 1_000, last_error="boom")
    older = await insert(database, retryable(NOW - 5_000))  # another row's retry, long due

    changed, nxt = await repo.finish_and_claim(
        owner="w",
        now_ms=NOW + 2_000,  # past the retry's due time
        delivered=[Delivered(first[1], "im")],
        retries=[retry],
        lock_ms=LOCK_MS,
        limit=10,
    )

    assert changed == 2
    assert [r.id for r in nxt] == older  # the other row's retry, not the one just written
    finished = await fetch(database, first[0])
    assert (finished["status"], finished["retry_count"]) == ("retryable", 1)
    assert [r.id for r in await repo.claim_due(owner="w", now_ms=NOW + 2_000, lock_ms=LOCK_MS, limit=10)] == [
        first[0]
    ]  # the next claim takes it, due as it is


async def test_a_dead_letter_written_by_finish_and_claim_holds_no_due_row_back(
    database: Database, repo: SqlOutboxRepository
) -> None:
    (row_id,) = await insert(database, pending())
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    due = await insert(database, retryable(NOW + 500))
    dead = RetryDecision(row_id, "", failed=True, next_retry_at_ms=NOW, last_error="poison")
    _, nxt = await repo.finish_and_claim(
        owner="w", now_ms=NOW + 1_000, delivered=[], retries=[dead], lock_ms=LOCK_MS, limit=10
    )
    assert [r.id for r in nxt] == due  # due at NOW + 500: a dead letter is never claimed, and bounds nothing


async def test_defer_puts_the_rooms_later_pending_rows_behind_the_deferred_ones(
    database: Database, repo: SqlOutboxRepository
) -> None:
    busy = await insert(
        database, *({**pending(T0 + n), "room_id": "busy", "room_version": n + 1} for n in range(12))
    )
    other = await insert(database, {**pending(T0 + 50), "room_id": "other"})
    claimed = await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=6)
    assert [r.id for r in claimed] == busy[:6]
    untried = [r.id for r in claimed if r.room_version > 4]  # the lane stopped after version 4
    assert await repo.defer(owner="w", row_ids=untried, now_ms=NOW + 1) == 2

    nxt = await repo.claim_due(owner="w", now_ms=NOW + 2, lock_ms=LOCK_MS, limit=3)
    # the other room's row (due before the deferral), then the busy room from version 5 on, not 7
    assert {r.id for r in nxt} == {*other, busy[4], busy[5]}
    later = [await fetch(database, i) for i in busy[6:]]
    assert [r["due_at_ms"] for r in later] == [NOW + 1] * 6  # behind the deferred rows, by id


async def test_finish_and_claim_is_all_or_nothing(database: Database, repo: SqlOutboxRepository) -> None:
    (row_id,) = await insert(database, pending())
    await repo.claim_due(owner="w", now_ms=NOW, lock_ms=LOCK_MS, limit=10)
    waiting = await insert(database, pending())
    before = [await fetch(database, i) for i in (row_id, *waiting)]

    with pytest.raises(ValueError, match="limit"):  # refused before anything runs
        await repo.finish_and_claim(
            owner="w", now_ms=NOW, delivered=[Delivered(row_id, "im")], retries=[], lock_ms=LOCK_MS, limit=0
        )
    # a claim that fails inside the transaction takes the finish down with it
    engine = database._sync_engine or database.engine.sync_engine

    def refuse_claims(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "SKIP LOCKED" in statement or "RETURNING" in statement:
            raise sa.exc.OperationalError(statement, {}, Exception("claim failed"))

    sa.event.listen(engine, "before_cursor_execute", refuse_claims)
    try:
        with pytest.raises(StoreUnavailable):
            await repo.finish_and_claim(
                owner="w", now_ms=NOW, delivered=[Delivered(row_id, "im")], retries=[], lock_ms=LOCK_MS, limit=5
            )
    finally:
        sa.event.remove(engine, "before_cursor_execute", refuse_claims)
    assert [await fetch(database, i) for i in (row_id, *waiting)] == before
