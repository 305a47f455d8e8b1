"""Database: the per-dialect connection settings and the transaction discipline of write()/read()."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from roomservice.store import database
from roomservice.store.database import Database, _WriteLock, session_limits_sql
from roomservice.store.port import StoreDeadlineExceeded, StoreUnavailable, Writes
from roomservice.store.writes import run_reads, run_writes


async def test_sqlite_connections_get_wal_and_pragmas(tmp_path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/nested/dir/room.db")
    try:
        assert db.dialect_name == "sqlite"
        assert (tmp_path / "nested" / "dir").is_dir()
        for open_connection in (db.read, db.write):
            async with open_connection() as conn:
                pragmas = [
                    (await conn.exec_driver_sql(f"PRAGMA {name}")).scalar()
                    for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
                ]
            assert pragmas == ["wal", 1, 5000, 1]  # synchronous 1 = NORMAL
    finally:
        await db.dispose()


async def test_sqlite_write_takes_the_write_lock_at_begin(tmp_path: Path) -> None:
    path = tmp_path / "room.db"
    db = Database.from_url(f"sqlite+aiosqlite:///{path}")
    other = sqlite3.connect(path, timeout=0, isolation_level=None)  # "another process"
    try:
        async with db.write() as conn:
            await conn.exec_driver_sql("SELECT 1")  # a read only: BEGIN IMMEDIATE already holds the lock
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # released at commit
        other.execute("ROLLBACK")
        async with db.read() as conn:  # a reader takes no write lock
            await conn.exec_driver_sql("SELECT 1")
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
    finally:
        other.close()
        await db.dispose()


def _sqlite_db(path: Path) -> Database:
    """A database on SQLite file ``path`` whose inline units never count as slow (a cold first run can
    take a millisecond: the counts the tests assert would depend on the machine)."""
    db = Database.from_url(f"sqlite+aiosqlite:///{path}")
    assert db._inline is not None
    db._inline.slow_s = math.inf
    return db


async def test_sqlite_units_take_the_write_lock_at_begin_and_reads_take_none(tmp_path: Path) -> None:
    # run_write / run_read issue their own BEGIN (their engine has no "begin" hook): the same
    # transactions as the write() / read() blocks, inline or on a thread (the "long" units); an
    # inline read holds one read snapshot for the unit, a threaded one reads in autocommit
    path = tmp_path / "room.db"
    db = _sqlite_db(path)
    other = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)  # "another process"
    seen: list[str] = []

    def write_unit(conn: sa.Connection) -> None:
        conn.exec_driver_sql("SELECT 1")  # a read only: BEGIN IMMEDIATE already holds the lock
        seen.append("in transaction" if conn.connection.driver_connection.in_transaction else "autocommit")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")

    def read_unit(conn: sa.Connection) -> None:
        conn.exec_driver_sql("SELECT 1")
        seen.append("in transaction" if conn.connection.driver_connection.in_transaction else "autocommit")
        other.execute("BEGIN IMMEDIATE")  # a reader takes no write lock
        other.execute("ROLLBACK")

    try:
        for run_write in (db.run_write, db.run_long_write):
            await run_write(write_unit)
            other.execute("BEGIN IMMEDIATE")  # released at commit
            other.execute("ROLLBACK")
        await db.run_read(read_unit)
        await db.run_long_read(read_unit)
        assert seen == ["in transaction", "in transaction", "in transaction", "autocommit"]
        assert (db.unit_counts.inline, db.unit_counts.on_thread) == (2, 2)
    finally:
        other.close()
        await db.dispose()


async def test_sqlite_write_transactions_queue_and_commit_or_roll_back(tmp_path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db")
    try:
        async with db.write() as conn:
            await conn.exec_driver_sql("CREATE TABLE t (n INTEGER)")
        inside: list[int] = []
        overlap: list[bool] = []

        async def writer(n: int) -> None:
            async with db.write() as conn:
                overlap.append(bool(inside))
                inside.append(n)
                await conn.exec_driver_sql(f"INSERT INTO t VALUES ({n})")
                await asyncio.sleep(0.005)  # a read-modify-write that would otherwise interleave
                inside.remove(n)

        async def failing_writer() -> None:
            async with db.write() as conn:
                await conn.exec_driver_sql("INSERT INTO t VALUES (99)")
                raise RuntimeError("boom")

        await asyncio.gather(*(writer(n) for n in range(10)))
        with pytest.raises(RuntimeError, match="boom"):
            await failing_writer()

        assert overlap == [False] * 10
        async with db.read() as conn:
            assert sorted((await conn.exec_driver_sql("SELECT n FROM t")).scalars()) == list(range(10))
    finally:
        await db.dispose()


async def test_mariadb_sessions_are_read_committed_utf8mb4(mariadb_url: str) -> None:
    db = Database.from_url(mariadb_url.replace("mysql+asyncmy", "mariadb+asyncmy"), pool_size=2, max_overflow=0)
    try:
        assert db.dialect_name == "mysql"
        assert db.engine.dialect.name == "mysql"  # "mariadb+" URLs are normalised to the mysql dialect
        assert db.engine.pool.size() == 2  # type: ignore[attr-defined]
        for open_connection in (db.read, db.write):
            async with open_connection() as conn:
                isolation, charset = (
                    await conn.execute(sa.text("SELECT @@tx_isolation, @@character_set_connection"))
                ).one()
            assert (isolation, charset) == ("READ-COMMITTED", "utf8mb4")
    finally:
        await db.dispose()


def test_unsupported_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        Database.from_url("postgresql+asyncpg://localhost/db")


async def test_run_write_and_run_read_units_commit_roll_back_and_share_the_write_lock(backend_url: str) -> None:
    db = Database.from_url(backend_url, pool_size=2, max_overflow=0)
    table = sa.table("unit_test_rows", sa.column("n"))

    def insert(conn: sa.Connection, n: int, *, fail: bool = False) -> int:
        conn.execute(sa.insert(table).values(n=n))
        if fail:
            raise LookupError("boom")
        return n

    def numbers(conn: sa.Connection) -> list[int]:
        return list(conn.scalars(sa.select(table.c.n).order_by(table.c.n)))

    try:
        async with db.write() as conn:
            await conn.exec_driver_sql("DROP TABLE IF EXISTS unit_test_rows")
            await conn.exec_driver_sql("CREATE TABLE unit_test_rows (n INTEGER)")
        assert await db.run_write(insert, 1) == 1
        with pytest.raises(LookupError):
            await db.run_write(insert, 2, fail=True)
        order: list[str] = []

        async def held_writer() -> None:
            async with db.write() as conn:
                order.append("write() in")
                await asyncio.sleep(0.05)
                await conn.execute(sa.insert(table).values(n=3))
                order.append("write() out")

        async def unit_writer() -> None:
            await asyncio.sleep(0.01)
            await db.run_write(insert, 4)
            order.append("run_write done")

        await asyncio.gather(held_writer(), unit_writer())

        assert await db.run_read(numbers) == [1, 3, 4]
        if db.is_sqlite:  # one writer: the unit waited for the open write transaction
            assert order == ["write() in", "write() out", "run_write done"]
    finally:
        async with db.write() as conn:
            await conn.exec_driver_sql("DROP TABLE IF EXISTS unit_test_rows")
        await db.dispose()


async def test_cancelled_sqlite_unit_finishes_its_transaction_before_the_lock_is_free(tmp_path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db")

    def slow_insert(conn: sa.Connection) -> None:
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        time.sleep(0.2)  # the worker thread cannot be interrupted

    try:
        async with db.write() as conn:
            await conn.exec_driver_sql("CREATE TABLE t (n INTEGER)")
        task = asyncio.create_task(db.run_long_write(slow_insert))  # on a thread (inline: never half-way)
        await asyncio.sleep(0.05)
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started > 0.1  # waited for the thread's commit
        async with db.write() as conn:  # the lock is free, the unit committed
            assert (await conn.exec_driver_sql("SELECT count(*) FROM t")).scalar() == 1
    finally:
        await db.dispose()


async def test_committed_connections_return_to_the_pool_without_a_rollback(mariadb_url: str) -> None:
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0)  # one connection: one session

    async def rollbacks() -> int:
        async with db.read() as conn:  # the read's own close rolls back once
            row = (await conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_rollback'"))).one()
        return int(row[1])

    def noop(conn: sa.Connection) -> None:
        conn.execute(sa.text("SELECT 1"))

    async def failing_write() -> None:
        async with db.write() as conn:
            await conn.execute(sa.text("SELECT 1"))
            raise ZeroDivisionError

    try:
        before = await rollbacks()
        for _ in range(5):
            await db.run_write(noop)
            async with db.write() as conn:
                await conn.execute(sa.text("SELECT 1"))
        after_commits = await rollbacks()
        with pytest.raises(ZeroDivisionError):
            await failing_write()
        after_failure = await rollbacks()
    finally:
        await db.dispose()
    assert after_commits - before == 1  # only the counting read's own rollback
    assert after_failure - after_commits >= 2  # the failed write rolled back (+ the read)


async def test_mariadb_statements_run_prepared_and_a_refused_bulk_runs_row_by_row(mariadb_url: str) -> None:
    """Parameterised statements go prepared (no escaping on the client); an executemany the server
    refuses to bulk-execute (INSERT ... SELECT) still inserts every row."""
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0)  # one connection: one session
    table = sa.table("prepared_probe", sa.column("n"), sa.column("doc"))
    try:
        async with db.write() as conn:
            await conn.execute(sa.text("CREATE TEMPORARY TABLE prepared_probe (n INT, doc TEXT)"))
            executed = int((await conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_stmt_execute'"))).one()[1])
            await conn.execute(sa.insert(table), [{"n": n, "doc": "a'b\\c\x00" * 50} for n in range(3)])
            await conn.execute(
                sa.insert(table).from_select(["n", "doc"], sa.select(sa.bindparam("n"), sa.bindparam("doc"))),
                [{"n": 10 + n, "doc": "x"} for n in range(3)],
            )
            rows = (await conn.execute(sa.select(table.c.n, table.c.doc).order_by(table.c.n))).all()
            after = int((await conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_stmt_execute'"))).one()[1])
    finally:
        await db.dispose()
    assert [n for n, _ in rows] == [0, 1, 2, 10, 11, 12]
    assert {doc for n, doc in rows if n < 10} == {"a'b\\c\x00" * 50}  # bytes as sent, quotes and backslashes kept
    assert after > executed  # prepared (COM_STMT_EXECUTE), not text queries


# --------------------------------------------------------------------------- deadlines

_COUNT_FOREVER = (  # a statement that runs for minutes unless interrupted
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000000000) SELECT count(*) FROM c"
)


async def test_sqlite_busy_timeout_is_the_deadline(tmp_path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db", timeout_s=0.25)
    try:
        async with db.read() as conn:
            assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar() == 250
        busy_timeout = "PRAGMA busy_timeout"
        assert await db.run_long_read(lambda conn: conn.exec_driver_sql(busy_timeout).scalar()) == 250
        # inline units never wait: refused at once, they run on a thread (with the timeout above)
        assert await db.run_read(lambda conn: conn.exec_driver_sql(busy_timeout).scalar()) == 0
    finally:
        await db.dispose()


@pytest.mark.parametrize("unit", ["run_read", "run_write"])
async def test_a_sqlite_unit_past_its_deadline_is_interrupted(tmp_path: Path, unit: str) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db", timeout_s=0.3)

    def count_forever(conn: sa.Connection) -> object:
        return conn.exec_driver_sql(_COUNT_FOREVER).scalar()

    try:
        started = time.monotonic()
        with pytest.raises(StoreDeadlineExceeded, match=r"0\.3s deadline"):
            await getattr(db, unit)(count_forever)
        assert time.monotonic() - started < 3  # interrupted, not run to its end
        assert await db.run_write(lambda conn: conn.exec_driver_sql("SELECT 1").scalar()) == 1  # lock free
    finally:
        await db.dispose()


async def test_a_sqlite_write_block_has_the_deadline_and_so_has_the_wait_for_the_write_lock(tmp_path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db", timeout_s=0.3)
    holding = asyncio.Event()

    async def hold_the_lock(*, bounded: bool) -> None:
        async with db.write(bounded=bounded):
            holding.set()
            await asyncio.sleep(30)  # a block that never ends on its own

    try:
        started = time.monotonic()
        with pytest.raises(StoreDeadlineExceeded):
            await hold_the_lock(bounded=True)
        assert time.monotonic() - started < 2
        holding.clear()
        holder = asyncio.create_task(hold_the_lock(bounded=False))  # a migration, say
        await holding.wait()
        started = time.monotonic()
        with pytest.raises(StoreDeadlineExceeded):
            await db.run_write(lambda conn: conn.exec_driver_sql("SELECT 1").scalar())
        assert time.monotonic() - started < 2
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
    finally:
        await db.dispose()


async def test_mariadb_sessions_carry_limits_that_are_multiples_of_the_deadline(mariadb_url: str) -> None:
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=1.5)
    try:
        async with db.read() as conn:
            limits = (
                await conn.execute(
                    sa.text("SELECT @@max_statement_time, @@innodb_lock_wait_timeout, @@idle_transaction_timeout")
                )
            ).one()
        assert (float(limits[0]), int(limits[1]), int(limits[2])) == (1.125, 2, 3)
    finally:
        await db.dispose()


def test_mysql_servers_get_their_own_statement_limit() -> None:
    assert session_limits_sql("mysql", 0.5) == ("SET SESSION max_execution_time = 375, innodb_lock_wait_timeout = 1")
    assert "idle_transaction_timeout = 1" in session_limits_sql("mariadb", 0.5)


async def test_a_mariadb_statement_past_the_deadline_is_ended_by_the_server(mariadb_url: str) -> None:
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=0.4)
    try:
        async with db.read() as conn:
            first = (await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="OperationalError"):
            async with db.read() as conn:
                await conn.execute(sa.text("SELECT SLEEP(5)"))  # max_statement_time interrupts it
        assert time.monotonic() - started < 2
        async with db.read() as conn:  # an answered error: the session is sound and stays pooled
            assert (await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one() == first
    finally:
        await db.dispose()


async def test_an_unbounded_write_lifts_the_limits_of_its_session_only(mariadb_url: str) -> None:
    """Migrations: DDL and the migration lock wait may take long; the session is closed after."""
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=0.4)
    try:
        async with db.write(bounded=False) as conn:
            session = (await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one()
            await conn.execute(sa.text("SELECT SLEEP(0.8)"))  # twice the deadline
            lifted = (await conn.execute(sa.text("SELECT @@max_statement_time, @@idle_transaction_timeout"))).one()
        assert (float(lifted[0]), int(lifted[1])) == (0.0, 0)
        async with db.read() as conn:
            again = (await conn.execute(sa.text("SELECT CONNECTION_ID(), @@max_statement_time"))).one()
        assert again[0] != session and float(again[1]) == 0.3
    finally:
        await db.dispose()


async def test_the_write_lock_is_taken_at_once_only_when_free_and_nobody_waits() -> None:
    lock = _WriteLock()
    assert lock.take_if_free() and lock.locked()
    assert not lock.take_if_free()  # held
    waiter = asyncio.ensure_future(lock.acquire())
    gone = asyncio.ensure_future(lock.acquire())
    await asyncio.sleep(0)  # both queued behind the holder
    gone.cancel()
    lock.release()  # handed to the first waiter, which has not run yet
    assert not lock.take_if_free()  # nobody jumps it
    await waiter
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert lock.locked()
    lock.release()
    assert lock.take_if_free()  # the cancelled waiter is not counted any more
    lock.release()


# --------------------------------------------------------------------------- SQLite units inline


def _create_table(path: Path, ddl: str = "CREATE TABLE t (n INTEGER)") -> None:
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(ddl)
    conn.close()


def _insert(conn: sa.Connection, n: int) -> int:
    conn.exec_driver_sql("INSERT INTO t VALUES (?)", (n,))
    return n


def _numbers(conn: sa.Connection) -> list[int]:
    return list(conn.exec_driver_sql("SELECT n FROM t ORDER BY rowid").scalars())


async def test_sqlite_units_run_inline_on_the_loops_thread(tmp_path: Path) -> None:
    _create_table(tmp_path / "room.db")
    db = _sqlite_db(tmp_path / "room.db")
    threads: list[int] = []

    def insert_here(conn: sa.Connection, n: int) -> int:
        threads.append(threading.get_ident())
        return _insert(conn, n)

    try:
        assert [await db.run_write(insert_here, n) for n in range(3)] == [0, 1, 2]
        assert await db.run_read(_numbers) == [0, 1, 2]
        assert (db.unit_counts.inline, db.unit_counts.on_thread, db.unit_counts.fallbacks) == (4, 0, 0)
        assert set(threads) == {threading.get_ident()}
        await db.run_long_write(insert_here, 3)  # a long unit: on a thread, where the deadline can interrupt it
        assert threads[-1] != threading.get_ident()
        assert await db.run_long_read(_numbers) == [0, 1, 2, 3]
        assert (db.unit_counts.inline, db.unit_counts.on_thread) == (4, 2)
    finally:
        await db.dispose()


_HOLD_THE_WRITE_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=5)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("INSERT INTO t VALUES (100)")
conn.execute("COMMIT")
print("committed", flush=True)
"""


