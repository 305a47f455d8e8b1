"""Statements run on the driver's own cursor, for the hottest write units (issue 12).

The outbox worker's claim and finish, the store's save of a command's rows (with a gift's embedded
debit), a room's load, a command's look-up, the lease epoch and the debit journal run a few small
statements a unit on the event loop its commands share; SQLAlchemy's execution of a statement
(execution context, parameter and result processing) costs more CPU than the driver's own work:

* MySQL/MariaDB: :meth:`Database.run_driver_write` runs an ``async`` unit ``fn(cursor, ...)``
  (:class:`DriverCursor`) with the discipline of :meth:`Database.run_write` (deadline, commit,
  rollback, a lost or abandoned session invalidated and killed), its statements on the asyncmy
  cursor: no greenlet switch, execution context or result processing per statement (measured:
  ``SELECT %s`` 108-138 against 67 us of CPU). Its session is held between driver units, and its
  COMMIT or ROLLBACK sent on the driver too (``DriverCursor.end``): no checkout, begin or check-in
  through SQLAlchemy's asyncio connection a unit (measured: a one-statement unit 870-1,200 against
  300-320 us of CPU).
* SQLite: a unit of :meth:`Database.run_write` (inline on the loop's thread, or on a thread, as
  every unit) takes a :class:`SqliteCursor` of its connection: the sqlite3 cursor of the same
  transaction (measured on the worker's one-row claim, the whole unit: 296-346 us of CPU through
  SQLAlchemy, 171-197 on the driver's cursor).

Statements are still SQLAlchemy constructs, compiled once per dialect: by :class:`DriverSql` (the
values bound in the construct itself taken from that compilation, one expanding ``IN`` parameter
spliced in per call), or by :func:`rendered` (a statement run per command: its parameters put in
place by an ``itemgetter``; an INSERT's for the columns its rows give). Only for statements whose
parameters and columns need no type processing (integers, strings, bytes); rows come back as the
driver's tuples.

SQLAlchemy's ``before_cursor_execute`` and ``after_cursor_execute`` events are still announced for
each statement, and its ``commit`` and ``rollback`` events for a unit's end (when something listens).
A driver error leaves as SQLAlchemy's own execution would raise it: the
:class:`~sqlalchemy.exc.DBAPIError` subclass of its kind, ``connection_invalidated`` (and the
connection invalidated, never pooled again) when the dialect calls it a disconnect.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection

_EXPANDING = "__[POSTCOMPILE_{}]"
_PLACEHOLDERS = {"format": "%s", "qmark": "?"}
T = TypeVar("T")


class DriverSql:
    """A statement compiled once for a dialect whose paramstyle is positional (``%s`` or ``?``)."""

    __slots__ = ("_defaults", "_expanding", "_names", "_parts", "_placeholder")

    def __init__(self, dialect: Dialect, statement: Any) -> None:
        placeholder = _PLACEHOLDERS.get(dialect.paramstyle)
        if placeholder is None:
            raise ValueError(f"driver statements need a positional paramstyle, not {dialect.paramstyle!r}")
        self._placeholder = placeholder
        compiled = statement.compile(dialect=dialect)
        names = tuple(compiled.positiontup or ())
        expanding = [name for name in names if _EXPANDING.format(name) in compiled.string]
        if len(expanding) > 1:
            raise ValueError("at most one expanding parameter")
        self._expanding = expanding[0] if expanding else None
        self._parts = (
            tuple(compiled.string.split(_EXPANDING.format(self._expanding)))
            if self._expanding
            else (compiled.string,)
        )
        self._names = names
        # values bound in the construct itself (a status literal, "+ 1", a None): given once, here
        self._defaults = {name: compiled.params[name] for name in names if not compiled.binds[name].required}

    @property
    def expands(self) -> bool:
        """Whether the SQL text depends on the parameters (an expanding ``IN``)."""
        return self._expanding is not None

    def render(self, params: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The SQL text and its positional arguments for ``params``."""
        defaults = self._defaults
        if self._expanding is None:
            return self._parts[0], tuple(params[n] if n in params else defaults[n] for n in self._names)
        values = params[self._expanding]
        if not values:
            raise ValueError(f"{self._expanding}: an empty IN list")
        args: list[Any] = []
        for name in self._names:
            if name == self._expanding:
                args.extend(values)
            else:
                args.append(params[name] if name in params else defaults[name])
        return ", ".join([self._placeholder] * len(values)).join(self._parts), tuple(args)


