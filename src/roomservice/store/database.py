"""The database handle: async access to SQLite or MySQL/MariaDB, with every dialect quirk here.

Two ways in, same transaction discipline on both backends:

* ``async with db.write() as conn`` / ``async with db.read() as conn`` yield an
  :class:`AsyncConnection` (a write transaction, or a connection for reads).
* ``await db.run_write(fn, ...)`` / ``await db.run_read(fn, ...)`` run a plain
  synchronous ``fn(conn, ...)`` as one unit. On MySQL this is
  ``AsyncConnection.run_sync``; on SQLite the whole unit runs in a single hop
  to a worker thread on a pysqlite connection, instead of one aiosqlite thread
  hop per cursor call (about four per statement) — the hot paths use it.

What differs per backend is decided once, here:

* SQLite (``sqlite+aiosqlite:///path``): WAL, ``synchronous=NORMAL``,
  ``busy_timeout=5000``, ``foreign_keys=ON``. The sqlite3 driver's own
  transaction handling is switched off (SQLAlchemy's documented recipe: no
  isolation level on connect, our own BEGIN in a "begin" hook) so a write
  transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock up front
  instead of failing with SQLITE_BUSY when a read turns into a write. Reads run
  without an explicit transaction (each statement is atomic) and are never
  blocked by the writer under WAL. SQLite has one writer, so write
  transactions of this process queue on an ``asyncio.Lock`` rather than spin
  on the busy timeout; other processes are covered by ``busy_timeout``.
* MySQL/MariaDB (``mysql+asyncmy://`` or ``mariadb+asyncmy://``, both run as
  the "mysql" dialect): READ COMMITTED, utf8mb4, a bounded pool with pre-ping
  and hourly recycling.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Concatenate, Final, Literal, ParamSpec, TypeVar

from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolResetState, QueuePool
from sqlalchemy.sql.dml import Insert

from roomservice.store.port import StoreUnavailable

DialectName = Literal["sqlite", "mysql"]
P = ParamSpec("P")
T = TypeVar("T")

# Execution option read by the SQLite "begin" hook: the statement that opens a transaction.
_BEGIN_OPTION: Final = "roomservice_sqlite_begin"
_BEGIN_WRITE: Final = {_BEGIN_OPTION: "BEGIN IMMEDIATE"}
_BEGIN_NOTHING: Final = {_BEGIN_OPTION: None}

_SQLITE_PRAGMAS: Final = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=5000",
    "PRAGMA foreign_keys=ON",
)
# Marks a pooled connection whose last transaction committed: it goes back to
# the pool without the customary (and here pointless) ROLLBACK round trip.
_COMMITTED: Final = "roomservice_committed"
# Threads (and pysqlite connections) for run_read/run_write on SQLite: one
# writer at a time anyway, a few concurrent readers.
_SQLITE_THREADS: Final = 4


class Database:
    """An :class:`AsyncEngine` plus the transaction discipline of its dialect."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        name = engine.dialect.name
        if name == "sqlite":
            self.dialect_name: DialectName = "sqlite"
        elif name in ("mysql", "mariadb"):
            self.dialect_name = "mysql"
        else:
            raise ValueError(f"unsupported database dialect {name!r}")
        self._write_lock = asyncio.Lock()
        _reset_unless_committed(engine.sync_engine)
        self._sync_engine: Engine | None = None
        self._threads: ThreadPoolExecutor | None = None
        if self.dialect_name == "sqlite":
            _take_over_sqlite_transactions(engine.sync_engine)
            self._write_engine = engine.execution_options(**_BEGIN_WRITE)
            self._read_engine = engine.execution_options(**_BEGIN_NOTHING)
            # A private :memory: database exists in one connection only; it
            # cannot be shared with a second engine, so it keeps the async path.
            if not _is_sqlite_memory(engine.url):
                self._sync_engine = _sqlite_sync_engine(engine)
                self._sync_write_engine = self._sync_engine.execution_options(**_BEGIN_WRITE)
                self._sync_read_engine = self._sync_engine.execution_options(**_BEGIN_NOTHING)
                self._threads = ThreadPoolExecutor(_SQLITE_THREADS, thread_name_prefix="roomservice-sqlite")
        else:
            self._write_engine = self._read_engine = engine

    @classmethod
    def from_url(
        cls,
        url: str | URL,
        *,
        pool_size: int = 20,
        max_overflow: int = 20,
        echo: bool = False,
    ) -> Database:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
        # The "reset" hook installed in __init__ does the return-to-pool reset.
        options: dict[str, Any] = {"echo": echo, "pool_reset_on_return": None}
        if backend == "sqlite":
            _ensure_sqlite_parent_dir(parsed)
            if not _is_sqlite_memory(parsed):
                options.update(pool_size=pool_size, max_overflow=max_overflow)
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
                # No pre-ping: it costs a round trip on every checkout. A dead
                # connection fails its statement, SQLAlchemy drops the pool, and
                # the command answers 503 (StoreUnavailable), safe to retry.
                pool_recycle=300,
            )
        else:
            raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}")
        return cls(create_async_engine(parsed, **options))

    @property
    def is_sqlite(self) -> bool:
        return self.dialect_name == "sqlite"

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction: committed when the block exits, rolled back if it raises."""
        with _unavailable_on_failure():
            if self.dialect_name == "sqlite":
                async with self._write_lock, self._write_transaction() as conn:
                    yield conn
            else:
                async with self._write_transaction() as conn:
                    yield conn

    @asynccontextmanager
    async def _write_transaction(self) -> AsyncIterator[AsyncConnection]:
        async with self._write_engine.connect() as conn:
            async with conn.begin():
                yield conn
            conn.info[_COMMITTED] = True

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads. Each statement sees committed data; write nothing through it."""
        with _unavailable_on_failure():
            async with self._read_engine.connect() as conn:
                yield conn

    async def run_write(self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(conn, *args, **kwargs)`` in one write transaction (committed unless it raises)."""
        if self._sync_engine is None:
            async with self.write() as conn:
                return await conn.run_sync(fn, *args, **kwargs)
        engine = self._sync_write_engine

        def unit() -> T:
            with engine.connect() as conn:
                with conn.begin():
                    result = fn(conn, *args, **kwargs)
                conn.info[_COMMITTED] = True
                return result

        with _unavailable_on_failure():
            async with self._write_lock:
                return await self._in_thread(unit)

    async def run_read(self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(conn, *args, **kwargs)`` on a read connection."""
        if self._sync_engine is None:
            async with self.read() as conn:
                return await conn.run_sync(fn, *args, **kwargs)
        engine = self._sync_read_engine

        def unit() -> T:
            with engine.connect() as conn:
                return fn(conn, *args, **kwargs)

        with _unavailable_on_failure():
            return await self._in_thread(unit)

    async def _in_thread(self, unit: Callable[[], T]) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._threads, unit)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread cannot be interrupted: let its transaction end (commit
            # or roll back) before the caller releases the write lock.
            await asyncio.wait([future])
            raise

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """``INSERT`` that silently skips a row whose primary or unique key already exists.

        Its rowcount says nothing on MySQL (a skipped row counts as found).
        """
        if self.dialect_name == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        # A self-assignment is MySQL's "do nothing" that, unlike INSERT IGNORE,
        # neither swallows other errors nor raises a warning on every duplicate.
        first_pk = next(iter(table.primary_key.columns))
        return mysql.insert(table).on_duplicate_key_update({first_pk.name: first_pk})

    async def dispose(self) -> None:
        await self.engine.dispose()
        if self._sync_engine is not None and self._threads is not None:
            threads, sync_engine = self._threads, self._sync_engine
            await asyncio.to_thread(threads.shutdown, wait=True)
            sync_engine.dispose()


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:")


def insert_or_ignore(table: Table) -> Insert:
    """``INSERT`` that skips a duplicate key and says so: rowcount 1 when inserted, 0 when
    ignored (``INSERT OR IGNORE`` / ``INSERT IGNORE``). Unlike
    :meth:`Database.insert_ignoring_duplicates` it can be built without a database, and
    its rowcount can be trusted on MySQL too."""
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


def _sqlite_sync_engine(engine: AsyncEngine) -> Engine:
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
    _take_over_sqlite_transactions(sync_engine)
    _reset_unless_committed(sync_engine)
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


def _take_over_sqlite_transactions(sync_engine: Engine) -> None:
    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        # Stop the sqlite3 driver from emitting BEGIN itself (its "legacy
        # transaction control"); the "begin" hook below does it instead.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            for pragma in _SQLITE_PRAGMAS:
                cursor.execute(pragma)
        finally:
            cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        begin = conn.get_execution_options().get(_BEGIN_OPTION, "BEGIN")
        if begin is not None:
            conn.exec_driver_sql(begin)