async def test_an_inline_write_refused_by_another_process_runs_on_a_thread_and_the_loop_runs_meanwhile(
    tmp_path: Path,
) -> None:
    path = tmp_path / "room.db"
    _create_table(path)
    db = _sqlite_db(path)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD_THE_WRITE_LOCK, str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert await db.run_write(_insert, 0) == 0  # inline, before the other process locks
        assert await holder.stdout.readline() == b"locked\n"
        write = asyncio.create_task(db.run_write(_insert, 1))
        await asyncio.sleep(0)  # the unit starts: its inline BEGIN IMMEDIATE is refused at once
        assert db.unit_counts.fallbacks == 1 and not write.done()
        # the loop is free while the unit waits on its thread (busy timeout): it talks to the holder
        holder.stdin.write(b"go\n")
        assert await holder.stdout.readline() == b"committed\n"
        assert await write == 1
        assert await db.run_read(_numbers) == [0, 100, 1]  # it waited for the other process's commit
        counts = db.unit_counts
        assert (counts.inline, counts.on_thread, counts.fallbacks) == (2, 1, 1)
        assert await db.run_write(_insert, 2) == 2  # and the next unit is inline again
        assert counts.inline == 3
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
        await db.dispose()


async def test_an_inline_read_refused_runs_on_a_thread_and_the_loop_runs_meanwhile(tmp_path: Path) -> None:
    # a connection in EXCLUSIVE locking mode shuts WAL readers out (SQLITE_BUSY): the inline read
    # is refused before its unit runs, the threaded one waits for the lock in its busy timeout
    path = tmp_path / "room.db"
    _create_table(path)
    other = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    other.execute("SELECT 1 FROM t")  # in WAL with shared memory first: EXCLUSIVE can be left again
    other.execute("PRAGMA locking_mode=EXCLUSIVE")
    other.execute("INSERT INTO t VALUES (7)")  # takes the exclusive lock, keeps it
    db = _sqlite_db(path)
    calls: list[int] = []

    def numbers(conn: sa.Connection) -> list[int]:
        calls.append(1)
        return _numbers(conn)

    try:
        read = asyncio.create_task(db.run_read(numbers))
        await asyncio.sleep(0)  # refused inline at once
        assert db.unit_counts.fallbacks == 1 and not read.done()
        ticks = 0
        while not read.done() and ticks < 3:  # the loop runs while the read waits on its thread
            ticks += 1
            await asyncio.sleep(0)
        assert ticks == 3 and not read.done()
        other.execute("PRAGMA locking_mode=NORMAL")
        other.execute("SELECT 1 FROM t")  # lets the lock go
        assert await read == [7]
        assert calls == [1]  # the unit ran once, on the thread
        assert (db.unit_counts.inline, db.unit_counts.on_thread) == (0, 1)
        assert await db.run_read(numbers) == [7]  # inline now
        assert db.unit_counts.inline == 1
    finally:
        other.close()
        await db.dispose()