# Statements compiled for the driver, by dialect and statement (the callers' are module constants).
# Each entry keeps its statement: an id in a key is never reused for another statement while cached.
_COMPILED: dict[tuple[str, str, int], tuple[Any, DriverSql]] = {}


def driver_sql(dialect: Dialect, statement: Any) -> DriverSql:
    """``statement`` compiled once for ``dialect`` (by its name and paramstyle)."""
    key = (dialect.name, dialect.paramstyle, id(statement))
    cached = _COMPILED.get(key)
    if cached is None:
        cached = _COMPILED[key] = (statement, DriverSql(dialect, statement))
    return cached[1]


# Statements run per command, rendered once per dialect and set of insert columns (see
# roomservice.store.database.execute_rendered): the SQL, and what takes a parameter dict to the positional
# tuple (itemgetter: no generator step per value). Each entry keeps its statement, as _COMPILED does.
Rendered = tuple[str, Callable[[dict[str, Any]], tuple[Any, ...]]]
_RENDERED: dict[tuple[str, str, int, tuple[str, ...] | None], tuple[Any, Rendered]] = {}


def rendered(dialect: Dialect, statement: Any, column_keys: tuple[str, ...] | None) -> Rendered:
    """``statement``'s SQL for ``dialect`` (an INSERT's for ``column_keys``) and its parameters in their
    positions. Only for statements whose parameters need no type processing, with every parameter given."""
    key = (dialect.name, dialect.paramstyle, id(statement), column_keys)
    cached = _RENDERED.get(key)
    if cached is None:
        keys = None if column_keys is None else list(column_keys)
        compiled = statement.compile(dialect=dialect, column_keys=keys)
        cached = _RENDERED[key] = (statement, (compiled.string, _positional(tuple(compiled.positiontup or ()))))
    return cached[1]


