"""The database handle: async access to SQLite or MySQL/MariaDB, with every dialect quirk here.

Two ways in, same transaction discipline on both backends:

* ``async with db.write() as conn`` / ``async with db.read() as conn`` yield an
  :class:`AsyncConnection` (a write transaction, or a connection for reads).
* ``await db.run_write(fn, ...)`` / ``await db.run_read(fn, ...)`` run a plain
  synchronous ``fn(conn, ...)`` as one unit. On MySQL this is
  ``AsyncConnection.run_sync``; on SQLite the whole unit runs on a pysqlite
  connection instead of one aiosqlite thread hop per cursor call (about four per
  statement) — the hot paths use it. It runs inline, on the event loop's thread,
  when it cannot wait on a lock (SQLite's busy timeout 0 there: refused, it runs
  on a worker thread as before, one hop); its SQL has a budget of 20 ms there,
  past which it is rolled back and run on a thread. ``run_long_read`` /
  ``run_long_write`` always run on a thread: for units that may run long.

What differs per backend is decided once, here:

* SQLite (``sqlite+aiosqlite:///path``): WAL, ``synchronous=NORMAL``,
  ``busy_timeout`` = the deadline, ``foreign_keys=ON``. The sqlite3 driver's own
  transaction handling is switched off (SQLAlchemy's documented recipe: no
  isolation level on connect, our own BEGIN in a "begin" hook) so a write
  transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock up front
  instead of failing with SQLITE_BUSY when a read turns into a write. Reads run
  without an explicit transaction (each statement is atomic) and are never
  blocked by the writer under WAL. SQLite has one writer, so write
  transactions of this process queue on an ``asyncio.Lock`` rather than spin
  on the busy timeout; other processes are covered by ``busy_timeout``.
* MySQL/MariaDB (``mysql+asyncmy://`` or ``mariadb+asyncmy://``, both run as
  the "mysql" dialect): READ COMMITTED, utf8mb4, a bounded pool (no pre-ping)
  recycled every five minutes, and per-session server limits (below).

Deadlines. Every call — a ``run_read``/``run_write`` unit or a ``read()``/``write()``
block, its wait for the write lock or a pooled connection and the connect
included — has one deadline ``D`` (``timeout_s``, ``database.timeout``). A call
that misses it raises :class:`StoreDeadlineExceeded` (a :class:`StoreUnavailable`:
the command answers ``503 unavailable``, and a write's outcome is unknown, so
the cell is reloaded). Every other bound is a multiple of ``D``:

==============================  =======================================================
client, MySQL                   the call fails by ``D``; its connection is closed at once
                                (no I/O on it) and invalidated, never pooled again
client, SQLite                  the running statement is interrupted at ``D``; a statement
                                inside the busy wait ends with it: by ``2 D`` at worst. An
                                inline unit waits on nothing; its SQL is stopped after 20 ms
                                and runs again on a thread, under the rule above
pool checkout, TCP connect      ``D`` (inside the call's deadline anyway)
driver read timeout             ``2 D``: a backstop for code that takes a connection
                                from ``engine`` directly (the maintenance lock)
server ``max_statement_time``   ``0.75 D`` (MySQL: ``max_execution_time``, SELECTs only):
                                the server ends a long statement with an answered error
                                before the client gives up, so that session stays pooled
``innodb_lock_wait_timeout``    ``ceil(D)`` seconds
``idle_transaction_timeout``    ``ceil(2 D)`` seconds (MariaDB): a live client never
                                idles inside a transaction longer than its deadline
abandoned session               ``KILL``-ed from a fresh connection, each attempt
                                bounded by ``D``, retried until ``3 D``; by then the
                                server limits above have ended it anyway, so its row
                                locks are gone ``3 D`` after the call gave up
``dispose()``                   ``D``
==============================  =======================================================

A client that gives up on a connection cannot tell the server (a partition
drops its close too); without the server-side limits and the kill, the
session's row locks would stay until ``wait_timeout`` (hours). Migrations run
``unbounded`` (``write(bounded=False)``): no deadline, the server limits lifted
for that one session, which is closed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType
from typing import Any, Concatenate, Final, Literal, ParamSpec, TypeVar

from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import URL, Connection, ExceptionContext, RootTransaction, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, NullPool, PoolResetState, QueuePool
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.dml import Insert

from roomservice.futures import Deadlines
from roomservice.observability.logging import get_logger
from roomservice.store.driver import DriverCursor, Rendered, rendered
from roomservice.store.port import StoreDeadlineExceeded, StoreUnavailable

DialectName = Literal["sqlite", "mysql"]
P = ParamSpec("P")
T = TypeVar("T")

_log = get_logger("roomservice.store")

DEFAULT_TIMEOUT_S: Final = 5.0
"""The deadline of one database call when none is configured (``database.timeout``)."""

# Execution option read by the SQLite "begin" hook: the statement that opens a transaction.
_BEGIN_OPTION: Final = "roomservice_sqlite_begin"
_BEGIN_WRITE: Final = {_BEGIN_OPTION: "BEGIN IMMEDIATE"}
_BEGIN_NOTHING: Final = {_BEGIN_OPTION: None}
_SQLITE_BEGIN_WRITE: Final = _BEGIN_WRITE[_BEGIN_OPTION]
# Read by an inline read unit right after its BEGIN: it takes the read snapshot (the only step of a
# WAL read that can be refused) before the unit's own statements run.
_SQLITE_READ_PROBE: Final = "PRAGMA schema_version"

_SQLITE_PRAGMAS: Final = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA foreign_keys=ON",
)
# Marks a pooled connection whose last transaction committed: it goes back to
# the pool without the customary (and here pointless) ROLLBACK round trip.
_COMMITTED: Final = "roomservice_committed"
# The server's id of a MySQL session (its CONNECTION_ID()), kept in the pool record's info.
_THREAD_ID: Final = "roomservice_thread_id"
# Threads (and pysqlite connections) for run_read/run_write on SQLite: one
# writer at a time anyway, a few concurrent readers.
_SQLITE_THREADS: Final = 4
# Driver units' sessions held idle between units (at most a quarter of the pool), and for how long.
_HELD_MAX: Final = 4
_HELD_FOR_S: Final = 60.0
_INTERRUPT_EVERY_S: Final = 0.02
# An inline unit (on the event loop's thread) whose SQL is still running this long after it began is
# stopped, rolled back and run again on a thread: it bounds how long one inline unit holds up the loop.
_INLINE_BUDGET_S: Final = 0.02
# Back-to-back inline units (a caller awaiting one after another never suspends) yield to the loop
# once they have kept it this long.
_INLINE_STREAK_S: Final = 0.005
# SQLite VM steps between two looks at the clock while an inline statement runs (a few hundred
# microseconds of work; the statements of the hot units never reach it)
_INLINE_PROGRESS_STEPS: Final = 20_000
# A unit that ran longer than this inline starts on a thread from then on (until a run there takes
# less than half of it), so that it does not hold up the loop every time (retention batches, admin
# scans). Not lower: at 1 ms the group commit's batches of a busy server went to a thread, and the
# HTTP join cost ~30 % more server CPU than with every unit inline (four interleaved pairs).
_INLINE_SLOW_S: Final = 0.01
_SLOW_UNITS_KEPT: Final = 256
# WAL frames (pages) past which the inline writes' WAL is checkpointed: SQLite's own auto-checkpoint
# threshold, which the inline connection has off (a checkpoint fsyncs: not on the loop's thread).
_CHECKPOINT_FRAMES: Final = 1000
# Rows changed by inline commits before the first checkpoint, until the WAL's frames per changed row
# are measured (one commit of a 200-row outbox batch fills tens of pages, a command's a few).
_CHECKPOINT_FIRST_AFTER: Final = 500
_CHECKPOINT_MAX_AFTER: Final = 1_000_000
# While a checkpoint's first pass copies without the write lock, inline writers that have changed
# this share of a checkpoint's rows meanwhile wait for it (the WAL stays bounded).
_CHECKPOINT_OUTRUN_SHARE: Final = 4
# Prepared statements a MySQL/MariaDB connection keeps (asyncmy's LRU): the hot statements of the
# store, the outbox and the brokers, with room to spare; the server's max_prepared_stmt_count
# (16,382) covers a pool of 40 at this size many times over.
_MYSQL_STATEMENT_CACHE: Final = 64


@dataclass(slots=True)
class UnitCounts:
    """Where the SQLite ``run_read``/``run_write`` units of a :class:`Database` ran."""

    inline: int = 0
    """On the event loop's thread, without a hop."""
    on_thread: int = 0
    """On a worker thread: long units, and the fallbacks below."""
    fallbacks: int = 0
    """Inline start refused (another process holds SQLite's write lock, say): run on a thread instead."""
    overruns: int = 0
    """Inline SQL past its budget: rolled back and run again on a thread."""
    slow: int = 0
    """Kinds of unit found slow inline (overruns included): they start on a thread for a while."""
    checkpoints: int = 0
    """WAL checkpoints run for the inline writes."""