async def test_an_inline_read_whose_snapshot_is_refused_runs_once_on_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _create_table(tmp_path / "room.db")
    db = _sqlite_db(tmp_path / "room.db")
    calls: list[int] = []

    def numbers(conn: sa.Connection) -> list[int]:
        calls.append(1)
        return _numbers(conn)

    try:
        await db.run_write(_insert, 1)  # the inline connection is open
        monkeypatch.setattr(database, "_SQLITE_READ_PROBE", "SELECT * FROM no_such_table")  # refused
        assert await db.run_read(numbers) == [1]
        assert calls == [1]
        assert (db.unit_counts.fallbacks, db.unit_counts.on_thread) == (1, 1)
        monkeypatch.undo()
        assert await db.run_read(numbers) == [1]  # the connection was left clean: inline again
        assert db.unit_counts.inline == 2
    finally:
        await db.dispose()


@pytest.mark.parametrize("unit", ["run_write", "run_long_write"])
async def test_a_failing_unit_rolls_back_and_raises_the_same_inline_and_on_a_thread(tmp_path: Path, unit: str) -> None:
    path = tmp_path / "room.db"
    _create_table(path, "CREATE TABLE t (n INTEGER PRIMARY KEY)")
    db = _sqlite_db(path)
    run_write = getattr(db, unit)

    def insert_then(conn: sa.Connection, n: int, then: str) -> None:
        _insert(conn, n)
        if then == "raise":
            raise LookupError("boom")
        conn.exec_driver_sql(then)

    try:
        await db.run_write(_insert, 1)
        with pytest.raises(LookupError, match="boom"):
            await run_write(insert_then, 2, "raise")
        with pytest.raises(sa.exc.IntegrityError, match="UNIQUE"):  # an error of the data: passes as is
            await run_write(insert_then, 3, "INSERT INTO t VALUES (1)")
        with pytest.raises(StoreUnavailable, match="OperationalError"):  # mapped the same on both paths
            await run_write(insert_then, 4, "SELECT * FROM no_such_table")
        assert await db.run_read(_numbers) == [1]  # each rolled back
        assert await db.run_write(_insert, 5) == 5  # and the connections are usable
        assert await db.run_read(_numbers) == [1, 5]
        inline = 4 + 3 * (unit == "run_write")  # a failed unit counts where it ran
        assert (db.unit_counts.inline, db.unit_counts.fallbacks) == (inline, 0)
    finally:
        await db.dispose()