def _positional(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """``lambda params: tuple(params[n] for n in names)``, in C where it can be."""
    if len(names) > 1:
        return operator.itemgetter(*names)  # a tuple for two names or more
    if names:
        (name,) = names
        return lambda params: (params[name],)
    return lambda params: ()


class _Statements:
    """What both cursors share: a statement rendered for the driver and announced to SQLAlchemy's
    listeners, and a driver error translated as SQLAlchemy would raise it."""

    __slots__ = ("_cursor", "_dialect", "_sync")

    def __init__(self, sync: Connection, cursor: Any) -> None:
        self._sync = sync
        self._dialect = sync.dialect
        self._cursor = cursor

    @property
    def dialect(self) -> Dialect:
        return self._dialect

    def _prepared(self, statement: Any, params: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        text, args = driver_sql(self._dialect, statement).render(params)
        self._announce(text, args, False)
        return text, args

    def _prepared_many(self, statement: Any, params: Sequence[dict[str, Any]]) -> tuple[str, list[tuple[Any, ...]]]:
        sql = driver_sql(self._dialect, statement)
        if sql.expands:
            raise ValueError("executemany needs one SQL text: no expanding parameter")
        text = sql.render(params[0])[0]
        many = [sql.render(p)[1] for p in params]
        self._announce(text, many, True)
        return text, many

    def _rendered(self, statement: Any, params: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """``statement`` (no expanding ``IN``) as :func:`rendered` has it, for ``params``."""
        text, positional = rendered(self._dialect, statement, None)
        args = positional(params)
        self._announce(text, args, False)
        return text, args

    def _rendered_rows(self, insert: Any, rows: Sequence[dict[str, Any]]) -> tuple[str, Any, bool]:
        """The INSERT of ``rows`` (each with the first one's keys): its text, its arguments, and whether
        they are several rows' (one bulk call of the driver) or one row's."""
        text, positional = rendered(self._dialect, insert, tuple(rows[0]))
        many = len(rows) > 1
        args = [positional(row) for row in rows] if many else positional(rows[0])
        self._announce(text, args, many)
        return text, args, many

    def _announce(self, text: str, args: Any, many: bool) -> None:
        """SQLAlchemy's ``before_cursor_execute`` event, for whoever listens (instrumentation, tests)."""
        sync = self._sync
        if sync.dispatch.before_cursor_execute:
            sync.dispatch.before_cursor_execute(sync, self._cursor, text, args, None, many)

    def _announce_done(self, text: str, args: Any, many: bool | None) -> None:
        """SQLAlchemy's ``after_cursor_execute`` event once a statement ran (``many`` None: a COMMIT or
        ROLLBACK, which SQLAlchemy announces as ``commit`` and ``rollback`` instead)."""
        sync = self._sync
        if many is not None and sync.dispatch.after_cursor_execute:
            sync.dispatch.after_cursor_execute(sync, self._cursor, text, args, None, many)

    def _translated(self, exc: Exception, text: str, args: Any) -> tuple[StatementError | None, bool]:
        """``exc`` as SQLAlchemy would raise it (None when it is not the driver's), and whether the
        connection is lost (the caller invalidates it)."""
        dialect = self._dialect
        dbapi = dialect.loaded_dbapi
        if not isinstance(exc, dbapi.Error):
            return None, False
        lost = bool(dialect.is_disconnect(exc, None, None))
        error = DBAPIError.instance(text, args, exc, dbapi.Error, connection_invalidated=lost, dialect=dialect)
        return error, lost


class DriverCursor(_Statements):
    """The asyncmy cursor of one MySQL/MariaDB unit, statements by their SQLAlchemy construct."""

    __slots__ = ("_conn", "out_of_step")

    def __init__(self, conn: AsyncConnection, cursor: Any) -> None:
        super().__init__(conn.sync_connection, cursor)  # type: ignore[arg-type]
        self._conn = conn
        self.out_of_step = False
        """A statement failed other than by the server's answer (a client-side error of the driver,
        say a packet out of sequence): what the connection would read next is unknown. Its unit's
        runner discards the session instead of rolling it back and using it again."""

    async def execute(self, statement: Any, params: dict[str, Any]) -> int:
        """Run ``statement``; the rows it matched (``CLIENT_FOUND_ROWS``) or returned."""
        text, args = self._prepared(statement, params)
        return int(await self._call(text, args, False, lambda: self._cursor.execute(text, args)))

    async def rows(self, statement: Any, params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        """Run the query ``statement``; its rows as the driver's tuples."""
        text, args = self._prepared(statement, params)

        async def query() -> Sequence[tuple[Any, ...]]:
            await self._cursor.execute(text, args)
            rows: Sequence[tuple[Any, ...]] = await self._cursor.fetchall()
            return rows

        return await self._call(text, args, False, query)

    async def executemany(self, statement: Any, params: Sequence[dict[str, Any]]) -> int:
        """Run ``statement`` once per parameter set (one bulk call where the driver can); the rows matched."""
        text, many = self._prepared_many(statement, params)
        await self._call(text, many, True, lambda: self._cursor.executemany(text, many))
        return int(self._cursor.rowcount)

    async def execute_rendered(self, statement: Any, params: dict[str, Any]) -> int:
        """:func:`~roomservice.store.database.execute_rendered` on the driver: the rows ``statement``
        matched."""
        text, args = self._rendered(statement, params)
        return int(await self._call(text, args, False, lambda: self._cursor.execute(text, args)))

    async def insert_rows(self, insert: Any, rows: Sequence[dict[str, Any]]) -> None:
        """:func:`~roomservice.store.database.insert_rendered` on the driver: ``rows`` inserted by one
        statement, or by one bulk call of the driver for several."""
        text, args, many = self._rendered_rows(insert, rows)
        cursor = self._cursor
        await self._call(text, args, many, (lambda: cursor.executemany(text, args)) if many else
                         (lambda: cursor.execute(text, args)))

    async def end(self, *, commit: bool) -> None:
        """COMMIT (or ROLLBACK) the unit's transaction on the driver: for the unit's runner, never the unit."""
        driver = self._cursor.connection
        sync = self._sync
        if commit:
            if sync.dispatch.commit:  # SQLAlchemy's event, for whoever listens, as its own commit announces it
                sync.dispatch.commit(sync)
            await self._call("COMMIT", (), None, driver.commit)
        else:
            if sync.dispatch.rollback:
                sync.dispatch.rollback(sync)
            await self._call("ROLLBACK", (), None, driver.rollback)

    async def _call(self, text: str, args: Any, many: bool | None, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``, announced done (:meth:`_announce_done`); a driver error raised as SQLAlchemy
        would raise it, a lost connection invalidated first."""
        try:
            result = await call()
        except Exception as exc:
            seen = exc
            if isinstance(exc, AttributeError):  # asyncmy's way of saying its transport is gone
                dbapi = self._dialect.loaded_dbapi
                seen = dbapi.InternalError("network operation failed due to asyncmy attribute error")
            translated, lost = self._translated(seen, text, args)
            self.out_of_step = self.out_of_step or not _answered_by_the_server(seen)
            if translated is None:
                raise
            if lost:
                self._retire_older_connections(seen)
                await self._conn.invalidate(seen)
            raise translated from exc
        self._announce_done(text, args, many)
        return result

    def _retire_older_connections(self, exc: BaseException) -> None:
        """What SQLAlchemy's execution does when it sees a connection lost (before invalidating it): the
        pool replaces every connection made before this one at its next checkout, as the server may have
        gone away for all of them (a restart, a failover). Without it each stale pooled connection failed
        one more unit."""
        fairy = self._sync._dbapi_connection  # its record's start time: a loss of an older one retires nothing new
        if fairy is not None:
            self._sync.engine.pool._invalidate(fairy, exc, _checkin=False)


def _answered_by_the_server(exc: BaseException) -> bool:
    """Whether ``exc`` is an error packet the server sent: a MySQL/MariaDB server error code (1000-1999,
    3000 and up); 2000-2999 are the client library's own, and an error without a code is the driver's."""
    args = getattr(exc, "args", ())
    code = args[0] if args else None
    return isinstance(code, int) and (1000 <= code < 2000 or code >= 3000)


class SqliteCursor(_Statements):
    """The driver cursor of a SQLite unit's connection (in its transaction), statements by their
    SQLAlchemy construct."""

    __slots__ = ()

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, conn.connection.dbapi_connection.cursor())  # type: ignore[union-attr]

    # Results are read from the cursor itself, not from what execute() returns: sqlite3 returns the
    # cursor, SQLAlchemy's aiosqlite adapter (a ':memory:' database's units) does not.

    def execute(self, statement: Any, params: dict[str, Any]) -> int:
        """Run ``statement``; the rows it changed."""
        text, args = self._prepared(statement, params)
        cursor = self._cursor
        self._call(text, args, False, lambda: cursor.execute(text, args))
        return int(cursor.rowcount)

    def rows(self, statement: Any, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run ``statement`` (a query, or a write with ``RETURNING``); its rows as the driver's tuples."""
        text, args = self._prepared(statement, params)
        cursor = self._cursor

        def query() -> list[tuple[Any, ...]]:
            cursor.execute(text, args)
            rows: list[tuple[Any, ...]] = cursor.fetchall()
            return rows

        return self._call(text, args, False, query)

    def executemany(self, statement: Any, params: Sequence[dict[str, Any]]) -> int:
        """Run ``statement`` once per parameter set; the rows changed, summed."""
        text, many = self._prepared_many(statement, params)
        cursor = self._cursor
        self._call(text, many, True, lambda: cursor.executemany(text, many))
        return int(cursor.rowcount)

    def execute_rendered(self, statement: Any, params: dict[str, Any]) -> int:
        """:func:`~roomservice.store.database.execute_rendered` on the driver: the rows ``statement``
        changed (matched, for an UPDATE)."""
        text, args = self._rendered(statement, params)
        cursor = self._cursor
        self._call(text, args, False, lambda: cursor.execute(text, args))
        return int(cursor.rowcount)

    def insert_rows(self, insert: Any, rows: Sequence[dict[str, Any]]) -> None:
        """:func:`~roomservice.store.database.insert_rendered` on the driver."""
        text, args, many = self._rendered_rows(insert, rows)
        cursor = self._cursor
        self._call(text, args, many, (lambda: cursor.executemany(text, args)) if many else
                   (lambda: cursor.execute(text, args)))

    def _call(self, text: str, args: Any, many: bool, call: Callable[[], T]) -> T:
        """``call()``, announced done; a driver error raised as SQLAlchemy would raise it, a lost
        connection invalidated."""
        try:
            result = call()
        except Exception as exc:
            translated, lost = self._translated(exc, text, args)
            if translated is None:
                raise
            if lost:
                self._sync.invalidate(exc)
            raise translated from exc
        self._announce_done(text, args, many)
        return result