class Database:
    """An :class:`AsyncEngine` plus the transaction discipline and the deadlines of its dialect."""

    def __init__(self, engine: AsyncEngine, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        self.engine = engine
        self.timeout_s = timeout_s
        name = engine.dialect.name
        if name == "sqlite":
            self.dialect_name: DialectName = "sqlite"
        elif name in ("mysql", "mariadb"):
            self.dialect_name = "mysql"
        else:
            raise ValueError(f"unsupported database dialect {name!r}")
        self._write_lock = _WriteLock()
        # the SQLite units' deadlines: a waiter past its own fails with TimeoutError (one timer for all)
        self._unit_deadlines = Deadlines(_time_out)
        _reset_unless_committed(engine.sync_engine)
        self._sync_engine: Engine | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._reaper: _SessionReaper | None = None
        self._held = _HeldSessions(engine, holds=self.dialect_name == "mysql")
        self._inline: _InlineUnits | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._checkpoint_copied = asyncio.Event()  # the running checkpoint's first pass is done
        self.unit_counts = UnitCounts()
        if self.dialect_name == "sqlite":
            _take_over_sqlite_transactions(engine.sync_engine, busy_timeout_ms=_sqlite_busy_ms(timeout_s))
            self._write_engine = engine.execution_options(**_BEGIN_WRITE)
            self._read_engine = engine.execution_options(**_BEGIN_NOTHING)
            # A private :memory: database exists in one connection only; it
            # cannot be shared with a second engine, so it keeps the async path.
            if not _is_sqlite_memory(engine.url):
                self._sync_engine = _sqlite_sync_engine(engine, busy_timeout_ms=_sqlite_busy_ms(timeout_s))
                self._threads = ThreadPoolExecutor(_SQLITE_THREADS, thread_name_prefix="roomservice-sqlite")
                self._inline = _InlineUnits(engine, self._sync_engine, self.unit_counts)
        else:
            self._write_engine = self._read_engine = engine
            _limit_mysql_sessions(engine.sync_engine, timeout_s)
            event.listen(engine.sync_engine, "do_executemany", _bulk_or_row_by_row)
            self._reaper = _SessionReaper(engine, timeout_s)

    @classmethod
    def from_url(
        cls,
        url: str | URL,
        *,
        pool_size: int = 20,
        max_overflow: int = 20,
        echo: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Database:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
        # The "reset" hook installed in __init__ does the return-to-pool reset.
        options: dict[str, Any] = {"echo": echo, "pool_reset_on_return": None}
        if backend == "sqlite":
            _ensure_sqlite_parent_dir(parsed)
            if not _is_sqlite_memory(parsed):
                options.update(pool_size=pool_size, max_overflow=max_overflow, pool_timeout=timeout_s)
        elif backend in ("mysql", "mariadb"):
            # One dialect name everywhere: statements written for "mysql"
            # (prefixes, variants, options) then also apply on MariaDB, which
            # SQLAlchemy still detects from the server version.
            parsed = parsed.set(drivername="mysql+" + (parsed.get_driver_name() or "asyncmy"))
            if "charset" not in parsed.query:
                parsed = parsed.update_query_dict({"charset": "utf8mb4"})
            options.update(
                isolation_level="READ COMMITTED",
                pool_size=pool_size,
                max_overflow=max_overflow,
                pool_timeout=timeout_s,
                # No pre-ping: it costs a round trip on every checkout. A dead
                # connection fails its statement, SQLAlchemy drops the pool, and
                # the command answers 503 (StoreUnavailable), safe to retry.
                pool_recycle=300,
                connect_args={
                    "connect_timeout": timeout_s,
                    "read_timeout": 2 * timeout_s,
                    # parameterised statements run prepared (binary protocol, see _bulk_or_row_by_row)
                    "stmt_cache_size": _MYSQL_STATEMENT_CACHE,
                },
            )
        else:
            raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}")
        return cls(create_async_engine(parsed, **options), timeout_s=timeout_s)

    @property
    def is_sqlite(self) -> bool:
        return self.dialect_name == "sqlite"

    def render_ahead(self, statements: Iterable[Any]) -> None:
        """Render ``statements`` for :func:`execute_rendered` now, for the dialect this database's units
        run on, instead of on their first execution. Rendering a big statement costs milliseconds of
        CPU with the GIL held (in the writer thread, so the event loop stalls with it): a server
        that would otherwise render the 32 shapes of the store's guarded UPDATE during its first
        seconds of commands pays ~160 ms of CPU there instead (issue 12)."""
        dialect = (self._sync_engine or self.engine.sync_engine).dialect
        for statement in statements:
            rendered(dialect, statement, None)

    # ------------------------------------------------------------------ blocks

    @asynccontextmanager
    async def write(self, *, bounded: bool = True) -> AsyncIterator[AsyncConnection]:
        """One write transaction: committed when the block exits, rolled back if it raises.

        The whole block has the deadline; ``bounded=False`` (migrations only) lifts it.
        """
        with _unavailable_on_failure():
            if self.dialect_name == "sqlite":
                async with self._sqlite_block(self._write_engine, write=True, bounded=bounded) as conn:
                    yield conn
            else:
                async with self._mysql_block(write=True, bounded=bounded) as conn:
                    yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads. Each statement sees committed data; write nothing through it."""
        with _unavailable_on_failure():
            if self.dialect_name == "sqlite":
                async with self._sqlite_block(self._read_engine, write=False, bounded=True) as conn:
                    yield conn
            else:
                async with self._mysql_block(write=False, bounded=True) as conn:
                    yield conn

    @asynccontextmanager
    async def _sqlite_block(self, engine: AsyncEngine, *, write: bool, bounded: bool) -> AsyncIterator[AsyncConnection]:
        # aiosqlite runs each call on its own thread: a call the deadline cancels
        # still finishes there (bounded by busy_timeout) before the rollback runs.
        scope = asyncio.timeout(self.timeout_s if bounded else None)
        try:
            async with scope:
                if write:
                    async with self._write_lock, engine.connect() as conn:
                        async with conn.begin():
                            yield conn
                        conn.info[_COMMITTED] = True
                else:
                    async with engine.connect() as conn:
                        yield conn
        except TimeoutError as exc:
            if scope.expired():
                raise self._deadline_exceeded() from exc
            raise

    @asynccontextmanager
    async def _mysql_block(self, *, write: bool, bounded: bool) -> AsyncIterator[AsyncConnection]:
        """A pooled connection under the deadline. Cancelled inside (the deadline, or
        the caller went away), the connection is in an unknown state: it is closed
        without another byte sent, invalidated and its server session killed."""
        scope = asyncio.timeout(self.timeout_s if bounded else None)
        conn: AsyncConnection | None = None
        driver: Any = None
        thread_id: int | None = None
        try:
            async with scope:
                conn = await self.engine.connect()
                driver, thread_id = _driver(conn), conn.info.get(_THREAD_ID)
                # The driver's read timeout (connect_args) is the backstop of a read no deadline
                # bounds; in a bounded block every read is bounded by the block's deadline. Off in
                # there: with it, asyncmy waits for each packet under asyncio.wait_for, a task and a
                # timer a read (issue 12). Back on before the connection goes back to the pool. (So a
                # block's body must never swallow the deadline's cancellation and read on.)
                backstop = driver._read_timeout
                if bounded:
                    driver._read_timeout = None
                try:
                    if write:
                        await conn.begin()
                    if not bounded:
                        await conn.exec_driver_sql(_UNBOUNDED_SESSION_SQL[_server_kind_of(driver.server_version)])
                        driver._read_timeout = None
                    yield conn
                    if write:
                        await conn.commit()
                        conn.info[_COMMITTED] = True
                except Exception as exc:
                    if _lost_connection(exc):  # already invalidated by SQLAlchemy
                        self._reap(thread_id)
                    elif conn.in_transaction():
                        await conn.rollback()
                    if not bounded:
                        await conn.invalidate()  # never pooled with its limits lifted
                    driver._read_timeout = backstop
                    await conn.close()
                    conn = None
                    raise
                if not bounded:
                    await conn.invalidate()  # never pooled with its limits lifted
                driver._read_timeout = backstop
                await conn.close()
                conn = None
        except TimeoutError as exc:
            if scope.expired():
                raise self._deadline_exceeded() from exc
            raise
        finally:
            if conn is not None:  # cancelled, timed out, or the rollback failed
                await self._discard(conn, driver, thread_id)

    async def _discard(self, conn: AsyncConnection, driver: Any, thread_id: int | None) -> None:
        if driver is not None:
            driver.close()  # the transport only: nothing may wait on a hung peer
        self._reap(thread_id)  # before any await: a second cancellation must not skip the kill
        try:
            await asyncio.shield(_invalidate_and_close(conn))
        except Exception as exc:
            _log.warning("database_connection_discard_failed", error=repr(exc))

    def _reap(self, thread_id: int | None) -> None:
        if self._reaper is not None and thread_id is not None:
            self._reaper.kill(thread_id)

    def _deadline_exceeded(self) -> StoreDeadlineExceeded:
        return StoreDeadlineExceeded(f"database call exceeded its {self.timeout_s:g}s deadline")

    # ------------------------------------------------------------------ units

    async def run_write(self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(conn, *args, **kwargs)`` in one write transaction (committed unless it raises).

        On SQLite it runs inline, on the event loop's thread, when that cannot stall the loop, and
        on a worker thread otherwise (see :class:`_InlineUnits`); the outcome is the same."""
        return await self._run_write(fn, args, kwargs, inline=True)

    async def run_driver_write(
        self, fn: Callable[Concatenate[DriverCursor, P], Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """MySQL/MariaDB: ``await fn(cursor, *args, **kwargs)`` in one write transaction, its statements on
        the driver's own cursor (:mod:`roomservice.store.driver`), committed unless it raises.

        The same deadline, errors and discipline as :meth:`run_write` (a lost, cancelled or timed-out
        session discarded and killed), on a session held between driver units (:class:`_HeldSessions`):
        no checkout, begin or check-in through SQLAlchemy's asyncio bridge a unit."""
        if self.is_sqlite:
            raise TypeError("driver units are for MySQL/MariaDB; SQLite units run with run_write")
        with _unavailable_on_failure():
            return await self._driver_unit(fn, args, kwargs)

    async def _driver_unit(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        scope = asyncio.timeout(self.timeout_s)
        held: _HeldSession | None = None
        clean = False  # the session's transaction ended (committed or rolled back): it may serve again
        try:
            async with scope:
                while held is None:
                    held = self._held.take()
                    if held is None:
                        held = await self._held.open()
                    elif not self._held.usable(held):
                        stale, held = held, None
                        await self._held.let_go(stale)
                # a buffered cursor keeps nothing on the server: not closed, so that a unit cancelled
                # mid-statement does no I/O on the way out (the session is discarded)
                cursor = DriverCursor(held.conn, held.driver.cursor())
                try:
                    result = await fn(cursor, *args, **kwargs)
                    if cursor.out_of_step:  # fn went on past a driver error it caught: nothing of it commits
                        raise StoreUnavailable(
                            "a statement of the unit failed out of step with the server; the unit was not committed"
                        )
                    await cursor.end(commit=True)
                except Exception as exc:
                    if _lost_connection(exc):  # invalidated by the cursor; the server may be gone for all
                        self._held.lost()
                    elif not cursor.out_of_step:  # the server answered every statement: in step, roll back
                        try:
                            await cursor.end(commit=False)
                            clean = True
                        except Exception as failed:  # discarded below
                            if _lost_connection(failed):
                                self._held.lost()
                    raise
                clean = True
                return result
        except TimeoutError as exc:
            if scope.expired():
                raise self._deadline_exceeded() from exc
            raise
        finally:
            if held is not None:
                if clean:
                    await self._held.put_back(held)
                else:  # cancelled, timed out, lost, out of step with the server, or its rollback failed
                    await self._discard(held.conn, held.driver, held.thread_id)

    async def run_long_write(
        self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """:meth:`run_write` for a unit that may run long (a retention delete, an admin repair): on
        SQLite always on a worker thread, where the loop runs meanwhile and the deadline interrupts it."""
        return await self._run_write(fn, args, kwargs, inline=False)

    async def run_read(self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(conn, *args, **kwargs)`` on a read connection (inline or on a thread, as :meth:`run_write`)."""
        return await self._run_read(fn, args, kwargs, inline=True)

    async def run_long_read(
        self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """:meth:`run_read` for a unit that may run long (a scan, a count over a big table): on a thread."""
        return await self._run_read(fn, args, kwargs, inline=False)

    async def _run_write(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], *, inline: bool
    ) -> T:
        if self._sync_engine is None:
            async with self.write() as conn:
                return await conn.run_sync(fn, *args, **kwargs)
        inline_units = self._inline if inline else None
        run_inline = inline_units is not None and not inline_units.is_slow(fn, args)
        if run_inline and inline_units is not None and inline_units.loop_starved():
            await asyncio.sleep(0)  # let the loop run between back-to-back inline units
        with _unavailable_on_failure():
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            if not self._write_lock.take_if_free():  # free: taken without arming a timer for the wait
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._write_lock.acquire()
                except TimeoutError as exc:
                    raise self._deadline_exceeded() from exc
            try:
                if run_inline and inline_units is not None:
                    try:
                        result = inline_units.write(fn, args, kwargs)
                    except _RunOnThread:
                        pass
                    else:
                        if self._checkpointing is None:
                            self._checkpoint_if_due(inline_units)
                        elif (
                            inline_units.changes_since_checkpoint
                            >= inline_units.checkpoint_after // _CHECKPOINT_OUTRUN_SHARE
                        ):
                            await self._wait_for_checkpoint_copy(deadline)
                        return result
                took: list[float] = []
                result = await self._write_on_thread(self._sync_engine, fn, args, kwargs, deadline, took)
                if inline_units is not None and not run_inline:
                    inline_units.ran_on_thread(fn, args, took[0])
                return result
            finally:
                self._write_lock.release()

    async def _write_on_thread(
        self,
        engine: Engine,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        deadline: float,
        took: list[float],
    ) -> T:
        running = _RunningUnit()

        def unit() -> T:
            with engine.connect() as conn:
                running.attach(conn)
                try:
                    with conn.begin():  # the driver's BEGIN is off (pysqlite, isolation_level None): ours
                        conn.exec_driver_sql(_SQLITE_BEGIN_WRITE)
                        started = time.perf_counter()
                        result = fn(conn, *args, **kwargs)
                        took.append(time.perf_counter() - started)
                    conn.info[_COMMITTED] = True
                    return result
                finally:
                    running.detach()

        self.unit_counts.on_thread += 1
        return await self._in_thread(unit, running, deadline)

    async def _run_read(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], *, inline: bool
    ) -> T:
        if self._sync_engine is None:
            async with self.read() as conn:
                return await conn.run_sync(fn, *args, **kwargs)
        inline_units = self._inline if inline else None
        run_inline = inline_units is not None and not inline_units.is_slow(fn, args)
        if run_inline and inline_units is not None:
            if inline_units.loop_starved():
                await asyncio.sleep(0)  # let the loop run between back-to-back inline units
            with _unavailable_on_failure():
                try:
                    return inline_units.read(fn, args, kwargs)
                except _RunOnThread:
                    pass
        engine = self._sync_engine
        running = _RunningUnit()
        took: list[float] = []

        def unit() -> T:
            with engine.connect() as conn:
                running.attach(conn)
                try:
                    started = time.perf_counter()
                    result = fn(conn, *args, **kwargs)
                    took.append(time.perf_counter() - started)
                    return result
                finally:
                    running.detach()

        with _unavailable_on_failure():
            self.unit_counts.on_thread += 1
            result = await self._in_thread(unit, running, asyncio.get_running_loop().time() + self.timeout_s)
        if inline_units is not None and not run_inline:
            inline_units.ran_on_thread(fn, args, took[0])
        return result

    def _checkpoint_if_due(self, inline: _InlineUnits) -> None:
        """After an inline commit: if the inline commits since the last checkpoint have filled about
        :data:`_CHECKPOINT_FRAMES` pages of WAL (estimated from the rows they changed), start one on
        a thread, as SQLite's auto-checkpoint runs inside the commit that crosses the threshold (the
        writer that crossed it is answered at once)."""
        if inline.changes_since_checkpoint < inline.checkpoint_after:  # (none is running: the caller checks)
            return
        changes, inline.changes_since_checkpoint = inline.changes_since_checkpoint, 0
        task = asyncio.get_running_loop().create_task(self._checkpoint(inline, changes), name="database-checkpoint")
        task.add_done_callback(self._checkpoint_done)
        self._checkpointing = task

    async def _wait_for_checkpoint_copy(self, deadline: float) -> None:
        """With the write lock held: the WAL has grown by a share of a checkpoint's worth while the running
        checkpoint's first pass copies (writes faster than it copies): this writer holds the lock, and
        every writer behind it waits, until that pass is done (or the unit's deadline), so the WAL
        stays bounded. At moderate rates a checkpoint's copy ends long before that."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await self._checkpoint_copied.wait()

    async def _checkpoint(self, inline: _InlineUnits, changes: int) -> None:
        """Two PASSIVE checkpoints. The first copies the frames there are while this process's
        writers go on (copying ~1,000 pages is milliseconds: with the write lock held, every write
        behind it waited that long, the commit -> delivered tail at 200 events/s). The second, with
        the write lock, copies the few frames written meanwhile: with no write of this process in
        between, every frame is then copied and the next write starts the WAL over instead of
        growing it. Writers that outrun the first pass wait for it (:meth:`_wait_for_checkpoint_copy`)."""
        loop = asyncio.get_running_loop()
        self._checkpoint_copied.clear()
        try:
            frames = await loop.run_in_executor(self._threads, self._checkpoint_on_thread)
        finally:
            self._checkpoint_copied.set()
        await self._write_lock.acquire()
        try:
            await loop.run_in_executor(self._threads, self._checkpoint_on_thread)
        finally:
            self._write_lock.release()
        self.unit_counts.checkpoints += 1
        inline.checkpointed(changes, frames)

    def _checkpoint_done(self, task: asyncio.Task[None]) -> None:
        self._checkpointing = None
        if not task.cancelled() and task.exception() is not None:  # the next commits try again
            _log.warning("database_checkpoint_failed", error=repr(task.exception()))

    def _checkpoint_on_thread(self) -> int:
        """The frames the WAL held (-1: not in WAL mode)."""
        assert self._sync_engine is not None
        with self._sync_engine.connect() as conn:
            _busy, frames, _copied = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()
        return int(frames)

    async def _in_thread(self, unit: Callable[[], T], running: _RunningUnit, deadline: float) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, unit)
        # done when the unit is, or failed with TimeoutError at the deadline (one timer for every unit
        # in flight, futures.Deadlines); cancelled with the caller, it leaves the unit running: a shield
        waiter: asyncio.Future[None] = loop.create_future()
        future.add_done_callback(functools.partial(_wake, waiter))
        self._unit_deadlines.watch(waiter, deadline)
        try:
            await waiter
            return future.result()
        except TimeoutError:
            # Interrupt the running statement (again, in case it ran between two),
            # and wait for the thread: its transaction must end before the write
            # lock is free. A unit that finished after all keeps its result.
            while not future.done():
                running.interrupt()
                await asyncio.wait([future], timeout=_INTERRUPT_EVERY_S)
            try:
                return future.result()
            except (OperationalError, _Abandoned) as exc:
                raise self._deadline_exceeded() from exc
        except asyncio.CancelledError:
            # The thread cannot be cancelled: let its transaction end (commit
            # or roll back) before the caller releases the write lock.
            await asyncio.wait([future])
            raise

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """``INSERT`` that silently skips a row whose primary or unique key already exists, and
        nothing else: any other error (a NULL, a value too long) still raises.

        Its rowcount says nothing on MySQL (a skipped row counts as found). Not the same as
        :func:`insert_or_ignore`, whose ``IGNORE`` also skips or adjusts rows for other errors.
        """
        if self.dialect_name == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        # A self-assignment is MySQL's "do nothing" that, unlike INSERT IGNORE,
        # neither swallows other errors nor raises a warning on every duplicate.
        first_pk = next(iter(table.primary_key.columns))
        return mysql.insert(table).on_duplicate_key_update({first_pk.name: first_pk})

    async def dispose(self) -> None:
        """Close every pooled connection; bounded by the deadline even when the server hangs."""
        if self._reaper is not None:
            await self._reaper.stop()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._held.close()
                await self.engine.dispose()
        except TimeoutError:
            _log.warning("database_dispose_timed_out", timeout_s=self.timeout_s)
        if self._checkpointing is not None:
            self._checkpointing.cancel()
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        if self._inline is not None:
            self._inline.close()
        if self._sync_engine is not None and self._threads is not None:
            threads, sync_engine = self._threads, self._sync_engine
            await asyncio.to_thread(threads.shutdown, wait=True)
            sync_engine.dispose()


# --------------------------------------------------------------------------- MySQL sessions

# MariaDB has a statement deadline for every statement and an idle-in-transaction
# limit; MySQL only a SELECT deadline (milliseconds) and no idle limit (the kill covers it).
_SERVER_MARIADB: Final = "mariadb"
_SERVER_MYSQL: Final = "mysql"
_UNBOUNDED_SESSION_SQL: Final = {
    _SERVER_MARIADB: "SET SESSION max_statement_time = 0, idle_transaction_timeout = 0",
    _SERVER_MYSQL: "SET SESSION max_execution_time = 0",
}


# The server's statement limit is this share of the call deadline: it fires first.
_STATEMENT_SHARE: Final = 0.75


def session_limits_sql(server: str, timeout_s: float) -> str:
    """The ``SET SESSION`` run on every new MySQL/MariaDB connection (see the module docs)."""
    lock_wait_s = max(1, math.ceil(timeout_s))
    statement_s = _STATEMENT_SHARE * timeout_s
    if server == _SERVER_MARIADB:
        idle_s = max(1, math.ceil(2 * timeout_s))
        return (
            f"SET SESSION max_statement_time = {statement_s:.3f}, innodb_lock_wait_timeout = {lock_wait_s}, "
            f"idle_transaction_timeout = {idle_s}"
        )
    statement_ms = max(1, round(statement_s * 1000))
    return f"SET SESSION max_execution_time = {statement_ms}, innodb_lock_wait_timeout = {lock_wait_s}"


def _server_kind_of(server_version: str) -> str:
    return _SERVER_MARIADB if "mariadb" in server_version.lower() else _SERVER_MYSQL


def _driver(conn: AsyncConnection) -> Any:
    """The asyncmy connection under ``conn``."""
    return conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]


def _limit_mysql_sessions(sync_engine: Engine, timeout_s: float) -> None:
    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        driver = getattr(dbapi_connection, "_connection", None)
        record.info[_THREAD_ID] = int(driver.thread_id()) if driver is not None else None
        server = _server_kind_of(str(getattr(driver, "server_version", "")))
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(session_limits_sql(server, timeout_s))
        finally:
            cursor.close()


# MariaDB: "This command is not supported in the prepared statement protocol yet".
_ER_UNSUPPORTED_PS: Final = 1295


def _bulk_or_row_by_row(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    """``executemany`` on MySQL/MariaDB, row by row where the server refuses the bulk protocol.

    With a statement cache, asyncmy sends parameterised statements prepared: no escaping of every
    string on the client (``escape_string`` was ~55 us a KiB; a command log row carries ~1.5 KiB),
    and an ``executemany`` as one COM_STMT_BULK_EXECUTE on MariaDB. The server refuses that for
    some statements (``INSERT ... SELECT``: error 1295, before executing anything), and the driver
    does not fall back by itself; here each row then runs on its own, as the driver's text
    protocol would have run such a statement anyway."""
    dialect = context.dialect
    try:
        dialect.do_executemany(cursor, statement, parameters, context)
    except Exception as exc:
        if getattr(exc, "args", (None,))[:1] != (_ER_UNSUPPORTED_PS,):
            raise
        for row in parameters:
            dialect.do_execute(cursor, statement, row, context)
    return True


async def _invalidate_and_close(conn: AsyncConnection) -> None:
    await conn.invalidate()
    await conn.close()


def _lost_connection(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


@dataclass(slots=True)
class _HeldSession:
    conn: AsyncConnection
    driver: Any  # the asyncmy connection
    thread_id: int | None
    backstop: Any  # the driver's read timeout, put back before the pool has the connection again
    epoch: int
    taken_at: float


class _HeldSessions:
    """MySQL/MariaDB sessions kept checked out between driver units (issue 12).

    Through SQLAlchemy's asyncio connection a unit's checkout, begin, commit and check-in each cross
    its greenlet bridge and the pool's bookkeeping: 600-900 us of CPU a unit, measured against
    ~300 us for a one-statement unit and its COMMIT on the driver alone. Driver units (the outbox
    worker's claim and finish, a command's save, a room's load: :mod:`roomservice.store.writes`) come
    one after another all day, so a few sessions stay checked out
    between them: a unit takes an idle one (no await), runs its statements and its COMMIT or ROLLBACK
    on the driver, and puts it back. Only a session whose transaction ended is put back, and it is
    rolled back only when the server answered each of its statements; anything else (cancelled,
    timed out, lost, a driver error the server did not send, a failed rollback) is discarded as a
    block's connection is.

    At most a quarter of the pool's size is held idle, and no more than four: a small pool keeps
    its connections for blocks (a pool of fewer than four holds none). A held session goes back to
    the pool after ``_HELD_FOR_S`` (where ``pool_recycle`` applies to it; taken again only after that
    time, a session idle meanwhile keeps its pool slot), and every idle one is let go once any
    connection of the engine is lost (the server may have gone away for all of them). The driver's
    read timeout is off while held, as inside any bounded block, and put back on release. Held
    sessions count as checked out in the pool's gauges.
    """

    def __init__(self, engine: AsyncEngine, *, holds: bool) -> None:
        self._engine = engine
        pool = engine.pool
        self._keep = min(_HELD_MAX, pool.size() // 4) if holds and isinstance(pool, QueuePool) else 0
        self._idle: list[_HeldSession] = []
        self._epoch = 0
        self._closed = False
        if self._keep:
            # A disconnect seen on any connection of the engine (SQLAlchemy then has the pool recycle
            # what it hands out next): the held sessions may be gone too.
            event.listen(engine.sync_engine, "handle_error", self._on_error)

    def _on_error(self, context: ExceptionContext) -> None:
        if context.is_disconnect:
            self.lost()

    def take(self) -> _HeldSession | None:
        return self._idle.pop() if self._idle else None

    def usable(self, held: _HeldSession) -> bool:
        return held.epoch == self._epoch and time.monotonic() - held.taken_at < _HELD_FOR_S

    async def open(self) -> _HeldSession:
        conn = await self._engine.connect()
        driver = _driver(conn)
        thread_id = conn.info.get(_THREAD_ID)
        held = _HeldSession(conn, driver, thread_id, driver._read_timeout, self._epoch, time.monotonic())
        driver._read_timeout = None  # every read of a driver unit is bounded by its deadline
        return held

    def lost(self) -> None:
        self._epoch += 1

    async def put_back(self, held: _HeldSession) -> None:
        # ``held`` is kept or on its way out before the first await: a caller cancelled while the
        # stale ones are let go would otherwise leave it to the garbage collector
        leaving = [h for h in self._idle if h.epoch != self._epoch]  # a loss since: the stale ones go
        if leaving:
            self._idle = [h for h in self._idle if h.epoch == self._epoch]
        if not self._closed and len(self._idle) < self._keep and self.usable(held):
            self._idle.append(held)
        else:
            leaving.append(held)
        if leaving:  # each release is started here, shielded: it ends even if this caller is cancelled
            await asyncio.gather(*[self.let_go(h) for h in leaving])

    def let_go(self, held: _HeldSession) -> asyncio.Future[None]:
        """Back to the pool (its transaction ended: no reset round trip); a session of an earlier epoch
        is closed and invalidated instead, without a byte sent, as its server may be gone. Started now
        and shielded (awaiting the result is optional): a caller's deadline or cancellation never leaves
        it half released, nor unreleased."""
        return asyncio.shield(self._release(held))

    async def _release(self, held: _HeldSession) -> None:
        held.driver._read_timeout = held.backstop
        try:
            if held.epoch != self._epoch:
                held.driver.close()  # the transport only
                await held.conn.invalidate()
            else:
                held.conn.info[_COMMITTED] = True
            await held.conn.close()
        except Exception as exc:
            _log.warning("database_held_session_release_failed", error=repr(exc))

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            await self.let_go(self._idle.pop())


class _SessionReaper:
    """Kills the server sessions of connections given up on, so their row locks go now
    rather than when the server notices. Best effort, one connection at a time: each
    attempt is bounded by the deadline, and a session is given up after ``3 D`` (the
    server's own limits have ended it by then)."""

    def __init__(self, engine: AsyncEngine, timeout_s: float) -> None:
        self._engine = engine
        self._timeout_s = timeout_s
        self._pending: dict[int, float] = {}  # thread id -> loop time to give up at
        self._task: asyncio.Task[None] | None = None
        self.killed = 0

    def kill(self, thread_id: int) -> None:
        loop = asyncio.get_running_loop()
        self._pending.setdefault(thread_id, loop.time() + 3 * self._timeout_s)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="database-session-reaper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._pending.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            now = loop.time()
            for thread_id, give_up_at in list(self._pending.items()):
                if give_up_at <= now:
                    del self._pending[thread_id]
            if not self._pending:
                return
            started = loop.time()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._kill_pending()
            except Exception as exc:  # unreachable still: try again shortly
                _log.info("database_session_kill_failed", sessions=len(self._pending), error=repr(exc))
                await asyncio.sleep(max(0.0, min(self._timeout_s, 1.0) - (loop.time() - started)))

    async def _kill_pending(self) -> None:
        import asyncmy
        from asyncmy.errors import OperationalError as DriverOperationalError

        _, params = self._engine.dialect.create_connect_args(self._engine.url)
        params = {**params, "connect_timeout": self._timeout_s, "read_timeout": self._timeout_s}
        conn = await asyncmy.connect(**params)
        try:
            async with conn.cursor() as cursor:
                for thread_id in list(self._pending):
                    try:
                        await cursor.execute(f"KILL CONNECTION {int(thread_id)}")
                        self.killed += 1
                        _log.info("database_session_killed", thread_id=thread_id)
                    except DriverOperationalError as exc:
                        if exc.args and exc.args[0] != _ER_NO_SUCH_THREAD:
                            raise
                    del self._pending[thread_id]
        finally:
            conn.close()


_ER_NO_SUCH_THREAD: Final = 1094


# --------------------------------------------------------------------------- SQLite units


def _time_out(waiter: asyncio.Future[Any]) -> None:
    waiter.set_exception(TimeoutError())


def _wake(waiter: asyncio.Future[None], _done: object) -> None:
    if not waiter.done():  # (failed at its deadline, or cancelled with its caller, already)
        waiter.set_result(None)


class _WriteLock:
    """SQLite's one writer in this process: an :class:`asyncio.Lock` that counts its waiters, so that
    a caller finding it free with nobody queued takes it at once, without the deadline timer a wait
    needs (a timer armed and cancelled per write unit: ~7 us of CPU, issue 12). A lock released to
    a waiter that has not run yet is not free: that waiter is still counted, so nobody jumps it."""

    __slots__ = ("_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._waiting = 0

    def take_if_free(self) -> bool:
        """Take the lock now if it is free and nobody waits for it; False (nothing done) otherwise."""
        if self._waiting or self._lock.locked():
            return False
        # asyncio.Lock.acquire takes a free lock with no waiter without suspending; drive it
        # synchronously, so that nothing can come between the check and the take
        acquiring = self._lock.acquire()
        try:
            acquiring.send(None)
        except StopIteration:
            return True
        raise AssertionError("a free asyncio.Lock with no waiter suspended its acquire")  # pragma: no cover

    async def acquire(self) -> None:
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _Abandoned(Exception):
    """The deadline passed before the unit got its connection: it did nothing."""


class _RunningUnit:
    """The pysqlite connection a run_read/run_write unit is using, so that the event
    loop can interrupt its statement (``sqlite3.Connection.interrupt`` is thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        self._interrupted = False

    def attach(self, conn: Connection) -> None:
        with self._lock:
            if self._interrupted:
                raise _Abandoned("deadline passed before the unit started")
            self._connection = conn.connection.driver_connection

    def detach(self) -> None:
        with self._lock:
            self._connection = None

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            if self._connection is not None:
                self._connection.interrupt()


class _RunOnThread(Exception):
    """An inline unit that did not start, or was stopped past its budget and rolled back: nothing of
    it is left in the database; it runs on a thread instead."""


class _Budget:
    """The progress handler of the inline connection: it stops a statement still running when the
    unit's budget is spent (SQLite then raises "interrupted"), so an inline unit holds up the event
    loop for about the budget at most, however much its SQL has to do."""

    __slots__ = ("overran", "until")

    def __init__(self) -> None:
        self.until = math.inf
        self.overran = False

    def start(self, seconds: float) -> float:
        """Arm for ``seconds`` from now; returns now (``time.monotonic``)."""
        now = time.monotonic()
        self.until = now + seconds
        self.overran = False
        return now

    def stop(self) -> bool:
        """Disarm; True if the unit overran (a statement of it was stopped)."""
        self.until = math.inf
        return self.overran

    def __call__(self) -> int:
        if time.monotonic() > self.until:
            self.overran = True
            return 1
        return 0


class _InlineUnits:
    """SQLite units run on the event loop's thread, without the hop to a worker thread and back
    (~50 us of CPU a unit: executor queue, futex wake, ``call_soon_threadsafe``, self-pipe; issue 12).

    A unit runs inline only when it cannot wait for anything, so that the loop never waits with it:

    * a write holds this process's write lock already, and its ``BEGIN IMMEDIATE`` runs on a
      connection with ``busy_timeout`` 0: SQLite's write lock is taken at once or refused
      (SQLITE_BUSY: another process writes), and then the unit runs on a thread as before, with the
      busy timeout and the deadline. A read opens a read transaction first (``BEGIN`` and a read of
      the schema cookie), which WAL never makes wait; refused (WAL recovery, say), on a thread too.
      Either way the refusal comes before ``fn`` ran.
    * its SQL has a budget (:data:`_INLINE_BUDGET_S`): a statement still running when it is spent
      is stopped, the unit rolled back and run again on a thread, where the deadline bounds it as
      before. A unit that ran inline longer than :data:`_INLINE_SLOW_S` (or overran) is marked slow
      by its ``fn`` and statement: that kind starts on a thread, where its SQL runs beside the loop,
      until a run there takes under half of it. ``run_long_read``/``run_long_write`` start there.
    * back-to-back inline units (a caller awaiting one after another never suspends) yield to the
      loop once they have kept it for :data:`_INLINE_STREAK_S`.
    * the connection has auto-checkpoint off: a checkpoint fsyncs, and SQLite runs it inside the
      commit that crosses the threshold. :meth:`Database._checkpoint` does it on a thread instead,
      once the rows changed by inline commits have filled about :data:`_CHECKPOINT_FRAMES` pages
      (frames per changed row measured at each checkpoint).

    One connection, kept open: inline units never overlap (each runs to its end synchronously).
    An inline unit is not interrupted at the deadline (it waits on nothing; the budget bounds its
    SQL) and cannot be cancelled half-way; errors are the thread path's, mapped the same way.
    """

    def __init__(self, engine: AsyncEngine, units_engine: Engine, counts: UnitCounts) -> None:
        self._budget = _Budget()
        self._engine = _sqlite_inline_engine(engine, self._budget)
        self._units_engine = units_engine
        self._counts = counts
        self._conn: Connection | None = None
        self._running = False
        self._slow: set[tuple[object, object]] = set()
        self._streak_since: float | None = None
        self._streak_loop: asyncio.AbstractEventLoop | None = None
        self.budget_s = _INLINE_BUDGET_S
        self.slow_s = _INLINE_SLOW_S
        self.changes_since_checkpoint = 0  # rows changed by inline commits (WAL pages, roughly)
        self.checkpoint_after = _CHECKPOINT_FIRST_AFTER

    def is_slow(self, fn: object, args: tuple[Any, ...]) -> bool:
        """Whether this kind of unit ran long inline: it starts on a thread."""
        return bool(self._slow) and _unit_key(fn, args) in self._slow

    def ran_on_thread(self, fn: object, args: tuple[Any, ...], seconds: float) -> None:
        """A slow unit took ``seconds`` on a thread: inline again if that was short."""
        if seconds < self.slow_s / 2:
            self._slow.discard(_unit_key(fn, args))

    def _ran_inline(self, fn: object, args: tuple[Any, ...], started: float) -> None:
        self._counts.inline += 1
        if time.monotonic() - started > self.slow_s:
            self._mark_slow(fn, args)

    def _mark_slow(self, fn: object, args: tuple[Any, ...]) -> None:
        self._counts.slow += 1
        if len(self._slow) >= _SLOW_UNITS_KEPT:
            self._slow.clear()
        self._slow.add(_unit_key(fn, args))

    def loop_starved(self) -> bool:
        """True when inline units have kept the loop for the budget without it getting a turn."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if self._streak_since is None or self._streak_loop is not loop:
            self._streak_since, self._streak_loop = now, loop
            loop.call_soon(self._end_streak)  # runs when the loop gets its turn
            return False
        return now - self._streak_since > _INLINE_STREAK_S

    def _end_streak(self) -> None:
        self._streak_since = None

    def write(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """``fn`` in a write transaction, inline; the caller holds the write lock."""
        return self._run(fn, args, kwargs, write=True)

    def read(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """``fn`` in a read transaction (one snapshot for the unit), inline."""
        return self._run(fn, args, kwargs, write=False)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], *, write: bool) -> T:
        conn, driver, transaction = self._begin(write=write)
        budget = self._budget
        changes_before = driver.total_changes
        started = budget.start(self.budget_s)
        try:
            result = fn(conn, *args, **kwargs)
            if budget.stop():  # fn went on past a stopped statement: not committed
                raise _RunOnThread
            if write:
                transaction.commit()
        except BaseException:
            overran = budget.stop()
            self._end_transaction(conn, driver)
            if overran:  # whatever the stopped statement raised: rolled back, to run on a thread
                self._overran(fn, args)
                raise _RunOnThread from None
            self._ran_inline(fn, args, started)
            raise
        finally:
            self._running = False
        if not write:
            self._end_transaction(conn, driver)
        self._ran_inline(fn, args, started)
        if write:
            self.changes_since_checkpoint += driver.total_changes - changes_before
        return result

    def _begin(self, *, write: bool) -> tuple[Connection, sqlite3.Connection, RootTransaction]:
        """The connection in a transaction (SQLAlchemy's, then the driver's own BEGIN, as on a thread),
        or :class:`_RunOnThread` if SQLite refused it (never waiting: ``busy_timeout`` 0)."""
        if self._running:  # (a second event loop on another thread: never in one loop)
            self._counts.fallbacks += 1
            raise _RunOnThread
        conn: Connection | None = None
        driver: sqlite3.Connection | None = None
        try:
            conn = self._conn
            if conn is None or conn.invalidated:
                conn = self._connect()
            driver = conn.connection.driver_connection
            assert driver is not None
            transaction = conn.begin()  # bookkeeping only: the driver's BEGIN is off, ours follows
            if not write:
                driver.execute("BEGIN")
                driver.execute(_SQLITE_READ_PROBE)
            elif self._units_engine._has_events:  # listeners see the statements of a thread's unit
                conn.exec_driver_sql(_SQLITE_BEGIN_WRITE)
            else:
                driver.execute(_SQLITE_BEGIN_WRITE)
        except (sqlite3.Error, DBAPIError) as exc:
            # refused, or the connection is broken: the thread path runs it (and raises what it raises)
            self._counts.fallbacks += 1
            if driver is not None:
                self._end_transaction(conn, driver)
            _log.debug("database_inline_refused", error=repr(exc))
            raise _RunOnThread from None
        self._running = True
        return conn, driver, transaction

    def _connect(self) -> Connection:
        """A connection of the inline engine's, seen as one of the threaded units' engine: the same
        dialect and the same connection events (a listener on that engine sees every unit), but
        never revalidated from that engine's pool: replaced here when invalidated instead."""
        self._discard()
        raw = self._engine.raw_connection()
        dialect = self._units_engine.dialect
        conn = self._conn = Connection(self._units_engine, connection=raw, _allow_revalidate=False)
        if getattr(dialect, "default_schema_name", None) is None:  # its engine has not connected yet
            dialect.initialize(conn)
        return conn

    def _end_transaction(self, conn: Connection | None, driver: sqlite3.Connection) -> None:
        """Roll back what is left open: SQLAlchemy's transaction, then the driver's."""
        try:
            if conn is None or conn.invalidated:  # (its driver connection is closed)
                self._discard()
                return
            left = conn.get_transaction()  # (still there, inactive, after a failed commit)
            if left is not None:
                left.rollback()
            if driver.in_transaction:  # (a failed COMMIT leaves SQLite's transaction open)
                driver.rollback()
        except Exception as exc:  # a connection that cannot roll back is not used again
            _log.warning("database_inline_rollback_failed", error=repr(exc))
            self._discard()

    def _overran(self, fn: object, args: tuple[Any, ...]) -> None:
        self._counts.overruns += 1
        self._mark_slow(fn, args)
        _log.info("database_inline_unit_overran", unit=getattr(fn, "__qualname__", repr(fn)), budget_s=self.budget_s)

    def checkpointed(self, changes: int, frames: int) -> None:
        """A checkpoint found ``frames`` in the WAL after inline commits changed ``changes`` rows:
        checkpoint again after as many changed rows as fill :data:`_CHECKPOINT_FRAMES`."""
        if changes > 0 and frames > 0:
            self.checkpoint_after = max(1, min(_CHECKPOINT_MAX_AFTER, round(_CHECKPOINT_FRAMES * changes / frames)))

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()
                conn.close()
            except Exception as exc:
                _log.warning("database_inline_close_failed", error=repr(exc))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._engine.dispose()


def _unit_key(fn: object, args: tuple[Any, ...]) -> tuple[object, object]:
    """What tells one kind of unit from another: its function, and its first argument if that is a
    statement (the generic functions, ``_execute(conn, statement, params)`` say, take it first). The
    unit of :func:`roomservice.store.writes.on_connection` is its first argument, a function, told apart
    the same way by the arguments after it (a room's load and a command's look-up: one function, two
    statements)."""
    if args and isinstance(args[0], FunctionType):  # (only a statement construct counts inside: not a key's value)
        inner = args[1] if len(args) > 1 else None
        return (args[0], inner if isinstance(inner, ClauseElement) else None)
    first = args[0] if args else None
    return (fn, first if isinstance(first, (ClauseElement, str)) else None)


def _sqlite_busy_ms(timeout_s: float) -> int:
    return max(1, round(timeout_s * 1000))


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:")


def _rendered(conn: Connection, statement: Any, column_keys: tuple[str, ...] | None) -> Rendered:
    """``statement``'s SQL for ``conn``'s dialect and its parameters in their positions."""
    return rendered(conn.dialect, statement, column_keys)


def execute_rendered(conn: Connection, statement: Any, params: dict[str, Any]) -> Any:
    """``conn.execute(statement, params)`` for a statement built once (a module constant) and run
    per command: rendered once per dialect and executed as driver SQL, it skips SQLAlchemy's
    cache lookup and parameter processing (a third of the store's CPU per mutation, measured
    with py-spy), while still going through the connection's events and error handling. Only
    for statements whose parameters need no type processing, with every parameter given."""
    sql, positional = _rendered(conn, statement, None)
    return conn.exec_driver_sql(sql, positional(params))


def insert_rendered(conn: Connection, insert: Insert, rows: list[dict[str, Any]]) -> Any:
    """``conn.execute(insert, rows)`` (one executemany) the way :func:`execute_rendered` runs a
    statement: rendered once per dialect and set of columns (the first row's keys; every row has
    the same), without SQLAlchemy's parameter processing of each row (half the store's own CPU in
    a shared transaction, py-spy). The same conditions: no type processing, every value given."""
    sql, positional = _rendered(conn, insert, tuple(rows[0]))
    if len(rows) == 1:  # one row: a plain execute, not the driver's executemany of one
        return conn.exec_driver_sql(sql, positional(rows[0]))
    return conn.exec_driver_sql(sql, [positional(row) for row in rows])


def insert_or_ignore(table: Table) -> Insert:
    """``INSERT`` that skips a duplicate key and says so: rowcount 1 when inserted, 0 when
    ignored (``INSERT OR IGNORE`` / ``INSERT IGNORE``). Unlike
    :meth:`Database.insert_ignoring_duplicates` it can be built without a database, and
    its rowcount can be trusted on MySQL too; but ``IGNORE`` is not only about duplicates
    (SQLite skips a NOT NULL or CHECK violation too, MySQL downgrades other errors to
    warnings), so it is for rows whose values the caller has checked."""
    return table.insert().prefix_with("OR IGNORE", dialect="sqlite").prefix_with("IGNORE", dialect="mysql")


@contextmanager
def _unavailable_on_failure() -> Iterator[None]:
    """Turn "the database did not answer" into :class:`StoreUnavailable`; other errors pass."""
    try:
        yield
    except (OperationalError, InterfaceError, PoolTimeoutError) as exc:
        raise StoreUnavailable(f"database unavailable: {exc.__class__.__name__}") from exc


def _ensure_sqlite_parent_dir(url: URL) -> None:
    database = url.database
    if _is_sqlite_memory(url) or database is None or database.startswith("file:"):
        return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def _sqlite_sync_engine(engine: AsyncEngine, *, busy_timeout_ms: int) -> Engine:
    """A pysqlite engine on the same file, for the single-hop run_read/run_write units."""
    sync_engine = create_engine(
        engine.url.set(drivername="sqlite+pysqlite"),
        poolclass=QueuePool,
        pool_size=_SQLITE_THREADS,
        max_overflow=0,
        connect_args={"check_same_thread": False},  # pooled across the worker threads
        echo=engine.echo,
        pool_reset_on_return=None,
    )
    # Pool events only, no connection event ("begin"): an engine with a connection event joins its
    # dispatch into every Connection, and each event point of a unit (checkout, begin, every
    # statement, commit) then builds listener objects: ~35 us of CPU a trivial write unit, ~50 a
    # read, measured against ~60 / ~30 for the whole unit without (issue 12). The units issue
    # their BEGIN themselves instead (run_write; a read runs in the driver's autocommit).
    _configure_sqlite_connections(sync_engine, busy_timeout_ms=busy_timeout_ms)
    _reset_unless_committed(sync_engine)
    return sync_engine


def _sqlite_inline_engine(engine: AsyncEngine, budget: _Budget) -> Engine:
    """A pysqlite engine on the same file for the inline units (:class:`_InlineUnits`): its
    connections never wait (``busy_timeout`` 0, from the connect on), never checkpoint by
    themselves, and stop a statement past the unit's budget. No pool: the one connection is kept
    open by :class:`_InlineUnits` (a pool's checkout could wait, on the loop's thread)."""
    sync_engine = create_engine(
        engine.url.set(drivername="sqlite+pysqlite"),
        poolclass=NullPool,
        connect_args={"check_same_thread": False, "timeout": 0},  # closed from dispose's thread
        echo=engine.echo,
        pool_reset_on_return=None,
    )
    _configure_sqlite_connections(sync_engine, busy_timeout_ms=0)

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.execute("PRAGMA wal_autocheckpoint=0")
        dbapi_connection.set_progress_handler(budget, _INLINE_PROGRESS_STEPS)

    return sync_engine


def _reset_unless_committed(sync_engine: Engine) -> None:
    """Roll a connection back on its return to the pool unless its transaction just committed.

    SQLAlchemy's own reset-on-return rolls back even after a COMMIT: one more
    round trip on every write. Engines built by :meth:`Database.from_url` turn
    that off (``pool_reset_on_return=None``) and rely on this hook instead,
    SQLAlchemy's documented "reset" event recipe plus the committed mark.
    """

    @event.listens_for(sync_engine, "reset")
    def _on_reset(dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry, state: PoolResetState) -> None:
        committed = record.info.pop(_COMMITTED, False)
        if committed or state.transaction_was_reset or state.terminate_only:
            return
        dbapi_connection.rollback()


def _take_over_sqlite_transactions(sync_engine: Engine, *, busy_timeout_ms: int) -> None:
    _configure_sqlite_connections(sync_engine, busy_timeout_ms=busy_timeout_ms)

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        begin = conn.get_execution_options().get(_BEGIN_OPTION, "BEGIN")
        if begin is not None:
            conn.exec_driver_sql(begin)


def _configure_sqlite_connections(sync_engine: Engine, *, busy_timeout_ms: int) -> None:
    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        # Stop the sqlite3 driver from emitting BEGIN itself (its "legacy
        # transaction control"); the async engine's "begin" hook, or run_write itself, does it instead.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            for pragma in (*_SQLITE_PRAGMAS, f"PRAGMA busy_timeout={int(busy_timeout_ms)}"):
                cursor.execute(pragma)
        finally:
            cursor.close()