@pytest.mark.parametrize("unit", ["run_write", "run_long_write"])
async def test_a_failing_commit_rolls_back_and_raises_the_same_inline_and_on_a_thread(
    tmp_path: Path, unit: str
) -> None:
    # a deferred foreign key is checked at COMMIT: the commit itself fails
    path = tmp_path / "room.db"
    _create_table(path, "CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("CREATE TABLE t (n INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)")
    conn.close()
    db = _sqlite_db(path)
    try:
        with pytest.raises(sa.exc.IntegrityError, match="FOREIGN KEY"):
            await getattr(db, unit)(_insert, 1)
        assert await db.run_read(_numbers) == []
        await db.run_write(lambda conn: conn.exec_driver_sql("INSERT INTO parent VALUES (2)"))
        assert await db.run_write(_insert, 2) == 2  # the inline connection is not left in a transaction
        assert await db.run_read(_numbers) == [2]
    finally:
        await db.dispose()


async def test_inline_sql_past_its_budget_is_rolled_back_and_runs_again_on_a_thread(tmp_path: Path) -> None:
    _create_table(tmp_path / "room.db")
    db = _sqlite_db(tmp_path / "room.db")
    assert db._inline is not None
    db._inline.budget_s = 0.001
    counting = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3000000) SELECT count(*) FROM c"
    )

    def insert_and_count(conn: sa.Connection, n: int) -> int:
        _insert(conn, n)
        return int(conn.exec_driver_sql(counting).scalar_one())

    try:
        assert await db.run_write(insert_and_count, 1) == 3_000_000  # stopped inline, run on a thread
        assert await db.run_read(_numbers) == [1]  # once: the inline attempt was rolled back
        counts = db.unit_counts
        assert (counts.overruns, counts.on_thread) == (1, 1)
        assert await db.run_write(insert_and_count, 2) == 3_000_000  # remembered as long: on a thread at once
        assert (counts.overruns, counts.on_thread) == (1, 2)
        assert await db.run_write(_insert, 3) == 3  # others stay inline
        assert await db.run_read(_numbers) == [1, 2, 3]
        assert counts.inline == 3
    finally:
        await db.dispose()


async def test_a_unit_slow_inline_starts_on_a_thread_until_it_is_quick_there(tmp_path: Path) -> None:
    _create_table(tmp_path / "room.db")
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db")
    assert db._inline is not None
    counting = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < ?) SELECT count(*) FROM c"

    def count(conn: sa.Connection, n: int) -> int:
        return int(conn.exec_driver_sql(counting, (n,)).scalar_one())

    try:
        assert await db.run_read(count, 1) == 1  # warm (a cold first unit can be slow)
        db._inline.slow_s, db._inline.budget_s = 0.005, 60  # (not stopped: only found slow)
        assert await db.run_read(count, 300_000) == 300_000  # tens of milliseconds
        counts = db.unit_counts
        assert (counts.inline, counts.on_thread, counts.slow, counts.overruns) == (2, 0, 1, 0)
        assert await db.run_read(count, 3) == 3  # that kind of unit starts on a thread now ...
        assert (counts.inline, counts.on_thread) == (2, 1)
        assert await db.run_read(count, 3) == 3  # ... and, quick there, inline again
        assert (counts.inline, counts.on_thread) == (3, 1)
        assert await db.run_read(_numbers) == []  # other kinds were inline all along
        assert counts.inline == 4
    finally:
        await db.dispose()


COUNTING = sa.text(
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < :n) SELECT count(*) FROM c"
)


async def _counted(writes: Writes, n: int) -> int:
    return int((await writes.rows(COUNTING, {"n": n}))[0][0])


async def _counted_too(writes: Writes, n: int) -> int:
    return int((await writes.rows(COUNTING, {"n": n}))[0][0])


async def test_write_units_of_store_writes_are_slow_each_by_its_own_function(tmp_path: Path) -> None:
    """Every unit of store.writes runs as ``on_connection(conn, fn, ...)``: a slow save must not send
    the other kinds (a wallet debit, a save of one mutation) to a thread with it."""
    _create_table(tmp_path / "room.db")
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db")
    assert db._inline is not None
    try:
        assert await run_writes(db, _counted, 1) == 1  # warm (a cold first unit can be slow)
        db._inline.slow_s, db._inline.budget_s = 0.005, 60  # (not stopped: only found slow)
        assert await run_writes(db, _counted, 300_000) == 300_000  # tens of milliseconds
        counts = db.unit_counts
        assert (counts.inline, counts.on_thread, counts.slow) == (2, 0, 1)
        assert await run_writes(db, _counted_too, 3) == 3  # another kind: inline still
        assert (counts.inline, counts.on_thread) == (3, 0)
        assert await run_writes(db, _counted, 3) == 3  # the slow kind starts on a thread
        assert (counts.inline, counts.on_thread) == (3, 1)
    finally:
        await db.dispose()


COUNTING_TOO = sa.text(
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < :n) SELECT count(*) + 0 FROM c"
)


async def _rows_of(reads: Writes, statement: Any, params: dict[str, Any]) -> int:
    return int((await reads.rows(statement, params))[0][0])


async def test_read_units_of_one_function_are_slow_each_by_its_statement(tmp_path: Path) -> None:
    """A room's load and a command's look-up are one function of store.writes with two statements:
    a slow load of a big room must not send every look-up to a thread with it (issue 12 review)."""
    _create_table(tmp_path / "room.db")
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/room.db")
    assert db._inline is not None
    try:
        assert await run_reads(db, _rows_of, COUNTING, {"n": 1}) == 1  # warm
        db._inline.slow_s, db._inline.budget_s = 0.005, 60  # (not stopped: only found slow)
        assert await run_reads(db, _rows_of, COUNTING, {"n": 300_000}) == 300_000  # tens of milliseconds
        counts = db.unit_counts
        assert (counts.inline, counts.on_thread, counts.slow) == (2, 0, 1)
        assert await run_reads(db, _rows_of, COUNTING_TOO, {"n": 3}) == 3  # another statement: inline still
        assert (counts.inline, counts.on_thread) == (3, 0)
        assert await run_reads(db, _rows_of, COUNTING, {"n": 3}) == 3  # the slow one starts on a thread
        assert (counts.inline, counts.on_thread) == (3, 1)
    finally:
        await db.dispose()


def test_a_units_key_counts_a_statement_inside_on_connection_not_a_value() -> None:
    """Looking through on_connection, only a statement tells kinds apart: a debit key (a string, new
    every call) must not make each unit a kind of its own (the slow-unit set is bounded and cleared)."""
    from roomservice.store.writes import on_connection

    assert database._unit_key(on_connection, (_rows_of, COUNTING, {})) != database._unit_key(
        on_connection, (_rows_of, COUNTING_TOO, {})
    )
    assert database._unit_key(on_connection, (_counted, "key-a")) == database._unit_key(
        on_connection, (_counted, "key-b")
    )


async def test_back_to_back_inline_units_let_the_loop_run(tmp_path: Path) -> None:
    _create_table(tmp_path / "room.db")
    db = _sqlite_db(tmp_path / "room.db")
    ran = asyncio.Event()

    async def other_coroutine() -> None:
        ran.set()

    try:
        other = asyncio.create_task(other_coroutine())
        units = 0
        while not ran.is_set():  # never suspends but in run_read: the loop must get a turn in there
            await db.run_read(_numbers)
            units += 1
            assert units < 100_000
        await other
        assert db.unit_counts.inline == units and units > 1
    finally:
        await db.dispose()


def _size(path: Path) -> int:
    return path.stat().st_size


async def test_the_wal_of_inline_writes_is_checkpointed(tmp_path: Path) -> None:
    path = tmp_path / "room.db"
    _create_table(path, "CREATE TABLE t (n INTEGER, doc BLOB)")
    db = _sqlite_db(path)
    wal = Path(f"{path}-wal")

    def insert(conn: sa.Connection, n: int) -> None:
        conn.exec_driver_sql("INSERT INTO t VALUES (?, zeroblob(3000))", (n,))

    try:
        for n in range(4000):  # a page or more a commit: ~4000 frames, 16 MB of WAL unless checkpointed
            await db.run_write(insert, n)
        page_size = await db.run_read(lambda conn: conn.exec_driver_sql("PRAGMA page_size").scalar_one())
        counts = db.unit_counts
        assert counts.inline == 4000 + 1 and counts.on_thread == 0
        assert counts.checkpoints >= 2
        assert _size(wal) <= 2000 * (page_size + 24)  # SQLite's threshold (1000), with room
    finally:
        await db.dispose()
